"""`patch` / `unpatch`: wiring only (docs/architecture.md#patching).

``patch`` leaves transformers' modules and classes alone and changes one model instance:

* registers ``jacap_<impl>`` attention and mask functions through transformers' registries and
  switches the model to it (``impl`` is the model's own ``sdpa`` or ``eager``);
* binds a thin ``forward`` on each attention module instance that hands the layer's
  :class:`~jacap_attn.storage.cache.JacapLayer` to the attention function;
* adds a forward pre-hook on the decoder stack (records padding; creates a ``JacapCache`` when
  the model would otherwise create a ``DynamicCache``) and a post-hook (selects and gathers);
* wraps ``_prepare_cache_for_generation`` so ``generate`` builds a ``JacapCache`` sized for its
  ``max_length``, and ``_valid_auto_compile_criteria`` for the ``compile`` option.

Everything replaced is remembered; ``unpatch`` puts back the very same objects.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from . import hooks
from .attention import make_attention_function
from .hooks import MISSING as _MISSING
from .storage.cache import COMPRESSED, JacapCache
from .storage.distributed import SINGLE, HeadGroup, head_group
from .storage.identity import unwrapped
from .config import JacapConfig
from .generation import _CACHE_KEYWORDS, _compile_criteria, _generate, _prepare_cache
from .methods import Method
from .model_state import route_forward
from .models import check_token_ids
from .prompts import tokenizer_instruction
from .patches import Adapter, get_adapter
from .routes import chunk as _chunk, reselect as _reselect  # noqa: F401 (they register; chunk imports the rest)
from .selection import global_budget
from .selection.spans import tables as span_tables

_SUPPORTED_IMPLS = ("sdpa", "eager")


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
    weights_sha256: str | None = None  # memo of jacap_attn.storage.cache.weights_fingerprint
    warned_spans: bool = False  # _warn_without_vocabulary has warned for this model
    model: weakref.ref | None = None  # the patched model
    spans: tuple | None = None  # (word starts, special ids, clause ends), [vocab] tables (jacap_attn.selection.spans), or None
    repeat_ids: tuple | None = None  # the given tokenizer's repeat instruction (a repeat pass without repeat_ids)
    heads: HeadGroup = SINGLE  # the ranks sharing the KV heads (tensor parallelism), jacap_attn.storage.distributed
    output_grams: list | None = None  # memo of grams(), computed when a cache first needs them, reset by patch()

    def grams(self) -> list:
        """Per layer, each query head's output gram ``[h, g, d, d]`` (``global_score="output"``,
        :func:`jacap_attn.selection.global_budget.output_grams`), computed once per :func:`patch` from the
        model's weights as they are then (a weight changed in place afterwards is seen after the next ``patch``)."""
        if self.output_grams is None:
            model = self.model()
            attention = self.adapter.attention_modules(model)[0]
            cfg = model.config
            head_dim = getattr(attention, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            group = cfg.num_attention_heads // (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
            with torch.no_grad():
                self.output_grams = global_budget.output_grams(self.adapter.output_projections(model), head_dim, group)
        return self.output_grams

    def __deepcopy__(self, memo):
        """``copy.deepcopy`` of a patched model: the copy's state names the copy (its weak reference;
        the modules, forwards, hooks and methods it records are the copy's through ``memo``); the
        process group of the KV heads is shared, not copied."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        memo[id(self)] = new
        for f in dataclasses.fields(self):
            if f.name not in ("model", "heads", "adapter"):
                setattr(new, f.name, copy.deepcopy(getattr(self, f.name), memo))
        model = self.model() if self.model is not None else None
        copied = memo.get(id(model)) if model is not None else None
        new.model = weakref.ref(copied) if copied is not None else None
        return new

    def __getstate__(self):
        """``pickle`` / ``torch.save`` of a patched model: the model itself in place of its weak
        reference (pickle's memo makes it the unpickled model), without the weights fingerprint's memo
        (recomputed for the model it is then; :func:`jacap_attn.storage.identity.weights_fingerprint`)."""
        state = dict(self.__dict__)
        state["model"] = self.model() if self.model is not None else None
        state.pop("weights_owner", None)
        state["weights_sha256"] = None
        return state

    def __setstate__(self, state):
        model = state.get("model")
        self.__dict__.update(state)
        self.model = weakref.ref(model) if model is not None else None

    def forward_over(self, cache: JacapCache):
        """The patched decoder stack over ``cache`` as a callable, for a route that needs extra forwards
        (:func:`jacap_attn.model_state.route_forward`)."""
        model = self.model()
        return route_forward(model, self.adapter.base_model(model), self.cache_keyword, cache)


def _register(impl: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = f"jacap_{impl}"
    AttentionInterface.register(name, make_attention_function(impl))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    return name


def patch(model, ratio: float = 0.1, method: Method | str = "jacap", *, tokenizer=None, **options):
    """Make every later prefill of ``model`` keep only ``ratio`` of the prompt's KV entries.

    Parameters
    ----------
    model: a ``*ForCausalLM`` of a supported family (``jacap_attn.patches.ADAPTERS``).
    ratio: kept fraction of the prompt tokens, in (0, 1].
    method: a registered name (``"jacap"``, a baseline, or one registered with
        :func:`jacap_attn.methods.register`; :func:`jacap_attn.methods.names` lists them) or a
        :class:`~jacap_attn.methods.Method` instance such as ``SnapKV(kernel=3)``.
    tokenizer: the model's tokenizer, for keeping words whole (``spans="words"``, Jacap's default;
        :mod:`jacap_attn.selection.spans` reads its vocabulary once). ``None``: the tokenizer files of the model's
        local folder (``model.name_or_path``), if any; without either, words are not kept whole. A given
        tokenizer also writes the repeat instruction a repeat pass replays before the prompt or chunk
        (:func:`jacap_attn.prompts.repeat_instruction_ids`, in its chat form when it has a chat
        template) where the config's ``repeat_ids`` is ``None``; without it the pass replays no
        instruction.
    **options: the shared settings of :class:`~jacap_attn.config.JacapConfig` and the fields of the
        method's dataclass (these replace the instance's values).

    Returns the same model, patched in place. Patching an already patched model only replaces its
    settings (idempotent); the original forwards stay remembered.

    Attention: the model's own ``sdpa`` or ``eager`` implementation; any other (``flex_attention``,
    ``flash_attention_2``, ...) runs as SDPA while patched, with a ``UserWarning`` naming the switch
    (``unpatch`` puts the original back).

    Caches. Every cache the patched model fills is its own compressed
    :class:`~jacap_attn.storage.cache.JacapCache` (static-shape, compileable):

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
    given, model = model, unwrapped(model)  # torch.compile(model): patch the module it compiles
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(model, torch.nn.Module) or model_type is None:
        raise ValueError(f"patch needs a transformers *ForCausalLM model, got {type(model).__name__}")
    adapter = get_adapter(model_type)
    try:
        adapter.decoder_layers(model)
    except AttributeError:
        raise ValueError(f"patch needs the *ForCausalLM model (layers at model.{adapter.layers_path}), "
                         f"got {type(model).__name__}") from None
    vocab = getattr(model.config, "vocab_size", None)
    if config.repeat_ids and isinstance(vocab, int) and max(config.repeat_ids) >= vocab:
        raise ValueError(f"repeat_ids must be ids of this model's vocabulary (vocab_size={vocab}), got "
                         f"repeat_ids={list(config.repeat_ids)!r}")
    state = getattr(model, "_jacap_state", None)
    if state is not None:
        state.heads.agree(config.to_dict(), "the patch settings")  # a collective on a tensor-parallel model
        if tokenizer is not None:  # read (and refused) before any setting changes
            spans, repeat_ids = span_tables(model, tokenizer), tokenizer_instruction(tokenizer)
            state.spans, state.repeat_ids = spans, repeat_ids
        state.config = config
        state.output_grams = None  # computed again from the weights as they are now (global_score="output")
        if not str(model.config._attn_implementation).startswith("jacap_"):  # set by the user since
            state.attn_implementation = _attend_through_jacap(model, stacklevel=3)
        _warn_without_vocabulary(state)
        return given
    try:
        _install(model, config, adapter, tokenizer)
    except BaseException:
        unpatch(model)
        raise
    _warn_without_vocabulary(model._jacap_state)
    return given


