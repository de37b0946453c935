"""User-reported faults, one test (or a few) per input; each docstring names its kind:

1. other cache choices bypass the patch;
2. a precomputed cache with several sequences per prompt (and other autograd contexts);
3. a saved cache answers another document;
4. cache identity across models;
5. a baseline that is not batch-invariant (the random baseline's draws).

Two more kinds (all-sliding checkpoints, short chat prompts) are in tests/test_sliding_short.py.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import transformers
from transformers.cache_utils import DynamicCache, StaticCache

import jacap_attn
from jacap_attn.files.cache_file import padded_tensors
from jacap_attn.storage.cache import JacapCache
from jacap_attn.files.persist import CacheFileError, read_cache_file
from conftest import random_ids, tiny_model

GREEDY = dict(do_sample=False)


def _returned_cache(out):
    return getattr(out, "cache", None) or out.past_key_values


def _keyword(model):
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _static_cache(model, max_cache_len):
    params = inspect.signature(StaticCache.__init__).parameters
    kwargs = {"max_cache_len": max_cache_len}
    if "config" in params:
        kwargs["config"] = model.config
    return StaticCache(**kwargs)


# -- kind 1: other cache choices bypass the patch --------------------------------------------------

@pytest.fixture
def long_prompt_model():
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.1)
    return model, random_ids(1, 300)


def _assert_compressed(cache, prompt_len):
    assert isinstance(cache, JacapCache)
    for layer in cache.layers:
        kept = layer.valid.sum(-1)  # [b, h]: kept prompt entries plus the appended tokens
        assert int(kept.max()) < prompt_len // 2, "the prompt was cached uncompressed"


@pytest.mark.parametrize("implementation", ["static", "dynamic"])
@pytest.mark.parametrize("where", ["argument", "generation_config"])
def test_static_and_dynamic_cache_implementations_are_served_compressed(long_prompt_model, implementation, where):
    """Kind 1 (other cache choices bypass the patch): `cache_implementation="static"` returned a stock
    StaticCache holding all 303 tokens; "static"/"dynamic" (argument or generation_config) must give
    the patched model's own compressed JacapCache and the same tokens as the default."""
    model, ids = long_prompt_model
    expected = model.generate(ids, max_new_tokens=3, min_new_tokens=3, **GREEDY)
    if where == "argument":
        out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, cache_implementation=implementation,
                             return_dict_in_generate=True, **GREEDY)
    else:
        model.generation_config.cache_implementation = implementation
        try:
            out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, return_dict_in_generate=True, **GREEDY)
        finally:
            model.generation_config.cache_implementation = None
    _assert_compressed(_returned_cache(out), 300)
    assert torch.equal(out.sequences, expected)


def test_static_cache_respects_max_cache_len(long_prompt_model):
    """Kind 1 (other cache choices bypass the patch): `max_cache_len` with "static" sizes the
    JacapCache's free room (fixed shapes across calls), still compressed."""
    model, ids = long_prompt_model
    out = model.generate(ids, max_new_tokens=3, cache_implementation="static", max_cache_len=900,
                         return_dict_in_generate=True, **GREEDY)
    cache = _returned_cache(out)
    _assert_compressed(cache, 300)
    assert cache.layers[0].capacity >= 900 - 300


@pytest.mark.parametrize("implementation", ["offloaded", "offloaded_static", "offloaded_hybrid", "quantized", "paged"])
def test_cache_implementations_that_cannot_compress_are_refused(long_prompt_model, implementation):
    """Kind 1 (other cache choices bypass the patch): offloaded, quantized and paged caches cannot hold
    a compressed cache: a ValueError naming the choice, not a silent full-size cache."""
    model, ids = long_prompt_model
    with pytest.raises(ValueError, match=f"cache_implementation='{implementation}'"):
        model.generate(ids, max_new_tokens=2, cache_implementation=implementation, **GREEDY)
    if implementation == "paged":
        return  # only ever an argument (transformers switches to continuous batching on it)
    model.generation_config.cache_implementation = implementation
    try:
        with pytest.raises(ValueError, match=f"cache_implementation='{implementation}'"):
            model.generate(ids, max_new_tokens=2, **GREEDY)
    finally:
        model.generation_config.cache_implementation = None


