"""PyramidKV: SnapKV scores with a pyramid budget schedule."""

from __future__ import annotations

from dataclasses import dataclass

from .base import register
from .snapkv import SnapKV


@register("pyramidkv")
@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al., 2024, arXiv:2406.02069, §3.3): SnapKV's scores with the pyramid
    budget schedule (more tokens in lower layers), which is part of the method."""

    fixed_budget = "pyramid"