def _warn_without_vocabulary(state) -> None:
    """Warn (once per patched model) that ``spans="words"`` (Jacap's default) or clause or sentence ``units`` found
    no vocabulary and rank token by token (docs/method.md#d8-answers-kept-whole)."""
    config = state.config
    units = getattr(config.method, "units", "none")
    needs = ["spans='words' (keep words whole, Jacap's default)"] if config.spans == "words" else []
    needs += [f"units={units!r}"] if units in ("clauses", "sentences") else []
    if state.spans is None and needs and config.method.compresses and not state.warned_spans:
        state.warned_spans = True
        warnings.warn(f"{' and '.join(needs)} need{'s' if len(needs) == 1 else ''} the model's vocabulary and "
                      "found no tokenizer (none given, none in the model's folder, the local Hugging Face "
                      "cache or the GGUF file it was loaded from): ranking token by token, which can keep part "
                      "of a number or code and lose the rest; pass jacap_attn.patch(model, tokenizer=tokenizer, "
                      "...)", UserWarning, stacklevel=3)


def _attend_through_jacap(model, stacklevel: int) -> str:
    """Set the model's attention to jacap_attn's over its own implementation, or over SDPA (with a warning naming
    both) for one jacap_attn does not run; returns the implementation replaced (what ``unpatch`` puts back).
    ``stacklevel``: the warning's, the user's call that far above this function."""
    impl = model.config._attn_implementation
    if impl not in _SUPPORTED_IMPLS:
        runs = " or ".join(map(repr, _SUPPORTED_IMPLS))
        warnings.warn(f"attn_implementation={impl!r} is not one jacap_attn runs ({runs}): the patched model attends "
                      f"with 'sdpa' (registered as 'jacap_sdpa') until jacap_attn.unpatch(model) puts {impl!r} back; "
                      "load the model with attn_implementation='sdpa' to silence this", UserWarning, stacklevel=stacklevel)
    model.set_attn_implementation(_register(impl if impl in _SUPPORTED_IMPLS else "sdpa"))
    return impl


