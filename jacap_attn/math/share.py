"""The window's own choice first, the lookahead's after it (``lookahead_share``;
docs/method.md#the-rule-for-lookahead_share-written-2026-12-04-sixth-session-before-its-implementation-and-runs).

A lookahead (docs/method.md#d11-lookahead-queries) sums the written tokens' attention statistics with
the observation window's, and the sum ranks every entry: where the full model writes a wrong value,
its queries move the whole ranking toward it. Under ``lookahead_share`` a layer is scored twice, from
the window's own statistics (every part the cut reads: budgets, consensus, sinks) and from the summed
ones (:data:`SUMMED`, the scores alone); at the cut, after what is kept by force, :func:`share_ranking`
gives the window's own ranking the first ``1 - share`` of each head's remaining budget and the summed
ranking the rest.
"""

from __future__ import annotations

import torch

from .ranking import top_order
from .scoring import CONSENSUS_RANK

SUMMED = "summed_scores"  # the part holding the summed statistics' scores [b, h, n] (-inf: not held)


def share_ranking(scores: torch.Tensor, summed: torch.Tensor, budgets: torch.Tensor, key_valid: torch.Tensor,
                  window: int, share: float) -> torch.Tensor:
    """Scores ``[b, h, n]`` float32 for the top-k of a cut: in each (row, KV head), what is kept by force
    stays as it is (the last ``window`` positions, and every entry scored at least
    :data:`~jacap_attn.math.scoring.CONSENSUS_RANK`: sinks, consensus); of the other entries the
    ``floor((1 - share) * free)`` best by ``scores`` rank next, in that order, then every other entry
    by ``summed``, where ``free`` is the head's budget less what is kept by force.

    scores: ``[b, h, n]`` the window's own scores after the cross-layer step (forced entries lifted);
    summed: ``[b, h, n]`` the summed statistics' scores of the same entries; budgets: ``[b, h]`` int64,
    each head's budget at the cut; key_valid: ``[b, n]`` or ``[b, h, n]`` bool; window: the positions
    kept by force at the end; share: in (0, 1], the part of the free budget the summed ranking fills.
    The lifted entries score ``scores + max(summed) - min(scores) + 1`` (per head, over the free
    entries): above every free entry's summed score and below the forced ones. Raises ``ValueError``
    for shapes that differ or a share outside (0, 1].
    """
    if scores.shape != summed.shape or scores.dim() != 3:
        raise ValueError(f"share_ranking needs scores and summed of one shape [b, h, n], got {tuple(scores.shape)} "
                         f"and {tuple(summed.shape)}")
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be in (0, 1], got {share!r}")
    b, h, n = scores.shape
    scores, summed = scores.float(), summed.float().to(scores.device)
    valid = (key_valid[:, None, :] if key_valid.dim() == 2 else key_valid).to(scores.device).expand(b, h, n)
    in_window = torch.arange(n, device=scores.device) >= n - min(window, n)
    forced = valid & (in_window | (scores >= CONSENSUS_RANK))
    free_entries = valid & ~forced & torch.isfinite(scores)
    free = (budgets.to(scores.device) - forced.sum(-1)).clamp_min(0)  # [b, h]
    first = torch.floor((1.0 - share) * free.double()).to(torch.int64)
    top = int(first.max()) if first.numel() else 0
    top = min(top, n)
    lifted = torch.zeros(b, h, n, dtype=torch.bool, device=scores.device)
    if top > 0:
        order = top_order(scores.masked_fill(~free_entries, float("-inf")), top)  # [b, h, top], ties to the later
        take = torch.arange(top, device=scores.device)[None, None, :] < first[..., None]
        lifted = lifted.scatter(-1, order, take) & free_entries
    finite = torch.isfinite(summed) & free_entries
    high = summed.masked_fill(~finite, float("-inf")).amax(-1, keepdim=True)
    low = scores.masked_fill(~lifted, float("inf")).amin(-1, keepdim=True)
    high = torch.where(torch.isfinite(high), high, torch.zeros_like(high))
    low = torch.where(torch.isfinite(low), low, torch.zeros_like(low))
    rest = torch.where(valid & ~forced, summed, scores)
    return torch.where(lifted, scores + (high - low + 1.0), rest)
