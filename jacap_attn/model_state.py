"""What a forward the library runs on the user's behalf may change in a model, put back afterwards.

Some modules keep state that a forward updates: transformers' dynamic and long-context RoPE
(``rope_type`` ``"dynamic"``, ``"longrope"``) recompute their ``inv_freq`` buffer and counters such as
``max_seq_len_cached`` from the longest position a forward sees. The repeat pass
(``queries="repeat"``) runs forwards at positions up to about twice the prompt's length; without
:func:`preserved` those would leave the model computing other frequencies than the user's own calls
would (transformers issue #25104's kind of fault).
"""

from __future__ import annotations

import contextlib

import torch

_PLAIN = (bool, int, float, str, type(None), tuple)
_SMALL = 1 << 20  # tensors kept as attributes are copied only up to this many elements


def snapshot(model: torch.nn.Module) -> list:
    """Every submodule's buffers (copied), tensor attributes that are neither parameters nor buffers
    (copied, when small) and plain attributes (numbers, strings, tuples, ``None``)."""
    saved = []
    for module in model.modules():
        plain, tensors = {}, {}
        for name, value in vars(module).items():
            if name.startswith("_"):
                continue
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                if value.numel() <= _SMALL:
                    tensors[name] = (value, value.detach().clone())
            elif isinstance(value, _PLAIN):
                plain[name] = value
        buffers = {name: (b, b.detach().clone()) for name, b in module._buffers.items() if b is not None}
        saved.append((module, plain, tensors, buffers))
    return saved


def restore(saved: list) -> None:
    """Put back what :func:`snapshot` saved: the very buffer and tensor objects, with their saved
    values, and the plain attributes."""
    for module, plain, tensors, buffers in saved:
        for name, value in plain.items():
            if getattr(module, name, None) is not value:
                setattr(module, name, value)
        for name, (original, values) in tensors.items():
            if not torch.equal(original, values):
                original.data.copy_(values)
            if module.__dict__.get(name) is not original:
                module.__dict__[name] = original
        for name, (original, values) in buffers.items():
            if original.shape == values.shape and not torch.equal(original, values):
                original.data.copy_(values)
            module._buffers[name] = original


@contextlib.contextmanager
def preserved(model: torch.nn.Module):
    """Run the block, then give every module of ``model`` back the state it had before (see
    :func:`snapshot`); parameters are never touched."""
    saved = snapshot(model)
    try:
        yield
    finally:
        restore(saved)


def length_dependent_rope(model: torch.nn.Module) -> bool:
    """Whether a rotary module of ``model`` picks its frequencies from the longest position of each
    forward (transformers' ``dynamic`` and ``longrope`` RoPE types: ``@dynamic_rope_update``)."""
    for module in model.modules():
        kinds = getattr(module, "rope_type", None)
        kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
        if type(module).__name__.endswith("RotaryEmbedding") and any(
                isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in kinds):
            return True
    return False


@contextlib.contextmanager
def rope_for_length(model: torch.nn.Module, length: int | None):
    """Inside the block, every rotary module of ``model`` computes its frequencies as a forward of
    ``length`` positions would (positions ``0 .. length - 1``), whatever positions it is given: a
    prompt cached in one forward then gets the frequencies that one forward over the prompt and its
    continuation uses (length-dependent RoPE, :func:`length_dependent_rope`). ``None``: no change."""
    if length is None:
        yield
        return
    modules = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    previous = [m.__dict__.get("forward") for m in modules]
    for module in modules:
        original = module.forward

        def forward(x, position_ids, *args, _original=original, **kwargs):
            last = torch.full_like(position_ids[..., :1], length - 1)
            cos, sin = _original(x, torch.cat([position_ids, last], dim=-1), *args, **kwargs)
            return cos[..., :-1, :], sin[..., :-1, :]

        module.forward = forward
    try:
        yield
    finally:
        for module, before in zip(modules, previous):
            if before is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = before


def route_forward(model: torch.nn.Module, base: torch.nn.Module, keyword: str, cache):
    """A callable ``forward(**kwargs)`` that runs ``model``'s patched decoder stack ``base`` over
    ``cache`` (passed as ``keyword``, ``use_cache=True``): what a route that needs extra forwards calls
    (the repeat pass, a lookahead, which writes tokens with the callable's ``output_embeddings``,
    ``model``'s hidden-states-to-logits map). The model's state that such a forward changes (rotary
    caches, buffers) is put back after each call (:func:`preserved`): nothing the library runs on the
    user's behalf leaves the model different from what the user's own calls would leave; nor does it
    take the hidden states a split forward holds for its caller (``cache.leading_hidden``,
    :func:`jacap_attn.routes.chunk.join_hidden`)."""

    def forward(**kwargs):
        leading, cache.leading_hidden = getattr(cache, "leading_hidden", None), None
        try:
            with preserved(model):
                return base(use_cache=True, **{keyword: cache}, **kwargs)
        finally:
            cache.leading_hidden = leading

    forward.output_embeddings = model.get_output_embeddings()
    return forward
