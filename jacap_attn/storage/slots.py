"""Slot helpers of the compressed layouts: copying entries out of ``[b, h, C, d]`` buffers by slot, and
the slot order that puts each head's kept entries first."""

from __future__ import annotations

import torch


def take_slots(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``x [b, h, C, d]`` at ``slots [b, h, K]`` (int64 in ``[0, C)``): ``[b, h, K, d]``. One row copy per
    entry (``index_select`` over the flattened rows, several times faster than ``gather`` with an index
    expanded over ``d`` on the CPU); ``gather`` where ``x`` is not contiguous (a pending layer's keys
    as the model made them: flattening would copy them all)."""
    b, h, c, d = x.shape
    if not x.is_contiguous():
        return x.gather(2, slots[..., None].expand(-1, -1, -1, d))
    rows = slots + (torch.arange(b * h, device=slots.device) * c).reshape(b, h, 1)
    return x.reshape(b * h * c, d).index_select(0, rows.reshape(-1)).reshape(b, h, slots.shape[-1], d)


def kept_first(kept: torch.Tensor) -> torch.Tensor:
    """``[b, h, K]`` int64 slot order putting each (row, KV head)'s kept slots first (``kept [b, h, K]``
    bool), in their order (stable), the rest after them."""
    return torch.sort((~kept).to(torch.int8), dim=-1, stable=True).indices
