"""compress -> save -> load -> reuse, and every refusal of a bad file."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

import jacap_attn
from jacap_attn.files import persist
from jacap_attn.files.cache_file import padded_tensors
from jacap_attn.storage.identity import legacy_weights_fingerprint
from jacap_attn.files.persist import CacheFileError, read_cache_file, read_cache_metadata
from conftest import random_ids, tiny_model

N = 80


def _answer(model, cache, prompt, question, steps=6):
    ids = torch.cat([prompt, question], dim=1)
    return model.generate(ids, cache=cache, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)[:, ids.shape[1]:]


@pytest.fixture
def saved(tmp_path):
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.2, window=8, budget="pyramid")
    prompt = random_ids(1, N)
    cache = jacap_attn.compress(model, prompt)
    path = tmp_path / "cache.safetensors"
    jacap_attn.save_cache(cache, path, model=model, prompt_ids=prompt)
    return model, prompt, cache, path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_generates_same_tokens(family, dtype, tmp_path):
    model = tiny_model(family, dtype=dtype)
    jacap_attn.patch(model, ratio=0.25, window=8, budget="capacity")
    prompt, question = random_ids(1, N), random_ids(1, 5, seed=9)
    cache = jacap_attn.compress(model, prompt)
    counts = [layer.valid.sum().item() for layer in cache.layers if not layer.is_sliding]
    path = tmp_path / "c.safetensors"
    size = jacap_attn.save_cache(cache, path, model=model, prompt_ids=prompt)
    assert size == os.path.getsize(path)
    loaded = jacap_attn.load_cache(path, model)
    assert [layer.valid.sum().item() for layer in loaded.layers if not layer.is_sliding] == counts
    assert loaded.layers[0].keys.dtype == dtype
    assert torch.equal(_answer(model, loaded, prompt, question), _answer(model, cache, prompt, question))


def test_a_cache_with_tokens_appended_saves_and_answers_as_before(tmp_path):
    """cache.md: a file holds "the tokens appended before saving" and ``prompt_ids`` is every token the cache has
    seen; such a cache (a question appended over a compressed prompt) once could not be saved at all (its ids
    were compared whole with the shorter prompt's). Its ids must still start with the prompt's."""
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.25, window=8)
    prompt, turn, question = random_ids(1, N), random_ids(1, 10, seed=9), random_ids(1, 5, seed=10)
    cache = jacap_attn.compress(model, prompt)
    model(input_ids=turn, past_key_values=cache, use_cache=True)
    seen = torch.cat([prompt, turn], dim=1)
    path = tmp_path / "c.safetensors"
    with pytest.raises(ValueError, match="do not start with the prompt"):
        jacap_attn.save_cache(cache, path, model=model, prompt_ids=torch.cat([random_ids(1, N, seed=5), turn], 1))
    jacap_attn.save_cache(cache, path, model=model, prompt_ids=seen)
    loaded = jacap_attn.load_cache(path, model)
    assert loaded.get_seq_length() == N + 10
    assert torch.equal(_answer(model, loaded, seen, question), _answer(model, cache, seen, question))


def test_deepcopy_answers_equal_fresh_loads(saved):
    model, prompt, _, path = saved
    q1, q2 = random_ids(1, 4, seed=11), random_ids(1, 6, seed=12)
    loaded = jacap_attn.load_cache(path, model)
    a1 = _answer(model, copy.deepcopy(loaded), prompt, q1)
    a2 = _answer(model, copy.deepcopy(loaded), prompt, q2)
    assert torch.equal(a1, _answer(model, jacap_attn.load_cache(path, model), prompt, q1))
    assert torch.equal(a2, _answer(model, jacap_attn.load_cache(path, model), prompt, q2))
    assert loaded.get_seq_length() == N  # the shared copy was never touched


def test_prompt_mismatch_is_an_error(saved):
    model, prompt, _, path = saved
    loaded = jacap_attn.load_cache(path, model)
    other = prompt.clone()
    other[0, 3] = (other[0, 3] + 1) % 90
    with pytest.raises(ValueError, match="do not start with the 80-token prompt"):
        model.generate(torch.cat([other, random_ids(1, 3)], 1), cache=loaded, max_new_tokens=2)


def _rewrite(path, out, *, metadata=None, tensors=None):
    """A consistent file with edited fields or tensors (checksums recomputed), for the checks behind
    the checksums; an edit that leaves the checksums stale is tests/test_user_bugs_25.py's."""
    meta, data = read_cache_file(path)
    meta = {**meta, **(metadata or {})}
    data = {**data, **(tensors or {})}
    if tensors:
        from jacap_attn.files.persist import _tensors_sha256
        meta["tensors_sha256"] = _tensors_sha256(data)
    meta["metadata_sha256"] = persist.metadata_sha256(meta)
    save_file(data, out, metadata=meta)
    return out


def test_refuses_truncated_file(saved, tmp_path):
    model, _, _, path = saved
    raw = path.read_bytes()
    bad = tmp_path / "truncated.safetensors"
    bad.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(CacheFileError, match="truncated or corrupted"):
        jacap_attn.load_cache(bad, model)


def test_refuses_flipped_header_bytes(saved, tmp_path):
    model, _, _, path = saved
    raw = bytearray(path.read_bytes())
    for i in range(10, 30):
        raw[i] ^= 0xFF
    bad = tmp_path / "flipped.safetensors"
    bad.write_bytes(bytes(raw))
    with pytest.raises(CacheFileError, match="truncated or corrupted"):
        jacap_attn.load_cache(bad, model)


def test_refuses_flipped_data_bytes(saved, tmp_path):
    model, _, _, path = saved
    raw = bytearray(path.read_bytes())
    raw[-50] ^= 0xFF
    bad = tmp_path / "data.safetensors"
    bad.write_bytes(bytes(raw))
    with pytest.raises(CacheFileError, match="tensors_sha256"):
        jacap_attn.load_cache(bad, model)


@pytest.mark.parametrize("field,value,match", [
    ("format_version", "99", "unknown format_version '99'"),
    ("format", "something-else", "field 'format'"),
    ("batch_size", "3", "has shape"),
    ("logical_length", "10", r"positions from \d+ to \d+, outside \[0, logical_length=10\)"),
])
def test_refuses_edited_metadata(saved, tmp_path, field, value, match):
    model, _, _, path = saved
    bad = _rewrite(path, tmp_path / "edited.safetensors", metadata={field: value})
    with pytest.raises(CacheFileError, match=match):
        jacap_attn.load_cache(bad, model)


def test_metadata_from_the_header_alone_and_documents_read_the_tensors_once(saved, tmp_path, monkeypatch):
    """read_cache_metadata reads the header (format and version checked, the tensors neither read
    nor checked); Document.load and the CLI read it for the file's settings, so a file's tensor data
    is read and checksummed once (load_cache), not once per reader."""
    model, prompt, _, path = saved
    assert read_cache_metadata(path) == read_cache_file(path)[0]
    for field, value, match in (("format_version", "99", "unknown format_version '99'"),
                                ("format", "something-else", "field 'format'")):
        with pytest.raises(CacheFileError, match=match):
            read_cache_metadata(_rewrite(path, tmp_path / f"{field}.safetensors", metadata={field: value}))
    raw = bytearray(path.read_bytes())
    raw[-50] ^= 0xFF  # tensor data: not the header's business
    corrupted = tmp_path / "data.safetensors"
    corrupted.write_bytes(bytes(raw))
    assert read_cache_metadata(corrupted) == read_cache_metadata(path)
    with pytest.raises(FileNotFoundError):
        read_cache_metadata(tmp_path / "missing.safetensors")
    reads = []
    original = persist.read_cache_file
    monkeypatch.setattr(persist, "read_cache_file", lambda p: reads.append(p) or original(p))
    doc = jacap_attn.Document.load(path, model)
    assert reads == [path] and torch.equal(doc.prompt_ids, prompt)


def test_a_file_is_read_once_its_header_from_the_same_bytes(saved, monkeypatch):
    """read_cache_file takes the header from the bytes it read the tensors from: the file is opened
    once, so a save that replaces it in between cannot pair one file's header with another's tensors."""
    import builtins

    from jacap_attn.files import cache_file

    _, _, _, path = saved
    expected = read_cache_metadata(path)
    opened, real_open = [], builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: opened.append(f) or real_open(f, *a, **k))
    monkeypatch.setattr(cache_file, "read_cache_metadata", lambda p: pytest.fail("header read a second time"))
    meta, tensors = read_cache_file(path)
    assert meta == expected and tensors and [str(f) for f in opened] == [str(path)]