def test_deprecated_static_aliases_are_served_with_one_warning(long_prompt_model, monkeypatch):
    """Kind 1 (other cache choices bypass the patch): the deprecated static aliases ("hybrid",
    "sliding_window") are served by the JacapCache, with one warning naming them."""
    model, ids = long_prompt_model
    monkeypatch.setattr(jacap_attn.generation, "_warned", set())
    with pytest.warns(UserWarning, match="cache_implementation='sliding_window'"):
        out = model.generate(ids, max_new_tokens=2, cache_implementation="sliding_window",
                             return_dict_in_generate=True, **GREEDY)
    _assert_compressed(_returned_cache(out), 300)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # once only
        model.generate(ids, max_new_tokens=2, cache_implementation="sliding_window", **GREEDY)


class MyCache(DynamicCache):
    """A user's own Cache subclass."""


@pytest.mark.parametrize("kind", ["DynamicCache", "StaticCache", "MyCache"])
def test_foreign_cache_objects_are_refused(long_prompt_model, kind):
    """Kind 1 (other cache choices bypass the patch): a transformers cache or a user's own Cache
    subclass passed as `cache=`/`past_key_values=` would hold the full prompt: a ValueError naming
    it, in generate and in a plain forward."""
    model, ids = long_prompt_model
    make = {"DynamicCache": lambda: DynamicCache(config=model.config), "StaticCache": lambda: _static_cache(model, 400),
            "MyCache": lambda: MyCache(config=model.config)}[kind]
    for keyword in ("cache", "past_key_values"):
        with pytest.raises(ValueError, match=f"got a {kind}"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.generate(ids, max_new_tokens=2, **{keyword: make()}, **GREEDY)
    with pytest.raises(ValueError, match=f"got a {kind}"), torch.no_grad():
        model(ids, **{_keyword(model): make()})


# -- kind 2: precomputed cache with several sequences per prompt ------------------------------------

@pytest.fixture
def doc_model():
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.3)
    doc, q = random_ids(1, 80), random_ids(1, 5, seed=7)
    return model, doc, q, jacap_attn.compress(model, doc)


@pytest.mark.parametrize("n", [2, 3])
def test_precomputed_cache_with_num_return_sequences(doc_model, n):
    """Kind 2 (a precomputed cache with several sequences per prompt crashes): `num_return_sequences`
    over a given compressed cache raised `index_copy_(): ... same slice shapes`; now every sequence
    equals the batch-1 greedy answer (top_k=1 sampling is greedy)."""
    model, doc, q, cache = doc_model
    ids = torch.cat([doc, q], 1)
    greedy = model.generate(ids, cache=copy.deepcopy(cache), max_new_tokens=8, min_new_tokens=8, **GREEDY)
    out = model.generate(ids, cache=copy.deepcopy(cache), do_sample=True, top_k=1, num_return_sequences=n,
                         max_new_tokens=8, min_new_tokens=8)
    assert out.shape == (n, ids.shape[1] + 8)
    for row in out:
        assert torch.equal(row, greedy[0])


def _reference_beam_search(model, cache, ids, prompt_len, beams, steps, eos):
    """Beam search by hand over copies of ``cache`` (plain forwards, one beam at a time): with EOS
    banned until the end (min_new_tokens) and equal lengths, transformers' beams are the top
    ``beams`` continuations by summed log-probability at every step. Returns them, best first."""
    keyword = _keyword(model)
    running = [(0.0, ids[0].tolist(), copy.deepcopy(cache))]
    for _ in range(steps):
        candidates = []
        for score, tokens, own in running:
            own = copy.deepcopy(own)
            new = torch.tensor([tokens[own.get_seq_length():]])
            with torch.no_grad():
                logits = model(new, **{keyword: own}).logits[0, -1].float()
            logprobs = torch.log_softmax(logits, -1)
            logprobs[eos] = -float("inf")
            top = logprobs.topk(beams)
            candidates += [(score + float(v), tokens + [int(t)], own) for v, t in zip(top.values, top.indices)]
        running = sorted(candidates, key=lambda c: -c[0])[:beams]
    return torch.tensor([tokens for _, tokens, _ in running])


