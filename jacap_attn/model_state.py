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
