"""SnapKV: the observation window's pooled attention."""

from __future__ import annotations

from dataclasses import dataclass

from ..math import baseline_scores, scoring
from .base import Method, PrefillInputs, option, register


@register("snapkv")
@dataclass(frozen=True)
class SnapKV(Method):
    """SnapKV (Li et al., 2024, arXiv:2404.14469, §4.2): attention of the observation window summed
    over its queries, averaged over the GQA group, pooled along the sequence (``pooling`` of
    ``kernel`` tokens). docs/method.md#baselines."""

    pooling: str = option("avg", choices=scoring.POOLINGS)
    kernel: int = option(5, low=1, odd=True)

    needs_window_attention = True
    repeat_stats = ("mass",)

    def score(self, inputs: PrefillInputs):
        if inputs.observed is not None:  # queries="repeat": the attention summed over the repeat pass
            return baseline_scores.pool_scores(inputs.observed["mass"], self.pooling, self.kernel, inputs.key_valid)
        return baseline_scores.snapkv_scores(inputs.probs, inputs.key_valid, pooling=self.pooling, kernel=self.kernel)

