"""The ``reselect`` route: question-time reselection (``reselect``; docs/method.md#question-time-reselection).

A compressed cache can be cut further when new tokens arrive: a forward of several tokens over it
(a question, a new turn; ``generate`` over a given or loaded cache) first attends every entry the
cache holds, exactly as without reselection; then, in each layer the method selects
(:func:`jacap_attn.scorer.scores_layer`), the method scores the held entries with the last
``window`` new tokens as the observation window (their queries are the question's), and the layer
keeps ``ceil(reselect * L)`` of its held entries per KV head (``L`` the real tokens the cache had
seen before the new ones; never more than it holds) plus every new token. Decoding then reads that
question-aware selection. So a document can be stored at a larger kept fraction (or whole,
``ratio=1``) and each question still skips the document's prefill.

Each layer is scored right after its attention (:meth:`ReselectRoute.layer`; that layer is not read
again in this forward), over the held slots in slot order (kept positions ascending, then the new
tokens); the cut waits for the end of the forward (:meth:`ReselectRoute.finish`), which changes
nothing in this forward and lets the method's cross-layer step run, as after a prefill. Per-layer
budgets are uniform. Cross-layer steps (Jacap's consensus) run over the layers' scores laid out by
position (left-padded index space, as in a prefill): a position a layer or head no longer holds
scores nothing there; with a document stored whole every layer holds every position and the step
is the prefill's. Without that step Jacap at 10% kept loses the digits after a needle's key
(eval/results/quality_smollm2_heldout_agnostic.md). The attention sinks (``Method.forced_sinks``)
are kept. A head's invalid slots (per-head budgets, padding) are masked out of the window attention
and never kept: each KV head is scored over exactly its own held entries, so a row keeps what it
keeps alone, whatever its batch mates hold. The new tokens are assumed unpadded (as for any forward
appended to a cache). A row that had seen fewer than ``min_tokens`` tokens keeps everything; the
short-prompt rule ``keep_special`` is not applied at question time (the held entries' token ids are
not at hand). A one-token input does not reselect.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import scorer, scoring, selection, spans, units
from ..layer import COMPRESSED
from ..methods import Method
from ..types import LayerPlan
from . import Route, register_route
from .window import window_queries


def targets(reselect: float, seen: torch.Tensor) -> torch.Tensor:
    """``[b]`` int64 held entries to keep per KV head: ``ceil(reselect * seen)`` (``seen [b]`` the real
    tokens before the new ones), at least 1."""
    return torch.ceil(seen.double() * reselect - 1e-9).clamp_min(1).to(torch.int64)


@dataclass
class Pending:
    """A layer scored by :meth:`ReselectRoute.layer`, cut by :meth:`ReselectRoute.finish`: its held
    entries (:meth:`JacapLayer.held_entries`, free slots first; ``[b, h, end]`` / ``[b, h, end, d]``),
    the row validity ``key_valid [b, end]``, ``keep [b, h]`` entries to keep (new tokens included),
    ``q`` new tokens and the method's parts."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    key_valid: torch.Tensor
    keep: torch.Tensor
    q: int
    parts: dict


@register_route("reselect")
class ReselectRoute(Route):
    """Question-time reselection of a compressed cache (an append route)."""

    prefill = False

    def __init__(self):
        self.pending: dict[int, Pending] = {}

    @classmethod
    def applies(cls, cache, new_tokens: int) -> bool:
        cfg = cache.config
        return cfg.reselect is not None and new_tokens >= 2 and cfg.method.compresses \
            and not torch.compiler.is_compiling()

    def layer(self, cache, index, query, keys, values, scaling) -> None:
        """Score layer ``index`` after the new tokens ``query [b, Hq, q, d]`` (post-RoPE) were written to
        it; a layer that holds no more than its target is left as it is."""
        layer = cache.layers[index]
        if layer.state != COMPRESSED or not scorer.scores_layer(cache.config, cache.layers, index):
            return
        cfg = cache.config
        b, hq, q, d = query.shape
        held_keys, held_values, positions, valid = layer.held_entries()
        held = valid[:, :, :-q].sum(-1)  # [b, h]: the entries held before the new tokens
        seen = layer.seen_before(q).to(held.device)  # [b]
        target = targets(cfg.reselect, seen)
        # A row shorter than `min_tokens` keeps everything, as at prefill (docs/method.md#short-prompts).
        target = torch.where(seen < cfg.min_tokens, held.amax(-1).clamp_min(1), target)
        if not bool((held > target[:, None]).any()):
            return
        h, end = held_keys.shape[1], held_keys.shape[2]
        queries = window_queries(query, h, cfg.window)
        keep = torch.minimum(held, target[:, None]) + q  # [b, h] new tokens always kept
        # Heads hold different entries (per-head budgets), and the methods take one validity per row:
        # every (row, KV head) is scored as a row of its own, one KV head over exactly its own held
        # entries, all of them in one call (the heads folded into the batch).
        g = hq // h
        folded = scorer.score_layer(
            cfg, index, queries.reshape(b * h, 1, g, queries.shape[3], d),
            held_keys.reshape(b * h, 1, end, held_keys.shape[-1]),
            held_values.reshape(b * h, 1, end, held_values.shape[-1]), scaling, valid.reshape(b * h, end),
            keep.reshape(b * h).cpu(), extras=False, adaptive=False)
        parts = {name: x.reshape(b, h, end) for name, x in folded.items()
                 if isinstance(x, torch.Tensor) and tuple(x.shape) == (b * h, 1, end)}
        self.pending[index] = Pending(held_keys, held_values, positions, valid, valid.any(dim=1), keep, q, parts)

    def finish(self, cache, forward) -> None:
        """Cut every layer scored in the forward that just ended: the method's cross-layer step over the
        layers' scores by position, its sinks, then each head's top ``keep`` held entries plus the new
        tokens. Each layer's buffers shrink to the reselected size plus the room still needed
        (:meth:`jacap_attn.cache.JacapCache.room`), never larger than before, so decoding reads buffers
        of the reselected size, not of the stored one."""
        pending, self.pending = self.pending, {}
        cache.route = None
        if not pending:
            return
        method = cache.config.method
        scores = {index: p.parts["scores"] for index, p in pending.items()}
        if type(method).across_layers is not Method.across_layers:
            scores = _across_layers(cache, method, pending)
        for index, p in pending.items():
            layer = cache.layers[index]
            s = scores[index]
            if method.forced_sinks:
                s = scoring.keep_sinks(s, p.key_valid, method.forced_sinks)
            s = s.masked_fill(~p.valid, scoring.NEG_INF)
            labels = _slot_spans(cache, p)
            if labels is not None:  # spans="words": a held word ranks as its best token
                s = spans.pool_spans(s, labels, cache.config.max_span)
            indices, kept = scoring.select_indices(s, p.keep, p.key_valid, p.q)
            kept = kept & p.valid.gather(2, indices)
            d, dv = p.keys.shape[-1], p.values.shape[-1]
            layer.replace_entries(p.keys.gather(2, indices[..., None].expand(-1, -1, -1, d)),
                                  p.values.gather(2, indices[..., None].expand(-1, -1, -1, dv)),
                                  p.positions.gather(2, indices), kept, cache.room(layer.get_seq_length()))


