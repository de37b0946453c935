"""The layout behind the layer (issue 22): everything outside ``layer.py`` reads a layer through its
methods, and the cache builds its layers from ``jacap_attn.storage.layer.LAYOUTS``, so a second layout is one
class (docs/architecture.md#adding-a-layout)."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import jacap_attn
from conftest import random_ids, tiny_model
from jacap_attn.storage.layer import LAYOUTS, JacapLayer

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUFFERS = {"keys", "values", "valid", "positions", "write_pos", "capacity", "logical"}


class CountingLayer(JacapLayer):
    """A toy layout: the padded one, counting the calls of its layout methods."""

    calls: dict = {}

    def attend(self, query, scaling, *, weights=False):
        CountingLayer.calls["attend"] = CountingLayer.calls.get("attend", 0) + 1
        return super().attend(query, scaling, weights=weights)

    def keep_slots(self, slots, kept, positions, capacity, logical, pads, **kwargs):
        CountingLayer.calls["keep_slots"] = CountingLayer.calls.get("keep_slots", 0) + 1
        return super().keep_slots(slots, kept, positions, capacity, logical, pads, **kwargs)


def test_a_layout_from_the_map_serves_prefill_decode_and_files(tmp_path):
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.3, window=8)
    ids = random_ids(1, 60)
    LAYOUTS["counting"] = CountingLayer
    try:
        CountingLayer.calls.clear()
        cache = jacap_attn.JacapCache(model, layout="counting")
        with torch.no_grad():
            model(input_ids=ids, cache=cache)
        assert all(type(layer) is CountingLayer for layer in cache.layers)
        assert CountingLayer.calls["keep_slots"] == model.config.num_hidden_layers
        path = tmp_path / "doc.safetensors"
        jacap_attn.save_cache(cache, path, model=model, prompt_ids=ids)
        assert jacap_attn.load_cache(path, model).get_seq_length() == cache.get_seq_length()
        question = torch.cat([ids, random_ids(1, 3, seed=4)], dim=1)
        got = model.generate(question, cache=cache, max_new_tokens=4, do_sample=False)
        want = model.generate(question, cache=jacap_attn.compress(model, ids), max_new_tokens=4, do_sample=False)
        assert torch.equal(got, want) and CountingLayer.calls["attend"] > 0
    finally:
        del LAYOUTS["counting"]
    with pytest.raises(ValueError, match="unknown layout"):
        jacap_attn.JacapCache(model, layout="nope")


def test_no_module_outside_the_layer_reads_its_buffers():
    """The padded buffers (``keys``, ``values``, ``valid``, ``positions``, ``write_pos``, ...) of a
    layer are read only in ``layer.py``; other modules call its methods."""
    offenders = []
    for path in (ROOT / "jacap_attn").rglob("*.py"):
        if path.name == "layer.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in BUFFERS and isinstance(node.value, ast.Name) \
                    and node.value.id in ("layer", "layer0"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} layer.{node.attr}")
    assert not offenders, "\n".join(offenders)
