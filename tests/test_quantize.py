"""8-bit saved files (``save_cache(..., quantize="int8")``; issue 24, docs/cache.md#quantized-files)."""

from __future__ import annotations

import json

import pytest
import torch

import jacap_attn
from conftest import random_ids, tiny_model
from jacap_attn.files import quantize
from jacap_attn.files.cache_file import CacheFileError, read_cache_file, read_cache_metadata


def _packed(counts, d=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = int(counts.sum())
    keys = torch.randn(total, d, generator=gen) * torch.linspace(0.1, 8.0, d)  # channels of very different ranges
    values = torch.randn(total, d, generator=gen) * torch.rand(total, 1, generator=gen) * 3
    return keys, values


def test_round_trip_error_is_half_a_step_per_channel_for_keys_and_per_token_for_values():
    counts = torch.tensor([[5, 0, 17], [1, 9, 3]])  # a head with no entry, a head with one
    keys, values = _packed(counts)
    parts = quantize.encode(keys, values, counts)
    assert parts["keys"].dtype == parts["values"].dtype == torch.uint8
    k, v = quantize.decode(parts, counts, torch.float32)
    heads = torch.repeat_interleave(torch.arange(6), counts.reshape(-1))
    k_step = parts["keys_scale"].reshape(6, -1)[heads]  # [E, d]: each key channel's own step
    assert bool(((k - keys).abs() <= k_step / 2 + 1e-5).all())
    assert bool(((v - values).abs() <= parts["values_scale"][:, None] / 2 + 1e-5).all())
    # Per channel, not per tensor: the narrow channels keep a fine step.
    many = counts >= 2  # a head of 0 or 1 entries has ranges of zero width (step 1, decoded exactly)
    assert float(parts["keys_scale"][many][:, 0].max()) < float(parts["keys_scale"][many][:, -1].min())
    # A constant group decodes exactly.
    flat = torch.ones(4, 8)
    one = torch.tensor([[4]])
    k1, v1 = quantize.decode(quantize.encode(flat, flat, one), one, torch.float32)
    assert torch.equal(k1, flat) and torch.equal(v1, flat)


def test_bad_quantize_values_and_tensors_are_refused():
    for bad in ("int4", "INT8", 8, True):
        with pytest.raises(ValueError, match="quantize must be None or one of int8"):
            quantize.check(bad)
    counts = torch.tensor([[3]])
    parts = quantize.encode(*_packed(counts), counts)
    parts["values_min"] = parts["values_min"][:2]
    with pytest.raises(ValueError, match="'values_min'"):
        quantize.decode(parts, counts, torch.float32)


def _saved(tmp_path, quantize_as):
    model = tiny_model("llama", head_dim=64, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    jacap_attn.patch(model, ratio=1.0, reselect=0.3, window=8)
    ids = random_ids(1, 160)
    doc = jacap_attn.Document.compress(model, ids)
    path = tmp_path / f"doc-{quantize_as}.safetensors"
    size = doc.save(path, quantize=quantize_as)
    return model, doc, path, size


def test_an_int8_file_is_about_a_quarter_of_float32_and_loads_and_answers(tmp_path):
    model, doc, plain_path, plain = _saved(tmp_path, None)
    path = tmp_path / "doc-int8.safetensors"
    size = doc.save(path, quantize="int8")
    kept = doc.cache.prompt_kept_bytes()
    # 2 d bytes of codes and 8 of value range per entry, against 8 d of float32 (d = 64): 0.27,
    # plus the header and each layer's key ranges.
    assert size <= 0.3 * plain and plain <= 1.15 * kept
    assert read_cache_metadata(path)["quantization"] == "int8"
    assert "quantization" not in read_cache_metadata(plain_path)
    _, tensors = read_cache_file(path)  # decoded to the file's dtype on read
    assert tensors["layers.0.keys"].dtype == torch.float32 and "layers.0.keys_min" not in tensors
    loaded = jacap_attn.Document.load(path, model)
    exact = jacap_attn.Document.load(plain_path, model)
    for a, b in zip(loaded.cache.layers, exact.cache.layers):
        ka, va, pa, ma = a.export()
        kb, vb, pb, mb = b.export()
        assert torch.equal(pa[ma], pb[mb]) and torch.equal(ma, mb)
        assert float((ka[ma] - kb[mb]).abs().max()) <= float(kb[mb].abs().max()) / 100
        assert float((va[ma] - vb[mb]).abs().max()) <= float(vb[mb].abs().max()) / 100
    question = random_ids(1, 12, seed=9)
    out = loaded.generate(question, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == 4  # the new tokens: greedy, as from the float32 file
    assert torch.equal(out, exact.generate(question, max_new_tokens=4, do_sample=False))


def test_a_bad_quantize_writes_nothing_and_an_edited_field_is_refused(tmp_path):
    model, doc, path, _ = _saved(tmp_path, "int8")
    target = tmp_path / "never.safetensors"
    with pytest.raises(ValueError, match="quantize="):
        doc.save(target, quantize="int4")
    assert not target.exists()
    # The header checksum covers the field: a file whose 'quantization' was removed is refused.
    from safetensors.torch import load, save

    raw = path.read_bytes()
    metadata = dict(read_cache_metadata(path))
    del metadata["quantization"]
    edited = tmp_path / "edited.safetensors"
    edited.write_bytes(save(load(raw), metadata=metadata))
    with pytest.raises(CacheFileError, match="quantization|metadata"):
        jacap_attn.load_cache(edited, model)
    assert json.loads(read_cache_metadata(path)["model"])["dtype"] == "float32"


def test_a_non_finite_entry_is_refused_in_8_bits_naming_its_layer_and_writes_nothing(tmp_path):
    """A NaN or inf entry has no 8-bit range (its channel would decode to NaN): refused at save,
    the layer named; the same cache saves exactly with quantize=None."""
    counts = torch.tensor([[3, 2]])
    keys, values = _packed(counts)
    keys[1, 4] = float("nan")
    with pytest.raises(ValueError, match="the keys hold 1 NaN or infinite"):
        quantize.encode(keys, values, counts)
    values[0, 0] = float("inf")
    with pytest.raises(ValueError, match="the values hold 1 NaN or infinite"):
        quantize.encode(keys.nan_to_num(), values, counts)
    model, doc, path, _ = _saved(tmp_path, None)
    doc.cache.layers[1].values[0, 0, 0, 0] = float("inf")
    target = tmp_path / "inf.safetensors"
    with pytest.raises(ValueError, match="layer 1: quantize='int8' needs finite entries"):
        doc.save(target, quantize="int8")
    assert not target.exists()
    doc.save(target, quantize=None)
    assert target.exists()


def test_a_document_is_saved_in_8_bits_by_default_at_most_0_3_of_the_full_cache(tmp_path):
    """The compressed Document default (docs/method.md, candidate C of the rule): stored whole,
    saved with int8 entries; ``quantize=None`` keeps them exact."""
    model = tiny_model("llama", head_dim=64, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    jacap_attn.patch(model, ratio=0.1, window=8)
    doc = jacap_attn.Document.compress(model, random_ids(1, 300))
    size = doc.save(tmp_path / "d.safetensors")
    assert read_cache_metadata(tmp_path / "d.safetensors")["quantization"] == "int8"
    assert size <= 0.3 * doc.cache.full_bytes()
    doc.save(tmp_path / "exact.safetensors", quantize=None)
    assert "quantization" not in read_cache_metadata(tmp_path / "exact.safetensors")
