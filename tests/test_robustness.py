"""Robustness: padding, short prompts, bad settings, numerics, memory, devices, and regression tests
for the bugs users hit in other KV-compression libraries (public bug reports of kvpress and transformers)."""

from __future__ import annotations

import contextlib
import gc
import math
import weakref

import pytest
import torch
import transformers

import jacap_attn
from jacap_attn.math import budget as budgets
from jacap_attn.math import scoring
from jacap_attn import methods
from jacap_attn.storage.cache import JacapCache, JacapLayer
from conftest import random_ids, tiny_model

GREEDY = dict(do_sample=False, pad_token_id=0)


# ---------------------------------------------------------------- helpers

def generate(model, ids, steps=6, **kwargs):
    """Greedy generation of exactly ``steps`` tokens, returning the dict output (with the cache)."""
    return model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, return_dict_in_generate=True,
                          output_logits=True, **GREEDY, **kwargs)


def kept_prompt_positions(layer: JacapLayer, row: int, n: int) -> list[list[int]]:
    """Per KV head of batch row ``row``: the sorted logical prompt positions (``< n``) still held."""
    out = []
    for head in range(layer.valid.shape[1]):
        pos = layer.positions[row, head][layer.valid[row, head]].tolist()
        out.append(sorted(p for p in pos if p < n))
    return out


@contextlib.contextmanager
def captured_scores():
    """Collect the scores of every pending layer at each ``finalize_prefill`` (prefill) call."""
    seen: list[torch.Tensor | None] = []
    original = jacap_attn.selection.finalize_prefill

    def spy(cache):
        seen.extend(None if i not in cache.prefill.parts else cache.prefill.parts[i]["scores"].clone()
                    for i, layer in enumerate(cache.layers) if layer.state == "pending" and not layer.is_sliding)
        return original(cache)

    jacap_attn.selection.finalize_prefill = spy
    try:
        yield seen
    finally:
        jacap_attn.selection.finalize_prefill = original


def left_pad(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D id tensors into ``(ids [b, n], attention_mask [b, n])`` (pad id 0)."""
    n = max(s.shape[0] for s in samples)
    ids = torch.zeros(len(samples), n, dtype=torch.long)
    mask = torch.zeros(len(samples), n, dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, n - sample.shape[0]:] = sample
        mask[row, n - sample.shape[0]:] = 1
    return ids, mask


def assert_unpatched_state(model, impl="sdpa"):
    assert not jacap_attn.is_patched(model)
    assert model.config._attn_implementation == impl
    adapter = jacap_attn.patches.get_adapter(model.config.model_type)
    assert all("forward" not in module.__dict__ for module in adapter.attention_modules(model))
    base = adapter.base_model(model)
    assert not base._forward_hooks and not base._forward_pre_hooks
    for name in ("generate", "_prepare_cache_for_generation", "_valid_auto_compile_criteria"):
        assert name not in model.__dict__


# ---------------------------------------------------------------- left padding

LENGTHS = (60, 45, 12)  # the last sample has more padding (48) than the whole budget of the others
# Every registered method: tests/test_methods.py::test_padded_batch_equals_each_row_alone.


def _padded_vs_alone(model, samples, steps=6):
    ids, mask = left_pad(samples)
    batch = generate(model, ids, steps, attention_mask=mask)
    alone = [generate(model, sample[None], steps) for sample in samples]
    return ids, mask, batch, alone


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "phi3"])
def test_padded_batch_without_pooling_equals_alone_every_family(family):
    """Same property without the local pooling (isolates masks, positions and sliding layers)."""
    model = tiny_model(family)
    jacap_attn.patch(model, ratio=0.3, window=8, pooling="none")
    samples = [random_ids(1, n, seed=20 + n)[0] for n in LENGTHS]
    ids, _, batch, alone = _padded_vs_alone(model, samples, steps=4)
    for row, (sample, single) in enumerate(zip(samples, alone)):
        m = sample.shape[0]
        for layer, ref in zip(batch.cache.layers, single.cache.layers):
            assert not bool((layer.valid[row] & (layer.positions[row] < 0)).any())
            assert kept_prompt_positions(layer, row, m) == kept_prompt_positions(ref, 0, m)
        assert batch.sequences[row, ids.shape[1]:].tolist() == single.sequences[0, m:].tolist()


def test_compress_padded_batch_matches_alone():
    """``compress(model, ids, attention_mask)`` on a left-padded batch, then ``generate`` with a
    question: each row must answer as its unpadded prompt does (RoPE positions must skip padding,
    as ``generate``'s own prefill does). Ratio 1.0: nothing is evicted, only positions matter."""
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=1.0)
    samples = [random_ids(1, 60, seed=3)[0], random_ids(1, 45, seed=4)[0]]
    ids, mask = left_pad(samples)
    question = random_ids(2, 3, seed=9)
    cache = jacap_attn.compress(model, ids, mask)
    batch = generate(model, torch.cat([ids, question], 1), 4, cache=cache,
                     attention_mask=torch.cat([mask, torch.ones_like(question)], 1))
    for row, sample in enumerate(samples):
        single = generate(model, torch.cat([sample[None], question[row:row + 1]], 1), 4,
                          cache=jacap_attn.compress(model, sample[None]))
        got = torch.stack(batch.logits)[:, row]
        want = torch.stack(single.logits)[:, 0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, row=row: f"row {row} (padding {ids.shape[1] - samples[row].shape[0]}): {m}")


def _right_padded():
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.3, window=8)
    ids = random_ids(2, 30)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    return model, ids, mask


