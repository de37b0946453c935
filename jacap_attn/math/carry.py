"""Scores carried along units larger than a word (issue 34; docs/method.md#d10-scores-carried-along-a-unit):
the unit kinds a method may read, the plan part holding their labels, and the carry itself, a pure
tensor function (the labels come from :mod:`jacap_attn.selection.units`)."""

from __future__ import annotations

import torch

UNITS = ("none", "clauses", "sentences", "chunks")  # Method.units: the kinds of units (jacap_attn.selection.units)
PART = "units"  # the plan part holding the labels [b, n] (jacap_attn.types.LayerPlan.parts)


def carry_forward(scores: torch.Tensor, units: torch.Tensor, gamma: float, max_len: int,
                  sources: torch.Tensor | None = None) -> torch.Tensor:
    """A score carried forward within its unit: ``c(t) = max(s(t), gamma c(t-1))`` inside a unit, reset
    at each unit start, i.e. ``c(t) = max_{k < max_len, unit(t-k) = unit(t)} gamma^k s(t-k)``
    (QuerySpanPress's span propagation, kvpress, with its 0.95 there; bounded here by the unit and
    ``max_len`` tokens). A key phrase lends its score to the value that follows it in the same
    clause. ``scores [b, h, n]`` float, non-negative where it is to be carried (``-inf`` carries
    nothing); ``units [b, n]`` or ``[b, h, n]`` int64 labels (:func:`jacap_attn.selection.spans.clause_ids`,
    :func:`jacap_attn.selection.spans.chunk_ids`);
    ``gamma`` in [0, 1]; ``sources`` (``[b, h, n]`` bool, optional): only these positions lend their
    score (every position keeps its own). Returns float32 ``[b, h, n]``, never below ``scores``."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    s = scores.float()
    if gamma == 0.0:
        return s.clone()
    b, h, n = s.shape
    lab = (units[:, None, :] if units.dim() == 2 else units).to(s.device).expand(b, h, n)
    out = s.clone()
    lend = s if sources is None else s.masked_fill(~sources.to(s.device).expand(b, h, n), float("-inf"))
    for k in range(1, min(max_len, n)):
        same = lab[..., k:] == lab[..., :-k]
        moved = torch.where(same, lend[..., :-k] * gamma ** k, torch.full_like(s[..., :-k], float("-inf")))
        out[..., k:] = torch.maximum(out[..., k:], moved)
    return out
