"""`selector="greedy"`: exact greedy log-det maximisation with rank-one updates (docs/method.md#greedy-log-det-selector)."""

from __future__ import annotations

import pytest
import torch

import jacap_attn
from jacap_attn.math import scoring
from conftest import random_ids, tiny_model


def brute_force_greedy(phi: torch.Tensor, lam: float, window: int, steps: int) -> list[int]:
    """Greedy by recomputing ``log det(lam I + sum_S phi phi^T)`` for every candidate (one head)."""
    n, d = phi.shape
    chosen = list(range(n - window, n))
    picks = []
    for _ in range(steps):
        best, arg = -float("inf"), None
        for i in range(n - window):
            if i in picks:
                continue
            rows = phi[chosen + picks + [i]]
            value = torch.logdet(lam * torch.eye(d, dtype=phi.dtype) + rows.T @ rows).item()
            if value > best:
                best, arg = value, i
        picks.append(arg)
    return picks


def test_greedy_scores_rank_the_exact_greedy_set():
    gen = torch.Generator().manual_seed(0)
    b, h, n, d, window, steps, ridge = 2, 3, 24, 4, 3, 9, 0.1
    weights = torch.rand(b, h, n, generator=gen, dtype=torch.float64) + 0.05
    directions = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    scores = scoring.greedy_logdet_scores(weights, directions, ridge, steps, window)
    assert scores.shape == (b, h, n) and scores.dtype == torch.float32
    assert bool((scores >= 0).all()) and bool((scores <= 1).all())
    for bi in range(b):
        for hi in range(h):
            phi = directions[bi, hi] * weights[bi, hi].sqrt()[:, None]
            lam = ridge * float((phi * phi).sum()) / d
            picks = brute_force_greedy(phi, lam, window, steps)
            head = scores[bi, hi, : n - window]
            order = torch.argsort(head, descending=True).tolist()
            # Top-k of the scores is the greedy set of size k, for every k <= steps.
            for k in range(1, steps + 1):
                assert set(order[:k]) == set(picks[:k]), (bi, hi, k)
            # Picked scores are the marginal leverages, non-increasing in pick order (submodularity).
            picked = head[picks]
            assert bool((picked[1:] <= picked[:-1] + 1e-6).all())


def test_greedy_never_picks_zero_weight_and_handles_steps_beyond_n():
    weights = torch.ones(1, 1, 10)
    weights[..., :3] = 0.0  # e.g. left padding
    directions = torch.randn(1, 1, 10, 2, generator=torch.Generator().manual_seed(1))
    scores = scoring.greedy_logdet_scores(weights, directions, 0.1, steps=50, window=2)
    assert torch.isfinite(scores).all()
    assert scores[0, 0, :3].tolist() == [0.0, 0.0, 0.0]
    assert bool((scores[0, 0, 3:8] > 0).all())


def test_leverage_is_the_first_greedy_step():
    """With no window, the first pick is the token with the largest ``phi^T (lam I)^-1 phi``, and the
    unpicked scores after zero steps are exactly the leverage against ``lam I``."""
    gen = torch.Generator().manual_seed(2)
    weights = torch.rand(1, 2, 16, generator=gen)
    directions = torch.randn(1, 2, 16, 5, generator=gen)
    scores = scoring.greedy_logdet_scores(weights, directions, 0.5, steps=0, window=0)
    phi = directions.double() * weights.double().sqrt()[..., None]
    lam = 0.5 * (phi * phi).sum(dim=(-1, -2)) / 5
    g = (phi * phi).sum(-1) / lam[..., None]
    torch.testing.assert_close(scores, (g / (1 + g)).float())


def kept_positions(layer) -> list[list[int]]:
    """Sorted logical positions kept per KV head of batch row 0."""
    return [sorted(layer.positions[0, h][layer.valid[0, h]].tolist()) for h in range(layer.valid.shape[1])]


@pytest.mark.parametrize("budget", ["uniform", "capacity", "global"])
def test_greedy_selector_through_patch(budget):
    model = tiny_model("llama")
    ids = random_ids(1, 120)
    jacap_attn.patch(model, ratio=0.2, window=8, selector="greedy", budget=budget, compile=False)
    with torch.no_grad():
        cache = model(ids).cache
    greedy_kept = [kept_positions(layer) for layer in cache.layers]
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 124)
    jacap_attn.unpatch(model)
    jacap_attn.patch(model, ratio=0.2, window=8, budget=budget, compile=False)
    with torch.no_grad():
        leverage_kept = [kept_positions(layer) for layer in model(ids).cache.layers]
    # Same budgets, different choices: the option is really used.
    assert [[len(head) for head in k] for k in greedy_kept] == [[len(head) for head in k] for k in leverage_kept]
    assert greedy_kept != leverage_kept


@pytest.mark.parametrize("budget", ["uniform", "capacity", "global"])
def test_greedy_padded_row_keeps_what_it_keeps_alone(budget):
    """Each row runs its own number of greedy steps: a short left-padded row's scores (and so the
    cross-layer consensus built from their shares) must not depend on its longer batch mates."""
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.1, window=4, selector="greedy", budget=budget, compile=False)
    ids = random_ids(2, 200, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :140] = 0
    ids[0, :140] = 0
    batch = jacap_attn.compress(model, ids, mask)
    alone = jacap_attn.compress(model, ids[:1, 140:])
    for layer_b, layer_a in zip(batch.layers, alone.layers):
        pads = int(layer_b.pads[0])
        for h in range(layer_b.valid.shape[1]):
            got = sorted((layer_b.positions[0, h][layer_b.valid[0, h]]).tolist())
            assert got == sorted(layer_a.positions[0, h][layer_a.valid[0, h]].tolist()), (pads, h)
    out_b = model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    out_a = model.generate(ids[:1, 140:], max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert torch.equal(out_b[0, 200:], out_a[0, 60:])