def test_right_padding_raises_clear_error_in_compress():
    model, ids, mask = _right_padded()
    with pytest.raises(ValueError, match="left padding"):
        jacap_attn.compress(model, ids, mask)


def test_right_padding_raises_clear_error_in_generate():
    """``generate`` hands the model a prepared 4-D mask: the check must hold there too (else the
    observation window is made of pad tokens and pads are scored)."""
    model, ids, mask = _right_padded()
    with pytest.raises(ValueError, match="left padding"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, **GREEDY)


# ---------------------------------------------------------------- short prompts

@pytest.mark.parametrize("family,method", [("llama", "jacap"), ("llama", "adakv"), ("llama", "capkv"), ("llama", "h2o"),
                                           ("llama", "streaming_llm"), ("gemma3_text", "jacap"), ("gemma3_text", "snapkv")])
def test_short_prompts_nothing_evicted_equal_unpatched(family, method):
    """Prompts no longer than the window (32): nothing can be evicted, tokens equal the unpatched model."""
    model = tiny_model(family)
    prompts = [random_ids(1, n, seed=n) for n in (1, 2, 15, 32)]
    expected = [model.generate(p, max_new_tokens=4, min_new_tokens=4, **GREEDY) for p in prompts]
    jacap_attn.patch(model, ratio=0.1, method=method)
    for prompt, want in zip(prompts, expected):
        out = generate(model, prompt, 4)
        n = prompt.shape[1]
        for layer in out.cache.layers:
            # a sliding-window layer holds the last sliding_window - 1 prompt tokens, like the stock model needs
            first = max(0, n - (layer.sliding_window - 1)) if layer.is_sliding else 0
            assert kept_prompt_positions(layer, 0, n) == [list(range(first, n))] * layer.valid.shape[1]
        assert torch.equal(out.sequences, want), f"n={n}"


@pytest.mark.parametrize("method", ["jacap", "snapkv", "adakv", "capkv", "streaming_llm", "h2o", "tova", "knorm"])
@pytest.mark.parametrize("n,ratio,window", [(15, 0.5, 4), (15, 0.5, 8), (1, 0.1, 1), (2, 0.5, 1), (7, 0.1, 3)])
def test_short_prompts_that_evict(method, n, ratio, window):
    """A ~15-token context at ratio 0.5 (kvpress produced degenerate output there), 1- and 2-token prompts
    with a 1-token window: kept count = clamp(ceil(ratio n), min(window, n), n), window kept, finite logits."""
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=ratio, method=method, window=window)
    prompt = random_ids(1, n, seed=n + window)
    out = generate(model, prompt, 5)
    want = min(max(math.ceil(ratio * n), min(window, n)), n)
    for layer in out.cache.layers:
        heads = kept_prompt_positions(layer, 0, n)
        assert sum(map(len, heads)) == want * len(heads)  # Ada-KV moves budget between heads, the sum stays
        for head in heads:
            assert min(window, n) <= len(head) <= n and (len(head) == want or method == "adakv")
            assert set(range(n - min(window, n), n)) <= set(head)
    assert all(torch.isfinite(step).all() for step in out.logits)
    assert out.sequences.shape == (1, n + 5)


