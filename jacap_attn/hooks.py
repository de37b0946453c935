"""What a patched model runs in each forward (docs/architecture.md#patching): the forwards
:func:`jacap_attn.patch` binds on module instances (every attention layer's, the decoder stack's) and
the decoder stack's pre- and post-hooks (begin a prefill, choose its route, end it with the cut).

The bound forwards are objects, not closures: ``copy.deepcopy`` of a patched model gives the copy
forwards that call the copy's modules, and the copy is patched as the original is (a closure kept
calling the original's modules: the copy ran the original's attention weights).
"""

from __future__ import annotations

import torch

from . import routes
from .generation import _cache_from, _canonical_cache_keyword, _foreign_cache_message, embeds_prefill_mask, generating
from .routes import chunk as _chunk
from .storage.cache import COMPRESSED, EMPTY, JacapCache
from .storage.masks import refuse_padded_continuation


class _Missing:
    """No instance-level attribute before :func:`jacap_attn.patch` set one: a singleton that copies and
    pickles as itself, so that ``unpatch`` of a copied model tells it apart."""

    def __repr__(self):
        return "MISSING"

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return "MISSING"


MISSING = _Missing()


class BoundForward:
    """The ``forward`` bound on ``module``'s instance by :func:`jacap_attn.patch`, around the module's
    own: ``previous``, the instance-level forward it had before (:data:`MISSING`: its class's)."""

    def __init__(self, module: torch.nn.Module, previous=MISSING):
        self.module, self.previous = module, previous

    def original(self, *args, **kwargs):
        """The module's own forward."""
        if self.previous is MISSING:
            return type(self.module).forward(self.module, *args, **kwargs)
        return self.previous(*args, **kwargs)

    @property
    def __wrapped__(self):  # inspect.signature(module.forward) reads the module's own
        return type(self.module).forward.__get__(self.module) if self.previous is MISSING else self.previous


class AttentionForward(BoundForward):
    """An attention layer's forward: hands the layer's :class:`~jacap_attn.storage.layer.JacapLayer`
    (``jacap_cache``, ``jacap_index``) to the registered attention function."""

    def __init__(self, module, previous=MISSING, index: int = 0):
        super().__init__(module, previous)
        self.index = index

    def __call__(self, *args, **kwargs):
        cache = _cache_from(kwargs)
        if isinstance(cache, JacapCache):
            kwargs["jacap_cache"], kwargs["jacap_index"] = cache, self.index
            # JacapCache.update accepts only armed calls. Set when traced too: a compiled layer whose
            # frame dynamo runs eagerly past a graph break (or its recompile limit) still updates
            cache.layers[self.index].armed = True
        return self.original(*args, **kwargs)


class StackForward(BoundForward):
    """The decoder stack's forward. Inside a compiled forward (``torch.compile(model.forward)``,
    ``model.compile()``, ``generate``'s compiled decode step) a decode step over a compressed cache
    (:func:`_traced_step`) is traced (static shapes, no graph break); every other forward over the
    stack (a prefill, a chunk of a chunked prefill, a question over a compressed cache, no cache yet)
    runs outside the graph with its route's cut, after the pre-hook's eager part
    (``torch._dynamo.disable``): one graph break where the stack is called, none per layer (each would
    be a graph specialised on its layer's index), so it compresses exactly as an eager forward does and
    a chunked prefill never recompiles per chunk or per layer (docs/cache.md#compiled-decode)."""

    def __init__(self, module, previous=MISSING, model: torch.nn.Module | None = None):
        super().__init__(module, previous)
        self.model = model

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling() and not _traced_step(self.model, args, kwargs):
            return _stack_outside(self, args, kwargs)
        return self.original(*args, **kwargs)


def _traced_step(model, args, kwargs) -> bool:
    """Whether a forward over the decoder stack is a decode step over a compressed cache (one token, no
    route, no chunked prefill going on): the one forward a compiled model traces."""
    cache = _cache_from(kwargs)
    inputs = _forward_inputs(args, kwargs)[1]
    # the shape first: a forward of several tokens never reads (so never guards on) the cache's counters
    return isinstance(inputs, torch.Tensor) and inputs.dim() >= 2 and inputs.shape[1] == 1 \
        and isinstance(cache, JacapCache) and cache.state == COMPRESSED and cache.route is None \
        and cache.prefill_until is None


def _forward_inputs(args, kwargs) -> tuple:
    """``(ids, inputs)`` of a call of the decoder stack: its ``input_ids`` (a keyword or the first
    positional argument; ``None`` without), and those ids or else its ``inputs_embeds``."""
    ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else (args[0] if args else None)
    return ids, ids if ids is not None else kwargs.get("inputs_embeds")


@torch._dynamo.disable
def _stack_outside(forward: "StackForward", args, kwargs):
    """The decoder stack's forward and the route's end of it (the cut), eagerly (see
    :class:`StackForward`; its pre-hook ran before, outside the graph too)."""
    return post_hook(forward.model, forward.module, args, kwargs, forward.original(*args, **kwargs))


def pre_hook(model, module, args, kwargs):
    """The decoder stack's forward pre-hook (``functools.partial(pre_hook, model)``)."""
    if torch.compiler.is_compiling():
        return _compiled_pre_hook(model, module, args, kwargs)
    return _eager_pre_hook(model, module, args, kwargs)


