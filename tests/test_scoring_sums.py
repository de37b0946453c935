"""Jacap's importance weights and the repeat pass's squared statistics summed over the queries first
(:func:`jacap_attn.math.scoring.squared_weights`, 2026-12-07): the same numbers as the per-pair formula of
docs/method.md#importance-weights, which builds every ``||k_i - kbar_t||^2``."""

from __future__ import annotations

import pytest
import torch

from jacap_attn.math import scoring
from jacap_attn.math.attention_stats import attention_statistics


def pairwise(probs, keys, kbar=None):
    """``(sum_t p^2, sum_t p^2 ||k_i - kbar_t||^2)`` from the explicit ``[b, h, T, n, d]`` differences."""
    b, h, g, w, n = probs.shape
    p = probs.reshape(b, h, g * w, n).double()
    k = keys.double()
    kbar = p @ k if kbar is None else kbar.double()
    dist2 = ((k[:, :, None, :, :] - kbar[:, :, :, None, :]) ** 2).sum(-1)  # [b, h, T, n]
    return (p * p).sum(2), (p * p * dist2).sum(2)


def inputs(seed, n=40, scale=3.0, zero_rows=False):
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(scale * torch.randn(2, 3, 2, 5, n, generator=gen), -1)
    if zero_rows:  # pad queries: rows of zeros (window_attention's nan_to_num)
        probs[1, :, :, :2] = 0.0
    keys = 4.0 * torch.randn(2, 3, n, 16, generator=gen) + 2.0  # norms far from 0: the expansion's cancellation
    return probs, keys


@pytest.mark.parametrize("seed,zero_rows", [(0, False), (1, True), (2, False)])
@pytest.mark.parametrize("beta", [0.0, 1.0, 2.5])
def test_importance_weights_equal_the_pairwise_formula(seed, zero_rows, beta):
    probs, keys = inputs(seed, zero_rows=zero_rows)
    sq, sq_dist = pairwise(probs, keys)
    want = (sq + beta * 0.25 ** 2 * sq_dist).float()
    got = scoring.jacap_weights(probs, keys, 0.25, beta)
    assert got.shape == (2, 3, 40) and got.dtype == torch.float32 and (got >= 0).all()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("seed", [0, 3])
def test_repeat_statistics_equal_the_pairwise_formula(seed):
    """``sq_dist`` with each query's mean key over the keys it reads (rows that need not sum to one)."""
    probs, keys = inputs(seed, zero_rows=True)
    probs = probs * 0.5  # a block of the repeat pass: each row's share of the keys
    p = probs.reshape(2, 3, 10, 40)
    kbar = (p @ keys) / p.sum(-1, keepdim=True).clamp_min(1e-30)
    sq, sq_dist = pairwise(probs, keys, kbar)
    out = attention_statistics(probs, keys, {"sq", "sq_dist"})
    torch.testing.assert_close(out["sq"], sq.float(), rtol=1e-5, atol=1e-8)
    # float32 cancellation in ||k||^2 - 2 k.kbar + ||kbar||^2, either way: errors relative to the largest value
    torch.testing.assert_close(out["sq_dist"], sq_dist.float(), rtol=0, atol=1e-5 * sq_dist.max().item())
    alone = attention_statistics(probs, keys, {"sq"})
    assert set(alone) == {"sq"}
    torch.testing.assert_close(alone["sq"], out["sq"])


def test_a_key_equal_to_its_queries_mean_scores_no_distance():
    """The expansion cancels to a tiny number where ``k_i = kbar_t``; it is clamped at 0, never negative."""
    keys = torch.full((1, 1, 3, 4), 5.0)
    probs = torch.full((1, 1, 1, 2, 3), 1.0 / 3)
    sq, sq_dist = scoring.squared_weights(probs.reshape(1, 1, 2, 3), keys, probs.reshape(1, 1, 2, 3) @ keys)
    assert (sq_dist >= 0).all() and sq_dist.abs().max() < 1e-4
    torch.testing.assert_close(sq, torch.full((1, 1, 3), 2.0 / 9))


@pytest.mark.parametrize("pads", [0, 3, 7])
def test_window_attention_equals_a_masked_softmax_with_or_without_padding(pads):
    """The window attention skips the padding mask where every key is valid (2026-12-07) and scales its
    queries, not its logits: the same probabilities as the explicit causal, padded softmax; a pad query
    (left padding longer than the keys before it) gets a zero row, never NaN."""
    gen = torch.Generator().manual_seed(pads)
    b, h, g, w, n, d = 2, 2, 3, 4, 9, 8
    queries = torch.randn(b, h, g, w, d, generator=gen)
    keys = torch.randn(b, h, n, d, generator=gen)
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :pads] = False
    got = scoring.window_attention(queries, keys, 0.3, valid)
    logits = torch.einsum("bhgwd,bhnd->bhgwn", queries, keys) * 0.3
    allowed = (torch.arange(n)[None, :] <= torch.arange(n - w, n)[:, None])[None, None, None] \
        & valid[:, None, None, None, :]
    want = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    torch.testing.assert_close(got, want)
    assert not got.isnan().any()
    if pads == 7:  # the first window query of row 1 reads keys 0..5, all padding
        assert got[1, :, :, 0].abs().max() == 0