# ---------------------------------------------------------------- bad settings

BAD_SETTINGS = [
    (dict(ratio=0), "ratio=0"),
    (dict(ratio=-0.5), "ratio=-0.5"),
    (dict(ratio=1.5), "ratio=1.5"),
    (dict(ratio=float("nan")), "ratio=nan"),
    (dict(ratio=float("inf")), "ratio=inf"),
    (dict(ratio="0.1"), "ratio='0.1'"),
    (dict(ratio=None), "ratio=None"),
    (dict(ratio=True), "ratio=True"),
    (dict(method="nope"), "method='nope'"),
    (dict(method=None), "method=None"),
    (dict(method="JACAP"), "method='JACAP'"),
    (dict(window=0), "window=0"),
    (dict(window=-3), "window=-3"),
    (dict(window=4.0), "window=4.0"),
    (dict(window=True), "window=True"),
    (dict(method="snapkv", ridge=0.5), "ridge=0.5"),
    (dict(method="jacap", temperature=2.0), "temperature=2.0"),
    (dict(method="tova", mass=1.0), "mass=1.0"),
    (dict(mass=-1.0), "mass=-1.0"),
    (dict(mass=float("inf")), "mass=inf"),
    (dict(sinks=-1), "sinks=-1"),
    (dict(method="full", window=8), "window=8"),
    (dict(method="h2o", pooling="max"), "pooling='max'"),
    (dict(frobnicate=1), "frobnicate"),
    (dict(budget="pyramids"), "budget='pyramids'"),
    (dict(method="pyramidkv", budget="uniform"), "budget='uniform'"),
    (dict(kernel=4), "kernel=4"),
    (dict(reserve=0), "reserve=0"),
    (dict(compile="yes"), "compile='yes'"),
    (dict(ridge=0.0), "ridge=0.0"),
    (dict(beta=-1.0), "beta=-1.0"),
    # Non-finite values: accepted today, they turn every score into NaN.
    (dict(ridge=float("inf")), "ridge=inf"),
    (dict(beta=float("inf")), "beta=inf"),
    (dict(method="capkv", temperature=float("inf")), "temperature=inf"),
]


@pytest.mark.parametrize("options,named", BAD_SETTINGS, ids=[n for _, n in BAD_SETTINGS])
def test_bad_setting_is_a_value_error_naming_it_and_leaves_model_unpatched(options, named):
    model = tiny_model("llama")
    with pytest.raises(ValueError) as info:
        jacap_attn.patch(model, **options)
    assert named in str(info.value), f"message does not name {named!r}: {info.value}"
    assert_unpatched_state(model)


def test_patch_twice_replaces_settings():
    model = tiny_model("llama")
    ids = random_ids(1, 100)
    jacap_attn.patch(model, ratio=0.5, window=4, budget="uniform")
    assert [layer.valid.sum(-1).tolist() for layer in jacap_attn.compress(model, ids).layers] == [[[50, 50]]] * 3
    jacap_attn.patch(model, ratio=0.1, window=4, method="streaming_llm", sinks=2)
    cache = jacap_attn.compress(model, ids)
    for layer in cache.layers:
        assert kept_prompt_positions(layer, 0, 100) == [[0, 1] + list(range(92, 100))] * 2
    # the second call replaced the settings without stacking a second set of wrappers/hooks
    base = model.model
    assert len(base._forward_hooks) == 1 and len(base._forward_pre_hooks) == 1
    assert model.config._attn_implementation == "jacap_sdpa"
    assert generate(model, ids, 3).sequences.shape == (1, 103)
    # a rejected second call keeps the model patched with the previous settings
    with pytest.raises(ValueError):
        jacap_attn.patch(model, ratio=2.0)
    assert jacap_attn.is_patched(model) and model._jacap_state.config.method.name == "streaming_llm"
    # one unpatch undoes everything
    jacap_attn.unpatch(model)
    assert_unpatched_state(model)