def test_the_cli_check_of_a_cache_file_reads_its_header_once(saved, monkeypatch):
    """``jacap ask``'s pre-load check took the header's fields from one read and its tensors' names (for the
    prompt ids) from a second (safetensors' ``safe_open``): a save in between could pair two files' headers."""
    import builtins

    from jacap_attn.cli_checks import _check_file_settings

    _, _, _, path = saved
    opened, real_open = [], builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: opened.append(f) or real_open(f, *a, **k))
    import safetensors

    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: pytest.fail("header read a second time"))
    assert _check_file_settings(path, None) == read_cache_metadata(path)
    assert [str(f) for f in opened] == [str(path)] * 2  # the check's one read, then the assertion's


def test_refuses_edited_model_field(saved, tmp_path):
    model, _, _, path = saved
    meta, _ = read_cache_file(path)
    fingerprint = json.loads(meta["model"])
    fingerprint["rope_parameters"] = {"rope_theta": 1.0, "rope_type": "default"}
    bad = _rewrite(path, tmp_path / "rope.safetensors", metadata={"model": json.dumps(fingerprint)})
    with pytest.raises(CacheFileError, match="field 'rope_parameters'"):
        jacap_attn.load_cache(bad, model)


@pytest.mark.parametrize("overrides,field", [(dict(num_hidden_layers=4), "num_hidden_layers"),
                                             (dict(num_key_value_heads=4), "num_key_value_heads"),
                                             (dict(head_dim=8), "head_dim")])
