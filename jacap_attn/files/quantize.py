"""8-bit storage of a saved cache's entries (``save_cache(..., quantize="int8")``; docs/cache.md#quantized-files).

KIVI's layout (Liu et al., 2024, arXiv:2402.02750, §3): keys are quantized **per channel** (their
outliers sit in a few channels, so each channel gets its own range), values **per token**. Here the
groups are whole: a key channel's range is taken over all the entries one (row, KV head) holds, a
value's over its ``d`` channels. Asymmetric, round to nearest:

    scale = (max - min) / 255,   q = round((x - min) / scale) in [0, 255] (uint8),   x' = q * scale + min

so ``|x - x'| <= scale / 2`` per element. A file then holds ``2 d`` bytes per entry plus 8 bytes of
value range (float32 ``min`` and ``scale``) and ``2 d`` floats of key ranges per (row, KV head):
about 0.27 of the float32 entries' bytes at ``d = 64``, 0.25 at ``d = 256``. Entries are
dequantized to the file's dtype on load; the in-memory cache is never quantized. Pure tensor
functions over the packed layout of :mod:`jacap_attn.files.cache_file` (``[E, d]`` entries, ``counts
[b, h]`` per row and KV head, in row, head order).
"""

from __future__ import annotations

import torch

QUANTIZATIONS = ("int8",)
_LEVELS = 255.0


def check(quantize) -> str | None:
    """``quantize`` validated: ``None`` (entries stored in the cache's dtype) or ``"int8"``; raises
    ``ValueError`` naming the bad value otherwise."""
    if quantize is None or quantize in QUANTIZATIONS:
        return quantize
    raise ValueError(f"quantize must be None or one of {', '.join(QUANTIZATIONS)}; got quantize={quantize!r}")


def segments(counts: torch.Tensor) -> torch.Tensor:
    """``[E]`` int64: the (row, KV head) index ``r * h + k`` of every packed entry."""
    return torch.repeat_interleave(torch.arange(counts.numel()), counts.reshape(-1))


def _codes(x: torch.Tensor, low: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round((x - low) / scale).clamp_(0, _LEVELS).to(torch.uint8)


def encode(keys: torch.Tensor, values: torch.Tensor, counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """One layer's packed entries in 8 bits: ``keys`` / ``values`` ``[E, d]`` float (any float dtype),
    ``counts [b, h]`` int64 (``E = counts.sum()``). Returns ``{"keys": [E, d] uint8, "keys_min",
    "keys_scale": [b, h, d] float32, "values": [E, d] uint8, "values_min", "values_scale": [E]
    float32}``. A range of zero width gets scale 1 (its codes are all 0, decoded exactly). Raises
    ``ValueError`` for a NaN or infinite entry (it has no 8-bit range: its whole channel or token
    would decode to NaN)."""
    b, h = counts.shape
    d = keys.shape[-1]
    k, v = keys.float(), values.float()
    for name, x in (("keys", k), ("values", v)):
        bad = int((~torch.isfinite(x)).sum())
        if bad:
            raise ValueError(f"quantize='int8' needs finite entries: the {name} hold {bad} NaN or infinite "
                             "values; save with quantize=None")
    index = segments(counts)
    seg = index[:, None].expand(-1, d)
    inf = torch.full((b * h, d), float("inf"))
    k_min = inf.scatter_reduce(0, seg, k, "amin", include_self=True)
    k_max = (-inf).scatter_reduce(0, seg, k, "amax", include_self=True)
    empty = ~torch.isfinite(k_min)  # a (row, head) holding no entry
    k_min, k_max = k_min.masked_fill(empty, 0.0), k_max.masked_fill(empty, 0.0)
    k_scale = ((k_max - k_min) / _LEVELS).masked_fill_(k_max <= k_min, 1.0)
    v_min, v_max = v.amin(-1), v.amax(-1)
    v_scale = ((v_max - v_min) / _LEVELS).masked_fill_(v_max <= v_min, 1.0)
    return {"keys": _codes(k, k_min[index], k_scale[index]), "keys_min": k_min.reshape(b, h, d).contiguous(),
            "keys_scale": k_scale.reshape(b, h, d).contiguous(),
            "values": _codes(v, v_min[:, None], v_scale[:, None]), "values_min": v_min.contiguous(),
            "values_scale": v_scale.contiguous()}


def decode(tensors: dict[str, torch.Tensor], counts: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)`` ``[E, d]`` in ``dtype`` from :func:`encode`'s tensors (same names, without the
    layer prefix) and ``counts [b, h]``. Raises ``ValueError`` naming a tensor whose shape or dtype
    disagrees with ``counts``."""
    b, h = counts.shape
    total = int(counts.sum())
    keys, values = tensors["keys"], tensors["values"]
    d = keys.shape[-1] if keys.dim() == 2 else -1
    expected = {"keys": ((total, d), torch.uint8), "values": ((total, d), torch.uint8),
                "keys_min": ((b, h, d), torch.float32), "keys_scale": ((b, h, d), torch.float32),
                "values_min": ((total,), torch.float32), "values_scale": ((total,), torch.float32)}
    for name, (shape, kind) in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape or tensor.dtype != kind:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}; "
                             f"the counts say {shape} {kind}")
    index = segments(counts)
    k = keys.float() * tensors["keys_scale"].reshape(b * h, d)[index] + tensors["keys_min"].reshape(b * h, d)[index]
    v = values.float() * tensors["values_scale"][:, None] + tensors["values_min"][:, None]
    return k.to(dtype), v.to(dtype)
