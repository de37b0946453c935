"""The patched model's ``generate`` and the cache it prepares (docs/architecture.md#patching):
which caches and decoding modes a compressed cache can serve, the prompt check of a given cache,
the ``JacapCache`` ``generate`` builds in place of a ``DynamicCache``, and the ``compile`` setting.
Wiring only, installed by :func:`jacap_attn.patching.patch`."""

from __future__ import annotations

import contextvars
import dataclasses
import numbers
import threading
import warnings

import torch
from transformers.cache_utils import DynamicCache

from . import route_settings
from .routes import chunk as _chunk
from .storage.cache import EMPTY, JacapCache
from .storage.masks import check_mask_shape, check_prompt_mask, refuse_padded_continuation
from .models import check_token_ids

_CACHE_KEYWORDS = ("cache", "past_key_values")
# `cache_implementation` values a patched model serves with its own JacapCache (static-shape and
# compileable, so "static" keeps compiled decoding); the deprecated static aliases are served too, with
# a one-time warning. Every other value (offloaded*, quantized, paged) is a ValueError.
_SERVED_CACHES = (None, "dynamic", "static")
_STATIC_ALIASES = ("sliding_window", "hybrid", "hybrid_chunked")
_warned = set()
_warned_rope: set = set()  # models already told that length-dependent RoPE is not served exactly
# Decoding modes that cannot run over a compressed cache (they crop it or rebuild it per candidate).
_REFUSED_CUSTOM_GENERATE = ("contrastive-search", "group-beam-search", "constrained-beam-search")
# The chunked prefill of the `generate` call under way in this thread (prompt tokens, chunk size), or
# (None, chunk size, the call's 2D attention_mask or None) for a prompt given as inputs_embeds, read when
# its cache is prepared and by the forward that splits it; a context variable, so concurrent calls
# never see each other's.
_PREFILL: contextvars.ContextVar = contextvars.ContextVar("jacap_chunked_prefill", default=None)


def _cache_from(kwargs):
    for key in _CACHE_KEYWORDS:
        if kwargs.get(key) is not None:
            return kwargs[key]
    return None


def _canonical_cache_keyword(kwargs, keyword: str) -> None:
    """Move a cache passed under the other name (``cache`` / ``past_key_values``) to ``keyword``, the
    one this transformers version reads (``past_key_values`` before 5.24), so the model never builds
    a second cache of its own beside ours. Given both, ``cache`` wins, as in transformers 5.24."""
    for other in _CACHE_KEYWORDS:
        if other != keyword and kwargs.get(other) is not None:
            moved = kwargs.pop(other)
            if kwargs.get(keyword) is None or other == "cache":
                kwargs[keyword] = moved


def _foreign_cache_message(cache) -> str:
    return (f"a model patched by jacap_attn fills only its own compressed JacapCache; got a {type(cache).__name__}, "
            "which would hold the full prompt uncompressed: pass no cache, jacap_attn.JacapCache(model), a cache "
            "from jacap_attn.compress / load_cache, or call jacap_attn.unpatch(model) first")


def _option(model, kwargs, name):
    """The value ``generate`` will use for the generation option ``name``: the keyword argument, else
    the given ``generation_config``, else the model's."""
    if name in kwargs:
        return kwargs[name]
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    return getattr(config, name, None)



def _refuse_unsupported_generation(model, kwargs) -> None:
    """``ValueError`` for the ``generate`` options a compressed cache cannot serve (see :func:`patch`)."""
    def option(name):
        return _option(model, kwargs, name)

    if kwargs.get("cache_implementation") is not None:
        _check_cache_implementation(kwargs["cache_implementation"])
    beams, top_k, alpha = option("num_beams") or 1, option("top_k"), option("penalty_alpha")
    if beams == 1 and option("do_sample") is not True and top_k is not None and top_k > 1 and alpha and alpha > 0:
        mode = "contrastive search (penalty_alpha > 0 with top_k > 1)"
    elif beams > 1 and (option("num_beam_groups") or 1) > 1:
        mode = "group beam search (num_beam_groups > 1)"
    elif option("constraints") is not None or option("force_words_ids") is not None:
        mode = "constrained beam search (constraints / force_words_ids)"
    elif kwargs.get("assistant_model") is not None or option("prompt_lookup_num_tokens") is not None \
            or option("assistant_early_exit") is not None or option("use_mtp"):
        mode = "assisted generation (assistant_model / prompt_lookup_num_tokens / assistant_early_exit)"
    elif isinstance(kwargs.get("custom_generate"), str) and any(
            name in kwargs["custom_generate"] for name in _REFUSED_CUSTOM_GENERATE):
        mode = f"custom_generate={kwargs['custom_generate']!r}"
    else:
        return
    raise ValueError(f"{mode} is not supported on a model patched by jacap_attn: it crops or rebuilds the "
                     "cache, which a compressed JacapCache cannot do; use greedy or sampling (with "
                     "num_return_sequences) or beam search (num_beams), or unpatch the model")



