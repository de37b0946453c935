"""TOVA: the last query's attention, averaged over the layer's query heads."""

from __future__ import annotations

from dataclasses import dataclass

from ..math import baseline_scores
from .base import Method, PrefillInputs, register


@register("tova")
@dataclass(frozen=True)
class TOVA(Method):
    """TOVA (Oren et al., 2024, arXiv:2401.06104, §3): the last query's attention averaged over all
    query heads of the layer, one score for every KV head."""

    needs_window_attention = True

    def score(self, inputs: PrefillInputs):
        # The mean runs over every query head of the layer: a tensor-parallel rank's heads are gathered
        # (only the last query's attention), the mean taken over all, its own heads' rows kept.
        last = inputs.heads.gather(inputs.probs[:, :, :, -1:, :])
        return inputs.heads.local(baseline_scores.tova_scores(last))
