"""Evicted attention mass carried between a chunked prefill's cuts (``chunk_mass``; docs/method.md#carried-mass).

A later chunk of a chunked prefill attends only what the cuts before it kept: the share of its softmax
mass the evicted entries would have taken goes to the held ones, and the later chunks' hidden states
drift from an exact prefill's (docs/results.md#why-the-chunked-prefill-still-loses-the-later-chunks-hidden-states-2026-12-06-diagnosis).
Under ``chunk_mass`` each entry a cut before the last evicts hands its mass to the held entry of the same
layer, row and KV head whose key (after RoPE) is nearest in cosine: that entry then stands for ``1 + m``
keys (``m`` the entries handed to it, theirs included), and the later chunks' queries add ``log(1 + m)``
to its logit, so its softmax weight is what ``1 + m`` copies of it would take (proportional attention, as
merged tokens are weighted in ToMe: Bolya et al. 2023, "Token Merging: Your ViT But Faster", sec. 3).
With ``mass_cosine`` above ``-1`` only an evicted entry whose nearest held key is at least that similar is
handed on (a near-duplicate merged, as ToMe merges only its most similar pairs); the others are dropped.
The last cut drops the bias: the decode reads the kept entries as a one-shot prefill's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..types import LayerPlan


def carries(config, kind: str, bucketed: bool) -> bool:
    """Whether a cut of ``kind`` (:class:`jacap_attn.selection.steps.Cut`) carries the mass it evicts: one
    before the last of a chunked prefill (not bucketed) under ``config.carries_mass``."""
    return config.carries_mass and kind in ("prefill", "chunk") and not bucketed


def carried(plan: LayerPlan, indices: torch.Tensor, kept: torch.Tensor, slots: torch.Tensor,
            min_cosine: float = -1.0) -> torch.Tensor:
    """The logit-bias table ``[b, h, L]`` float32 (``log(1 + m)`` per prompt index, ``L`` the indices of the
    cut) that :meth:`~jacap_attn.storage.layer.JacapLayer.carry_mass` gives ``plan``'s layer once it keeps
    ``indices [b, h, K]`` int64 (prompt indices, ``kept [b, h, K]`` bool True at the real selections) of its
    candidates (:meth:`LayerPlan.candidates`), held at storage ``slots [b, h, K]``: the layer's own table before the cut (none: nothing carried)
    plus, for each candidate not kept, ``1 +`` its carried count added to the kept entry of its row and
    KV head with the nearest key in cosine (:func:`handovers`), if that cosine is at least ``min_cosine``
    (``mass_cosine``; a candidate below it is dropped with what it carried). Reads the keys before the cut
    (call it before the layer keeps its entries)."""
    layer = plan.layer
    keep, handed_over = handovers(plan, indices, kept, slots)
    mass = torch.zeros(keep.shape, dtype=torch.float32, device=keep.device)
    if layer.mass is not None:
        old = torch.expm1(layer.mass.to(keep.device))[..., :keep.shape[-1]]
        mass[..., :old.shape[-1]] = old
    if handed_over is not None:
        order, real, cosine, nearest = handed_over
        handed = (1.0 + mass.gather(2, order)) * (real & (cosine >= min_cosine))
        mass = mass.masked_fill(~keep, 0.0).scatter_add_(2, nearest, handed)
    return torch.log1p(mass.masked_fill(~keep, 0.0))


def handovers(plan: LayerPlan, indices: torch.Tensor, kept: torch.Tensor, slots: torch.Tensor):
    """What a cut of ``plan``'s layer (arguments as :func:`carried`) evicts and where each evicted entry
    would go: ``(keep, handed_over)``, ``keep [b, h, L]`` bool the candidates it keeps, by prompt index, and
    ``handed_over`` ``None`` where it evicts nothing, else ``(order, real, cosine, nearest)``, each
    ``[b, h, E]`` (``E`` the most evicted in one head): ``order`` int64 the evicted candidates' prompt
    indices (padded), ``real`` bool False at the padding, ``cosine`` float32 the cosine between each one's
    key and the nearest kept key of its row and KV head (after RoPE), ``nearest`` int64 that key's prompt
    index. A head that keeps nothing evicts nothing here. Transient cost: ``[b, h, E, K]`` float32."""
    layer = plan.layer
    candidates = plan.candidates()
    device = indices.device
    keep = torch.zeros(candidates.shape, dtype=torch.bool, device=device).scatter_(2, indices, kept)
    evicted = candidates.to(device) & ~keep & kept.any(-1, keepdim=True)
    count = int(evicted.sum(-1).max()) if evicted.numel() else 0
    if not count:
        return keep, None
    order = torch.sort(evicted.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :count]  # [b, h, E]
    gone_slots = order if plan.slots is None else plan.slots.to(device).gather(2, order)
    gone = F.normalize(layer.take(gone_slots)[0].float(), dim=-1)  # [b, h, E, d]
    held = F.normalize(layer.take(slots)[0].float(), dim=-1)  # [b, h, K, d]
    similarity = torch.matmul(gone, held.transpose(-1, -2)).masked_fill(~kept[:, :, None, :], float("-inf"))
    cosine, at = similarity.max(-1)
    return keep, (order, evicted.gather(2, order), cosine, indices.gather(2, at))