def test_refuses_another_models_file(saved, overrides, field):
    _, _, _, path = saved
    other = jacap_attn.patch(tiny_model("llama", **overrides), ratio=0.2)
    with pytest.raises(CacheFileError, match=f"field '{field}'"):
        jacap_attn.load_cache(path, other)


def test_refuses_other_family(saved):
    _, _, _, path = saved
    other = jacap_attn.patch(tiny_model("qwen3"), ratio=0.2)
    with pytest.raises(CacheFileError, match="field 'model_type'"):
        jacap_attn.load_cache(path, other)


def test_dtype_mismatch_refused_unless_cast(saved):
    model, prompt, cache, path = saved
    bf16 = jacap_attn.patch(tiny_model("llama", dtype=torch.bfloat16), ratio=0.2, window=8, budget="pyramid")
    with pytest.raises(CacheFileError, match="field 'dtype'"):
        jacap_attn.load_cache(path, bf16)
    cast = jacap_attn.load_cache(path, bf16, dtype=torch.bfloat16)
    assert cast.layers[0].keys.dtype == torch.bfloat16


def test_a_dtype_given_as_a_string_is_named(saved):
    """``load_cache(path, model, dtype="float32")`` raised torch's own "to() received an invalid combination of
    arguments" from deep inside the load."""
    model, _, _, path = saved
    with pytest.raises(ValueError, match=r"dtype must be a torch.dtype \(e.g. torch.float32 for 'float32'\)"):
        jacap_attn.Document.load(path, model, dtype="float32")


def test_cast_to_a_dtype_other_than_the_models_refused(saved):
    """A float32 model cannot continue a bfloat16 cache (the attention would mix the two): refused at
    load, naming the dtype, not at the first generate."""
    model, _, _, path = saved
    with pytest.raises(ValueError, match="dtype=torch.bfloat16 is not the model's dtype"):
        jacap_attn.load_cache(path, model, dtype=torch.bfloat16)
    assert jacap_attn.load_cache(path, model, dtype=torch.float32).layers[0].keys.dtype == torch.float32


