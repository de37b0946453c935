"""Scores carried along units larger than a word (issue 34; docs/method.md#d10-scores-carried-along-a-unit):
the unit kinds a method may read, the plan part holding their labels, the carry itself and the runs
it keeps by force, pure tensor functions (the labels come from :mod:`jacap_attn.selection.units`)."""

from __future__ import annotations

import torch

from .scoring import CONSENSUS_RANK, NEG_INF, top_tokens

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


def force_runs(scores: torch.Tensor, strength: torch.Tensor, threshold: float,
               counts: torch.Tensor | None = None, key_valid: torch.Tensor | None = None,
               window: int = 0) -> torch.Tensor:
    """Keep by force the positions whose ``strength`` (``[b, h, n]`` float in [0, 1], e.g. the last window
    query's attention on the lender of a carried run) is at least ``threshold`` (> 0): they rank above the
    cross-layer consensus tokens and below the sinks, the strongest first. With ``counts`` (``[b, h]``
    int64, and ``key_valid`` ``[b, n]`` bool, ``window``) only each head's ``counts`` strongest of them
    (ties to the later position, outside the window) are forced. scores ``[b, h, n]`` -> float32
    ``[b, h, n]``. Used by Jacap's ``carry_force`` (docs/method.md#d10-scores-carried-along-a-unit)."""
    if threshold <= 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    strength = strength.float().clamp(0.0, 1.0).to(scores.device)
    forced = strength >= threshold
    if counts is not None:
        if key_valid is None:
            raise ValueError("force_runs: counts need key_valid")
        forced &= top_tokens(strength.masked_fill(~forced, NEG_INF), counts, key_valid.to(scores.device), window)
    return torch.where(forced, CONSENSUS_RANK * (1.0 + strength), scores.float())
