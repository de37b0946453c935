"""Random eviction: the floor every method must beat."""

from __future__ import annotations

from dataclasses import dataclass

from ..math import baseline_scores
from .base import Method, PrefillInputs, option, register


@register("random")
@dataclass(frozen=True)
class Random(Method):
    """Random eviction, the floor of every method: each row's draws depend only on ``seed``, the
    layer, the KV head and the row's own token positions (batch-invariant)."""

    seed: int = option(0, low=0)

    def score(self, inputs: PrefillInputs):
        h = inputs.keys.shape[1]
        return baseline_scores.random_scores(inputs.key_valid, h, self.seed, inputs.layer_index, inputs.heads.offset(h))
