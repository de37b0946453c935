"""Ada-KV: SnapKV scores with per-head budgets."""

from __future__ import annotations

from dataclasses import dataclass

from ..math import budget
from .base import option, register
from .snapkv import SnapKV


@register("adakv")
@dataclass(frozen=True)
class AdaKV(SnapKV):
    """Ada-KV (Feng et al., 2024, arXiv:2407.11550, Alg. 1) over SnapKV scores: each head's budget
    is its count in the layer-wide top ``h * B``, mixed with the uniform share ``adakv_alpha``."""

    adakv_alpha: float = option(0.2, low=0.0, high=1.0)

    def head_budgets(self, scores, budgets, key_valid, window):
        return budget.adakv_head_budgets(scores, budgets.to(scores.device), key_valid, window, self.adakv_alpha)
