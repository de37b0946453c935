"""The cut over every KV head of a tensor-parallel model (docs/architecture.md#tensor-parallelism).

Each rank of a tensor-parallel model holds ``h`` of a layer's ``H`` KV heads and scores them. The cut's
decisions compare heads and layers (the ``global`` ranking, a method's per-head budgets, its
cross-layer step, special tokens, word spans), so :func:`jacap_attn.selection.cut` runs them on plans
of every head (:func:`full_plans`: each rank's ``[b, h, ...]`` tensors gathered to ``[b, H, ...]`` by
the cache's :class:`~jacap_attn.storage.distributed.HeadGroup`), the same on every rank and as one
process holding all ``H`` heads runs them; then each rank takes its own heads' scores and budgets back
(:func:`keep_local`) and keeps its own entries (top-k per head and the gather, which never compare
heads). Without a process group, or with heads every rank holds whole, both are the identity.
"""

from __future__ import annotations

import dataclasses

import torch

from ..storage.distributed import SINGLE, HeadGroup
from ..types import LayerPlan


def group_of(cache, local_heads: int) -> HeadGroup:
    """The :class:`HeadGroup` of ``cache``'s layers of which this rank holds ``local_heads`` KV heads
    (:meth:`HeadGroup.for_heads` against the model's ``num_key_value_heads``); :data:`SINGLE` in one
    process. Raises ``ValueError`` when the heads are split unevenly over the ranks."""
    group = cache.heads
    if not group.distributed:
        return SINGLE
    return group.for_heads(int(local_heads), int(cache.model_shape["num_key_value_heads"]))


def _per_head(name: str, value, b: int, h: int) -> bool:
    """Whether a plan's part is laid out per KV head: ``[b, h, ...]`` of 3 dims or more (scores,
    leverage, weights, the observation peak), or the ``capacity`` policy's ``"need"`` ``[b, h]``."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or tuple(value.shape[:2]) != (b, h):
        return False
    return value.dim() >= 3 or name == "need"


def full_plans(group: HeadGroup, plans: list[LayerPlan]) -> list[LayerPlan]:
    """Plans of every KV head: copies of ``plans`` whose per-head tensors (``scores``, ``held``,
    ``head_budgets`` when set, the per-head parts) are gathered over ``group`` in one all-gather per
    dtype; the other fields shared (``slots`` left out: only the local gather reads them). ``plans``
    itself when the heads are not split. Every rank must call it with plans of the same layers."""
    if not group.split or not plans:
        return plans
    tensors, where = [], []  # what is gathered, and (plan, field, part name) for each
    for i, plan in enumerate(plans):
        b, h = plan.scores.shape[:2]
        tensors.append(plan.scores)
        where.append((i, "scores", None))
        for name in ("held", "head_budgets"):
            if getattr(plan, name) is not None:
                tensors.append(getattr(plan, name))
                where.append((i, name, None))
        for name, value in plan.parts.items():
            if _per_head(name, value, b, h):
                tensors.append(value)
                where.append((i, "parts", name))
    gathered = group.gather_many(tensors)
    fields = [{"parts": dict(plan.parts), "slots": None} for plan in plans]
    for (i, name, part), value in zip(where, gathered):
        if part is None:
            fields[i][name] = value
        else:
            fields[i]["parts"][part] = value
    return [dataclasses.replace(plan, **changes) for plan, changes in zip(plans, fields)]


def keep_local(group: HeadGroup, plans: list[LayerPlan], full: list[LayerPlan]) -> None:
    """Give each of ``plans`` (this rank's) its heads' slice of what the cut's steps set on ``full``
    (:func:`full_plans`): ``scores``, ``head_budgets``, and the per-layer ``budget`` and ``global_heads``.
    A no-op when ``full`` is ``plans``."""
    if full is plans:
        return
    for plan, whole in zip(plans, full):
        plan.scores = group.local(whole.scores)
        plan.head_budgets = None if whole.head_budgets is None else group.local(whole.head_budgets)
        plan.budget, plan.global_heads = whole.budget, whole.global_heads