@pytest.mark.parametrize("beams, sequences", [(2, 1), (2, 2), (3, 2)])
def test_precomputed_cache_with_beam_search(doc_model, beams, sequences):
    """Kind 2 (a precomputed cache with several sequences per prompt crashes): beam search over a
    given compressed cache ran into the batch-1 cache; it now runs on the cache's rows repeated per
    beam and returns the beams a search by hand over copies of the cache finds."""
    model, doc, q, cache = doc_model
    ids = torch.cat([doc, q], 1)
    out = model.generate(ids, cache=copy.deepcopy(cache), num_beams=beams, num_return_sequences=sequences,
                         max_new_tokens=6, min_new_tokens=6, do_sample=False)
    expected = _reference_beam_search(model, cache, ids, 80, beams, 6, model.generation_config.eos_token_id)
    assert torch.equal(out, expected[:sequences])


def test_precomputed_cache_with_beam_sampling(doc_model):
    """Kind 2 (a precomputed cache with several sequences per prompt crashes): beam sampling over a
    given compressed cache runs on its repeated rows."""
    model, doc, q, cache = doc_model
    ids = torch.cat([doc, q], 1)
    torch.manual_seed(0)
    out = model.generate(ids, cache=copy.deepcopy(cache), num_beams=3, num_return_sequences=2, do_sample=True,
                         max_new_tokens=6, min_new_tokens=6)
    assert out.shape == (2, ids.shape[1] + 6) and torch.equal(out[:, :85], ids.expand(2, -1))


def test_beam_search_over_a_full_precomputed_cache_equals_stock():
    """Kind 2 (a precomputed cache with several sequences per prompt crashes): with nothing evicted
    (method "full"), beam search with num_return_sequences over a precomputed cache returns what
    stock transformers returns for the whole prompt."""
    stock = tiny_model("llama")
    doc, q = random_ids(1, 60), random_ids(1, 5, seed=7)
    ids = torch.cat([doc, q], 1)
    options = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    expected = stock.generate(ids, **options)
    model = jacap_attn.patch(tiny_model("llama"), ratio=1.0, method="full")
    out = model.generate(ids, cache=jacap_attn.compress(model, doc), **options)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("options, named", [
    (dict(penalty_alpha=0.6, top_k=4), "contrastive search"),
    (dict(penalty_alpha=0.6, top_k=4, trust_remote_code=True), "contrastive search"),
    (dict(custom_generate="transformers-community/contrastive-search", trust_remote_code=True), "custom_generate"),
    (dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0), "group beam search"),
    (dict(num_beams=2, force_words_ids=[[5]]), "constrained beam search"),
    (dict(prompt_lookup_num_tokens=3), "assisted generation"),
])
@pytest.mark.parametrize("given", [True, False])
def test_decoding_modes_that_rebuild_the_cache_are_refused(doc_model, options, named, given):
    """Kind 2 (a precomputed cache with several sequences per prompt crashes): the generate options
    that change the batch or roll the cache back and cannot run over a compressed cache (contrastive
    search, also as custom_generate; group and constrained beam search; assisted generation) refuse
    with a ValueError naming them, with a given cache or without."""
    model, doc, q, cache = doc_model
    extra = {"cache": copy.deepcopy(cache)} if given else {}
    with pytest.raises(ValueError, match=named):
        model.generate(torch.cat([doc, q], 1), max_new_tokens=4, **extra, **options)


CONTEXTS = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "grad": torch.enable_grad}


@pytest.mark.parametrize("built", sorted(CONTEXTS))
@pytest.mark.parametrize("used", ["no_grad", "inference_mode", "generate", "deepcopy"])
def test_cache_built_in_one_autograd_context_used_in_another(doc_model, built, used):
    """Kind 2 (cache buffers under another autograd context): a cache built under inference_mode
    could not be written outside it ("Inplace update to inference tensor"), and one built with grad
    enabled could not be deep-copied; every combination must give the reference answer."""
    model, doc, q, reference_cache = doc_model
    ids = torch.cat([doc, q], 1)
    expected = model.generate(ids, cache=copy.deepcopy(reference_cache), max_new_tokens=5, min_new_tokens=5, **GREEDY)
    with CONTEXTS[built]():
        if built == "grad":
            cache = model(doc, use_cache=True).cache  # a plain forward with grad enabled
        else:
            cache = jacap_attn.compress(model, doc)
    if used == "generate":
        out = model.generate(ids, cache=cache, max_new_tokens=5, min_new_tokens=5, **GREEDY)
    elif used == "deepcopy":
        out = model.generate(ids, cache=copy.deepcopy(cache), max_new_tokens=5, min_new_tokens=5, **GREEDY)
    else:
        with CONTEXTS[used]():
            out = model.generate(ids, cache=cache, max_new_tokens=5, min_new_tokens=5, **GREEDY)
    assert torch.equal(out, expected)


