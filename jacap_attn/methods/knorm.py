"""KNorm: keep the keys of lowest norm."""

from __future__ import annotations

from dataclasses import dataclass

from ..math import baseline_scores
from .base import Method, PrefillInputs, register


@register("knorm")
@dataclass(frozen=True)
class KNorm(Method):
    """KNorm (Devoto et al., 2024, arXiv:2406.11430, §3): keep the keys of lowest L2 norm."""

    def score(self, inputs: PrefillInputs):
        return baseline_scores.knorm_scores(inputs.keys)