def _slot_spans(cache, p: Pending) -> torch.Tensor | None:
    """``[b, h, end]`` word-span labels of a pending layer's slots (``spans="words"``): a held prompt
    entry takes its word's label in the cache's prompt ids, every new token a label of its own.
    ``None`` when spans are off or the prompt ids are unknown (a file saved without them)."""
    prompt = selection.prompt_span_labels(cache)
    if prompt is None:
        return None
    prompt = prompt.to(p.positions.device)  # [b, n]
    n = prompt.shape[1]
    index = p.positions + cache.pads.to(p.positions.device)[:, None, None]  # left-padded prompt index
    inside = p.valid & (index < n)
    held = prompt[:, None, :].expand(-1, index.shape[1], -1).gather(2, index.clamp(0, n - 1))
    own = n + torch.arange(index.shape[-1], device=index.device)  # a label per slot, beyond the prompt's
    return torch.where(inside, held, own)


def _across_layers(cache, method: Method, pending: dict) -> dict:
    """The method's cross-layer step over the pending layers: each layer's parts laid out by position
    in a ``[b, h, T]`` left-padded index space (``T`` the cache's logical length; the new tokens are
    its last ``q`` positions, the observation window), unheld positions scoring nothing (``-inf``,
    zero for other parts); the step's scores mapped back to each layer's slots."""
    first_index = next(iter(pending))
    first = pending[first_index]
    layer0 = cache.layers[first_index]
    t = layer0.get_seq_length()
    pads = layer0.pads.to(first.positions.device)[:, None, None]
    # Each slot's index in the [b, h, T] space; free slots go to a spare column T, dropped below.
    slots = {index: torch.where(p.valid, p.positions + pads, t) for index, p in pending.items()}

    def spread(index, x, fill):
        out = torch.full((*x.shape[:2], t + 1), fill, dtype=x.dtype if x.dtype == torch.bool else torch.float32,
                         device=x.device)
        return out.scatter(2, slots[index], x if x.dtype == torch.bool else x.float())[:, :, :t]

    # A position is a valid key of a row when some layer and KV head still holds it.
    row_valid = torch.stack([spread(i, p.valid, False).any(dim=1).to(first.valid.device)
                             for i, p in pending.items()]).any(dim=0)  # [b, T]
    plans = []
    for index, p in pending.items():
        parts = {name: spread(index, x, 0.0) for name, x in p.parts.items()
                 if name != "scores" and isinstance(x, torch.Tensor) and tuple(x.shape) == tuple(p.valid.shape)}
        scores = spread(index, p.parts["scores"], scoring.NEG_INF)
        plans.append(LayerPlan(index, cache.layers[index], scores, row_valid.to(scores.device), p.q, parts,
                               head_budgets=p.keep))
    units.label_positions(cache, plans, t)  # a method's units larger than a word (issue 34)
    method.across_layers(plans, row_valid, first.q)
    out = {}
    for plan in plans:
        padded = torch.nn.functional.pad(plan.scores, (0, 1), value=scoring.NEG_INF)
        out[plan.index] = padded.gather(2, slots[plan.index])
    return out