def test_cache_grown_and_reordered_in_inference_mode_is_usable_outside(doc_model, tmp_path):
    """Kind 2 (cache buffers under another autograd context): buffers made under inference_mode by
    growing, by repeating rows, by `generate` or by `load_cache` are written later outside it."""
    model, doc, q, cache = doc_model
    ids = torch.cat([doc, q], 1)
    expected = model.generate(ids, cache=copy.deepcopy(cache), max_new_tokens=5, min_new_tokens=5, **GREEDY)
    grown = copy.deepcopy(cache)
    with torch.inference_mode():
        grown.ensure_room(grown.layers[0].capacity + 1)
    assert grown.layers[0].keys.is_inference()
    assert torch.equal(model.generate(ids, cache=grown, max_new_tokens=5, min_new_tokens=5, **GREEDY), expected)
    repeated = copy.deepcopy(cache)
    with torch.inference_mode():
        repeated.batch_repeat_interleave(2)
    step = torch.cat([doc, q], 1).repeat(2, 1)
    out = model.generate(step, cache=repeated, max_new_tokens=5, min_new_tokens=5, **GREEDY)
    assert torch.equal(out, expected.expand(2, -1))
    # generate itself under inference_mode, then a second turn outside it
    turn_cache = copy.deepcopy(cache)
    with torch.inference_mode():
        first = model.generate(ids, cache=turn_cache, max_new_tokens=3, min_new_tokens=3, **GREEDY)
    second = model.generate(first, cache=turn_cache, max_new_tokens=2, min_new_tokens=2, **GREEDY)
    assert torch.equal(second, expected)
    path = tmp_path / "c.safetensors"
    jacap_attn.save_cache(cache, path, model=model, prompt_ids=doc)
    with torch.inference_mode():
        loaded = jacap_attn.load_cache(path, model)
    assert torch.equal(model.generate(ids, cache=loaded, max_new_tokens=5, min_new_tokens=5, **GREEDY), expected)


# -- kind 3: a saved cache answers another document -------------------------------------------------

@pytest.fixture
def two_docs(tmp_path):
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.3, window=8)
    doc_a, doc_b, q = random_ids(1, 80, seed=1), random_ids(1, 80, seed=2), random_ids(1, 5, seed=7)
    cache = jacap_attn.compress(model, doc_a)
    paths = {}
    for store in (False, True):
        paths[store] = tmp_path / f"a_{store}.safetensors"
        jacap_attn.save_cache(cache, paths[store], model=model, prompt_ids=doc_a, store_ids=store)
    return model, doc_a, doc_b, q, cache, paths


@pytest.mark.parametrize("store_ids", [False, True])
def test_saved_cache_refuses_another_document_of_the_same_length(two_docs, store_ids):
    """Kind 3 (a saved cache answers another document): a file saved with `store_ids=False` accepted
    doc B of the same length and answered from doc A; the prompt's SHA-256 (or its ids) is checked."""
    model, doc_a, doc_b, q, cache, paths = two_docs
    loaded = jacap_attn.load_cache(paths[store_ids], model)
    match = "prompt_sha256" if not store_ids else "do not start with the 80-token prompt"
    with pytest.raises(ValueError, match=match):
        model.generate(torch.cat([doc_b, q], 1), cache=copy.deepcopy(loaded), max_new_tokens=3)
    with pytest.raises(ValueError, match="do not start"):  # shorter than the prompt
        model.generate(doc_a[:, :60], cache=copy.deepcopy(loaded), max_new_tokens=3)
    expected = model.generate(torch.cat([doc_a, q], 1), cache=copy.deepcopy(cache), max_new_tokens=4, **GREEDY)
    out = model.generate(torch.cat([doc_a, q], 1), cache=loaded, max_new_tokens=4, **GREEDY)
    assert torch.equal(out, expected)


