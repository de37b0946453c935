"""The data the methods and the budget policies work on, shared by every layer of the library.

A leaf module: it imports nothing from ``jacap_attn`` but the leaf :mod:`jacap_attn.storage.distributed`. Orchestration (:mod:`jacap_attn.selection.scorer`,
:mod:`jacap_attn.selection`, the routes of :mod:`jacap_attn.routes`) builds these objects; methods
(:mod:`jacap_attn.methods`) and budget policies (:mod:`jacap_attn.selection.global_budget`) read them
(docs/architecture.md#prefill-inputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .storage.distributed import SINGLE, HeadGroup  # torch.distributed glue, itself importing nothing of the package


@dataclass(frozen=True)
class PrefillInputs:
    """What a method may read about one layer it scores (post-RoPE, exactly as cached).

    queries: ``[b, h, g, w, d]`` the observation window's queries, grouped by the KV head they read
        (GQA group ``g``); ``w = min(window, n)``. At question-time reselection, the question's last
        ``w`` queries.
    keys, values: ``[b, h, n, d]`` the scored entries' keys and values (model dtype): the prompt's at
        prefill, the held entries then the new tokens at question time.
    key_valid: ``[b, n]`` bool, False at left padding (and at entries a head does not hold).
    scaling: the attention scale of the module (``1/sqrt(d)`` for most models).
    layer_index: index of the decoder layer.
    budget: ``[b]`` int64, the mean number of tokens a compressed layer keeps (``ceil(ratio * n)``,
        at least the window); ``adaptive`` is True when layers get different budgets.
    probs: ``[b, h, g, w, n]`` float32 window attention (:func:`jacap_attn.math.scoring.window_attention`),
        when the method sets ``needs_window_attention``; else ``None``.
    all_queries: ``[b, h, g, n, d]`` every prompt query, when the method sets ``needs_all_queries``.
    observed: under ``queries="repeat"`` (docs/method.md#question-agnostic-scoring), the statistics
        of the repeat pass's queries named by the method's ``repeat_stats``, each ``[b, h, n]``
        float32 (:func:`jacap_attn.math.attention_stats.attention_statistics`), and ``probs`` is ``None``;
        else ``None``.
    heads: the :class:`~jacap_attn.storage.distributed.HeadGroup` of the layer's KV heads. In one process
        (:data:`~jacap_attn.storage.distributed.SINGLE`) the ``h`` heads are the model's; on a rank of a
        tensor-parallel model they are its slice of the model's, heads ``heads.offset(h) ..`` (a score that
        reads other heads, e.g. TOVA's mean over all query heads, gathers them with ``heads.gather`` and
        slices its own back with ``heads.local``; docs/architecture.md#tensor-parallelism).
    """

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    key_valid: torch.Tensor
    scaling: float
    layer_index: int
    budget: torch.Tensor
    adaptive: bool = False
    probs: torch.Tensor | None = None
    all_queries: torch.Tensor | None = None
    observed: dict | None = None
    heads: HeadGroup = SINGLE

    @property
    def window(self) -> int:
        return self.queries.shape[3]


@dataclass
class LayerPlan:
    """What the selection knows about one layer it cuts (docs/architecture.md#the-cut).

    index: the decoder layer. layer: its cache layer (a :class:`~jacap_attn.storage.layer.JacapLayer`).
    scores: ``[b, h, n]`` float32, higher = keep. key_valid: ``[b, n]`` bool on the layer's device:
    the tokens the layer can still attend (a sliding-window layer's last ``sliding_window - 1`` real
    tokens). window: last positions always kept (0 for a sliding-window layer that keeps its window
    unscored). parts: the method's extra tensors for this layer (``Method.score_parts``).
    head_budgets: ``[b, h]`` int64 tokens to keep per KV head (set by the budget steps); budget:
    ``[b]`` int64 the layer's mean per-head budget before the per-head steps (set with them).
    compressed: whether the method scores and selects this layer (``False`` for every layer without
    compression: ``ratio=1``, ``full``, a prompt shorter than ``min_tokens``; a mixed model's sliding
    layer under ``sliding="window"``). global_heads: its per-head budgets come from the ``global``
    policy (the method's ``head_budgets`` hook is then not called).

    Every plan works in the *index space* of the tokens seen so far: index ``t`` is logical position
    ``t - pads`` of its row, the same token in every layer and head (``n`` above is that space's
    length). A cut over a compressed layer (a chunk, question time) has per-head candidates:
    held: ``[b, h, n]`` bool, the indices each KV head can keep (``None``: every head holds every
    index, a prefill's pending layer); slots: ``[b, h, n]`` int64, the storage slot of each held
    index (``None``: slot ``t`` holds index ``t``). ``scores`` and the method's parts are laid out in
    that space, ``-inf`` (scores) or 0 (parts) at indices a head does not hold.
    """

    index: int
    layer: Any
    scores: torch.Tensor
    key_valid: torch.Tensor
    window: int
    parts: dict = field(default_factory=dict)
    head_budgets: torch.Tensor | None = None
    compressed: bool = True
    global_heads: bool = False
    held: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    budget: torch.Tensor | None = None

    def candidates(self) -> torch.Tensor:
        """``[b, h, n]`` bool: the indices each KV head may keep (``key_valid``, and ``held`` per head);
        computed once per plan (neither changes once the plan is built)."""
        cached = self.__dict__.get("_candidates")
        if cached is None:
            b, h, n = self.scores.shape
            valid = self.key_valid[:, None, :].expand(b, h, n)
            cached = self.__dict__["_candidates"] = valid if self.held is None else valid & self.held.to(valid.device)
        return cached


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: how files and reports name a dtype."""
    return str(dtype).removeprefix("torch.")


def fold_plans(plans: list[LayerPlan], parts: tuple[str, ...] = ()) -> tuple[list[LayerPlan], int]:
    """``(groups, count)``: ``plans`` as one plan whose batch holds every plan's rows, plan-major (row
    ``i b + r`` is row ``r`` of ``plans[i]``; ``count = len(plans)``), so that a step run plan by plan runs once
    over all of them (the same per-row arithmetic, one call instead of one per layer); or ``(plans, 1)``
    where they cannot be folded (scores of different shapes or devices, a part of ``parts`` held by some
    plans only). The folded plan's ``scores [P b, h, n]``, ``key_valid [P b, n]``, ``head_budgets [P b, h]``
    and each part of ``parts`` that every plan holds are the plans' concatenated (copies: write its scores
    back with :func:`unfold_scores`); its ``index`` is -1, its ``layer`` ``None``, its ``window`` the first
    plan's."""
    first = plans[0] if plans else None
    if len(plans) < 2 or any(p.scores.shape != first.scores.shape or p.scores.device != first.scores.device
                             or p.head_budgets is None or p.key_valid.shape != first.key_valid.shape
                             or any((name in p.parts) != (name in first.parts) for name in parts) for p in plans):
        return plans, 1
    device = first.scores.device
    joined = {name: torch.cat([p.parts[name].to(device) for p in plans]) for name in parts if name in first.parts}
    folded = LayerPlan(-1, None, torch.cat([p.scores for p in plans]),
                       torch.cat([p.key_valid.to(device) for p in plans]), first.window, joined,
                       torch.cat([p.head_budgets.to(first.head_budgets.device) for p in plans]))
    return [folded], len(plans)


def unfold_scores(groups: list[LayerPlan], plans: list[LayerPlan], count: int) -> None:
    """Give each of ``plans`` its rows of the folded plan's scores (:func:`fold_plans`; nothing to do
    where ``count`` is 1: ``groups`` are the plans themselves)."""
    if count > 1:
        for plan, scores in zip(plans, groups[0].scores.chunk(count)):
            plan.scores = scores


def repeat_rows(x: torch.Tensor | None, count: int) -> torch.Tensor | None:
    """``x [b, ...]`` repeated ``count`` times along its first axis (the rows of a folded plan,
    :func:`fold_plans`); ``x`` itself where ``count`` is 1 or it is ``None``."""
    return x if x is None or count == 1 else x.repeat(count, *(1,) * (x.dim() - 1))
