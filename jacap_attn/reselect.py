"""Question-time reselection (``reselect``; docs/method.md#question-time-reselection).

A compressed cache can be cut further when new tokens arrive: a forward of several tokens over it
(a question, a new turn; ``generate`` over a given or loaded cache) first attends every entry the
cache holds, exactly as without reselection; then, in each compressed layer, the method scores the
held entries with the last ``window`` new tokens as the observation window (their queries are the
question's), and the layer keeps ``ceil(reselect * L)`` of its held entries per KV head (``L`` the
real tokens the cache had seen before the new ones; never more than it holds) plus every new token.
Decoding then reads that question-aware selection. So a document can be stored at a larger kept
fraction (or whole, ``ratio=1``) and each question still skips the document's prefill.

Layers: the ones the prefill compressed with the method (full-attention layers; sliding-window
layers only under ``sliding="compress"`` or on a model whose layers all slide); a mixed model's
sliding layers keep their window. Each layer is scored right after its attention (:func:`score_layer`;
that layer is not read again in this forward), over the held slots in slot order (kept positions
ascending, then the new tokens); the cut waits for the end of the forward (:func:`finish`), which
changes nothing in this forward and lets the method's cross-layer step run, as after a prefill.
Per-layer budgets are uniform. Cross-layer steps (Jacap's consensus, :meth:`Method.across_layers`)
run over the layers' scores laid out by position (left-padded index space, as in a prefill): a
position a layer or head no longer holds scores nothing there; with a document stored whole every
layer holds every position and the step is the prefill's. Without that step Jacap at 10% kept
loses the digits after a needle's key (the question's queries find the key, the consensus carries
the value; measured in eval/results/quality_smollm2_heldout_agnostic.md). The attention sinks
(``Method.forced_sinks``) are kept. A head's invalid slots (per-head budgets, padding) are masked
out of the window attention and never kept. The new tokens are assumed unpadded (as for any
forward appended to a cache); a left-padded batch's rows keep what they keep alone. A row that had
seen fewer than ``min_tokens`` tokens keeps everything; the short-prompt rule ``keep_special`` is
not applied at question time (the held entries' token ids are not at hand). A one-token input does
not reselect.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import scoring
from .budget import bucket
from .layer import COMPRESSED
from .methods import Method, PrefillInputs


def applies(cache, index: int, new_tokens: int) -> bool:
    """Whether the forward of ``new_tokens`` tokens just written to layer ``index`` of ``cache``
    reselects it: ``reselect`` set, more than one new token, a compressing method, and a layer the
    prefill selected with the method."""
    cfg = cache.config
    if cfg.reselect is None or new_tokens < 2 or not cfg.method.compresses:
        return False
    layer = cache.layers[index]
    if layer.state != COMPRESSED or torch.compiler.is_compiling():
        return False
    return not layer.is_sliding or cfg.sliding == "compress" or all(x.is_sliding for x in cache.layers)


def targets(reselect: float, seen: torch.Tensor) -> torch.Tensor:
    """``[b]`` int64 held entries to keep per KV head: ``ceil(reselect * seen)`` (``seen [b]`` the real
    tokens before the new ones), at least 1."""
    return torch.ceil(seen.double() * reselect - 1e-9).clamp_min(1).to(torch.int64)


@dataclass
class Pending:
    """A layer scored by :func:`score_layer`, cut by :func:`finish`: its held slots sorted (free
    slots first; ``[b, h, end]`` / ``[b, h, end, d]``), the row validity ``key_valid [b, end]``,
    ``keep [b, h]`` entries to keep (new tokens included), ``q`` new tokens and the method's parts."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    key_valid: torch.Tensor
    keep: torch.Tensor
    q: int
    parts: dict


