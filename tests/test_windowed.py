"""Sliding-window layers attend in query blocks at prefill (jacap_attn/windowed.py): the same output as
one stock call over the whole prompt, used only where the mask proves it exact."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import jacap_attn
from jacap_attn import windowed
from jacap_attn.windowed import windowed_prefill

from conftest import DECODE_ATOL, DECODE_RTOL, random_ids, tiny_model


class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def _sliding_mask(q_len: int, k_len: int, window: int, pads: list[int] | None = None) -> torch.Tensor:
    """Bool ``[b, 1, q, k]``: causal, at most ``window`` keys per query (its own included), left pads masked."""
    pads = pads or [0]
    offset = k_len - q_len
    q = torch.arange(q_len)[:, None] + offset
    k = torch.arange(k_len)[None, :]
    base = (k <= q) & (q - k < window)
    rows = [base & (k >= p) for p in pads]
    return torch.stack(rows)[:, None]


def _qkv(b=1, q_len=200, k_len=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(b, 4, q_len, 16, generator=g)
    key = torch.randn(b, 2, k_len, 16, generator=g)
    value = torch.randn(b, 2, k_len, 16, generator=g)
    return query, key, value


@pytest.mark.parametrize("q_len,k_len,pads,block", [(200, 200, None, None), (150, 230, None, None),
                                                    (200, 200, [0, 37], None), (203, 203, None, 7)])
def test_blocks_equal_one_call(q_len, k_len, pads, block):
    query, key, value = _qkv(len(pads or [0]), q_len, k_len)
    mask = _sliding_mask(q_len, k_len, 24, pads)
    ref, _ = sdpa_attention_forward(_Module(), query, key, value, mask, scaling=0.25)
    got = windowed_prefill(sdpa_attention_forward, _Module(), query, key, value, mask, 24, block=block, scaling=0.25)
    assert got is not None
    live = mask[:, 0].any(-1)  # rows of padding attend nothing: whatever the kernel gives, both give
    torch.testing.assert_close(got[0][live], ref[live], atol=DECODE_ATOL, rtol=DECODE_RTOL)


def test_mask_reaching_beyond_the_window_runs_stock():
    """A mask that lets a query see a key outside its block's slice (here: plain causal) is not
    sliced: the caller runs the stock attention."""
    query, key, value = _qkv()
    causal = _sliding_mask(200, 200, 10_000)
    assert windowed_prefill(sdpa_attention_forward, _Module(), query, key, value, causal, 24) is None


@pytest.mark.parametrize("mask,window", [(None, 24), ("float", 24), ("bool", None)])
def test_nothing_to_prove_runs_stock(mask, window):
    query, key, value = _qkv()
    bool_mask = _sliding_mask(200, 200, 24)
    mask = {"float": torch.zeros(bool_mask.shape).masked_fill(~bool_mask, float("-inf")), "bool": bool_mask}.get(mask)
    assert windowed_prefill(sdpa_attention_forward, _Module(), query, key, value, mask, window) is None


def test_short_prompt_runs_stock():
    query, key, value = _qkv(q_len=60, k_len=60)
    assert windowed_prefill(sdpa_attention_forward, _Module(), query, key, value, _sliding_mask(60, 60, 24), 24) is None


@pytest.mark.parametrize("name,bad", [("window", 0), ("window", 2.5), ("block", -1), ("block", True)])
def test_bad_sizes_named(name, bad):
    query, key, value = _qkv()
    kwargs = {"window": 24, "block": None, name: bad}
    with pytest.raises(ValueError, match=name):
        windowed_prefill(sdpa_attention_forward, _Module(), query, key, value, _sliding_mask(200, 200, 24),
                         kwargs["window"], block=kwargs["block"])


def _spy_blocks(monkeypatch) -> list:
    """The spans (or ``None``) of every :func:`windowed._blocks` call from now on, as a list."""
    calls = []
    real = windowed._blocks

    def spy(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(windowed, "_blocks", spy)
    return calls


def test_gemma_prefill_in_blocks_matches_the_stock_model(monkeypatch):
    """A patched tiny Gemma-3 (window 24) prefilling 160 tokens runs its two sliding layers in
    blocks, and its logits are the unpatched model's."""
    calls = _spy_blocks(monkeypatch)
    ids = random_ids(2, 160)
    stock = tiny_model("gemma3_text")
    with torch.no_grad():
        ref = stock(input_ids=ids).logits
    model = tiny_model("gemma3_text")
    jacap_attn.patch(model, ratio=1.0, method="full")
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=True).logits
    assert len(calls) == 2 and all(spans is not None and len(spans) == 7 for spans in calls)
    torch.testing.assert_close(got, ref, atol=DECODE_ATOL, rtol=DECODE_RTOL)


@pytest.mark.parametrize("family,overrides,sliding_layers", [
    ("mistral", dict(sliding_window=24), 3),
    ("qwen2", dict(use_sliding_window=True, sliding_window=24, max_window_layers=1), 2),
    ("gemma3_text", {}, 2)])
def test_left_padded_batch_in_blocks_matches_the_stock_model(monkeypatch, family, overrides, sliding_layers):
    """Every family whose config slides, a left-padded batch: the sliding layers run in blocks and
    the real tokens' logits and greedy continuations are the unpatched model's."""
    calls = _spy_blocks(monkeypatch)
    ids = random_ids(2, 150)
    mask = torch.ones_like(ids)
    mask[1, :13] = 0
    stock = tiny_model(family, **overrides)
    model = tiny_model(family, **overrides)
    jacap_attn.patch(model, ratio=1.0, method="full")
    with torch.no_grad():
        ref = stock(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=ids, attention_mask=mask, use_cache=True).logits
    assert len(calls) == sliding_layers and all(spans is not None for spans in calls)
    live = mask.bool()
    torch.testing.assert_close(got[live], ref[live], atol=DECODE_ATOL, rtol=DECODE_RTOL)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False),
                       stock.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False))
