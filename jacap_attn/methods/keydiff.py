"""KeyDiff: keep the keys least similar to the mean key."""

from __future__ import annotations

from dataclasses import dataclass

from ..math import baseline_scores
from .base import Method, PrefillInputs, register


@register("keydiff")
@dataclass(frozen=True)
class KeyDiff(Method):
    """KeyDiff (Park et al., 2025, arXiv:2504.15364, §3): keep the keys least similar (cosine) to
    the mean normalised key."""

    def score(self, inputs: PrefillInputs):
        return baseline_scores.keydiff_scores(inputs.keys, inputs.key_valid)