def score_layer(cache, index: int, query: torch.Tensor, scaling: float) -> None:
    """Score layer ``index`` of ``cache`` after the forward of the new tokens ``query [b, Hq, q, d]``
    (post-RoPE) was written to it; the cut waits in ``cache.reselecting[index]`` for :func:`finish`.
    A layer that holds no more than its target is left as it is."""
    cfg, method = cache.config, cache.config.method
    layer = cache.layers[index]
    b, hq, q, d = query.shape
    end = int(layer.write_pos)
    old_end = end - q
    valid = layer.valid[:, :, :end]  # [b, h, end]
    held = valid[:, :, :old_end].sum(-1)  # [b, h]
    seen = (layer.logical - q - layer.pads).to(held.device)  # [b]
    target = targets(cfg.reselect, seen)
    # A row shorter than `min_tokens` keeps everything, as at prefill (docs/method.md#short-prompts).
    target = torch.where(seen < cfg.min_tokens, held.amax(-1).clamp_min(1), target)
    if not bool((held > target[:, None]).any()):
        return
    # Free slots between a row's held entries and the new tokens (a shorter row of a padded batch,
    # per-head budgets) move to the front, so every row is scored as a left-padded sequence of its
    # held entries then the new tokens: what it holds alone (the scorers are padding-aware).
    order = torch.sort(valid.to(torch.int8), dim=-1, stable=True).indices  # [b, h, end]
    valid = valid.gather(2, order)
    keys = layer.keys[:, :, :end].gather(2, order[..., None].expand(-1, -1, -1, layer.keys.shape[-1]))
    values = layer.values[:, :, :end].gather(2, order[..., None].expand(-1, -1, -1, layer.values.shape[-1]))
    positions = layer.positions[:, :, :end].gather(2, order)
    h = keys.shape[1]
    w = min(cfg.window, q)
    window_queries = query[:, :, q - w:].reshape(b, h, hq // h, w, d)
    key_valid = valid.any(dim=1)  # [b, end]: the row's slots
    keep = torch.minimum(held, target[:, None]) + q  # [b, h] new tokens always kept
    from .selection import checked_parts

    # Heads hold different entries (per-head budgets), and the scorers take one validity per row:
    # each KV head is scored alone, over exactly its own held entries, so a slot another head holds
    # (with whatever data this head's buffer has there) never counts as one of this head's tokens,
    # and a row scores what it scores alone, whatever its batch mates hold.
    per_head = []
    for j in range(h):
        head_valid = valid[:, j:j + 1]
        probs = (scoring.window_attention(window_queries[:, j:j + 1], keys[:, j:j + 1], scaling, head_valid)
                 if method.needs_window_attention else None)
        inputs = PrefillInputs(queries=window_queries[:, j:j + 1], keys=keys[:, j:j + 1], values=values[:, j:j + 1],
                               key_valid=head_valid[:, 0], scaling=float(scaling), layer_index=index,
                               budget=keep[:, j].cpu(), probs=probs)
        per_head.append(checked_parts(method, method.score_parts(inputs), (b, 1, end)))
    parts = {name: torch.cat([head[name] for head in per_head], dim=1) for name, x in per_head[0].items()
             if isinstance(x, torch.Tensor) and tuple(x.shape) == (b, 1, end)}
    cache.reselecting[index] = Pending(keys, values, positions, valid, key_valid, keep, q, parts)


def finish(cache) -> None:
    """Cut every layer :func:`score_layer` scored in the forward that just ended: the method's
    cross-layer step over the layers' scores by position, its sinks, then each head's top ``keep``
    held entries plus the new tokens. Each layer's buffers shrink to ``bucket(kept + room)`` slots
    (``room``: the tokens ``generate`` will still add, from ``cache.max_length``, else
    ``config.reserve``; never larger than before), so decoding reads buffers of the reselected size,
    not of the stored one; their ``logical`` length and ``pads`` stay."""
    pending, cache.reselecting = cache.reselecting, {}
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
        indices, kept = scoring.select_indices(s, p.keep, p.key_valid, p.q)
        kept = kept & p.valid.gather(2, indices)
        d = p.keys.shape[-1]
        logical = int(layer.logical)
        room = cache.config.reserve if cache.max_length is None else max(int(cache.max_length) - logical, 1)
        capacity = min(layer.capacity, bucket(indices.shape[-1] + room))
        layer.compress(p.keys.gather(2, indices[..., None].expand(-1, -1, -1, d)),
                       p.values.gather(2, indices[..., None].expand(-1, -1, -1, p.values.shape[-1])),
                       p.positions.gather(2, indices), kept, capacity, logical, layer.pads)


def _across_layers(cache, method: Method, pending: dict) -> dict:
    """The method's cross-layer step over the pending layers: each layer's parts laid out by
    position in a ``[b, h, T]`` left-padded index space (``T`` the cache's logical length; the new
    tokens are its last ``q`` positions, the observation window), unheld positions scoring
    nothing (``-inf``, zero for other parts); the step's scores mapped back to each layer's slots."""
    from .selection import LayerPlan

    first = next(iter(pending.values()))
    layer0 = cache.layers[next(iter(pending))]
    t = int(layer0.logical)
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
    method.across_layers(plans, row_valid, first.q)
    out = {}
    for plan in plans:
        padded = torch.nn.functional.pad(plan.scores, (0, 1), value=scoring.NEG_INF)
        out[plan.index] = padded.gather(2, slots[plan.index])
    return out