def test_refuses_tensor_shape_disagreeing_with_metadata(saved, tmp_path):
    model, _, _, path = saved
    _, tensors = read_cache_file(path)
    keys = tensors["layers.1.keys"]
    bad = _rewrite(path, tmp_path / "shape.safetensors", tensors={"layers.1.keys": keys[..., :8].contiguous()})
    with pytest.raises(CacheFileError, match="'layers.1.keys' has shape"):
        jacap_attn.load_cache(bad, model)


def test_failed_load_changes_nothing(saved, tmp_path):
    model, prompt, _, path = saved
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config_before = model._jacap_state.config
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage")
    with pytest.raises(CacheFileError):
        jacap_attn.load_cache(bad, model)
    assert model._jacap_state.config is config_before
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_crash_during_save_keeps_previous_file(saved, monkeypatch):
    model, prompt, cache, path = saved
    original = path.read_bytes()

    def boom(fd):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk on fire"):
        jacap_attn.save_cache(cache, path, model=model, prompt_ids=prompt)
    monkeypatch.undo()
    assert path.read_bytes() == original
    assert sorted(os.listdir(path.parent)) == ["cache.safetensors"]


def test_a_saved_file_gets_the_umasks_mode_and_keeps_the_mode_it_replaces(saved, tmp_path):
    """A new cache file is ``0o666`` less the umask, as ``open(path, "w")`` and safetensors'
    ``save_file`` give, and a file saved over keeps its own mode. Before, every file was 0600 (the
    temporary file's, ``tempfile.mkstemp``), so another user or service could not read a document
    (found by a new user)."""
    model, prompt, cache, _ = saved
    previous = os.umask(0o022)
    try:
        fresh = tmp_path / "fresh.safetensors"
        jacap_attn.save_cache(cache, fresh, model=model, prompt_ids=prompt)
        assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o644
        os.umask(0o077)
        other = tmp_path / "private.safetensors"
        jacap_attn.save_cache(cache, other, model=model, prompt_ids=prompt)
        assert stat.S_IMODE(os.stat(other).st_mode) == 0o600
        os.chmod(fresh, 0o640)
        jacap_attn.save_cache(cache, fresh, model=model, prompt_ids=prompt)  # saved over: its mode stays
        assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o640
    finally:
        os.umask(previous)


def test_file_holds_metadata_and_ids(saved):
    model, prompt, cache, path = saved
    meta, tensors = read_cache_file(path)
    assert meta["logical_length"] == str(N)
    assert json.loads(meta["jacap_config"])["budget"] == "pyramid"
    assert json.loads(meta["model"])["num_key_value_heads"] == 2
    assert torch.equal(tensors["prompt_ids"], prompt)
    assert set(load_file(path)) >= {"layers.0.keys", "layers.0.values", "layers.0.positions", "layers.0.counts", "pads"}


def test_format_1_files_still_load(saved, tmp_path):
    """Files written before methods had their own options (format 1: a flat config, ``None`` for
    a method default) load with the same settings and answer the same tokens."""
    from safetensors import safe_open

    model, prompt, cache, path = saved
    with safe_open(path, "pt") as handle:
        metadata = dict(handle.metadata())
    jacap = cache.config.method
    flat = {"ratio": 0.2, "method": "jacap", "window": 8, "budget": "pyramid", "ridge": None, "beta": jacap.beta,
            "pooling": "avg", "kernel": jacap.kernel, "selector": "leverage", "consensus": jacap.consensus, "consensus_kernel": 15,
            "mass": None, "sinks": 4, "temperature": 5.0, "seed": 0, "pyramid_beta": 20.0, "capacity_alpha": 0.5,
            "adakv_alpha": 0.2, "reserve": 256, "compile": True}
    metadata.update(format_version="1", jacap_config=json.dumps(flat))
    del metadata["metadata_sha256"]  # format 3's; older files have none
    metadata, tensors = padded_tensors(metadata, load_file(path))  # format 1 was padded
    metadata["weights_sha256"] = legacy_weights_fingerprint(model, model.model.layers)  # and held the fingerprint of its time
    old = tmp_path / "v1.safetensors"
    save_file(tensors, old, metadata=metadata)
    loaded = jacap_attn.load_cache(old, model)
    # Written before word spans existed: read as token by token, the behaviour of its time.
    # Written before the carry and prompt lookup were on by default (2026-12-05/06): read without them.
    assert loaded.config == dataclasses.replace(cache.config, spans="none", chunk_scores="rescore", chunk_mass=False, method=dataclasses.replace(
        cache.config.method, carry=0.0, carry_len=64, carry_count=0, carry_by="score", lookup=0, lookup_share=0.5,
        lookup_free=0, lookup_ahead=False))
    question = random_ids(1, 5, seed=9)
    assert torch.equal(_answer(model, loaded, prompt, question), _answer(model, cache, prompt, question))
    assert json.loads(read_cache_file(path)[0]["jacap_config"])["options"]["mass"] == 2.0  # format 2 nests


