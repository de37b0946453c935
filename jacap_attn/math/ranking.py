"""The ranking every cut uses, as integer keys: by score, ties to the later position
(docs/method.md#top-k-selection). ``torch.topk`` over the keys gives the order a stable descending sort
of the reversed row gives, without the full sort."""

from __future__ import annotations

import torch


def ranking_keys(scores: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` int64 keys, distinct within a row, in the order of the ranking every cut uses: by
    score (compared in float32), ties to the later position. The float32 bits mapped to integers in
    IEEE order (``-0.0`` counted as ``0.0``), shifted above the position: ``torch.topk`` of the keys
    gives what a stable descending sort of the reversed row gives, without a full sort (about 8x faster
    on the CPU for 1,900 entries per head). A NaN ranks above ``+inf``, whatever its sign bit, as the
    sort ranks it."""
    s = scores.float() + 0.0  # -0.0 + 0.0 = +0.0: equal scores, equal high bits
    bits = s.contiguous().view(torch.int32).to(torch.int64)
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: larger magnitude, smaller key
    bits = bits.masked_fill(torch.isnan(s), 0x7FFFFFFF)  # every NaN the largest (+inf is 0x7F800000)
    return (bits << 32) | torch.arange(s.shape[-1], device=s.device)


def top_order(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``[..., k]`` int64 positions of the ``k`` best of each row of ``scores [..., n]``, best first, ties
    to the later position (:func:`ranking_keys`); ``0 <= k <= n``."""
    return torch.topk(ranking_keys(scores), k, dim=-1, sorted=True).indices


def in_top(keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[b, h, n]`` bool: each row's ``counts [b, h]`` (int64, any value: clipped to ``[0, n]``) largest of
    ``keys`` (:func:`ranking_keys`, ``[b, h, n]``, or ``[b, n]`` shared by the heads)."""
    n = keys.shape[-1]
    counts = counts.to(keys.device).clamp(0, n)
    most = int(counts.max()) if counts.numel() else 0
    if most == 0:
        return torch.zeros(*counts.shape, n, dtype=torch.bool, device=keys.device)
    best = torch.topk(keys, most, dim=-1, sorted=True).values  # [b, (h,) most], descending
    if keys.dim() == counts.dim():  # shared by the heads
        best = best[:, None, :].expand(*counts.shape, most)
        keys = keys[:, None, :]
    kth = best.gather(-1, (counts.clamp_min(1) - 1)[..., None])  # [b, h, 1]: the last one kept
    return (keys >= kth) & (counts > 0)[..., None]