def test_patch_unpatch_patch_cycle_and_unpatch_noop():
    model = tiny_model("llama")
    ids = random_ids(1, 50)
    with torch.no_grad():
        reference = model(ids).logits
    assert jacap_attn.unpatch(model) is model  # no-op on an unpatched model
    assert_unpatched_state(model)
    for _ in range(2):
        jacap_attn.patch(model, ratio=0.2, window=8)
        assert int(jacap_attn.compress(model, ids).layers[0].valid[0, 0].sum()) == 10
        jacap_attn.unpatch(model)
        assert_unpatched_state(model)
        jacap_attn.unpatch(model)
    with torch.no_grad():
        out = model(ids)
    assert type(out.cache) is transformers.DynamicCache
    torch.testing.assert_close(out.logits, reference, rtol=0, atol=0)


def test_failed_patch_leaves_model_unpatched():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="gpt2"):
        jacap_attn.patch(gpt2)
    assert not jacap_attn.is_patched(gpt2)

    model = tiny_model("llama")

    def refuse(*args, **kwargs):
        raise RuntimeError("attention implementation refused")

    model.set_attn_implementation = refuse  # a failure in the last step of patch()
    with pytest.raises(RuntimeError, match="refused"):
        jacap_attn.patch(model, ratio=0.2)
    del model.set_attn_implementation
    assert_unpatched_state(model)

    jacap_attn.patch(model, ratio=0.2)  # a patched model keeps its earlier settings (docs/usage.md)
    state, config = model._jacap_state, model._jacap_state.config
    with pytest.raises(ValueError, match="tokenizer"):  # once: the new ratio and window were applied anyway
        jacap_attn.patch(model, ratio=0.5, window=8, tokenizer=object())
    assert model._jacap_state is state and state.config is config and config.ratio == 0.2


def test_an_attention_implementation_set_after_patch_is_refused_then_kept():
    """``set_attn_implementation("eager")`` on a patched model once turned compression off without a word (a
    200-token prompt kept 200 entries) and ``unpatch`` then put back the implementation of before ``patch``."""
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.2)
    model.set_attn_implementation("eager")
    with pytest.raises(RuntimeError, match="set to 'eager' after jacap_attn.patch.*patch\\(model, ...\\) again"):
        jacap_attn.compress(model, random_ids(1, 200))
    jacap_attn.unpatch(model)
    assert model.config._attn_implementation == "eager"
    jacap_attn.patch(model, ratio=0.2)
    assert max(layer.kept_counts().max().item() for layer in jacap_attn.compress(model, random_ids(1, 200)).layers) < 100
    model.set_attn_implementation("sdpa")  # patching again attends through jacap_attn again (once: still refused)
    jacap_attn.patch(model, ratio=0.2)
    assert max(layer.kept_counts().max().item() for layer in jacap_attn.compress(model, random_ids(1, 200)).layers) < 100
    jacap_attn.unpatch(model)
    assert model.config._attn_implementation == "sdpa"


# ---------------------------------------------------------------- numerics

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", ["jacap", "snapkv", "adakv", "capkv", "h2o", "keydiff", "knorm", "tova"])
def test_scores_float32_and_kept_sets_deterministic_in_half_precision(dtype, method):
    model = tiny_model("llama", dtype=dtype)
    jacap_attn.patch(model, ratio=0.2, method=method, window=8)
    ids = random_ids(1, 120, seed=5)
    with captured_scores() as seen:
        first = jacap_attn.compress(model, ids)
    assert len(seen) == 3 and all(s is not None and s.dtype == torch.float32 for s in seen)
    assert first.layers[0].keys.dtype == dtype
    second = jacap_attn.compress(model, ids)
    twin = jacap_attn.compress(model, ids.expand(2, -1).clone())  # the same prompt twice in one batch
    for a, b, t in zip(first.layers, second.layers, twin.layers):
        assert kept_prompt_positions(a, 0, 120) == kept_prompt_positions(b, 0, 120)
        assert kept_prompt_positions(t, 0, 120) == kept_prompt_positions(t, 1, 120) == kept_prompt_positions(a, 0, 120)