def test_a_file_holds_only_the_kept_entries(tmp_path):
    """Issue 24: per-head budgets (the global policy) pad a layer's KV heads to its largest head in
    memory; the file packs the held entries, so it is at most 1.15x their bytes, and loads back to a
    cache that answers exactly as the saved one."""
    model = tiny_model("llama", max_position_embeddings=2048)
    jacap_attn.patch(model, ratio=0.2, window=8, budget="global")
    ids = random_ids(1, 600)
    cache = jacap_attn.compress(model, ids)
    counts = cache.layers[0].kept_counts()
    assert int(counts.max()) > int(counts.min())  # the heads keep different numbers of entries
    path = tmp_path / "packed.safetensors"
    size = jacap_attn.save_cache(cache, path, model=model, prompt_ids=ids, store_ids=False)
    assert size <= 1.15 * cache.kept_bytes() < cache.kv_bytes()
    loaded = jacap_attn.load_cache(path, model)
    for saved, back in zip(cache.layers, loaded.layers):
        assert torch.equal(saved.kept_counts(), back.kept_counts())
        s_pos, b_pos = saved.export()[2], back.export()[2]
        for h in range(s_pos.shape[1]):
            assert torch.equal(s_pos[0, h][saved.export()[3][0, h]], b_pos[0, h][back.export()[3][0, h]])
    question = torch.cat([ids, random_ids(1, 4, seed=9)], dim=1)
    with torch.no_grad():
        want = model.generate(question, cache=copy.deepcopy(cache), max_new_tokens=4, do_sample=False)
        got = model.generate(question, cache=loaded, max_new_tokens=4, do_sample=False)
    assert torch.equal(want, got)


def test_a_file_of_format_2_saved_by_the_previous_release_still_loads(saved, tmp_path):
    """A format 2 file as the previous release wrote it (padded tensors, no header checksum, the
    weights fingerprint of its time) loads, checked against that fingerprint; another model's weights
    are still refused."""
    model, prompt, cache, path = saved
    meta, tensors = read_cache_file(path)
    meta = {k: v for k, v in meta.items() if k != "metadata_sha256"}
    meta, tensors = padded_tensors({**meta, "format_version": "2"}, tensors)
    meta["weights_sha256"] = legacy_weights_fingerprint(model, model.model.layers)
    old = tmp_path / "v2.safetensors"
    save_file(tensors, old, metadata=meta)
    loaded = jacap_attn.load_cache(old, model)
    question = random_ids(1, 5, seed=9)
    assert torch.equal(_answer(model, loaded, prompt, question), _answer(model, cache, prompt, question))
    save_file(tensors, old, metadata={**meta, "weights_sha256": "0" * 64})
    with pytest.raises(CacheFileError, match="weights_sha256"):
        jacap_attn.load_cache(old, model)


