"""`patch` / `unpatch`: wiring only (docs/architecture.md#patching).

``patch`` leaves transformers' modules and classes alone and changes one model instance:

* registers ``jacap_<impl>`` attention and mask functions through transformers' registries and
  switches the model to it (``impl`` is the model's own ``sdpa`` or ``eager``);
* binds a thin ``forward`` on each attention module instance that hands the layer's
  :class:`~jacap_attn.cache.JacapLayer` to the attention function;
* adds a forward pre-hook on the decoder stack (records padding; creates a ``JacapCache`` when
  the model would otherwise create a ``DynamicCache``) and a post-hook (selects and gathers);
* wraps ``_prepare_cache_for_generation`` so ``generate`` builds a ``JacapCache`` sized for its
  ``max_length``, and ``_valid_auto_compile_criteria`` for the ``compile`` option.

Everything replaced is remembered; ``unpatch`` puts back the very same objects.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
from dataclasses import dataclass, field

from transformers.cache_utils import DynamicCache

from . import repeat, reselect
from .attention import make_attention_function
from .cache import COMPRESSED, EMPTY, JacapCache
from .config import JacapConfig
from .methods import Method
from .selection import finalize_prefill
from .patches import Adapter, get_adapter

_MISSING = object()
_CACHE_KEYWORDS = ("cache", "past_key_values")
_SUPPORTED_IMPLS = ("sdpa", "eager")
# `cache_implementation` values a patched model serves with its own JacapCache (static-shape and
# compileable, so "static" keeps compiled decoding); the deprecated static aliases are served too, with
# a one-time warning. Every other value (offloaded*, quantized, paged) is a ValueError.
_SERVED_CACHES = (None, "dynamic", "static")
_STATIC_ALIASES = ("sliding_window", "hybrid", "hybrid_chunked")
_warned = set()
# Decoding modes that cannot run over a compressed cache (they crop it or rebuild it per candidate).
_REFUSED_CUSTOM_GENERATE = ("contrastive-search", "group-beam-search", "constrained-beam-search")


@dataclass
class PatchState:
    """What :func:`patch` changed on one model, kept on it as ``model._jacap_state``."""

    config: JacapConfig
    adapter: Adapter
    sliding_windows: list
    attn_implementation: str
    cache_keyword: str
    forwards: list = field(default_factory=list)  # (module, previous instance-level forward or _MISSING)
    hooks: list = field(default_factory=list)
    methods: dict = field(default_factory=dict)  # name -> previous instance attribute or _MISSING
    weights_sha256: str | None = None  # memo of jacap_attn.cache.weights_fingerprint
    generating: int = 0  # > 0 while the patched `generate` runs (it checks the prompt itself)


def _register(impl: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = f"jacap_{impl}"
    AttentionInterface.register(name, make_attention_function(impl))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    return name


def _cache_from(kwargs):
    for key in _CACHE_KEYWORDS:
        if kwargs.get(key) is not None:
            return kwargs[key]
    return None


def patch(model, ratio: float = 0.1, method: Method | str = "jacap", **options):
    """Make every later prefill of ``model`` keep only ``ratio`` of the prompt's KV entries.

    Parameters
    ----------
    model: a ``*ForCausalLM`` of a supported family (``jacap_attn.patches.ADAPTERS``).
    ratio: kept fraction of the prompt tokens, in (0, 1].
    method: a registered name (``"jacap"``, a baseline, or one registered with
        :func:`jacap_attn.methods.register`; :func:`jacap_attn.methods.names` lists them) or a
        :class:`~jacap_attn.methods.Method` instance such as ``SnapKV(kernel=3)``.
    **options: the shared settings of :class:`~jacap_attn.config.JacapConfig` and the fields of the
        method's dataclass (these replace the instance's values).

    Returns the same model, patched in place. Patching an already patched model only replaces its
    settings (idempotent); the original forwards stay remembered.

    Caches. Every cache the patched model fills is its own compressed
    :class:`~jacap_attn.cache.JacapCache` (static-shape, compileable):

    * served: ``cache_implementation`` unset, ``"dynamic"`` or ``"static"`` (as a ``generate`` argument
      or in ``model.generation_config``; ``"static"`` keeps compiled decoding, ``max_cache_len`` sizes
      the free room); the deprecated static aliases ``"sliding_window"``, ``"hybrid"``,
      ``"hybrid_chunked"`` likewise, with a one-time warning naming them; a ``JacapCache`` passed as
      ``cache=`` / ``past_key_values=`` (empty, from :func:`compress` or from ``load_cache``), also with
      ``num_return_sequences`` / ``num_beams`` (its rows are repeated as ``generate`` repeats the inputs);
    * refused with a ``ValueError`` naming it: ``"offloaded"``, ``"offloaded_static"``,
      ``"offloaded_hybrid*"``, ``"quantized"``, ``"paged"`` (they cannot hold a compressed cache), and any
      other cache object passed as ``cache=`` / ``past_key_values=`` (``DynamicCache``, ``StaticCache``,
      a user's ``Cache`` subclass: it would hold the full prompt); also the decoding modes that crop or
      rebuild the cache: contrastive search (``penalty_alpha``), group and constrained beam search,
      their ``custom_generate`` repositories, assisted generation.

    A given ``JacapCache`` is checked before use: the model (shape and a weights fingerprint; another
    model is a ``ValueError``, a model that is not patched a ``RuntimeError``) and, in ``generate``, that
    the ids start with its prompt (its ids, or the SHA-256 of a file saved without them) and are
    longer than what it holds. A plain forward over it takes the new tokens only; it refuses ids that
    repeat the prompt and ``position_ids`` that do not continue at the cache's length.

    Raises
    ------
    ValueError: unsupported ``model_type`` (the message lists the supported ones), a bad setting, or
        an option that does not apply to ``method``. Nothing is changed when it raises.
    """
    config = JacapConfig.from_options(ratio=ratio, method=method, **options)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(model, torch.nn.Module) or model_type is None:
        raise ValueError(f"patch needs a transformers *ForCausalLM model, got {type(model).__name__}")
    adapter = get_adapter(model_type)
    try:
        adapter.decoder_layers(model)
    except AttributeError:
        raise ValueError(f"patch needs the *ForCausalLM model (layers at model.{adapter.layers_path}), "
                         f"got {type(model).__name__}") from None
    state = getattr(model, "_jacap_state", None)
    if state is not None:
        state.config = config
        return model
    try:
        _install(model, config, adapter)
    except BaseException:
        unpatch(model)
        raise
    return model


def _install(model, config: JacapConfig, adapter: Adapter) -> None:
    impl = model.config._attn_implementation
    impl = impl if impl in _SUPPORTED_IMPLS else "sdpa"
    base = adapter.base_model(model)
    params = inspect.signature(base.forward).parameters
    keyword = next((k for k in _CACHE_KEYWORDS if k in params), _CACHE_KEYWORDS[0])
    state = PatchState(config, adapter, adapter.sliding_windows(model.config), model.config._attn_implementation, keyword)

    for index, module in enumerate(adapter.attention_modules(model)):
        state.forwards.append((module, module.__dict__.get("forward", _MISSING)))
        module.forward = _attention_forward(module.forward, index)
    state.hooks.append(base.register_forward_pre_hook(functools.partial(_pre_hook, model), with_kwargs=True))
    state.hooks.append(base.register_forward_hook(functools.partial(_post_hook, model), with_kwargs=True))
    wrappers = (("generate", _generate), ("_prepare_cache_for_generation", _prepare_cache),
                ("_valid_auto_compile_criteria", _compile_criteria))
    for name, wrapper in wrappers:
        state.methods[name] = model.__dict__.get(name, _MISSING)
        setattr(model, name, functools.partial(wrapper, model, getattr(model, name)))
    model._jacap_state = state
    model.set_attn_implementation(_register(impl))


def unpatch(model):
    """Undo :func:`patch`: the original forward objects, hooks and attention implementation.
    A no-op on a model that is not patched. Returns the model."""
    state = getattr(model, "_jacap_state", None)
    if state is None:
        return model
    for module, previous in state.forwards:
        if previous is _MISSING:
            module.__dict__.pop("forward", None)
        else:
            module.forward = previous
    for handle in state.hooks:
        handle.remove()
    for name, previous in state.methods.items():
        if previous is _MISSING:
            model.__dict__.pop(name, None)
        else:
            setattr(model, name, previous)
    del model._jacap_state
    if model.config._attn_implementation != state.attn_implementation:
        model.set_attn_implementation(state.attn_implementation)
    return model


def is_patched(model) -> bool:
    """Whether ``model`` is currently patched."""
    return getattr(model, "_jacap_state", None) is not None


def _attention_forward(original, index: int):
    @functools.wraps(original)
    def forward(*args, **kwargs):
        cache = _cache_from(kwargs)
        if isinstance(cache, JacapCache):
            kwargs["jacap_cache"], kwargs["jacap_index"] = cache, index
            if not torch.compiler.is_compiling():
                cache.layers[index].armed = True  # JacapCache.update accepts only armed calls
        return original(*args, **kwargs)

    return forward


def _canonical_cache_keyword(kwargs, keyword: str) -> None:
    """Move a cache passed under the other name (``cache`` / ``past_key_values``) to ``keyword``, the
    one this transformers version reads (``past_key_values`` before 5.24), so the model never builds
    a second cache of its own beside ours. Given both, ``cache`` wins, as in transformers 5.24."""
    for other in _CACHE_KEYWORDS:
        if other != keyword and kwargs.get(other) is not None:
            moved = kwargs.pop(other)
            if kwargs.get(keyword) is None or other == "cache":
                kwargs[keyword] = moved


def _pre_hook(model, module, args, kwargs):
    state = model._jacap_state
    _canonical_cache_keyword(kwargs, state.cache_keyword)
    cache = _cache_from(kwargs)
    if cache is not None and not isinstance(cache, JacapCache) and not torch.compiler.is_compiling():
        raise ValueError(_foreign_cache_message(cache))
    use_cache = kwargs.get("use_cache")
    if cache is None and not module.training and (use_cache if use_cache is not None else model.config.use_cache):
        cache = kwargs[state.cache_keyword] = JacapCache(model)
    if isinstance(cache, JacapCache):
        cache.check_model(model)
        if not torch.compiler.is_compiling():
            cache.bind(model)
            if cache.state == COMPRESSED and not state.generating:
                ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else (args[0] if args else None)
                cache.check_forward(ids, kwargs.get("position_ids"))
    if isinstance(cache, JacapCache) and cache.state == EMPTY:
        inputs = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        if inputs is None and args:
            inputs = args[0]
        cache.begin_prefill(kwargs.get("attention_mask"), inputs.shape[1], inputs.shape[0], inputs.device)
        if kwargs.get("input_ids") is not None:
            cache.prompt_ids = kwargs["input_ids"].detach().clone()
    return args, kwargs


def _post_hook(model, module, args, kwargs, output):
    cache = _cache_from(kwargs)
    if isinstance(cache, JacapCache):
        if cache.prefill is not None and cache.prefill.replay_valid is not None:
            return output  # a forward of the repeat pass itself
        if repeat.needs_pass(cache):
            run_repeat_pass(model, cache)
        finalize_prefill(cache)
        reselect.finish(cache)  # question-time reselection: the cut after the forward
    return output


def run_repeat_pass(model, cache: JacapCache) -> None:
    """Run the repeat pass (``queries="repeat"``, :func:`jacap_attn.repeat.run_pass`) of ``cache``'s
    pending prefill through the patched ``model``'s decoder stack."""
    state = model._jacap_state
    repeat.run_pass(state.adapter.base_model(model), cache, state.cache_keyword)


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


def _generate(model, original, *args, **kwargs):
    state = model._jacap_state
    _canonical_cache_keyword(kwargs, state.cache_keyword)
    _refuse_unsupported_generation(model, kwargs)
    inputs = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    for name, given in (("input_ids", inputs), ("inputs_embeds", kwargs.get("inputs_embeds"))):
        if isinstance(given, torch.Tensor) and given.numel() == 0:
            raise ValueError(f"{name} has shape {tuple(given.shape)}: generate needs a prompt of at least one "
                             "token in every row")
    cache = _cache_from(kwargs)
    if cache is not None and not isinstance(cache, JacapCache):
        raise ValueError(_foreign_cache_message(cache))
    if isinstance(cache, JacapCache):
        cache.check_model(model)
        if isinstance(inputs, torch.Tensor):
            cache.check_prompt(inputs)
    state.generating += 1
    try:
        return original(*args, **kwargs)
    finally:
        state.generating -= 1


def compress(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
             config: JacapConfig | None = None) -> JacapCache:
    """Run the prefill of the patched ``model`` on ``input_ids`` ``[b, n]`` and return the compressed
    :class:`JacapCache` (no token generated; only the last position's logits are computed).

    ``attention_mask`` ``[b, n]`` (1 = token) for left-padded batches. ``config``: settings for this
    cache instead of the patched ones (e.g. :meth:`jacap_attn.Document.compress` stores a document at a
    larger kept fraction). This is the selection ``generate`` makes: scored by the prompt's last
    positions (``queries="window"``, the default), it suits a prompt that ends with its question; for
    a document whose questions come later see :class:`jacap_attn.Document` (README, "Question asked
    after compression"). Raises ``ValueError`` if the model is not patched.
    """
    state = getattr(model, "_jacap_state", None)
    if state is None:
        raise ValueError("compress needs a patched model: call jacap_attn.patch(model, ...) first")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point \
            or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty [batch, tokens] integer tensor, got "
                         f"{type(input_ids).__name__} {tuple(getattr(input_ids, 'shape', ()))}")
    position_ids = None
    if attention_mask is not None:
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}")
        # Logical RoPE positions of a left-padded row, as `generate` computes them.
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    if config is not None and not isinstance(config, JacapConfig):
        raise ValueError(f"config must be a JacapConfig, got {type(config).__name__}")
    cache = JacapCache(model, config=config)
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
              logits_to_keep=1, **{state.cache_keyword: cache})
    return cache


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
        model_kwargs[key] = JacapCache(model, max_length=max_length)
    elif isinstance(cache, JacapCache):
        _expand_given_cache(cache, generation_config, args[1] if len(args) > 1 else kwargs.get("batch_size"))
        if cache.state == EMPTY:
            cache.max_length = max_length
        else:
            cache.ensure_room(max_length - cache.get_seq_length())
            cache.max_length = max_length  # question-time reselection sizes the buffers it shrinks to by it
    return result


def _expand_given_cache(cache: JacapCache, generation_config, batch) -> None:
    """Repeat the rows of a given, already filled cache as ``generate`` repeated its inputs
    (``num_return_sequences`` / ``num_beams``, each row ``max(...)`` times, interleaved); transformers
    expands the inputs but never a given cache. ``ValueError`` if its rows fit neither."""
    if cache.state == EMPTY or batch is None:
        return
    expand = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    rows = cache.layers[0].keys.shape[0]
    if rows == batch and expand > 1:
        cache.batch_repeat_interleave(expand)
    elif rows != batch * expand:
        raise ValueError(f"the cache holds {rows} rows but generate runs {batch} input rows x {expand} "
                         "(num_return_sequences / num_beams): give a cache of the inputs' batch")


def _compile_criteria(model, original, *args, **kwargs):
    return model._jacap_state.config.compile and original(*args, **kwargs)
