"""User-reported faults, one test (or a few) per input; each docstring names its kind:

1. other cache choices bypass the patch;
2. a precomputed cache with several sequences per prompt (and other autograd contexts);
3. a saved cache answers another document;
4. cache identity across models.
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
from jacap_attn.cache import JacapCache
from jacap_attn.persist import CacheFileError, read_cache_file
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
    monkeypatch.setattr(jacap_attn.patching, "_warned", set())
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


