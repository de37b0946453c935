"""StreamingLLM: attention sinks plus the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

from ..math import baseline_scores
from .base import Method, PrefillInputs, option, register


@register("streaming_llm")
@dataclass(frozen=True)
class StreamingLLM(Method):
    """StreamingLLM (Xiao et al., 2024, arXiv:2309.17453, §3.2): the first ``sinks`` real tokens
    (attention sinks) plus the most recent ones."""

    sinks: int = option(4, low=0)

    @property
    def forced_sinks(self) -> int:
        return self.sinks

    def score(self, inputs: PrefillInputs):
        return baseline_scores.streaming_scores(inputs.key_valid, self.sinks, inputs.keys.shape[1])
