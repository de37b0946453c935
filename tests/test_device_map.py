"""Layers on several devices (``device_map``), checked on the CPU: every tensor the library creates
follows the device of the layer it serves (docs/architecture.md#sharded-layers).

The layers of a tiny model are put on three fake devices (tests/fake_devices.py: CPU tensors that report
``lazy:0``, ``lazy:1``, ``lazy:2``, with the one-device-per-op rule of a machine with several
accelerators enforced on every aten op). A tensor the library made on the wrong device (the CPU by
default, the first layer's, the prompt's) meets a layer's tensors in some op and fails there, as on
GPUs; the numbers are the CPU's, so the tokens must equal those of the model on the CPU alone. The CUDA
test of the same rule on real devices is ``tests/test_robustness.py``'s ``device_map`` test.
"""

from __future__ import annotations

import pytest
import torch

import jacap_attn
from conftest import random_ids, tiny_model
from fake_devices import DeviceMismatch, OnDevice, fake_devices, place

NEW = 4
DEVICES = {"model.embed_tokens": "lazy:0", "model.rotary_emb": "lazy:0", "model.layers.0": "lazy:0",
           "model.layers.1": "lazy:1", "model.layers.2": "lazy:2", "model.norm": "lazy:2", "lm_head": "lazy:2"}


def test_fake_devices_enforce_one_device_per_op():
    """The emulator itself: what fails across real devices fails here, what works works."""
    with fake_devices():
        a = torch.ones(3, device="lazy:1")
        assert isinstance(a, OnDevice) and a.device == torch.device("lazy:1")
        assert (a + 1).device == a.device and float((a * 2).sum()) == 6.0
        assert torch.zeros(2, device=a.device).device == a.device  # a factory follows device=
        with pytest.raises(DeviceMismatch):
            a + torch.ones(3)  # the CPU default
        with pytest.raises(DeviceMismatch):
            a + torch.ones(3, device="lazy:0")  # another device
        with pytest.raises(DeviceMismatch):
            a + torch.tensor(1.0, device="lazy:0")  # a 0-dim tensor of another accelerator too
        assert (a + torch.tensor(1.0)).device == a.device  # a 0-dim CPU tensor is a scalar
        assert a.to("lazy:0").device == torch.device("lazy:0") and a.cpu().device.type == "cpu"
        assert a[torch.tensor([0, 2])].device == a.device  # a CPU index may index another device


def _kept(cache) -> list:
    return [[[sorted(layer.export()[2][r, h][layer.export()[3][r, h]].tolist()) for h in range(layer.kv_heads())]
             for r in range(cache.batch_size)] for layer in cache.layers]


def _run(model, ids, mask, options: dict, kind: str) -> dict:
    """Kept sets, tokens and each layer's storage device of one case (the model patched with ``options``)."""
    jacap_attn.patch(model, **options)
    try:
        if kind == "question":  # a document stored whole, reselected by a question
            doc = jacap_attn.Document.compress(model, ids)
            question = random_ids(1, 9, seed=5)
            cache = doc.fresh_cache()
            with torch.no_grad():
                model(input_ids=question.to(ids.device), cache=cache, use_cache=True)
            tokens = doc.generate(question, max_new_tokens=NEW, do_sample=False)
        else:
            cache = jacap_attn.compress(model, ids, mask)
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        return {"kept": _kept(cache), "tokens": tokens.cpu().tolist(),
                "devices": [str(layer.export()[0].device) for layer in cache.layers]}
    finally:
        jacap_attn.unpatch(model)


CASES = {
    "llama/global": ("llama", dict(ratio=0.25, window=8), "generate"),
    "llama/uniform/batch": ("llama", dict(ratio=0.25, window=8, budget="uniform"), "batch"),
    "llama/adakv": ("llama", dict(ratio=0.25, method="adakv", window=8), "generate"),
    "llama/tova": ("llama", dict(ratio=0.25, method="tova", window=8), "generate"),
    "llama/capacity": ("llama", dict(ratio=0.25, budget="capacity", window=8), "generate"),
    "llama/chunked": ("llama", dict(ratio=0.25, window=8, chunk_size=24), "generate"),
    "llama/question": ("llama", dict(ratio=0.25, window=8, reselect_budget="global"), "question"),
    "gemma3_text/global": ("gemma3_text", dict(ratio=0.25, window=8), "generate"),
    "gemma3_text/question": ("gemma3_text", dict(ratio=0.25, window=8), "question"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_layers_on_three_devices_keep_and_generate_as_on_one(name):
    family, options, kind = CASES[name]
    ids = random_ids(2 if kind == "batch" else 1, 70)
    mask = torch.ones_like(ids)
    if kind == "batch":
        mask[1, :7] = 0
    want = _run(tiny_model(family), ids, mask, options, kind)
    model = tiny_model(family)
    with fake_devices():
        place(model, DEVICES)
        got = _run(model, ids.to("lazy:0"), mask.to("lazy:0"), options, kind)
    assert got["devices"] == ["lazy:0", "lazy:1", "lazy:2"]  # each layer's entries on its own device
    assert got["kept"] == want["kept"]
    assert got["tokens"] == want["tokens"]


def test_saved_from_sharded_layers_loads_onto_them(tmp_path):
    """A document saved from layers on three devices, loaded back onto them (each layer's entries on its
    layer's device) and onto a model on the CPU alone: the same answers."""
    ids, question = random_ids(1, 70), random_ids(1, 9, seed=5)
    model = tiny_model("llama")
    with fake_devices():
        place(model, DEVICES)
        jacap_attn.patch(model, ratio=0.25, window=8)
        doc = jacap_attn.Document.compress(model, ids)
        doc.save(tmp_path / "doc.safetensors", quantize=None)
        want = doc.generate(question, max_new_tokens=NEW, do_sample=False).cpu().tolist()
        loaded = jacap_attn.Document.load(tmp_path / "doc.safetensors", model)
        assert [str(layer.export()[0].device) for layer in loaded.cache.layers] == ["lazy:0", "lazy:1", "lazy:2"]
        assert loaded.generate(question, max_new_tokens=NEW, do_sample=False).cpu().tolist() == want
    cpu = jacap_attn.Document.load(tmp_path / "doc.safetensors", tiny_model("llama"))
    assert cpu.generate(question, max_new_tokens=NEW, do_sample=False).tolist() == want