def test_saved_cache_without_ids_serves_num_return_sequences(two_docs):
    """Kind 3 (a saved cache answers another document): a hash-only cache, once its prompt matched,
    follows the batch expansion and keeps checking the prompt in a second turn."""
    model, doc_a, doc_b, q, cache, paths = two_docs
    loaded = jacap_attn.load_cache(paths[False], model)
    out = model.generate(torch.cat([doc_a, q], 1), cache=loaded, do_sample=True, top_k=1, num_return_sequences=2,
                         max_new_tokens=3, min_new_tokens=3)
    assert out.shape[0] == 2 and torch.equal(out[0], out[1])
    with pytest.raises(ValueError, match="do not start"):
        model.generate(torch.cat([doc_b.repeat(2, 1), out[:, 80:]], 1), cache=loaded, max_new_tokens=2)
    assert model.generate(out, cache=loaded, max_new_tokens=2, min_new_tokens=2, **GREEDY).shape == (2, out.shape[1] + 2)


@pytest.mark.parametrize("store_ids", [False, True])
def test_plain_forward_over_a_given_cache_checks_prompt_and_length(two_docs, store_ids):
    """Kind 3 (a saved cache answers another document): a plain forward over a given compressed cache
    reads the new tokens only: it refuses ids that repeat the cached prompt (read twice) and
    position_ids that do not continue at the cache's length (another prompt's positions)."""
    model, doc_a, doc_b, q, cache, paths = two_docs
    loaded = jacap_attn.load_cache(paths[store_ids], model)
    keyword = _keyword(model)
    with torch.no_grad():
        with pytest.raises(ValueError, match="already holds"):
            model(torch.cat([doc_a, q], 1), **{keyword: copy.deepcopy(loaded)})
        full = torch.cat([doc_b, q], 1)
        with pytest.raises(ValueError, match="position_ids start at"):
            model(full, position_ids=torch.arange(full.shape[1])[None], **{keyword: copy.deepcopy(loaded)})
        good = model(q, position_ids=torch.arange(80, 85)[None], **{keyword: copy.deepcopy(loaded)}).logits
        plain = model(q, **{keyword: copy.deepcopy(cache)}).logits
    torch.testing.assert_close(good, plain)


# -- kind 4: cache identity across models ----------------------------------------------------------

@pytest.fixture
def twins():
    """Two patched models with the same config and other weights (two seeds), and A's cache."""
    a = jacap_attn.patch(tiny_model("llama", seed=0), ratio=0.3, window=8)
    b = jacap_attn.patch(tiny_model("llama", seed=1), ratio=0.3, window=8)
    doc, q = random_ids(1, 80), random_ids(1, 5, seed=7)
    return a, b, doc, q, jacap_attn.compress(a, doc)


def test_cache_passed_to_another_patched_model_is_refused(twins):
    """Kind 4 (cache identity across models): A's JacapCache passed to B (same shape, other weights)
    was used silently; generate and a plain forward now refuse it naming the weights fingerprint."""
    a, b, doc, q, cache = twins
    with pytest.raises(ValueError, match="weights_sha256"):
        b.generate(torch.cat([doc, q], 1), cache=copy.deepcopy(cache), max_new_tokens=3)
    with pytest.raises(ValueError, match="weights_sha256"), torch.no_grad():
        b(q, **{_keyword(b): copy.deepcopy(cache)})
    empty = JacapCache(a)  # an empty cache made for A is A's too
    with pytest.raises(ValueError, match="weights_sha256"):
        b.generate(doc, cache=empty, max_new_tokens=2)
    out = a.generate(torch.cat([doc, q], 1), cache=copy.deepcopy(cache), max_new_tokens=3, min_new_tokens=3)
    assert out.shape == (1, 88)


def test_cache_passed_to_a_never_patched_model_is_refused(twins):
    """Kind 4 (cache identity across models): a never-patched model of the same shape read A's static
    buffers with its stock attention (no validity mask): a RuntimeError at its first forward."""
    a, b, doc, q, cache = twins
    c = tiny_model("llama", seed=1)
    with pytest.raises(RuntimeError, match="not patched"), torch.no_grad():
        c(q, **{_keyword(c): copy.deepcopy(cache)})
    with pytest.raises(RuntimeError, match="not patched"):
        c.generate(torch.cat([doc, q], 1), **{_keyword(c): copy.deepcopy(cache)}, max_new_tokens=2)
    with torch.no_grad():  # the cache itself is intact for its own model
        assert a(q, **{_keyword(a): copy.deepcopy(cache)}).logits.isfinite().all()