def _check_cache_implementation(name) -> None:
    """``ValueError`` for a ``cache_implementation`` a patched model cannot serve; a one-time warning
    for a deprecated static alias, which it serves with its JacapCache like ``"static"``."""
    if name in _SERVED_CACHES:
        return
    if name in _STATIC_ALIASES:
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"cache_implementation={name!r} is served by jacap_attn's compressed JacapCache (as "
                          "'static'; sliding-window layers keep their window), not by the transformers cache of "
                          "that name", UserWarning, stacklevel=4)
        return
    raise ValueError(f"cache_implementation={name!r} is not supported on a model patched by jacap_attn: it cannot "
                     f"hold a compressed cache; use one of {[n for n in _SERVED_CACHES if n]} (or leave it unset), "
                     "or unpatch the model")



def _warn_length_dependent_rope(model) -> None:
    """One warning per model: a cache compressed before its continuation holds the prompt's keys at the
    RoPE frequencies of the prompt's own forward; ``dynamic`` and ``longrope`` RoPE pick frequencies
    from each forward's length, so a continuation that takes the sequence past the original context
    gets other frequencies than one forward over prompt and continuation would (stock ``generate``
    does the same between its prefill and its decode steps). Not served exactly; said once."""
    from .model_state import length_dependent_rope

    key = id(model)
    if key in _warned_rope or not length_dependent_rope(model):
        return
    _warned_rope.add(key)
    warnings.warn("this model's RoPE (dynamic / longrope) picks its frequencies from each forward's length: a "
                  "cache compressed before its continuation keeps the prompt's keys at the prompt's own "
                  "frequencies, so a continuation past the original context length does not equal one forward "
                  "over prompt and continuation (hf-jacap's loglikelihood corrects this; generate over a given "
                  "cache cannot)", UserWarning, stacklevel=3)


def _generate(model, original, *args, **kwargs):
    state = model._jacap_state
    _canonical_cache_keyword(kwargs, state.cache_keyword)
    _refuse_unsupported_generation(model, kwargs)
    inputs = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    for name, given in (("input_ids", inputs), ("inputs_embeds", kwargs.get("inputs_embeds"))):
        if isinstance(given, torch.Tensor) and given.numel() == 0:
            raise ValueError(f"{name} has shape {tuple(given.shape)}: generate needs a prompt of at least one "
                             "token in every row")
    if isinstance(inputs, torch.Tensor) and not inputs.dtype.is_floating_point:
        if inputs.dim() != 2:
            raise ValueError(f"input_ids has shape {tuple(inputs.shape)}: generate needs [batch, tokens] (one prompt: "
                             "ids[None])")
        check_token_ids(model, inputs)  # before any prefill: a clear error, not torch's IndexError from inside it
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:  # before the forward's own shape error
            check_mask_shape(mask, tuple(inputs.shape))
    cache = _cache_from(kwargs)
    if cache is not None and not isinstance(cache, JacapCache):
        raise ValueError(_foreign_cache_message(cache))
    if isinstance(cache, JacapCache):
        cache.check_model(model)
        if isinstance(inputs, torch.Tensor):
            cache.check_prompt(inputs)
            if cache.state != EMPTY:  # the forward sees the 4D mask generate builds; the new columns are these
                refuse_padded_continuation(kwargs.get("attention_mask"), inputs.shape[1] - cache.get_seq_length())
        if cache.state != EMPTY:
            _warn_length_dependent_rope(model)
    if _option(model, kwargs, "use_cache") is False:  # given, or the checkpoint's generation_config
        warnings.warn("generate(use_cache=False) keeps no KV cache, so jacap_attn compresses nothing: every step "
                      "attends over the whole sequence, as an unpatched model does", UserWarning, stacklevel=2)
    own_config = _turn_chunk_size(model, kwargs, cache)
    try:
        chunked = _chunked_prefill(model, kwargs, inputs, cache)
        if chunked is not None and isinstance(cache, JacapCache) and cache.state != EMPTY:
            _chunk.begin_turn(cache, inputs)  # a new turn in chunks: the ids of what the cache holds
        calls = _generating_calls()
        calls[id(model)] = calls.get(id(model), 0) + 1
        token = _PREFILL.set(chunked)
        try:
            return original(*args, **kwargs)
        finally:
            _PREFILL.reset(token)
            calls[id(model)] -= 1
            if not calls[id(model)]:
                del calls[id(model)]
    finally:
        if own_config is not None:
            cache.config = own_config