def _degenerate(model, kind):
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if kind == "uniform":  # zero queries: every window query attends uniformly
                attn.q_proj.weight.zero_()
            elif kind == "one_hot":  # huge logits: attention collapses on one key per query
                attn.q_proj.weight.mul_(40.0)
                attn.k_proj.weight.mul_(40.0)
            elif kind == "equal_values":  # all values equal (zero): degenerate Gram matrix in the solve
                attn.v_proj.weight.zero_()
            elif kind == "zero_keys":  # all keys zero: uniform attention, zero key norms
                attn.k_proj.weight.zero_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["uniform", "one_hot", "equal_values", "zero_keys"])
@pytest.mark.parametrize("method", ["jacap", "snapkv", "adakv", "capkv"])
@pytest.mark.parametrize("budget", ["capacity", "global"])
def test_degenerate_attention_no_nan_valid_kept_sets(method, kind, dtype, budget):
    model = tiny_model("llama", dtype=dtype)
    _degenerate(model, kind)
    jacap_attn.patch(model, ratio=0.2, method=method, window=8, budget=budget)
    n = 100
    with captured_scores() as seen:
        out = generate(model, random_ids(1, n, seed=2), 4)
    assert all(s is not None and s.dtype == torch.float32 and not torch.isnan(s).any() for s in seen)
    assert all(torch.isfinite(step.float()).all() for step in out.logits)
    total = 0
    for layer in out.cache.layers:
        assert not bool((layer.valid & (layer.positions < 0)).any())
        for head in kept_prompt_positions(layer, 0, n):
            assert len(set(head)) == len(head) and set(range(n - 8, n)) <= set(head)
            assert 8 <= len(head) <= n
            total += len(head)
    # adaptive policies: the layers (and, under `global`, the heads) share the total L * h * ceil(0.2 n)
    assert total == 3 * 2 * 20


# ---------------------------------------------------------------- memory

@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "phi3", "mistral", "qwen2"])
def test_no_reference_to_full_prompt_kv_remains(family, monkeypatch):
    model = tiny_model(family)
    jacap_attn.patch(model, ratio=0.1, window=8, reserve=16)
    n = 700
    full_refs = []
    original = JacapLayer.compress

    def spy(self, *args, **kwargs):
        full_refs.extend([weakref.ref(self.keys), weakref.ref(self.values)])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JacapLayer, "compress", spy)
    cache = jacap_attn.compress(model, random_ids(1, n))
    gc.collect()
    assert len(full_refs) == 2 * model.config.num_hidden_layers
    assert all(ref() is None for ref in full_refs), "a full-length prompt K/V tensor is still alive"
    kv_heads = model.config.num_key_value_heads
    d = model.config.head_dim
    for layer in cache.layers:
        assert layer.capacity < n
        assert layer.keys.shape[:3] == layer.values.shape[:3] == (1, kv_heads, layer.capacity)
        bound = kv_heads * layer.capacity * d * layer.keys.element_size()
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor):
                assert n not in value.shape, f"{name} has the prompt length in its shape {tuple(value.shape)}"
                assert value.untyped_storage().nbytes() <= bound, f"{name} storage exceeds the capacity bound"
    stale = [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.is_floating_point() and n in t.shape]
    assert not stale, [tuple(t.shape) for t in stale]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "phi3"])
def test_gqa_cache_never_expanded_to_query_heads(family):
    model = tiny_model(family, num_attention_heads=4, num_key_value_heads=1)
    jacap_attn.patch(model, ratio=0.2, window=8)
    out = generate(model, random_ids(2, 80), 5)
    for layer in out.cache.layers:
        for t in (layer.keys, layer.values, layer.positions, layer.valid):
            assert t.shape[1] == model.config.num_key_value_heads == 1


