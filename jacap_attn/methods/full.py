"""``full``: no compression, the reference row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Method, PrefillInputs, register


@register("full")
@dataclass(frozen=True)
class Full(Method):
    """No compression: every prompt entry is kept (the reference row)."""

    compresses = False

    def score(self, inputs: PrefillInputs):
        return torch.zeros(inputs.keys.shape[:3], device=inputs.keys.device)