def _is_chunk_size(value) -> bool:
    """Whether ``value`` is a usable ``prefill_chunk_size``: a positive integer (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= 1


def _turn_chunk_size(model, kwargs, cache):
    """A new turn over a compressed cache whose config has no ``chunk_size``, given
    ``prefill_chunk_size=N`` at ``generate``, is cut under the running budget every ``N`` tokens as
    under ``chunk_size=N`` (not appended whole): the cache reads ``chunk_size=N`` for this call only.
    Returns the cache's own config, to put back when the call ends, or ``None`` (nothing changed:
    no such turn, a ``chunk_size`` already set, or ``reselect``, which cuts the turn by its question)."""
    chunk = _option(model, kwargs, "prefill_chunk_size")
    if not isinstance(cache, JacapCache) or cache.state == EMPTY or chunk is None:
        return None
    cfg = cache.config
    if cfg.chunk_size is not None or cfg.reselect is not None or cfg.queries == "repeat":
        return None
    if not _is_chunk_size(chunk):
        return None  # refused with its name by _chunked_prefill
    try:
        turn = dataclasses.replace(cfg, chunk_size=int(chunk))
    except ValueError:  # a method that cannot be chunked: refused with its name by _chunked_prefill
        return None
    cache.config = turn
    return cfg


# Per-call state is never kept on the (shared) model: which models' patched `generate` is running is
# known per thread, so another thread's plain forward over a compressed cache is checked as when alone.
_local = threading.local()


def _generating_calls() -> dict:
    """``{id(model): running generate calls}`` of the calling thread."""
    if not hasattr(_local, "calls"):
        _local.calls = {}
    return _local.calls


def embeds_prefill_mask(kwargs: dict) -> tuple[dict, bool]:
    """``(kwargs, True)`` for a prefill forward that the patched ``generate`` left to the forward to split
    (a prompt given as ``inputs_embeds``, :func:`_chunked_prefill`): ``kwargs`` with the call's own 2D
    ``attention_mask`` (or none; its rows repeated as generate repeats the prompt's for beams or
    ``num_return_sequences``) in place of the 4D one generate built for the whole prompt.
    ``(kwargs, False)`` unchanged outside such a call."""
    chunked = _PREFILL.get()
    if chunked is None or chunked[0] is not None:
        return kwargs, False
    mask = chunked[2]
    rows = kwargs["inputs_embeds"].shape[0] if isinstance(kwargs.get("inputs_embeds"), torch.Tensor) else None
    if isinstance(mask, torch.Tensor) and rows and mask.shape[0] != rows and rows % mask.shape[0] == 0:
        mask = mask.repeat_interleave(rows // mask.shape[0], dim=0)
    return {**kwargs, "attention_mask": mask}, True


def generating(model) -> bool:
    """Whether the patched ``generate`` of ``model`` runs in the calling thread (it checks its prompt
    itself, so its own forwards skip :meth:`jacap_attn.storage.cache.JacapCache.check_forward`)."""
    return id(model) in _generating_calls()


def _chunked_prefill(model, kwargs, inputs, cache) -> tuple | None:
    """``(prompt tokens, chunk size, attention_mask, input_ids)`` when this ``generate`` call prefills in chunks (its own
    ``prefill_chunk_size``, or the config's ``chunk_size``, which it then passes on as
    ``prefill_chunk_size``), else ``None``; ``(None, chunk size, attention_mask, None)`` for a prompt given as
    ``inputs_embeds``, which the patched forward splits itself (``prefill_chunk_size`` then unset; the
    call's own 2D mask, as generate hands the forward a 4D one built for the whole prompt). The chunks
    are cut as they come under a running budget (:mod:`jacap_attn.routes.chunk`) from an empty cache,
    or, under the config's ``chunk_size`` without ``reselect``, over a given compressed cache (a new
    turn); any other continuation over a compressed cache (a question that ``reselect`` cuts) runs as one
    forward, ``prefill_chunk_size`` dropped. ``ValueError`` with ``queries="repeat"``, for a
    ``prefill_chunk_size`` that is not a positive integer, and for a 2D ``attention_mask`` that does not fit
    the prompt, pads on the right or has holes (:func:`~jacap_attn.storage.masks.check_prompt_mask`, before
    any chunk runs)."""
    cfg = cache.config if isinstance(cache, JacapCache) else model._jacap_state.config  # a given cache's own settings
    chunk = _option(model, kwargs, "prefill_chunk_size")
    if chunk is not None and not _is_chunk_size(chunk):
        raise ValueError(f"prefill_chunk_size must be a positive integer (tokens per chunk), got prefill_chunk_size={chunk!r}")
    if chunk is None and cfg.chunk_size is not None and _option(model, kwargs, "use_cache") is not False:
        chunk = kwargs["prefill_chunk_size"] = cfg.chunk_size  # (without a cache transformers refuses chunks)
    if chunk is None:
        return None
    if cfg.queries == "repeat":
        raise ValueError("queries='repeat' replays the whole prompt over its exact cache, which a chunked prefill "
                         f"never holds: drop prefill_chunk_size={chunk}, or use queries='window'")
    route_settings.check_chunkable(cfg.method, f"prefill_chunk_size={chunk}")
    # the prefill reads inputs_embeds when they are given, beside input_ids or not (as stock generate does)
    embeds = isinstance(kwargs.get("inputs_embeds"), torch.Tensor)
    given = kwargs["inputs_embeds"] if embeds else inputs
    if not isinstance(given, torch.Tensor) or given.dim() < 2:
        return None
    if embeds:
        # transformers' chunked prefill slices input_ids only (from inputs_embeds it fails with a shape
        # error, patched or not): generate runs one plain prefill forward, which the patched forward
        # splits into the same chunks (routes.chunk.split_forward), cut as they come
        kwargs["prefill_chunk_size"] = None
    if isinstance(cache, JacapCache) and cache.state != EMPTY and (cfg.chunk_size is None or cfg.reselect is not None):
        # a continuation over a compressed cache: appended (or reselected by the whole question) in one
        # forward, as without chunks; split, each piece would reselect alone and evict the question's start
        kwargs["prefill_chunk_size"] = None
        return None
    check_prompt_mask(kwargs.get("attention_mask"), tuple(given.shape[:2]))
    if embeds:
        # a new turn under a running budget, given as embeddings, is cut once, as one chunk (docs/usage.md)
        return None if isinstance(cache, JacapCache) and cache.state != EMPTY else (None, int(chunk), kwargs.get("attention_mask"), None)
    return int(given.shape[1]), int(chunk), kwargs.get("attention_mask"), given



def _prepare_cache(model, original, generation_config, model_kwargs, *args, **kwargs):
    implementation = generation_config.cache_implementation
    creates = _cache_from(model_kwargs) is None and generation_config.use_cache is not False
    if creates:
        # A served implementation becomes a JacapCache: let transformers build its (lazy, empty)
        # DynamicCache rather than allocate a full-size StaticCache that would be thrown away.
        _check_cache_implementation(implementation)
        generation_config.cache_implementation = None
    try:
        result = original(generation_config, model_kwargs, *args, **kwargs)
    finally:
        generation_config.cache_implementation = implementation
    key = next((k for k in _CACHE_KEYWORDS if k in model_kwargs), None)
    cache = model_kwargs.get(key) if key else None
    max_length = generation_config.max_length
    if creates and getattr(generation_config, "max_cache_len", None):
        max_length = max(max_length, generation_config.max_cache_len)
    if creates and type(cache) is DynamicCache:
        cache = model_kwargs[key] = JacapCache(model, max_length=max_length)
    elif isinstance(cache, JacapCache):
        _expand_given_cache(cache, generation_config, args[1] if len(args) > 1 else kwargs.get("batch_size"))
        if cache.state == EMPTY:
            cache.max_length = max_length
        else:
            cache.ensure_room(max_length - cache.get_seq_length())
            cache.max_length = max_length  # question-time reselection sizes the buffers it shrinks to by it
    chunked = _PREFILL.get()
    if chunked is not None and isinstance(cache, JacapCache):
        cache.prefill_until, cache.prefill_chunk = chunked[:2]
        _chunk.know_prompt(cache, chunked[3], chunked[2])
    return result



def _expand_given_cache(cache: JacapCache, generation_config, batch) -> None:
    """Repeat the rows of a given, already filled cache as ``generate`` repeated its inputs
    (``num_return_sequences`` / ``num_beams``, each row ``max(...)`` times, interleaved); transformers
    expands the inputs but never a given cache. ``ValueError`` if its rows fit neither."""
    if cache.state == EMPTY or batch is None:
        return
    expand = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    rows = cache.batch_size
    if rows == batch and expand > 1:
        cache.batch_repeat_interleave(expand)
    elif rows != batch * expand:
        raise ValueError(f"the cache holds {rows} rows but generate runs {batch} input rows x {expand} "
                         "(num_return_sequences / num_beams): give a cache of the inputs' batch")



def _compile_criteria(model, original, *args, **kwargs):
    return model._jacap_state.config.compile and original(*args, **kwargs)