# ---------------------------------------------------------------- devices

def _layer_device(model, index):
    adapter = jacap_attn.patches.get_adapter(model.config.model_type)
    return next(adapter.attention_modules(model)[index].parameters()).device


def _assert_buffers_on_layer_devices(model, cache):
    for index, layer in enumerate(cache.layers):
        device = _layer_device(model, index)
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor):
                assert value.device == device, f"layer {index} {name} on {value.device}, weights on {device}"


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "phi3"])
def test_cache_buffers_live_on_their_layer_device(family):
    model = tiny_model(family)
    jacap_attn.patch(model, ratio=0.3, window=8, method="adakv")
    ids, mask = left_pad([random_ids(1, 50)[0], random_ids(1, 35, seed=2)[0]])
    out = generate(model, ids, 3, attention_mask=mask)
    _assert_buffers_on_layer_devices(model, out.cache)


def _move(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_move(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    return obj


def _split_across_devices(model, devices):
    """Place decoder layer ``i`` on ``devices[i % len(devices)]`` (embeddings on the first, head on the
    last layer's device) with pre-hooks moving every tensor input: a hand-made ``device_map``."""
    layers = model.model.layers
    model.model.embed_tokens.to(devices[0])
    model.model.rotary_emb.to(devices[0])
    handles = []
    for index, layer in enumerate(layers):
        device = torch.device(devices[index % len(devices)])
        layer.to(device)
        handles.append(layer.register_forward_pre_hook(
            lambda mod, args, kwargs, device=device: (_move(args, device), _move(kwargs, device)), with_kwargs=True))
    last = torch.device(devices[(len(layers) - 1) % len(devices)])
    for module in (model.model.norm, model.lm_head):
        module.to(last)
        handles.append(module.register_forward_pre_hook(
            lambda mod, args, kwargs, device=last: (_move(args, device), _move(kwargs, device)), with_kwargs=True))
    return handles


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: splits layers across devices")
def test_layers_split_across_devices():
    devices = ["cuda:0", "cuda:1"] if torch.cuda.device_count() > 1 else ["cuda:0", "cpu"]
    model = tiny_model("llama", num_hidden_layers=4)
    _split_across_devices(model, devices)
    ids, mask = left_pad([random_ids(1, 90)[0], random_ids(1, 70, seed=2)[0]])
    ids, mask = ids.to(devices[0]), mask.to(devices[0])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, **GREEDY)
    jacap_attn.patch(model, ratio=1.0, compile=False)
    same = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, **GREEDY)
    assert torch.equal(same, expected)
    for method in ("jacap", "adakv", "capkv"):
        jacap_attn.patch(model, ratio=0.3, window=8, method=method, budget="capacity" if method == "jacap" else "uniform",
                         compile=False)
        out = generate(model, ids, 5, attention_mask=mask)
        _assert_buffers_on_layer_devices(model, out.cache)
        assert {layer.keys.device.type for layer in out.cache.layers} == {torch.device(d).type for d in devices}
        for layer in out.cache.layers:
            assert not bool((layer.valid & (layer.positions < 0)).any())
        cache = jacap_attn.compress(model, ids, mask)
        _assert_buffers_on_layer_devices(model, cache)


# ---------------------------------------------------------------- regressions from other libraries

@pytest.mark.parametrize("method,kind", [("jacap", "equal_values"), ("snapkv", "uniform"), ("tova", "uniform"),
                                         ("adakv", "uniform"), ("keydiff", "zero_keys"), ("knorm", "zero_keys")])