def _compiled_pre_hook(model, module, args, kwargs):
    """The pre-hook inside a compiled forward: a decode step over a compressed cache is checked and
    traced (static shapes, no graph break); every other forward (a prefill, a chunk, a question over a
    compressed cache, no cache yet) runs the eager pre-hook outside the graph
    (``torch._dynamo.disable``), and the stack's forward runs outside it too (:class:`StackForward`),
    so it compresses exactly as an eager forward does (docs/cache.md#compiled-decode)."""
    _canonical_cache_keyword(kwargs, model._jacap_state.cache_keyword)
    if _traced_step(model, args, kwargs):
        _cache_from(kwargs).check_model(model)  # the shape (the weights fingerprint is checked by eager forwards)
        return args, kwargs
    return _eager_pre_hook_outside(model, module, args, kwargs, compiled=True)


def _eager_pre_hook(model, module, args, kwargs, compiled: bool = False):
    state = model._jacap_state
    impl = model.config._attn_implementation
    if not str(impl).startswith("jacap_"):  # set_attn_implementation after patch: nothing would be compressed
        raise RuntimeError(f"the model's attention implementation was set to {impl!r} after jacap_attn.patch, so "
                           "this forward would compress nothing: call jacap_attn.patch(model, ...) again")
    _canonical_cache_keyword(kwargs, state.cache_keyword)
    cache = _cache_from(kwargs)
    if cache is not None and not isinstance(cache, JacapCache):
        raise ValueError(_foreign_cache_message(cache))
    use_cache = kwargs.get("use_cache")
    if cache is None and not module.training and (use_cache if use_cache is not None else model.config.use_cache):
        cache = kwargs[state.cache_keyword] = JacapCache(model)
    if not isinstance(cache, JacapCache):
        return args, kwargs
    cache.check_model(model)
    cache.bind(model)
    ids, inputs = _forward_inputs(args, kwargs)
    if cache.route is not None:  # a forward the route itself runs (the repeat pass, a lookahead)
        return args, kwargs
    if cache.state == COMPRESSED and not generating(model) and cache.prefill_until is None:  # generate checks its prompt itself
        cache.check_forward(ids, kwargs.get("position_ids"))
    if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2 and inputs.shape[1] == 0:
        raise ValueError(f"{'input_ids' if ids is not None else 'inputs_embeds'} has shape {tuple(inputs.shape)}: "
                         "a forward over a JacapCache needs at least one token")
    chunk = cache.chunk_in_force  # generate's prefill_chunk_size over inputs_embeds (generation._chunked_prefill)
    if cache.state == EMPTY and cache.prefill_until is None and chunk is not None and inputs.shape[1] > chunk:
        kwargs, in_generate = embeds_prefill_mask(kwargs)
        args, kwargs = _chunk.split_forward(cache, state.forward_over(cache), args, kwargs, chunk,
                                            last_outputs=in_generate)
        inputs = _forward_inputs((), kwargs)[1]  # the last chunk's, now a keyword
    if cache.state == EMPTY:
        cache.begin_prefill(kwargs.get("attention_mask"), inputs.shape[1], inputs.shape[0], inputs.device)
        if kwargs.get("input_ids") is not None:
            cache.prompt_ids = kwargs["input_ids"].detach().clone()
        chunked = cache.prefill_until is not None or chunk is not None
        cache.route = _chunk.ChunkRoute() if chunked else routes.route_for(cache, True, inputs.shape[1])
    elif cache.state == COMPRESSED and inputs is not None:
        refuse_padded_continuation(kwargs.get("attention_mask"), inputs.shape[1])
        if compiled or inputs.shape[1] > 1:  # a compiled forward, or compiled layers, cannot grow the buffers while they write
            cache.ensure_room(inputs.shape[1])
        if cache.prefill_until is not None:  # the next chunk of a chunked prefill
            _chunk.extend_prompt(cache, kwargs.get("input_ids"), inputs.shape[1])
            cache.route = _chunk.ChunkRoute()
        else:
            cache.route = routes.route_for(cache, False, inputs.shape[1])
    cache.forward_ids = ids.detach() if cache.route is not None and isinstance(ids, torch.Tensor) else None
    if cache.route is not None and isinstance(inputs, torch.Tensor):  # the forward's last token
        cache.last_input = {"input_ids" if ids is not None else "inputs_embeds": inputs[:, -1:]}
    return args, kwargs


def post_hook(model, module, args, kwargs, output):
    """The decoder stack's forward hook: the route's end of the forward (:func:`_finish`)."""
    cache = _cache_from(kwargs)
    if isinstance(cache, JacapCache) and cache.route is not None:
        return (_finish_outside if torch.compiler.is_compiling() else _finish)(model, cache, output)
    return output


def _finish(model, cache: JacapCache, output):
    """The forward's route ends it (the prefill's cut, a chunk's, a question's reselection); returns the
    forward's output, with the hidden states of chunks a split forward ran before it
    (:func:`jacap_attn.routes.chunk.join_hidden`)."""
    cache.route.finish(cache, model._jacap_state.forward_over(cache))
    return _chunk.join_hidden(cache, output)




# Inside a compiled forward, the prefill's work (beginning it, the route's `finish`) runs eagerly,
# outside the graph (torch._dynamo.disable), as the stack's forward does (StackForward). Since the
# stack's forward ends its own route (_stack_outside), a traced post-hook finds none on the paths the
# tests run (compiled forward, compiled module, compiled layers); _finish_outside stays as the guard
# for a frame dynamo splits otherwise, where tracing into the cut would fail.
_eager_pre_hook_outside = torch._dynamo.disable(_eager_pre_hook)
_finish_outside = torch._dynamo.disable(_finish)