def _install(model, config: JacapConfig, adapter: Adapter, tokenizer=None) -> None:
    base = adapter.base_model(model)
    params = inspect.signature(base.forward).parameters
    keyword = next((k for k in _CACHE_KEYWORDS if k in params), _CACHE_KEYWORDS[0])
    state = PatchState(config, adapter, adapter.sliding_windows(model.config), model.config._attn_implementation, keyword,
                       model=weakref.ref(model))
    state.spans = span_tables(model, tokenizer)
    state.repeat_ids = tokenizer_instruction(tokenizer)
    state.heads = head_group(model)
    state.heads.agree(config.to_dict(), "the patch settings")

    for index, module in enumerate(adapter.attention_modules(model)):
        state.forwards.append((module, module.__dict__.get("forward", _MISSING)))
        module.forward = hooks.AttentionForward(module, state.forwards[-1][1], index)
    state.forwards.append((base, base.__dict__.get("forward", _MISSING)))
    base.forward = hooks.StackForward(base, state.forwards[-1][1], model)
    state.hooks.append(base.register_forward_pre_hook(functools.partial(hooks.pre_hook, model), with_kwargs=True))
    state.hooks.append(base.register_forward_hook(functools.partial(hooks.post_hook, model), with_kwargs=True))
    wrappers = (("generate", _generate), ("_prepare_cache_for_generation", _prepare_cache),
                ("_valid_auto_compile_criteria", _compile_criteria))
    for name, wrapper in wrappers:
        state.methods[name] = model.__dict__.get(name, _MISSING)
        setattr(model, name, functools.partial(wrapper, model, getattr(model, name)))
    model._jacap_state = state
    _attend_through_jacap(model, stacklevel=4)