def test_window_kept_when_all_scores_tie(method, kind):
    """kvpress/SnapKV: window tokens lost top-k ties to a sentinel and were evicted."""
    model = tiny_model("llama")
    _degenerate(model, kind)
    options = {"pooling": "none"} if method in ("jacap", "snapkv", "adakv") else {}
    if method == "jacap":  # the leverage alone ties (zero values); sinks and the mass term would not
        options.update(mass=0.0, sinks=0, budget="uniform")  # every head keeps 30: the count checked below
    n = 300
    jacap_attn.patch(model, ratio=0.1, method=method, window=16, **options)
    with captured_scores() as seen:
        cache = jacap_attn.compress(model, random_ids(1, n))
    # every position before the window ties (so top-k alone cannot tell which to keep)
    assert all(bool((s[..., : n - 16] == s[..., :1]).all()) for s in seen), "no tie: the test is vacuous"
    for layer in cache.layers:
        for head in kept_prompt_positions(layer, 0, n):
            assert set(range(n - 16, n)) <= set(head)
            assert len(head) == 30


def test_bf16_scores_float32_and_ties_resolved_deterministically():
    """SnapKV in bf16: scores tie in most heads and the kept set depended on index order."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    jacap_attn.patch(model, ratio=0.25, method="snapkv", window=8)
    ids = random_ids(1, 160, seed=8)
    with captured_scores() as seen:
        runs = [jacap_attn.compress(model, ids) for _ in range(3)]
    assert all(s.dtype == torch.float32 for s in seen)
    for layers in zip(*(run.layers for run in runs)):
        sets = [kept_prompt_positions(layer, 0, 160) for layer in layers]
        assert sets[0] == sets[1] == sets[2]
        # slots are stored in ascending position order
        pos = layers[0].positions[0][:, : int(layers[0].write_pos)]
        assert torch.equal(pos, pos.sort(-1).values)


def test_qwen3_scores_use_normed_queries():
    """kvpress: Qwen3's q/k RMS norm was ignored when queries were recomputed for scoring."""
    model = tiny_model("qwen3")
    d = model.config.head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.copy_(torch.linspace(0.05, 4.0, d))
            layer.self_attn.k_norm.weight.copy_(torch.linspace(3.0, 0.2, d))
    n, ratio, window = 120, 0.15, 8
    ids = random_ids(1, n, seed=4)
    inputs = {}
    handles = [layer.self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: inputs.__setitem__(i, (kwargs["hidden_states"], kwargs["position_embeddings"])),
        with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    # Per-head leverage scores only (no consensus, no attention-mass term, no forced sinks, no carry).
    jacap_attn.patch(model, ratio=ratio, window=window, consensus=0.0, mass=0.0, sinks=0, carry=0.0, budget="uniform")
    cache = jacap_attn.compress(model, ids)
    for h in handles:
        h.remove()
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    valid = torch.ones(1, n, dtype=torch.bool)
    budget = budgets.uniform_budgets(torch.tensor([n]), ratio, window, 1)[:, 0]

    def manual_kept(attn, hidden, cos_sin, use_q_norm):
        shape = (1, n, -1, d)
        with torch.no_grad():
            q = attn.q_proj(hidden).view(shape)
            q = (attn.q_norm(q) if use_q_norm else q).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(hidden).view(shape)).transpose(1, 2)
            v = attn.v_proj(hidden).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, *cos_sin)
            hk = k.shape[1]
            wq = q[:, :, n - window:].reshape(1, hk, q.shape[1] // hk, window, d)
            probs = scoring.window_attention(wq, k, attn.scaling, valid)
            jacap = methods.Jacap()
            s, _ = scoring.jacap_scores(probs, k, v, valid, scaling=attn.scaling, beta=jacap.beta, kernel=jacap.kernel)
            idx, kept = scoring.select_indices(s, budget[:, None].expand(1, hk), valid, window)
        return [sorted(idx[0, j][kept[0, j]].tolist()) for j in range(hk)]

    differs = False
    for i, layer in enumerate(model.model.layers):
        hidden, cos_sin = inputs[i]
        with_norm = manual_kept(layer.self_attn, hidden, cos_sin, True)
        assert kept_prompt_positions(cache.layers[i], 0, n) == with_norm, f"layer {i}"
        differs |= with_norm != manual_kept(layer.self_attn, hidden, cos_sin, False)
    assert differs, "q_norm changes no kept set: the test cannot tell the two apart"


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_eager_attention_decode_after_compression(family):
    """kvpress/transformers #35168: eager decode crashed on the mask/length mismatch after compression."""
    eager, sdpa = tiny_model(family, attn="eager"), tiny_model(family)
    ids = random_ids(1, 100, seed=6)
    reference = eager.generate(ids, max_new_tokens=6, min_new_tokens=6, **GREEDY)
    jacap_attn.patch(eager, ratio=1.0)
    assert torch.equal(eager.generate(ids, max_new_tokens=6, min_new_tokens=6, **GREEDY), reference)
    jacap_attn.patch(eager, ratio=0.3, window=8)
    jacap_attn.patch(sdpa, ratio=0.3, window=8)
    assert eager.config._attn_implementation == "jacap_eager"
    got, want = generate(eager, ids, 6), generate(sdpa, ids, 6)
    for a, b in zip(got.cache.layers, want.cache.layers):
        assert kept_prompt_positions(a, 0, 100) == kept_prompt_positions(b, 0, 100)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4, rtol=1e-4)
    # padded batch through eager as well
    pad_ids, mask = left_pad([ids[0], random_ids(1, 70, seed=7)[0]])
    out = generate(eager, pad_ids, 4, attention_mask=mask)
    assert out.sequences.shape == (2, 104)
    jacap_attn.unpatch(eager)
    assert eager.config._attn_implementation == "eager"


