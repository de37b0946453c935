"""CapKV: ridge leverage of values weighted by key-query similarity (Jacap's predecessor)."""

from __future__ import annotations

from dataclasses import dataclass

from ..math import baseline_scores
from .base import Method, PrefillInputs, option, register


@register("capkv")
@dataclass(frozen=True)
class CapKV(Method):
    """CapKV (arXiv:2604.25975; kvpress ``CapPress``): ``w_i = exp(temperature cos(k_i, qbar))``,
    score the ridge leverage ``w_i v_i^T (ridge I + sum_j w_j v_j v_j^T)^-1 v_i`` per query head,
    averaged over the GQA group; the first ``sinks`` tokens always kept. ``ridge`` is absolute here.
    Deviation (docs/method.md#baselines): ``qbar`` is the mean post-RoPE window query."""

    ridge: float = option(1.0, above=0.0)
    temperature: float = option(5.0, above=0.0)
    sinks: int = option(4, low=0)

    @property
    def forced_sinks(self) -> int:
        return self.sinks

    def score(self, inputs: PrefillInputs):
        return baseline_scores.capkv_scores(inputs.queries, inputs.keys, inputs.values, inputs.key_valid,
                                    temperature=self.temperature, ridge=self.ridge, sinks=self.sinks)
