"""Forwards the library runs on the user's behalf leave the model as the user's own calls would
(issue 25, case 1; transformers #25104's kind of fault)."""

from __future__ import annotations

import copy

import torch

import jacap_attn
from conftest import random_ids, tiny_model
from jacap_attn.model_state import preserved

DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}


def _pair():
    return [tiny_model("llama", max_position_embeddings=64, rope_parameters=dict(DYNAMIC)) for _ in range(2)]


def test_the_repeat_pass_leaves_no_rotary_state_behind():
    """Kind: hidden extra forwards change model state. Two identical tiny Llamas with dynamic RoPE,
    ``max_position_embeddings=64``; A compresses a 100-token prompt with the repeat pass (forwards at
    positions up to ~2n, which grow the rotary module's cached frequencies). The same cache continued
    by A and by B must give the same logits, and after ``unpatch`` a stock forward of A equals B's."""
    a, b = _pair()
    ids = random_ids(1, 100)
    for model in (a, b):
        jacap_attn.patch(model, ratio=0.3, queries="repeat", window=8)
    with torch.no_grad():
        cache = jacap_attn.compress(a, ids)
        new = random_ids(1, 4, seed=7)
        positions = torch.arange(100, 104)[None]
        out_a = a(input_ids=new, cache=copy.deepcopy(cache), position_ids=positions).logits
        out_b = b(input_ids=new, cache=copy.deepcopy(cache), position_ids=positions).logits
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)
    for model in (a, b):
        jacap_attn.unpatch(model)
    probe = random_ids(1, 30, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(a(probe).logits, b(probe).logits, rtol=0, atol=0)
    rotary_a, rotary_b = a.model.rotary_emb, b.model.rotary_emb
    torch.testing.assert_close(rotary_a.inv_freq, rotary_b.inv_freq, rtol=0, atol=0)
    assert getattr(rotary_a, "max_seq_len_cached", None) == getattr(rotary_b, "max_seq_len_cached", None)


def test_preserved_puts_back_buffers_and_plain_attributes():
    """The snapshot covers every submodule's buffers (the same objects, their values) and plain
    attributes, whatever the block changed."""
    model = tiny_model("llama")
    rotary = model.model.rotary_emb
    before = rotary.inv_freq.clone()
    buffer = rotary.inv_freq
    with preserved(model):
        rotary.inv_freq.mul_(3.0)
        rotary.register_buffer("inv_freq", torch.zeros_like(before), persistent=False)
        rotary.attention_scaling = 123.0
    assert rotary.inv_freq is buffer
    torch.testing.assert_close(rotary.inv_freq, before, rtol=0, atol=0)
    assert rotary.attention_scaling != 123.0
