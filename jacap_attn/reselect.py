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
sliding layers keep their window. Scoring runs per layer right after its attention (that layer is
not read again in this forward), over the held slots in slot order (kept positions ascending, then
the new tokens): per-layer budgets are uniform, the method's per-layer score is used as is, with
its attention sinks (``Method.forced_sinks``) kept, and cross-layer steps (Jacap's consensus) are
not run, since the layers hold different positions. A head's invalid slots (per-head budgets,
padding) are masked out of the window attention and never kept. The new tokens are assumed
unpadded (as for any forward appended to a cache); a left-padded batch's rows keep what they keep
alone.
"""

from __future__ import annotations

import torch

from . import scoring
from .layer import COMPRESSED
from .methods import PrefillInputs


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


def reselect_layer(cache, index: int, query: torch.Tensor, scaling: float) -> None:
    """Reselect layer ``index`` of ``cache`` after the forward of the new tokens ``query [b, Hq, q, d]``
    (post-RoPE) was written to it. The layer keeps its capacity (decode shapes unchanged); its
    ``logical`` length and ``pads`` stay; a layer that holds no more than its target is unchanged.
    """
    cfg, method = cache.config, cache.config.method
    layer = cache.layers[index]
    b, hq, q, d = query.shape
    end = int(layer.write_pos)
    old_end = end - q
    valid = layer.valid[:, :, :end]  # [b, h, end]
    held = valid[:, :, :old_end].sum(-1)  # [b, h]
    seen = (layer.logical - q - layer.pads).to(held.device)  # [b]
    target = targets(cfg.reselect, seen)
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
    key_valid = valid.any(dim=1)  # [b, end]: the row's slots (per-head validity handled below)
    keep = torch.minimum(held, target[:, None]) + q  # [b, h] new tokens always kept
    probs = scoring.window_attention(window_queries, keys, scaling, valid) if method.needs_window_attention else None
    inputs = PrefillInputs(queries=window_queries, keys=keys, values=values, key_valid=key_valid,
                           scaling=float(scaling), layer_index=index, budget=keep.amax(-1).cpu(), probs=probs)
    from .selection import checked_parts

    scores = checked_parts(method, method.score_parts(inputs), (b, h, end))["scores"]
    if method.forced_sinks:
        scores = scoring.keep_sinks(scores, key_valid, method.forced_sinks)
    scores = scores.masked_fill(~valid, scoring.NEG_INF)
    indices, kept = scoring.select_indices(scores, keep, key_valid, q)
    kept = kept & valid.gather(2, indices)
    gather = indices[..., None].expand(-1, -1, -1, d)
    layer.compress(keys.gather(2, gather), values.gather(2, indices[..., None].expand(-1, -1, -1, values.shape[-1])),
                   positions.gather(2, indices), kept, layer.capacity, int(layer.logical), layer.pads)

