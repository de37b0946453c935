"""H2O: heavy hitters of the attention accumulated over every prompt query."""

from __future__ import annotations

from dataclasses import dataclass

from ..math import baseline_scores
from .base import Method, PrefillInputs, register


@register("h2o")
@dataclass(frozen=True)
class H2O(Method):
    """H2O (Zhang et al., 2023, arXiv:2306.14048, §3): attention accumulated over every prompt
    query (causal), summed over the GQA group."""

    needs_all_queries = True

    def score(self, inputs: PrefillInputs):
        return baseline_scores.h2o_scores(inputs.all_queries, inputs.keys, inputs.scaling, inputs.key_valid)
