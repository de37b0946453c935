"""The ``global`` budget policy (docs/method.md#global-budget): the scores it compares across layers
and KV heads, and its per-head budgets over the plans of the selection steps
(:mod:`jacap_attn.selection`; the ranking itself is :func:`jacap_attn.math.budget.global_head_budgets`)."""

from __future__ import annotations

import torch

from ..math import baseline_scores, scoring
from ..math import budget as budgets
from ..config import JacapConfig
from ..methods import Method
from ..types import LayerPlan, PrefillInputs

GLOBAL_ATTENTION = "global_attention"  # the per-layer part the `global` policy ranks under "attention"


def ranks_attention(cfg: JacapConfig, policy: str | None = None) -> bool:
    """Whether the budget policy (``policy``, default ``cfg.budget``) is ``global`` ranking the
    observation attention (``global_score="attention"``)."""
    return (cfg.budget if policy is None else policy) == "global" and cfg.global_score == "attention"


def observation_peak(inputs: PrefillInputs, probs: torch.Tensor | None, method: Method) -> torch.Tensor:
    """``[b, h, n]`` float32: what ``global_score="attention"`` ranks in one layer, each token's largest
    attention over the queries the method scores with (all prompt queries for a method that reads
    them, H2O; else the observation window's ``probs [b, h, g, w, n]``)."""
    if method.needs_all_queries:
        return baseline_scores.max_attention_all_queries(inputs.all_queries, inputs.keys, inputs.scaling,
                                                         inputs.key_valid)
    return baseline_scores.max_attention(probs)


def head_shares(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """A method's scores made comparable across layers and KV heads: each head's distribution over its
    candidate tokens (docs/method.md#global-budget).

    ``pi_i = (s_i - m) / sum_j (s_j - m)`` over the head's candidates ``j``, with ``m = min(0, min_j
    s_j)``: the plain share ``s_i / sum_j s_j`` for non-negative scores (Jacap's ranking, SnapKV,
    H2O, leverage, which sums to each head's effective rank and so is not comparable across heads
    unnormalised), shifted to start at 0 for scores that may be negative (KNorm's ``-||k||``,
    KeyDiff's ``-cos``). Scores at or above :data:`jacap_attn.math.scoring.CONSENSUS_RANK` (a method's forced tokens, e.g.
    sinks ranked by :func:`jacap_attn.math.scoring.keep_sinks`), infinite or NaN take no part in the sum and get share 0:
    the global policy keeps forced tokens on its own. A head whose candidates all tie gets ``1/c``
    each. Shares are summed in float64, so a row's shares do not depend on its left padding beyond
    rounding.

    scores: ``[b, h, n]`` float; candidates: ``[b, n]`` or ``[b, h, n]`` bool (valid tokens within the
    layer's reach). Returns float64 ``[b, h, n]``, 0 outside the candidates, summing to 1 (or 0 if a
    head has none) over each head.
    """
    s = scores.double()
    cand = candidates if candidates.dim() == 3 else candidates[:, None, :].expand_as(s)
    usable = cand & torch.isfinite(s) & (s < scoring.CONSENSUS_RANK)
    low = torch.where(usable, s, torch.full_like(s, float("inf"))).amin(-1, keepdim=True).clamp(max=0.0)
    shifted = torch.where(usable, s - torch.where(torch.isfinite(low), low, torch.zeros_like(low)), torch.zeros_like(s))
    total = shifted.sum(-1, keepdim=True)
    count = usable.sum(-1, keepdim=True).clamp_min(1)
    flat = torch.where(usable, 1.0 / count.double(), torch.zeros_like(s))  # all-equal heads: uniform share
    return torch.where(total > 0, shifted / total.clamp_min(1e-300), flat)


def global_budgets(policy: list[LayerPlan], cfg: JacapConfig, uniform: torch.Tensor) -> list[torch.Tensor]:
    """The ``global`` policy over the layers of ``policy`` (docs/method.md#global-budget): per layer
    ``[b, h]`` int64 per-head budgets summing, per row, to the uniform total ``sum_l h * uniform[:, l]``
    (``uniform [b, L]``), from one ranking of :func:`global_scores` over every layer, KV head and token.
    Each head keeps by force its observation window, the method's attention sinks
    (``Method.forced_sinks``) and the tokens the method ranks above every score, within its reach;
    then Ada-KV's mix with the uniform budget (``cfg.head_floor``) sets its floor."""
    scores, candidates, forced = [], [], []
    for plan in policy:
        n = plan.key_valid.shape[-1]
        in_window = torch.arange(n, device=plan.key_valid.device) >= n - min(plan.window, n)
        sinks = scoring.first_valid(plan.key_valid, cfg.method.forced_sinks)
        marked = plan.scores >= scoring.CONSENSUS_RANK  # [b, h, n]: tokens the method ranks above all scores
        held = plan.candidates()  # [b, h, n]: what each head can keep
        forced.append(((in_window[None, :] | sinks)[:, None, :] | marked.to(sinks.device)) & held)
        candidates.append(held)
        scores.append(global_scores(plan, cfg))
    return budgets.global_head_budgets(scores, candidates, forced, uniform, cfg.head_floor)


def global_scores(plan: LayerPlan, cfg: JacapConfig) -> torch.Tensor:
    """``[b, h, n]`` scores of one layer that the ``global`` policy compares across layers and KV heads:
    the observation attention's maximum (``global_score="attention"``, :func:`jacap_attn.math.baseline_scores.max_attention`;
    dropped from the plan once read) or the method's scores as a distribution per head
    (``"normalized"``, :func:`head_shares`)."""
    if cfg.global_score == "attention":
        return plan.parts.pop(GLOBAL_ATTENTION)
    return head_shares(plan.scores, plan.candidates())
