"""The ``window`` route (``queries="window"``, the default): the prompt is scored by the queries of
its own last ``window`` positions, right after each layer's exact prefill attention, and cut after
the last layer (docs/architecture.md#prefill). :class:`PrefillRoute` is what every prefill route
shares: the ``on_prefill`` callback, which layers are scored, the cut."""

from __future__ import annotations

import torch

from .. import selection
from ..selection import heads, scorer
from ..selection.scorer import window_queries  # noqa: F401 - where the routes and eval import it from
from . import Route, register_route


class PrefillRoute(Route):
    """A prefill route: :meth:`layer` calls the cache's ``on_prefill(index, query, keys, values,
    scaling)`` callback (the evaluation harness records the prefill with it), then, for a layer the
    method scores (:meth:`scored`), :meth:`score`; :meth:`finish` completes the scoring
    (:meth:`complete`) and cuts every layer (:func:`jacap_attn.selection.finalize_prefill`)."""

    def layer(self, cache, index, query, keys, values, scaling) -> None:
        if cache.on_prefill is not None:
            cache.on_prefill(index, query, keys, values, scaling)
        if self.scored(cache, index):
            self.score(cache, index, query, keys, values, scaling)

    @staticmethod
    def scored(cache, index: int) -> bool:
        """Whether layer ``index`` of ``cache`` is scored by the method in the prefill under way."""
        return (scorer.compresses_prompt(cache.config, cache.prefill.key_valid.shape[-1])
                and scorer.scores_layer(cache.config, cache.layers, index))

    def score(self, cache, index, query, keys, values, scaling) -> None:
        """Score layer ``index`` into ``cache.prefill.parts[index]`` from the observation window's queries."""
        cfg = cache.config
        b, hq, n, d = query.shape
        h = keys.shape[1]
        key_valid, budget = scorer.layer_inputs(cfg, cache.layers, index, cache.prefill.key_valid, keys.device,
                                                self.cut_ratio(cache))
        all_queries = query.reshape(b, h, hq // h, n, d) if cfg.method.needs_all_queries else None
        cache.prefill.parts[index] = scorer.score_layer(cfg, index, window_queries(query, h, cfg.window), keys, values,
                                                        scaling, key_valid, budget, all_queries=all_queries,
                                                        heads=heads.group_of(cache, h),
                                                        gains=scorer.prefill_gains(cache, index, values, key_valid))

    def cut_ratio(self, cache) -> float:
        """The kept fraction this prefill's cut keeps: ``ratio`` (a chunked prefill's first chunk, when
        more follow, keeps its running budget, :func:`jacap_attn.routes.chunk.running_ratio`)."""
        return cache.config.ratio

    def complete(self, cache, forward) -> None:
        """Score what the forward left unscored (the repeat route's deferred layers); default: nothing."""

    def finish(self, cache, forward) -> None:
        self.complete(cache, forward)
        selection.finalize_prefill(cache)
        cache.route = None


@register_route("window")
class WindowRoute(PrefillRoute):
    """Scored by the observation window: question-aware when the prompt ends with the question."""
