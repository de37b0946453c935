"""Every registered method through one matrix, with no hand-kept list of methods
(docs/architecture.md#methods, #tests): ratio=1 parity, a left-padded batch equals each row alone,
determinism, bad options, compiled scoring equals eager. A method registered here, outside the
package, runs end to end (patch, generate, save, load)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest
import torch

import jacap_attn
from jacap_attn import methods
from jacap_attn.selection import scorer
from jacap_attn.methods import Method, PrefillInputs, SnapKV, register
from jacap_attn.patches import ADAPTERS
from conftest import DECODE_ATOL, DECODE_RTOL, FAMILIES, random_ids, tiny_model
from test_robustness import generate, kept_prompt_positions, left_pad


@register("neg_knorm")
@dataclass(frozen=True)
class NegKNorm(Method):
    """Keeps the keys of *largest* norm (KNorm reversed): a user's method, defined outside the package."""

    def score(self, inputs):  # inputs.keys: [b, h, n, d]
        return inputs.keys.float().norm(dim=-1)


ALL = methods.names()  # the built-ins and neg_knorm
COMPRESSING = [m for m in ALL if methods.get_method(m).compresses]
LENGTHS = (60, 45, 12)  # the last row has more padding (48) than the whole budget of the others


def test_the_matrix_sees_every_method_including_a_user_one():
    assert {"jacap", "snapkv", "full", "random", "neg_knorm"} <= set(ALL)
    assert methods.get_method("neg_knorm") is NegKNorm and NegKNorm.name == "neg_knorm"


def test_every_adapter_family_is_a_test_family():
    tested = {config_cls.model_type for config_cls, _, _ in FAMILIES.values()}
    assert set(ADAPTERS) <= tested, f"adapters without a tiny test model: {set(ADAPTERS) - tested}"


@pytest.mark.parametrize("method", ALL)
def test_ratio_one_equals_the_unpatched_model(method):
    model = tiny_model("llama")
    ids = random_ids(1, 50)
    reference = generate(model, ids, 4)
    jacap_attn.patch(model, ratio=1.0, method=method, compile=False)
    out = generate(model, ids, 4)
    assert torch.equal(out.sequences, reference.sequences)
    for got, want in zip(out.logits, reference.logits):
        torch.testing.assert_close(got, want, atol=DECODE_ATOL, rtol=DECODE_RTOL)


@pytest.mark.parametrize("method", COMPRESSING)
def test_padded_batch_equals_each_row_alone(method):
    """Left padding is invisible: no pad slot kept; each row keeps exactly what it keeps alone and
    generates the same tokens (the random baseline included: its draws follow the row's positions)."""
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.3, method=method, window=8)
    samples = [random_ids(1, n, seed=10 + n)[0] for n in LENGTHS]
    ids, mask = left_pad(samples)
    batch = generate(model, ids, 6, attention_mask=mask)
    n = ids.shape[1]
    for layer in batch.cache.layers:
        assert not bool((layer.valid & (layer.positions < 0)).any()), "a padding position was kept"
    for row, sample in enumerate(samples):
        alone, m = generate(model, sample[None], 6), sample.shape[0]
        for index, (layer, ref) in enumerate(zip(batch.cache.layers, alone.cache.layers)):
            assert kept_prompt_positions(layer, row, m) == kept_prompt_positions(ref, 0, m), (
                f"row {row} (padding {n - m}), layer {index}: kept set differs from the unpadded run")
        assert batch.sequences[row, n:].tolist() == alone.sequences[0, m:].tolist(), f"row {row} tokens differ"


@pytest.mark.parametrize("budget,options", [("pyramid", {}), ("capacity", {}), ("global", {}),
                                            ("global", {"global_score": "normalized"})])
def test_padded_batch_equals_each_row_alone_adaptive_budgets(budget, options):
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.3, window=8, budget=budget, **options)
    samples = [random_ids(1, n, seed=10 + n)[0] for n in LENGTHS]
    ids, mask = left_pad(samples)
    batch = jacap_attn.compress(model, ids, mask)
    for row, sample in enumerate(samples):
        alone = jacap_attn.compress(model, sample[None])
        for layer, ref in zip(batch.layers, alone.layers):
            assert kept_prompt_positions(layer, row, sample.shape[0]) == kept_prompt_positions(ref, 0, sample.shape[0])


