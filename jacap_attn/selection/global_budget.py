"""The ``global`` budget policy (docs/method.md#global-budget): the scores it compares across layers
and KV heads, and its per-head budgets over the plans of the selection steps
(:mod:`jacap_attn.selection`; the ranking itself is :func:`jacap_attn.math.budget.global_head_budgets`)."""

from __future__ import annotations

import torch

from ..math import baseline_scores, scoring
from ..math import budget as budgets
from ..config import JacapConfig
from ..methods import Method
from ..storage.distributed import SINGLE, HeadGroup
from ..types import LayerPlan, PrefillInputs

GLOBAL_ATTENTION = "global_attention"  # the per-layer part the `global` policy ranks under "attention"


def ranks_attention(cfg: JacapConfig, policy: str | None = None) -> bool:
    """Whether the budget policy (``policy``, default ``cfg.budget``) is ``global`` ranking the
    observation attention (``global_score="attention"``, or ``"output"``: weighted by output gains)."""
    return (cfg.budget if policy is None else policy) == "global" and cfg.global_score in ("attention", "output")


def output_grams(projections: list[torch.Tensor], head_dim: int, group: int) -> list[torch.Tensor]:
    """Per layer, ``W_O^(j)T W_O^(j)`` of each query head ``j``: ``[h, g, d, d]`` float32 (``h`` KV heads,
    GQA group ``g = group``, head size ``d = head_dim``), from the output projection weights
    ``[hidden, Hq * d]`` (``Adapter.output_projections``: a tensor-parallel rank's own columns; query
    head ``j`` reads columns ``j d .. (j + 1) d`` and KV head ``j // g``, as transformers' ``repeat_kv``).
    Raises ``ValueError`` if a weight's width is not a multiple of ``g * d``."""
    grams = []
    for weight in projections:
        w = weight.detach().float()
        hidden, width = w.shape
        if width % (group * head_dim):
            raise ValueError(f"an output projection of width {width} does not split into groups of {group} "
                             f"query heads of size {head_dim}")
        per_head = w.reshape(hidden, width // head_dim, head_dim).transpose(0, 1)  # [Hq, hidden, d]
        grams.append((per_head.transpose(-1, -2) @ per_head).reshape(-1, group, head_dim, head_dim))
    return grams


def output_gains(values: torch.Tensor, key_valid: torch.Tensor, gram: torch.Tensor,
                 heads: HeadGroup = SINGLE) -> torch.Tensor:
    """``global_score="output"`` (docs/method.md#global-budget): how much each entry writes to the residual
    stream through each query head of its group, ``||W_O^(j) v_i||``, divided by its row's mean over
    every (KV head, query head, valid entry) of the layer, so that the factor moves budget between
    the heads of a layer and leaves the layers' overall scale to the attention (CriticalKV's
    output-perturbation weight, Feng et al., arXiv:2502.03805, §3, with the L2 norm).

    values: ``[b, h, n, d]``; key_valid: ``[b, n]`` or ``[b, h, n]`` bool; gram: ``[h, g, d, d]``
    (:func:`output_grams`); heads: the layer's :class:`~jacap_attn.storage.distributed.HeadGroup` (a
    tensor-parallel rank's mean runs over every rank's heads, a collective). Returns float32
    ``[b, h, g, n]``, 0 at invalid entries. Raises ``ValueError`` if ``gram`` does not fit ``values``."""
    v = values.float()
    b, h, n, d = v.shape
    if gram.shape[0] != h or gram.shape[-1] != d:
        raise ValueError(f"output gram {tuple(gram.shape)} does not fit values {tuple(v.shape)}")
    norms = (torch.einsum("bhnd,hgde->bhgne", v, gram.to(v.device)) * v[:, :, None]).sum(-1).clamp_min(0.0).sqrt()
    valid = (key_valid[:, None, None, :] if key_valid.dim() == 2 else key_valid[:, :, None, :]).expand_as(norms)
    norms = norms * valid
    total, count = heads.gather_many([norms.sum(dim=(2, 3)), valid.sum(dim=(2, 3)).double()])  # [b, H] each
    mean = (total.sum(-1) / count.sum(-1).clamp_min(1)).float()
    return norms / mean.clamp_min(1e-30)[:, None, None, None]


def weighted_peak(probs: torch.Tensor, gains: torch.Tensor) -> torch.Tensor:
    """``[b, h, n]``: each token's largest ``p_ti * gain_ji`` over the observation queries ``t`` and the
    query heads ``j`` of its group, from ``probs [b, h, g, w, n]`` and :func:`output_gains` ``[b, h, g, n]``."""
    return (probs.amax(dim=3) * gains).amax(dim=2)


def observation_peak(inputs: PrefillInputs, probs: torch.Tensor | None, method: Method) -> torch.Tensor:
    """``[b, h, n]`` float32: what ``global_score="attention"`` ranks in one layer, each token's largest
    attention over the queries the method scores with (all prompt queries for a method that reads
    them, H2O; else the observation window's ``probs [b, h, g, w, n]``)."""
    if method.needs_all_queries:
        return baseline_scores.max_attention_all_queries(inputs.all_queries, inputs.keys, inputs.scaling,
                                                         inputs.key_valid)
    return baseline_scores.max_attention(probs)


def ranked_attention(inputs: PrefillInputs, probs: torch.Tensor | None, method: Method, observed: dict | None,
                     gains: torch.Tensor | None) -> torch.Tensor:
    """``[b, h, n]``: what the ``global`` policy ranks in one layer under ``global_score="attention"``
    (:func:`observation_peak`, or a repeat pass's ``observed["peak"]``) or ``"output"`` (``gains``
    from :func:`output_gains`: :func:`weighted_peak` of the window attention; a repeat pass's or an
    all-query peak, whose query head is not kept, times the group's mean gain)."""
    if gains is not None and observed is None and not method.needs_all_queries:
        return weighted_peak(probs, gains)
    peak = observed["peak"] if observed is not None else observation_peak(inputs, probs, method)
    return peak if gains is None else peak * gains.mean(dim=2)


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
    if cfg.global_score in ("attention", "output"):
        return cfg.method.global_scores(plan, plan.parts.pop(GLOBAL_ATTENTION))
    return cfg.method.global_scores(plan, head_shares(plan.scores, plan.candidates()))