_TAMPERED = {  # a consistent file (checksums recomputed) whose tensors no save_cache writes
    "keys in float16": (lambda t: {"layers.0.keys": t["layers.0.keys"].half()}, "'layers.0.keys' has dtype float16"),
    "values in float64": (lambda t: {"layers.1.values": t["layers.1.values"].double()},
                          "'layers.1.values' has dtype float64"),
    "float positions": (lambda t: {"layers.0.positions": t["layers.0.positions"].float()}, "positions are integers"),
    "repeated positions": (lambda t: {"layers.0.positions": torch.zeros_like(t["layers.0.positions"])},
                           "not strictly increasing"),
    "reversed positions": (lambda t: {"layers.0.positions": t["layers.0.positions"].flip(0)}, "not strictly increasing"),
    "negative pads": (lambda t: {"pads": torch.tensor([-5])}, "'pads' must hold int64 left paddings"),
    "pads past the prompt": (lambda t: {"pads": torch.tensor([N])}, "'pads' must hold int64 left paddings"),
    "float ids": (lambda t: {"prompt_ids": t["prompt_ids"].float()}, "'prompt_ids' has dtype"),
    "a tensor of its own": (lambda t: {"extra": torch.zeros(1)}, "unexpected tensor 'extra'"),
}


@pytest.mark.parametrize("case", sorted(_TAMPERED))
def test_tampered_tensors_with_recomputed_checksums_are_refused_at_load(saved, tmp_path, case):
    """Every such file is a CacheFileError naming the tensor at load, not an error inside a later
    generate, nor a cache that decodes over a wrong layout (these loaded before)."""
    model, _, _, path = saved
    edit, message = _TAMPERED[case]
    _, tensors = read_cache_file(path)
    bad = _rewrite(path, tmp_path / "tampered.safetensors", tensors=edit(tensors))
    with pytest.raises(CacheFileError, match=message):
        jacap_attn.load_cache(bad, model)


def test_a_refused_load_says_only_why_it_was_refused(saved):
    """Loading into another model family (unpatched) used to warn about the temporary patch's word
    spans first ("found no tokenizer"), advice that does not apply; the warning now comes only with a
    cache that loads."""
    import warnings

    _, _, _, path = saved
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CacheFileError, match="field 'model_type'"):
            jacap_attn.load_cache(path, tiny_model("qwen3"))
    assert [str(w.message) for w in caught] == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jacap_attn.load_cache(path, tiny_model("llama"))  # the right weights (same seed), unpatched
    assert any("spans" in str(w.message) for w in caught)


def test_the_same_cache_saved_twice_gives_the_same_bytes(saved, tmp_path):
    """safetensors writes the header's metadata in hash-map order (different on every call): the
    files of one cache differed in ~2.7 kB of header; now byte-identical, and still loadable."""
    model, prompt, cache, _ = saved
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    for path in (a, b):
        jacap_attn.save_cache(cache, path, model=model, prompt_ids=prompt)
    assert a.read_bytes() == b.read_bytes()
    meta = read_cache_file(a)[0]
    raw = a.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert list(header["__metadata__"]) == sorted(meta)
    assert jacap_attn.load_cache(a, model).get_seq_length() == prompt.shape[1]


def test_a_file_from_another_dtypes_copy_of_the_weights_names_the_dtype(tmp_path):
    """A file written by a bfloat16 model, loaded into a float16 copy of the same weights (whose fingerprint
    differs: float16 rounds other bits): the refusal names the dtype that wrote the file and what to load,
    not "other weights?" (``dtype=`` cannot help: the fingerprint is of the model's own weights)."""
    ids = random_ids(1, 80)
    writer = jacap_attn.patch(tiny_model("llama", dtype=torch.bfloat16), ratio=0.3)
    jacap_attn.save_cache(jacap_attn.compress(writer, ids), tmp_path / "bf.safetensors", model=writer, prompt_ids=ids)
    reader = jacap_attn.patch(tiny_model("llama", dtype=torch.float16), ratio=0.3)
    for dtype in (None, torch.float16):
        with pytest.raises(CacheFileError, match="written by a bfloat16 model and this one is float16.*load the "
                                                 "model in bfloat16"):
            jacap_attn.load_cache(tmp_path / "bf.safetensors", reader, dtype=dtype)
    other = jacap_attn.patch(tiny_model("llama", seed=1, dtype=torch.bfloat16), ratio=0.3)
    with pytest.raises(CacheFileError, match=r"same shape, other weights\?"):  # same dtype, other weights
        jacap_attn.load_cache(tmp_path / "bf.safetensors", other)


