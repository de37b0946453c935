"""``output_attentions`` over a compressed cache (issue 25, case 2; transformers #26174's kind)."""

from __future__ import annotations

import torch

import jacap_attn
from conftest import DECODE_ATOL, DECODE_RTOL, random_ids, tiny_model


def _generate(model, ids):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                              output_attentions=True)


def test_output_attentions_at_ratio_one_equal_stock():
    """Kind: outputs silently dropped. Eager tiny Llama, ``patch(ratio=1.0)``: per decode step one
    ``[1, 4, 1, L]`` tensor per layer, equal to stock transformers' (it was an empty tuple)."""
    model = tiny_model("llama", attn="eager")
    ids = random_ids(1, 58)
    stock = _generate(model, ids)
    jacap_attn.patch(model, ratio=1.0)
    patched = _generate(model, ids)
    assert torch.equal(stock.sequences, patched.sequences)
    assert len(patched.attentions) == len(stock.attentions) == 3
    for step_stock, step_patched in zip(stock.attentions[1:], patched.attentions[1:]):  # the decode steps
        assert len(step_patched) == model.config.num_hidden_layers
        for a, b in zip(step_stock, step_patched):
            assert b.shape == a.shape
            torch.testing.assert_close(b, a, atol=DECODE_ATOL, rtol=DECODE_RTOL)


def test_output_attentions_below_ratio_one_cover_the_held_slots():
    """Below ratio 1 each decode step's weights run over the slots the layer holds (rows sum to 1,
    zero where a head holds nothing)."""
    model = tiny_model("llama", attn="eager")
    jacap_attn.patch(model, ratio=0.25, window=8)
    out = _generate(model, random_ids(1, 80))
    step = out.attentions[-1]
    assert len(step) == model.config.num_hidden_layers
    for weights in step:
        assert weights.shape[:3] == (1, 4, 1) and weights.shape[-1] < 80
        torch.testing.assert_close(weights.sum(-1), torch.ones(1, 4, 1))
