"""The ``reselect`` route: question-time reselection (``reselect``; docs/method.md#question-time-reselection).

A compressed cache can be cut further when new tokens arrive: a forward of several tokens over it
(a question, a new turn; ``generate`` over a given or loaded cache) first attends every entry the
cache holds, exactly as without reselection; then, in each layer the method selects
(:func:`jacap_attn.selection.scorer.scores_layer`), the method scores the held entries with the last
``window`` new tokens as the observation window (their queries are the question's;
:func:`jacap_attn.selection.scorer.score_held`), and the cut (:func:`jacap_attn.selection.cut`, kind
``"question"``) keeps ``ceil(reselect * L)`` of them per KV head on average (``L`` the real tokens the
cache had seen before the new ones; never more than a head holds) plus every new token. Decoding then
reads that question-aware selection. So a document can be stored at a larger kept fraction (or
whole, ``ratio=1``) and each question still skips the document's prefill.

Each layer is scored right after its attention (:meth:`ReselectRoute.layer`; that layer is not read
again in this forward); the cut waits for the end of the forward (:meth:`ReselectRoute.finish`),
which changes nothing in this forward and lets the method's cross-layer step run, as after a prefill.
The budget policy is ``reselect_budget`` (``"uniform"``, the default, or ``"global"``: one ranking
across layers and KV heads, as at prefill). The cut runs in the index space of the tokens seen, so
the cross-layer steps (Jacap's consensus) compare the same token across layers; a position a layer or
head no longer holds scores nothing there; with a document stored whole every layer holds every
position and the cut is the prefill's of prompt + question. Without that step Jacap at 10% kept loses
the digits after a needle's key (eval/results/quality_smollm2_heldout_agnostic.md). The attention
sinks (``Method.forced_sinks``) are kept. Each KV head is scored over exactly its own held entries
and keeps only those: a row keeps what it keeps alone, whatever its batch mates hold. The new tokens
are assumed unpadded (as for any forward appended to a cache). A row that had seen fewer than
``min_tokens`` tokens keeps everything; the short-prompt rule ``keep_special`` is not applied at
question time. A one-token input does not reselect. With ``lookahead > 0`` the scored layers wait for
the end of the forward: the model then writes ``lookahead`` tokens after the new ones over everything
the cache holds (nothing stored; :func:`jacap_attn.routes.lookahead.held_lookahead_statistics`), and each
layer is scored from its window's statistics plus theirs (docs/method.md#d11-lookahead-queries).
"""

from __future__ import annotations

import torch

from ..math import budget as budgets
from .. import selection
from ..selection import heads, scorer
from ..storage.layer import COMPRESSED
from . import Route, register_route
from .lookahead import held_lookahead_statistics


@register_route("reselect")
class ReselectRoute(Route):
    """Question-time reselection of a compressed cache (an append route)."""

    prefill = False

    def __init__(self):
        self.parts: dict[int, dict] = {}  # layer -> its parts in the index space
        self.new = 0  # tokens of the forward under way
        # lookahead > 0: layer -> (window queries [b, Hq, w, d], scaling, keep [b, h]), scored at finish
        self.deferred: dict[int, tuple] = {}
        self.evicts = False  # some scored head holds more than its target

    @classmethod
    def applies(cls, cache, new_tokens: int) -> bool:
        cfg = cache.config
        return cfg.reselect is not None and new_tokens >= 2 and cfg.method.compresses \
            and not torch.compiler.is_compiling()

    def layer(self, cache, index, query, keys, values, scaling) -> None:
        """Score layer ``index`` after the new tokens ``query [b, Hq, q, d]`` (post-RoPE) were written to
        it; under the uniform policy a layer whose heads all hold no more than the target is left as it is."""
        layer = cache.layers[index]
        cfg = cache.config
        if layer.state != COMPRESSED or not scorer.scores_layer(cfg, cache.layers, index):
            return
        q = query.shape[2]
        self.new = q
        local = layer.kept_counts() - q  # [b, h]: the entries held before the new tokens
        group = heads.group_of(cache, local.shape[1])
        held = group.gather(local)  # every KV head's (a tensor-parallel rank decides for all of them)
        seen = layer.seen_before(q).cpu()  # [b]
        target = budgets.layer_budget(seen, cfg.reselect, 1)
        # A row shorter than `min_tokens` keeps everything, as at prefill (docs/method.md#short-prompts).
        target = torch.where(seen < cfg.min_tokens, held.amax(-1).cpu().clamp_min(1), target)
        over = bool((held.cpu() > target[:, None]).any())
        if cfg.reselect_budget == "uniform" and not over:
            return
        keep = torch.minimum(local.cpu(), target[:, None]) + q  # [b, h]: new tokens always kept
        if cfg.lookahead:  # scored at finish, with the tokens the model writes next
            self.evicts |= over
            self.deferred[index] = (query[:, :, -min(cfg.window, q):], scaling, keep)
            return
        self.parts[index] = scorer.score_held(cfg, cache.layers, index, query, scaling, keep,
                                              policy=cfg.reselect_budget)

    def finish(self, cache, forward) -> None:
        """Cut every layer scored in the forward that just ended (:func:`jacap_attn.selection.cut`,
        kind ``"question"``): each head's best held entries plus the new tokens. Each layer's buffers
        shrink to the reselected size plus the room still needed (:meth:`jacap_attn.storage.cache.JacapCache.room`),
        never larger than before, so decoding reads buffers of the reselected size, not of the stored one."""
        cache.route = None
        cfg = cache.config
        if self.deferred:
            self._score_deferred(cache, forward)
        parts, self.parts = self.parts, {}
        if not parts:
            return
        first = cache.layers[next(iter(parts))]
        length, q = first.get_seq_length(), self.new
        plans, key_valid = selection.held_plans(cache, parts, parts, q)
        request = selection.Cut("question", first.seen_before(q).cpu(), cfg.reselect, 1, q, q, cache.room(length),
                                key_valid, cfg.reselect_budget)
        selection.cut(cache, plans, request)

    def _score_deferred(self, cache, forward) -> None:
        """``lookahead > 0`` (docs/method.md#d11-lookahead-queries): score each deferred layer from its
        window's statistics plus those of the ``lookahead`` tokens the model writes after the new ones
        over everything the cache holds (:func:`jacap_attn.routes.lookahead.held_lookahead_statistics`;
        nothing of them stored), before the cut."""
        deferred, self.deferred = self.deferred, {}
        windows = {index: (query, scaling) for index, (query, scaling, _) in deferred.items()}
        observed, own = held_lookahead_statistics(cache, forward, windows, evicts=self.evicts)
        for index, (query, scaling, keep) in deferred.items():
            self.parts[index] = scorer.score_held(cache.config, cache.layers, index, query, scaling, keep,
                                                  policy=cache.config.reselect_budget, observed=observed.get(index),
                                                  window_observed=own.get(index))