def test_every_prompt_is_compressed_to_its_own_budget():
    """kvpress: compression silently ran only once across many samples."""
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.2, window=8, budget="uniform")
    first, second = random_ids(1, 100, seed=1), random_ids(1, 150, seed=2)
    outs = [generate(model, ids, 3) for ids in (first, second, first)]
    caches = [jacap_attn.compress(model, ids) for ids in (first, second)]
    for out, n in zip(outs, (100, 150, 100)):
        for layer in out.cache.layers:
            assert [len(h) for h in kept_prompt_positions(layer, 0, n)] == [math.ceil(0.2 * n)] * 2
    for cache, n in zip(caches, (100, 150)):
        assert [layer.valid.sum(-1).tolist() for layer in cache.layers] == [[[math.ceil(0.2 * n)] * 2]] * 3
    a = [kept_prompt_positions(layer, 0, 100) for layer in outs[0].cache.layers]
    b = [kept_prompt_positions(layer, 0, 150) for layer in outs[1].cache.layers]
    assert a != b
    assert a == [kept_prompt_positions(layer, 0, 100) for layer in outs[2].cache.layers]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_multi_turn_continues_the_compressed_cache(family):
    model = tiny_model(family)
    jacap_attn.patch(model, ratio=0.3, window=8)
    ids = random_ids(1, 90, seed=3)
    single = model.generate(ids, max_new_tokens=10, min_new_tokens=10, **GREEDY)
    cache = JacapCache(model)
    first = model.generate(ids, cache=cache, max_new_tokens=6, min_new_tokens=6, **GREEDY)
    prompt_sets = [kept_prompt_positions(layer, 0, 90) for layer in cache.layers]
    second = model.generate(first, cache=cache, max_new_tokens=4, min_new_tokens=4, **GREEDY)
    assert torch.equal(second, single), "two calls must equal one call of the same total length"
    # a second turn with new user tokens: the prompt part is untouched, the new tokens are all appended
    turn = torch.cat([second, random_ids(1, 12, seed=5)], dim=1)
    before = cache.get_seq_length()
    out = model.generate(turn, cache=cache, max_new_tokens=3, min_new_tokens=3, **GREEDY)
    assert out.shape[1] == turn.shape[1] + 3
    assert cache.get_seq_length() == turn.shape[1] + 2
    for layer, prompt_set in zip(cache.layers, prompt_sets):
        assert kept_prompt_positions(layer, 0, 90) == prompt_set
        if layer.is_sliding:
            continue
        for head in range(layer.valid.shape[1]):
            pos = layer.positions[0, head][layer.valid[0, head]].tolist()
            appended = [p for p in pos if p >= 90]
            assert appended == list(range(90, cache.get_seq_length())), "appended tokens were evicted or reordered"
    assert before == 99