@pytest.mark.parametrize("method", COMPRESSING)
def test_selection_is_deterministic(method):
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.25, method=method, window=6)
    ids = random_ids(2, 70, seed=4)
    first, second = jacap_attn.compress(model, ids), jacap_attn.compress(model, ids)
    for a, b in zip(first.layers, second.layers):
        assert torch.equal(a.positions, b.positions) and torch.equal(a.valid, b.valid)
        assert torch.equal(a.keys, b.keys)


def _bad_value(field: dataclasses.Field):
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    if field.metadata.get("choices"):
        return "no-such-choice"
    return {"int": 2.5, "float": "high", "bool": "yes"}.get(kind.split("|")[0].strip(), object())


@pytest.mark.parametrize("method", ALL)
def test_bad_options_name_the_option(method):
    cls = methods.get_method(method)
    own = {f.name for f in dataclasses.fields(cls)}
    model = tiny_model("llama")
    for field in dataclasses.fields(cls):
        bad = _bad_value(field)
        with pytest.raises(ValueError, match=field.name):
            jacap_attn.patch(model, ratio=0.2, method=method, **{field.name: bad})
    foreign = sorted({f.name for m in ALL for f in dataclasses.fields(methods.get_method(m))} - own)
    for name in foreign:  # an option of another method: the error lists this method's own options
        with pytest.raises(ValueError, match=f"does not apply to method='{method}'") as err:
            jacap_attn.patch(model, ratio=0.2, method=method, **{name: 1})
        assert all(option in str(err.value) for option in own)
    with pytest.raises(ValueError, match="no_such_option"):
        jacap_attn.patch(model, ratio=0.2, method=method, no_such_option=1)
    assert not jacap_attn.is_patched(model)


def _recorded_inputs(method: Method) -> PrefillInputs:
    """One layer's prefill inputs of a tiny model, as the selection builds them for ``method``."""
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=1.0, method="full", compile=False)
    records = {}
    cache = jacap_attn.JacapCache(model, on_prefill=lambda i, q, k, v, s: records.setdefault(i, (q, k, v, s)))
    with torch.no_grad():
        model(random_ids(1, 57), cache=cache)
    query, keys, values, scaling = records[1]
    b, hq, n, d = query.shape
    h, w = keys.shape[1], 8
    window = query[:, :, n - w:].reshape(b, h, hq // h, w, d)
    key_valid = torch.ones(b, n, dtype=torch.bool)
    key_valid[:, :3] = False
    probs = jacap_attn.math.scoring.window_attention(window, keys, scaling, key_valid)
    return PrefillInputs(window, keys, values, key_valid, scaling, 1, torch.tensor([20]), False,
                         probs if method.needs_window_attention else None,
                         query.reshape(b, h, hq // h, n, d) if method.needs_all_queries else None)


@pytest.mark.parametrize("method", ALL)
def test_compiled_scoring_equals_eager(method):
    """Each method's scoring compiles with no graph break (``fullgraph=True``) and a dynamic sequence
    length, and gives the eager values (what ``compile=True`` runs on CUDA)."""
    instance = methods.get_method(method)()
    inputs = _recorded_inputs(instance)
    torch._dynamo.reset()
    compiled = scorer.compiled_scorer(instance, fullgraph=True)(inputs)
    eager = instance.score_parts(inputs)
    assert compiled.keys() == eager.keys()
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], atol=1e-5, rtol=1e-4)


def test_a_user_method_runs_end_to_end(tmp_path):
    """patch, generate, save, load and generate again with a method registered outside the package."""
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.3, method="neg_knorm", window=4)
    doc, question = random_ids(1, 80, seed=7), random_ids(1, 5, seed=8)
    cache = jacap_attn.compress(model, doc)
    assert all(int(layer.valid[0, 0].sum()) == 24 for layer in cache.layers)  # ceil(0.3 * 80)
    assert cache.config.method == NegKNorm()
    path = tmp_path / "doc.safetensors"
    jacap_attn.save_cache(cache, path, model=model, prompt_ids=doc)
    loaded = jacap_attn.load_cache(path, model)
    assert loaded.config.method == NegKNorm()
    ids = torch.cat([doc, question], 1)
    direct = generate(model, ids, 5, cache=cache)
    again = generate(model, ids, 5, cache=loaded)
    assert torch.equal(direct.sequences, again.sequences)