def test_a_symlinked_output_replaces_the_file_it_names(tmp_path):
    """``save_cache`` to a symbolic link writes the file the link names (the link stays a link, as ``cp`` and
    editors write through one), atomically there; an output folder that is a file is named as such."""
    from jacap_attn.files.paths import check_output_path, write_atomically

    (tmp_path / "v1.safetensors").write_bytes(b"old")
    link = tmp_path / "latest.safetensors"
    link.symlink_to("v1.safetensors")
    model = jacap_attn.patch(tiny_model(), ratio=0.5, min_tokens=0)
    ids = random_ids(1, 40)
    jacap_attn.save_cache(jacap_attn.compress(model, ids), link, model=model, prompt_ids=ids)
    assert link.is_symlink() and os.readlink(link) == "v1.safetensors"
    assert read_cache_metadata(tmp_path / "v1.safetensors")["format"] == "jacap-cache"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    dangling = tmp_path / "next.safetensors"
    dangling.symlink_to("sub/next.safetensors")  # its folder does not exist: refused before writing
    with pytest.raises(ValueError, match="does not exist"):
        check_output_path(dangling)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_output_path(tmp_path / "afile" / "doc.safetensors")
    write_atomically(tmp_path / "plain.bin", b"data")
    assert (tmp_path / "plain.bin").read_bytes() == b"data"


def test_a_header_read_while_another_process_replaces_the_file_sees_one_version(tmp_path):
    """``read_cache_metadata`` reads through one open file: while another process replaces the file again and
    again (atomically, files of two sizes), every read sees one whole version, never "truncated or corrupted"
    (safetensors' ``safe_open`` took the size of one version and the header of another)."""
    import subprocess
    import sys

    model = jacap_attn.patch(tiny_model(), ratio=0.5, min_tokens=0)
    paths = []
    for n, quantize in ((30, None), (90, "int8")):
        ids = random_ids(1, n)
        paths.append(tmp_path / f"v{n}.safetensors")
        jacap_attn.save_cache(jacap_attn.compress(model, ids), paths[-1], model=model, prompt_ids=ids, quantize=quantize)
    target = tmp_path / "doc.safetensors"
    target.write_bytes(paths[0].read_bytes())
    # the writer renames a finished file over the target, as write_atomically does (no imports: it starts at once)
    writer = ("import os, sys, time\nversions = [open(p, 'rb').read() for p in sys.argv[2:4]]\n"
              "end, i = time.time() + 3, 0\nwhile time.time() < end:\n"
              "    tmp = sys.argv[1] + f'.{i}.tmp'\n    open(tmp, 'wb').write(versions[i % 2])\n"
              "    os.replace(tmp, sys.argv[1]); i += 1\n")
    proc = subprocess.Popen([sys.executable, "-c", writer, str(target), *map(str, paths)])
    reads = 0
    try:
        while proc.poll() is None:
            assert read_cache_metadata(target)["format"] == "jacap-cache"
            reads += 1
    finally:
        proc.kill()
        proc.wait()
    assert reads > 1000


def test_document_load_reads_its_header_and_entries_from_one_version(tmp_path, monkeypatch):
    """``Document.load`` read the header (its ``prompt_format``) and then, in a second open, the entries: a file
    replaced in between (an atomic save of another document) gave one document's layout with another's entries.
    Both now come from one read. Here the file is replaced right after any header-only read."""
    from jacap_attn.files import cache_file

    model = jacap_attn.patch(tiny_model(), ratio=0.5, min_tokens=0)
    target, other = tmp_path / "doc.safetensors", tmp_path / "other.safetensors"
    for path, n, source in ((target, 30, "first"), (other, 50, "second")):
        jacap_attn.Document.compress(model, random_ids(1, n, seed=n),
                                     prompt_format={"chat": False, "source": source}).save(path)
    header_only = cache_file.read_header

    def then_replaced(path):
        header = header_only(path)
        os.replace(other, target)  # another process's atomic save lands now
        return header

    monkeypatch.setattr(cache_file, "read_header", then_replaced)
    doc = jacap_attn.Document.load(target, model)
    assert (doc.prompt_format["source"], doc.length) in (("first", 30), ("second", 50))
