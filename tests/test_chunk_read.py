"""A chunk's attention over a compressed cache read in two parts (docs/architecture.md#chunked-prefill):
the held entries, then the chunk's own tokens causally with no mask, merged by their log-sum-exp
(:func:`jacap_attn.math.masked.chunk_attention`). The same outputs as the one masked SDPA call
(:func:`jacap_attn.math.masked.grouped_attention`) to float rounding, logits that match the masking
oracle, and the cases that must keep the mask (padding in the chunk, a sliding window shorter than it,
a layout writing out of order, compiled code, another device) do."""

from __future__ import annotations

import pytest
import torch

import jacap_attn
from jacap_attn.math import masked
from jacap_attn.storage import layer as layer_module
from conftest import random_ids, tiny_model
from test_chunked import assert_matches_oracle


def _full_mask(allowed: torch.Tensor, q: int) -> torch.Tensor:
    """``allowed [b, h, 1 or q, held]`` followed by the causal mask of the chunk's own ``q`` tokens."""
    b, h, _, held = allowed.shape
    own = torch.ones(q, q, dtype=torch.bool).tril()
    return torch.cat([allowed.expand(b, h, q, held), own.expand(b, h, q, q)], dim=-1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float16, 5e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("per_query", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_split_attention_equals_the_masked_one(dtype, tol, per_query, with_bias):
    gen = torch.Generator().manual_seed(0)
    b, h, g, q, held, d = 2, 2, 3, 13, 29, 16
    query = torch.randn(b, h * g, q, d, generator=gen).to(dtype)
    keys = torch.randn(b, h, held + q, d, generator=gen).to(dtype)
    values = torch.randn(b, h, held + q, d, generator=gen).to(dtype)
    allowed = torch.rand(b, h, q if per_query else 1, held, generator=gen) > 0.4
    allowed[1, 0] = False  # a head that reads none of its held entries: its own part alone
    if per_query:
        allowed[0, 1, :5] = False  # queries that read no held entry (a sliding window's distance)
    bias = torch.rand(b, h, held, generator=gen) if with_bias else None
    got = masked.chunk_attention(query, keys, values, held, allowed, 0.25, bias)
    full_bias = None if bias is None else torch.cat([bias, torch.zeros(b, h, q)], dim=-1)
    want = masked.grouped_attention(query, keys, values, _full_mask(allowed, q), 0.25, full_bias)
    assert got.shape == want.shape == (b, q, h * g, d) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_the_split_attention_with_every_held_entry_read_builds_no_mask(monkeypatch):
    """All held entries valid and no bias: neither part gets a mask (what makes the chunk cheaper)."""
    masks = []
    real = masked._attention_lse
    monkeypatch.setattr(masked, "_attention_lse", lambda *a: masks.append(a[3]) or real(*a))
    query, keys, values = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
    allowed = torch.ones(1, 2, 1, 12, dtype=torch.bool)
    got = masked.chunk_attention(query, keys, values, 12, allowed, 0.25)
    assert masks == [None] * 4  # two group members, each its own part and its held part
    want = masked.grouped_attention(query, keys, values, _full_mask(allowed, 8), 0.25)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def _spy(monkeypatch):
    """Count the layer forwards read in two parts, by their number of new tokens."""
    calls: dict = {}
    real = layer_module.chunk_attention

    def spy(query, *args, **kwargs):
        calls[query.shape[-2]] = calls.get(query.shape[-2], 0) + 1
        return real(query, *args, **kwargs)

    monkeypatch.setattr(layer_module, "chunk_attention", spy)
    return calls


def test_a_chunked_prefill_reads_its_later_chunks_in_two_parts(family, monkeypatch):
    """Every later chunk of a chunked prefill (40 tokens, the first is a prefill of its own) goes
    through the split attention on the CPU, and the logits still match the masking oracle."""
    calls = _spy(monkeypatch)
    model = tiny_model(family)
    jacap_attn.patch(model, ratio=0.3, window=8)
    ids = random_ids(1, 150)
    assert_matches_oracle(model, ids, torch.ones_like(ids), 40, extra=random_ids(1, 5, seed=7))
    full_layers = sum(t != "sliding_attention" for t in getattr(model.config, "layer_types", None) or ["full"] * 3)
    assert calls.get(40, 0) >= 2 * full_layers  # chunks 2 and 3 of 40 tokens, every full-attention layer


def test_sliding_layers_read_a_chunk_within_their_window_in_two_parts(monkeypatch):
    """Gemma 3's sliding layers (window 24) in chunks of 16: the held part masked by distance per
    query, the chunk causal; the logits match the masking oracle, with and without left padding."""
    calls = _spy(monkeypatch)
    model = tiny_model("gemma3_text")
    jacap_attn.patch(model, ratio=0.3, window=8)
    ids = random_ids(2, 120)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    assert_matches_oracle(model, ids, mask, 16, extra=random_ids(2, 4, seed=9))
    assert calls.get(16, 0) >= 3 * 6  # every layer, sliding ones included, in the chunks after the first


def test_the_mask_stays_where_the_split_cannot_run(monkeypatch):
    """A sliding window shorter than the chunk (Gemma 3's 24 in chunks of 40) keeps the one masked call on
    its sliding layers, while the full-attention layers split; the logits still match the oracle."""
    model = tiny_model("gemma3_text")
    jacap_attn.patch(model, ratio=0.3, window=8)
    ids = random_ids(2, 150)
    mask = torch.ones_like(ids)
    mask[1, :13] = 0
    seen = []
    real = layer_module.split_point
    monkeypatch.setattr(layer_module, "split_point", lambda *a: seen.append((a[4], real(*a))) or seen[-1][1])
    assert_matches_oracle(model, ids, mask, 40)
    assert {held is None for window, held in seen if window is not None} == {True}
    assert {held is None for window, held in seen if window is None} == {False}


def _split(query, bias=None, write_pos=30, logical=40, pads=(0, 3), sliding_window=None):
    return masked.split_point(query, torch.tensor(write_pos), torch.tensor(logical), torch.tensor(pads),
                              sliding_window, bias)


def test_the_cases_that_keep_the_mask():
    """Left padding reaching into the chunk, a sliding window shorter than the chunk, one token, a
    carried bias on the chunk's own tokens, another device, a layout writing a forward's tokens out of
    order (the ragged layout): no split; otherwise the slots written before the chunk."""
    from jacap_attn.storage.ragged import RaggedLayer

    query = torch.zeros(2, 4, 8, 16)
    assert _split(query) == 22
    assert _split(query, pads=(0, 33)) is None  # 40 - 8 tokens before the chunk, 33 of them padding
    assert _split(query, sliding_window=7) is None
    assert _split(query, sliding_window=8) == 22
    assert _split(query[:, :, :1]) is None
    bias = torch.zeros(2, 2, 64)
    assert _split(query, bias) == 22
    bias[1, 0, 25] = 0.5
    assert _split(query, bias) is None
    assert _split(query.to("meta")) is None
    assert RaggedLayer.writes_in_order is False and layer_module.JacapLayer.writes_in_order is True