def test_cache_file_from_another_model_of_the_same_shape_is_refused(twins, tmp_path):
    """Kind 4 (cache identity across models): a file saved from model A loaded into B (same shape,
    other weights: base vs instruct) silently; `load_cache` now refuses it naming `weights_sha256`.
    A bfloat16 copy of A's weights is the same model (dtype= casts the cache)."""
    a, b, doc, q, cache = twins
    path = tmp_path / "a.safetensors"
    jacap_attn.save_cache(cache, path, model=a, prompt_ids=doc)
    assert read_cache_file(path)[0]["weights_sha256"] == jacap_attn.storage.cache.weights_fingerprint(a)
    with pytest.raises(CacheFileError, match="weights_sha256"):
        jacap_attn.load_cache(path, b)
    a16 = jacap_attn.patch(tiny_model("llama", seed=0, dtype=torch.bfloat16), ratio=0.3, window=8)
    assert jacap_attn.load_cache(path, a16, dtype=torch.bfloat16).layers[0].keys.dtype == torch.bfloat16
    loaded = jacap_attn.load_cache(path, a)
    assert torch.equal(a.generate(torch.cat([doc, q], 1), cache=loaded, max_new_tokens=3, **GREEDY),
                       a.generate(torch.cat([doc, q], 1), cache=copy.deepcopy(cache), max_new_tokens=3, **GREEDY))


def test_old_cache_file_without_weights_fingerprint_loads_with_a_warning(twins, tmp_path):
    """Kind 4 (cache identity across models): a file of the same format version saved before the
    weights fingerprint existed still loads, with a warning that it cannot be checked."""
    from safetensors.torch import save_file

    a, b, doc, q, cache = twins
    path = tmp_path / "a.safetensors"
    jacap_attn.save_cache(cache, path, model=a, prompt_ids=doc)
    meta, data = read_cache_file(path)
    del meta["weights_sha256"], meta["metadata_sha256"]  # as format 2 wrote it: no header checksum either
    meta["format_version"] = "2"
    meta, data = padded_tensors(meta, data)  # format 2 was padded
    old = tmp_path / "old.safetensors"
    save_file(data, old, metadata=meta)
    with pytest.warns(UserWarning, match="weights_sha256"):
        loaded = jacap_attn.load_cache(old, a)
    assert loaded.get_seq_length() == 80


def test_weights_fingerprint_is_memoised_and_moves_only_slices(twins):
    """Kind 4 (cache identity across models): the fingerprint is computed once per patched model."""
    a, b, doc, q, cache = twins
    fingerprint = jacap_attn.storage.cache.weights_fingerprint
    assert fingerprint(a) != fingerprint(b)
    assert a._jacap_state.weights_sha256 == fingerprint(a) == cache.weights_sha256
    assert fingerprint(tiny_model("llama", seed=0)) == fingerprint(a)  # unpatched: same weights, same value


def test_random_baseline_draws_do_not_depend_on_the_batch():
    """Kind 5, a baseline that is not batch-invariant: a left-padded batch of a 60-token and a
    40-token row, ratio 0.3, window 4: each row keeps what it keeps alone (the draws depend only on
    the seed, the layer, the head and the row's own token positions), so its tokens too."""
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.3, method="random", window=4)
    rows = [random_ids(1, 60, seed=21)[0], random_ids(1, 40, seed=22)[0]]
    ids = torch.zeros(2, 60, dtype=torch.long)
    mask = torch.zeros(2, 60, dtype=torch.long)
    for row, sample in enumerate(rows):
        ids[row, 60 - sample.shape[0]:], mask[row, 60 - sample.shape[0]:] = sample, 1
    batch = jacap_attn.compress(model, ids, mask)
    for row, sample in enumerate(rows):
        alone = jacap_attn.compress(model, sample[None])
        for layer, ref in zip(batch.layers, alone.layers):
            for head in range(layer.valid.shape[1]):
                got = sorted(layer.positions[row, head][layer.valid[row, head]].tolist())
                want = sorted(ref.positions[0, head][ref.valid[0, head]].tolist())
                assert got == want, f"row {row}, head {head}"
    seed0 = jacap_attn.compress(model, rows[0][None]).layers[0]
    jacap_attn.patch(model, ratio=0.3, method="random", window=4, seed=1)
    seed1 = jacap_attn.compress(model, rows[0][None]).layers[0]
    assert not torch.equal(seed0.positions[seed0.valid], seed1.positions[seed1.valid])  # the seed matters