def unpatch(model):
    """Undo :func:`patch`: the original forward objects, hooks and attention implementation (one the user set
    after ``patch`` stays). A no-op on a model that is not patched. Returns the model."""
    given, model = model, unwrapped(model)
    state = getattr(model, "_jacap_state", None)
    if state is None:
        return given
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
    current = model.config._attn_implementation  # one the user set after patch is left as it is
    if str(current).startswith("jacap_") and current != state.attn_implementation:
        model.set_attn_implementation(state.attn_implementation)
    return given


def is_patched(model) -> bool:
    """Whether ``model`` is currently patched."""
    return getattr(model, "_jacap_state", None) is not None


def compress(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
             config: JacapConfig | None = None, chunk_size: int | None = None) -> JacapCache:
    """Run the prefill of the patched ``model`` on ``input_ids`` ``[b, n]`` and return the compressed
    :class:`JacapCache` (no token generated; only the last position's logits are computed).

    ``attention_mask`` ``[b, n]`` (1 = token) for left-padded batches. ``config``: settings for this
    cache instead of the patched ones (e.g. :meth:`jacap_attn.Document.compress` stores a document at a
    larger kept fraction). ``chunk_size``: prefill in chunks of that many tokens under a running budget
    (docs/usage.md#chunked-prefill; default: the config's ``chunk_size``, ``None`` for one exact prefill).
    This is the selection ``generate`` makes: scored by the prompt's last positions
    (``queries="window"``, the default), it suits a prompt that ends with its question; for a document
    whose questions come later see :class:`jacap_attn.Document`
    (docs/results.md#question-asked-after-compression-make-bench-agnostic).
    Raises ``ValueError`` if the model is not patched, the inputs are malformed or ``chunk_size`` is bad (an
    integer >= 1; not with ``queries="repeat"``), ``RuntimeError`` if the prefill did not end compressed.
    """
    state = getattr(model, "_jacap_state", None)
    if state is None:
        raise ValueError("compress needs a patched model: call jacap_attn.patch(model, ...) first")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point \
            or input_ids.numel() == 0:
        got = (f"{type(input_ids).__name__} of shape {tuple(input_ids.shape)}, dtype {input_ids.dtype}"
               if isinstance(input_ids, torch.Tensor) else f"a {type(input_ids).__name__} (torch.tensor(ids) makes one)")
        raise ValueError(f"input_ids must be a non-empty [batch, tokens] integer tensor, got {got}")
    check_token_ids(model, input_ids)
    position_ids = None
    if attention_mask is not None:
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}")
        # Logical RoPE positions of a left-padded row, as `generate` computes them.
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    if config is not None and not isinstance(config, JacapConfig):
        raise ValueError(f"config must be a JacapConfig, got {type(config).__name__}")
    cfg = config if config is not None else state.config
    if chunk_size is not None:
        cfg = dataclasses.replace(cfg, chunk_size=chunk_size)  # validated: ValueError naming it
    cache = JacapCache(model, config=config if chunk_size is None else cfg)
    chunk, n = cfg.chunk_size, input_ids.shape[1]
    with torch.no_grad():
        forward = functools.partial(model, use_cache=True, logits_to_keep=1, **{state.cache_keyword: cache})
        if chunk is None or n <= chunk:
            forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        else:
            _chunk.prefill_in_chunks(cache, forward, input_ids, attention_mask, position_ids, chunk)
    if cache.state != COMPRESSED or cache.prefill_until is not None:  # never hand back an unfinished cache
        raise RuntimeError(f"the prefill left the cache {cache.state!r}, not compressed: the model's forward did not "
                           "run jacap_attn's hooks (is it wrapped by something that skips them?)")
    return cache