def test_kept_tokens_of_the_user_method_are_its_top_scores():
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=1.0, method="full", compile=False)
    full = jacap_attn.compress(model, random_ids(1, 80, seed=7))
    jacap_attn.patch(model, ratio=0.3, method="neg_knorm", window=4)
    cache = jacap_attn.compress(model, random_ids(1, 80, seed=7))
    for layer, ref in zip(cache.layers, full.layers):
        for head in range(layer.valid.shape[1]):
            norms = ref.keys[0, head, :76].norm(dim=-1)  # positions before the window
            kept = set(kept_prompt_positions(layer, 0, 76)[head])
            assert kept == set(norms.topk(20).indices.tolist())


def test_method_instance_or_name_and_options_are_the_same_config():
    model = tiny_model("llama")
    ids = random_ids(1, 70, seed=3)
    jacap_attn.patch(model, ratio=0.2, method="snapkv", kernel=3)
    by_name = jacap_attn.compress(model, ids)
    jacap_attn.patch(model, ratio=0.2, method=SnapKV(kernel=3))
    by_instance = jacap_attn.compress(model, ids)
    assert by_name.config == by_instance.config
    for a, b in zip(by_name.layers, by_instance.layers):
        assert torch.equal(a.positions, b.positions)
    jacap_attn.patch(model, ratio=0.2, method=SnapKV(kernel=3), kernel=5)  # keywords replace fields
    assert model._jacap_state.config.method == SnapKV(kernel=5)
    with pytest.raises(ValueError, match="does not apply to method='snapkv'"):
        jacap_attn.patch(model, ratio=0.2, method=SnapKV(), ridge=0.1)


def test_register_refuses_what_is_not_a_frozen_method_dataclass_or_a_taken_name():
    with pytest.raises(TypeError, match="frozen dataclass"):
        register("plain")(type("Plain", (Method,), {}))
    with pytest.raises(TypeError, match="frozen dataclass"):
        register("mutable")(dataclass(type("Mutable", (Method,), {})))
    with pytest.raises(ValueError, match="already registered"):
        register("jacap")(dataclass(frozen=True)(type("Other", (Method,), {})))
    with pytest.raises(ValueError, match="identifier"):
        register("not a name")
    with pytest.raises(ValueError, match="unknown method='nope'"):
        jacap_attn.patch(tiny_model("llama"), method="nope")


def test_config_round_trips_and_reads_the_flat_format_1():
    config = jacap_attn.JacapConfig.from_options(ratio=0.2, method="capkv", ridge=0.5, window=16)
    assert jacap_attn.JacapConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    flat = {"ratio": 0.2, "method": "pyramidkv", "window": 32, "budget": "pyramid", "ridge": None, "beta": 1.0,
            "pooling": "max", "kernel": None, "selector": "leverage", "consensus": 0.25, "consensus_kernel": 15,
            "mass": None, "sinks": 4, "temperature": 5.0, "seed": 0, "pyramid_beta": 20.0, "capacity_alpha": 0.5,
            "adakv_alpha": 0.2, "reserve": 256, "compile": True}
    old = jacap_attn.JacapConfig.from_dict(flat)
    assert old.method == methods.PyramidKV(pooling="max", kernel=5) and old.budget == "pyramid"
    jacap = jacap_attn.JacapConfig.from_dict({**flat, "method": "jacap", "budget": "uniform", "mass": None})
    # kernel None: Jacap's default when format 1 was written (7; 3 since 2026-12-01); beta and consensus as written.
    assert jacap.method == methods.Jacap(pooling="max", beta=1.0, kernel=7, consensus=0.25, carry=0.0, carry_len=64,
                                         carry_count=0, carry_by="score", lookup=0, lookup_share=0.5,
                                         lookup_free=0, lookup_ahead=False) \
        and jacap.method.mass == 2.0
