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
again in this forward). Where the new tokens fit in the window, a scored layer's attention is computed
from the window probabilities it is scored with (:meth:`ReselectRoute.attend`: one ``Q K^T`` and one
softmax serve both, instead of SDPA and then the scorer's own product). The cut waits for the end of the forward (:meth:`ReselectRoute.finish`),
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
from .repeat import stock_attention_only


@register_route("reselect")
class ReselectRoute(Route):
    """Question-time reselection of a compressed cache (an append route)."""

    prefill = False
    attends_held = True  # a scored layer's attention comes from the probabilities it is scored with

    def __init__(self):
        self.parts: dict[int, dict] = {}  # layer -> its parts in the index space
        self.new = 0  # tokens of the forward under way
        # lookahead > 0: layer -> (window queries [b, Hq, w, d], scaling, keep [b, h]), scored at finish
        self.deferred: dict[int, tuple] = {}
        self.evicts = False  # some scored head holds more than its target
        self.decided: dict[int, torch.Tensor | None] = {}  # layer -> keep [b, h] or None (_keep)
        self.windows: dict[int, tuple] = {}  # layer -> (held entries, window attention) of attend()

    @classmethod
    def applies(cls, cache, new_tokens: int) -> bool:
        cfg = cache.config
        return cfg.reselect is not None and new_tokens >= 2 and cfg.method.compresses \
            and not torch.compiler.is_compiling()

    def _keep(self, cache, index: int, q: int):
        """``keep [b, h]`` (each head's reselected size plus the ``q`` new tokens) if layer ``index`` is
        scored in this forward, else ``None``: a layer the method does not select, or under the uniform
        policy one whose heads all hold no more than the target. Decided once per layer and forward
        (a tensor-parallel rank gathers every head's count, a collective)."""
        if index in self.decided:
            return self.decided[index]
        layer = cache.layers[index]
        cfg = cache.config
        keep = None
        if layer.state == COMPRESSED and scorer.scores_layer(cfg, cache.layers, index):
            local = layer.kept_counts() - q  # [b, h]: the entries held before the new tokens
            held = heads.group_of(cache, local.shape[1]).gather(local)  # every KV head's (a rank decides for all)
            seen = layer.seen_before(q).cpu()  # [b]
            target = budgets.layer_budget(seen, cfg.reselect, 1)
            # A row shorter than `min_tokens` keeps everything, as at prefill (docs/method.md#short-prompts).
            target = torch.where(seen < cfg.min_tokens, held.amax(-1).cpu().clamp_min(1), target)
            over = bool((held.cpu() > target[:, None]).any())
            self.evicts |= over
            if cfg.reselect_budget != "uniform" or over:
                keep = torch.minimum(local.cpu(), target[:, None]) + q  # [b, h]: new tokens always kept
        self.decided[index] = keep
        return keep

    def attend(self, cache, index, query, keys, values, scaling, *, weights: bool = False, **kwargs):
        """The attention of a layer scored in this forward, from the probabilities it is scored with
        (:func:`jacap_attn.selection.scorer.held_window_attention`: one product ``Q K^T`` and one
        softmax for both): ``(out [b, q, Hq, d], None)`` in the query's dtype, the layer's own
        attention over its held entries within float32 rounding. ``None`` (the layer attends as
        usual) where the new tokens outnumber the observation window, for a layer not scored, under
        ``lookahead``, for a method that reads no window attention, with ``weights`` (the eager
        implementation's ``output_attentions``), dropout, or an attention extra (soft-capping, sinks,
        a sliding window)."""
        cfg = cache.config
        b, hq, q, d = query.shape
        if (weights or q > cfg.window or cfg.lookahead or not cfg.method.needs_window_attention
                or stock_attention_only(kwargs) or self._keep(cache, index, q) is None):
            return None
        held, probs = scorer.held_window_attention(cfg, cache.layers[index], query, scaling)
        values = held[1]
        h, end = values.shape[1], values.shape[2]
        # [b h, g q, E] @ [b h, E, d]: one batched product (not a broadcast over the GQA group)
        out = probs.reshape(b * h, -1, end) @ values.reshape(b * h, end, values.shape[-1]).float()
        self.windows[index] = (held, probs)
        out = out.to(query.dtype).reshape(b, hq, q, values.shape[-1])
        return out.transpose(1, 2).contiguous(), None

    def layer(self, cache, index, query, keys, values, scaling) -> None:
        """Score layer ``index`` after the new tokens ``query [b, Hq, q, d]`` (post-RoPE) were written to
        it (from :meth:`attend`'s probabilities where it computed them); under the uniform policy a
        layer whose heads all hold no more than the target is left as it is."""
        cfg = cache.config
        q = query.shape[2]
        keep = self._keep(cache, index, q)
        if keep is None:
            return
        self.new = q
        if cfg.lookahead:  # scored at finish, with the tokens the model writes next
            self.deferred[index] = (query[:, :, -min(cfg.window, q):], scaling, keep)
            return
        self.parts[index] = scorer.score_held(cfg, cache.layers, index, query, scaling, keep,
                                              policy=cfg.reselect_budget, window=self.windows.pop(index, None),
                                              output=scorer.output_of(cache, index))

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
        observed, own = held_lookahead_statistics(cache, forward, windows, evicts=self.evicts,
                                                  policy=cache.config.reselect_budget)
        for index, (query, scaling, keep) in deferred.items():
            self.parts[index] = scorer.score_held(cache.config, cache.layers, index, query, scaling, keep,
                                                  policy=cache.config.reselect_budget, observed=observed.get(index),
                                                  window_observed=own.get(index), output=scorer.output_of(cache, index))
