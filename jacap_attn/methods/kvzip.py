"""KVzip: the largest attention a token receives while the model repeats the prompt."""

from __future__ import annotations

from dataclasses import dataclass

from ..math import baseline_scores, scoring
from .base import Method, PrefillInputs, option, register


@register("kvzip")
@dataclass(frozen=True)
class KVzip(Method):
    """KVzip (Kim et al., 2025, arXiv:2505.23416, §3.2; kvpress's ``KVzipPress``): each prompt token
    scores, per KV head, the largest attention it receives from the queries of a teacher-forced
    "repeat the previous context" pass over the full cache, over those queries and the heads of the
    GQA group (:func:`jacap_attn.math.attention_stats.attention_statistics`'s ``peak``): that is
    ``method="kvzip", queries="repeat"`` (docs/method.md#question-agnostic-scoring). With the default
    ``queries="window"`` (every method's until the routes are measured, and the only route the
    evaluation harness can replay) the observation window's queries stand in for the repeat pass's. ``sinks``: the first real tokens
    kept in every head (kvpress's ``n_sink``, 4). The paper ranks across layers and heads: that is
    ``budget="global", head_floor=0`` here (our default budget stays ``uniform``, kvpress's
    ``layerwise=True``). docs/method.md#baselines.
    """

    sinks: int = option(4, low=0)

    needs_window_attention = True
    repeat_stats = ("peak",)

    @property
    def forced_sinks(self) -> int:
        return self.sinks

    def score(self, inputs: PrefillInputs):
        if inputs.observed is not None:
            return inputs.observed["peak"]
        return baseline_scores.max_attention(inputs.probs)

    def across_layers(self, plans, key_valid, window) -> None:
        if self.sinks:
            for p in plans:
                p.scores = scoring.keep_sinks(p.scores, key_valid.to(p.scores.device), self.sinks)
