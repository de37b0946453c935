"""The ``chunk`` route: a prefill in chunks under a running budget (docs/architecture.md#chunked-prefill).

A prompt too long to hold whole is prefilled a chunk at a time. The first chunk is a prefill of its
own (pending layers, scored by its observation window as the ``window`` route scores a prompt); every
later chunk is a forward over the compressed cache: its attention reads exactly what the cache holds
plus the chunk itself (:meth:`jacap_attn.storage.layer.JacapLayer.attend`, causal by logical position), and
its K/V are appended. After each chunk the same cut as a prefill's (:func:`jacap_attn.selection.cut`)
keeps ``ceil(ratio * seen)`` entries per compressed layer and KV head on average (``seen`` the real
tokens so far; the budget policy, the method's per-head budgets, its cross-layer step, sinks, special
tokens, word spans), the newest ``window`` tokens by force, each head's candidates being what it held
plus the chunk. Sliding-window layers keep their last ``sliding_window - 1`` tokens, which is all the
next chunk's attention can read of them. Each entry keeps its original RoPE position.

Candidates are scored by the new chunk's observation window (``chunk_scores="rescore"``), or keep the
larger of that score and their score at the cut before (``"carry"``), or, at the cuts before the last,
by a repeat pass of the chunk over the held entries (``"repeat"``, KVzip's reconstruction queries:
:func:`jacap_attn.routes.repeat.held_repeat_statistics`; the first chunk by the repeat route's pass
over its exact prefill), each survivor keeping the larger of its new and earlier score. The last cut
is always scored by the prompt's own end (the question, when it ends the prompt), and with
``lookahead`` by the tokens the model writes next over the held entries too
(:func:`jacap_attn.routes.lookahead.held_lookahead_statistics`). The cuts before the last keep
``chunk_ratio`` of the tokens seen when it is set (:func:`running_ratio`): a running budget above the
final one, so that the last cut, scored by the prompt's own end (the question), chooses among more;
under the final budget (``chunk_budget="final"``; unset, a prompt's chunks whose first cut is smaller than
what a cut sets aside) none keeps less than the prompt's final budget ``ceil(ratio * n)``.

The same route cuts a new turn over a cache under a running budget (``chunk_size`` set): a chat whose
cache stays within ``ratio`` of what it has seen, plus one turn.

A chunked prefill runs from an empty cache to ``cache.prefill_until`` tokens (set by the caller that
splits the prompt: :func:`jacap_attn.compress`, the patched ``generate``); the forwards in between are
its chunks, whatever their length (a last chunk of one token too).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import selection
from ..selection import scorer
from ..math.budget import layer_budget
from ..storage.layer import EMPTY, PENDING
from . import register_route
from .lookahead import LookaheadRoute, held_lookahead_statistics
from .repeat import NO_IDS_TO_REPLAY, RepeatRoute, held_repeat_statistics
from .window import PrefillRoute, window_queries

@register_route("chunk")
class ChunkRoute(PrefillRoute):
    """One forward of a chunked prefill (or a new turn under a running budget): the first chunk scored
    as a prefill, every later one over the cache's held entries plus itself, then cut."""

    prefill = False  # chosen by the patched model for chunked prefills, never by `queries`

    def __init__(self):
        self.parts: dict[int, dict] = {}  # layer -> its parts in the index space (a compressed layer's)
        # The first chunk's own route: the repeat route's (chunk_scores="repeat", more chunks to come) or
        # the lookahead route's (lookahead > 0, the first chunk is the last)
        self.first: RepeatRoute | None = None
        self.window: dict[int, tuple] = {}  # layer -> (window queries, scaling), scored after the forward
        self.new_tokens = 0  # the chunk's length (padding included)

    @classmethod
    def applies(cls, cache, new_tokens: int) -> bool:
        """A forward over a compressed cache continuing a chunked prefill, or of several new tokens
        under a running budget (``chunk_size`` set and no question-time ``reselect``)."""
        cfg = cache.config
        if torch.compiler.is_compiling():
            return False
        if cache.prefill_until is not None:
            return True
        return cfg.chunk_size is not None and cfg.reselect is None and new_tokens >= 2

    def layer(self, cache, index, query, keys, values, scaling) -> None:
        layer = cache.layers[index]
        cfg = cache.config
        if layer.state == PENDING:  # the first chunk: a prefill of its own
            length = cache.prefill.key_valid.shape[-1]
            if scoring(cache) == "repeat" and not _last(cache, length):
                if self.first is None:
                    if cache.prompt_ids is None:  # before the rest of the chunk's forward
                        raise ValueError(NO_IDS_TO_REPLAY)
                    self.first = RepeatRoute(ratio=running_ratio(cache, length))
                self.first.layer(cache, index, query, keys, values, scaling)
            elif cfg.lookahead and _last(cache, length):
                self.first = self.first or LookaheadRoute()
                self.first.layer(cache, index, query, keys, values, scaling)
            else:
                super().layer(cache, index, query, keys, values, scaling)
            return
        length = layer.get_seq_length()
        self.new_tokens = query.shape[2]
        if not (scorer.compresses_prompt(cfg, length) and scorer.scores_layer(cfg, cache.layers, index)):
            return
        last = _last(cache, length)
        if scoring(cache) == "repeat" and not last or cfg.lookahead and last:  # scored after the forward, by its pass
            self.window[index] = (window_queries(query, layer.kv_heads(), cfg.window).flatten(1, 2), scaling)
            return
        self.parts[index] = scorer.score_held(cfg, cache.layers, index, query, scaling, _expected(cache, index, length),
                                              policy=cfg.budget, output=scorer.output_of(cache, index))

    def finish(self, cache, forward) -> None:
        cache.route = None
        cfg = cache.config
        until = cache.prefill_until
        carry = scoring(cache) in ("carry", "repeat")
        if cache.state == PENDING:
            length = cache.prefill.key_valid.shape[-1]
            last = _last(cache, length)
            if self.first is not None:  # chunk_scores="repeat": the repeat route's pass over the first chunk
                cache.route = self.first
                try:
                    self.first.complete(cache, forward)
                finally:
                    cache.route = None
            carried = _carry_prefill(cache) if carry and not last else None
            selection.finalize_prefill(cache, room=_room(cache, length, last), bucketed=last,
                                       ratio=running_ratio(cache, length))
        else:
            length = cache.layers[0].get_seq_length()
            last = _last(cache, length)
            if self.window:
                self._score_after(cache, forward, length, last)
            parts, self.parts = self.parts, {}
            if carry and not last:
                _carry(cache, parts)
            carried = {i: p["scores"].clone() for i, p in parts.items()} if carry else None
            self._cut(cache, parts, length, last)
        cache.chunk_scores = None if carried is None or last else carried
        if last:
            cache.prompt_ahead = None
            if getattr(cache, "prompt_config", None) is not None:  # a repetitive prompt's settings (know_prompt)
                cache.config, cache.prompt_config = cache.prompt_config, None
        if last and until is not None:
            cache.prefill_until = None
            cache.prompt_kept = [layer.kept_counts().cpu() for layer in cache.layers]

    def _score_after(self, cache, forward, length: int, last: bool) -> None:
        """Score each layer this chunk left to a pass after its forward (:attr:`window`): at a cut
        before the last (``chunk_scores="repeat"``) from the repeat pass of the chunk over the held
        entries, at the last (``lookahead > 0``) from its window and the tokens the model writes next
        over them (:func:`jacap_attn.routes.lookahead.held_lookahead_statistics`); a scored
        sliding-window layer, which neither pass observes, by the chunk's window."""
        cfg = cache.config
        windows, self.window = self.window, {}
        own: dict = {}
        if last:
            observed, own = held_lookahead_statistics(cache, forward, windows)
        else:
            observed = held_repeat_statistics(cache, forward, length - self.new_tokens, length, windows)
        for index, (query, scaling) in windows.items():
            self.parts[index] = scorer.score_held(cfg, cache.layers, index, query, scaling,
                                                  _expected(cache, index, length), policy=cfg.budget,
                                                  observed=observed.get(index), window_observed=own.get(index),
                                                  output=scorer.output_of(cache, index))

    def _cut(self, cache, parts: dict, length: int, last: bool) -> None:
        cfg = cache.config
        plans, key_valid = selection.held_plans(cache, parts, range(len(cache.layers)), cfg.window)
        seen = cache.layers[0].next_positions().cpu()
        request = selection.Cut("chunk", seen, running_ratio(cache, length), cfg.window, 0, cfg.window,
                                _room(cache, length, last), key_valid, cfg.budget, bucketed=last)
        selection.cut(cache, plans, request)

    def cut_ratio(self, cache) -> float:
        """The first chunk's kept fraction: the running budget while more chunks follow."""
        return running_ratio(cache, cache.prefill.key_valid.shape[-1])


def scoring(cache) -> str:
    """How this chunked prefill scores its cuts: the config's :attr:`~jacap_attn.config.JacapConfig.chunk_scoring`
    (under ``chunk_scores=None`` ``"rescore"``, which needs no token ids: a prefill from ``inputs_embeds``
    runs it too). An explicit ``"repeat"`` without ids raises at its first chunk."""
    return cache.config.chunk_scoring


def _expected(cache, index: int, length: int) -> torch.Tensor:
    """``[b, h]`` int64: the entries each KV head of compressed layer ``index`` is expected to keep at
    the cut of the chunk that brings the cache to ``length`` positions (what a method that reads its
    budget picks)."""
    layer = cache.layers[index]
    seen = layer.next_positions().cpu()  # [b] real tokens seen, the new ones included
    ratio = running_ratio(cache, length)
    return layer_budget(seen, ratio, cache.config.window)[:, None].expand(-1, layer.kv_heads())


def running_ratio(cache, length: int) -> float:
    """The kept fraction of the cut of the chunk that brings ``cache`` to ``length`` positions: ``ratio``
    at the prefill's last cut and for a new turn; before it the running fraction ``r``
    (``chunk_ratio`` when set, the config holds it at least ``ratio``; else ``ratio``) of the tokens
    seen, under the final budget (``chunk_budget="final"``, or unset for a prompt's chunks small against what a
    cut sets aside: :func:`know_prompt`) at least ``min(1, ratio * N / length)``
    (``N`` the prefill's positions, :attr:`~jacap_attn.storage.cache.JacapCache.prefill_until`): a prompt without
    padding keeps at least its final budget ``ceil(ratio * N)`` at every cut (a left-padded row a little less:
    the fraction is of its real tokens)."""
    cfg = cache.config
    if _last(cache, length):
        return cfg.ratio
    running = cfg.ratio if cfg.chunk_ratio is None else cfg.chunk_ratio
    if cfg.chunk_budget == "final":  # unset: resolved by know_prompt for the prefill under way
        running = max(running, min(1.0, cfg.ratio * cache.prefill_until / length))
    return running


def _last(cache, length: int) -> bool:
    """Whether the chunk that brings the cache to ``length`` positions ends the prefill (or is a turn)."""
    return cache.prefill_until is None or length >= cache.prefill_until


def _room(cache, length: int, last: bool) -> int:
    """Free slots after a chunk's cut: the next chunk's tokens while the prefill goes on (so its
    forward writes without growing the buffers), then what the cache keeps after a prompt."""
    if last or cache.prefill_chunk is None:
        return cache.room(length)
    return int(cache.prefill_chunk)


def _carry_prefill(cache) -> dict:
    """The first chunk's scores (``[b, h, n]``, each scored layer's), kept for the next cut."""
    return {i: p["scores"].clone() for i, p in cache.prefill.parts.items() if "scores" in p}


def _carry(cache, parts: dict) -> None:
    """``chunk_scores="carry"``: each candidate's score becomes the larger of the new chunk's and the
    one it had at the cut before (those scores, ``[b, h, T']``, extended with ``-inf`` to ``T``)."""
    before = getattr(cache, "chunk_scores", None) or {}
    for index, p in parts.items():
        old = before.get(index)
        if old is None:
            continue
        new = p["scores"]
        old = torch.nn.functional.pad(old.to(new.device), (0, new.shape[-1] - old.shape[-1]), value=float("-inf"))
        p["scores"] = torch.maximum(new, old)


def split_forward(cache, forward, args: tuple, kwargs: dict, chunk: int, *,
                  last_outputs: bool = False) -> tuple[tuple, dict]:
    """A plain forward of more than ``chunk`` tokens over an empty cache under ``chunk_size``: its
    chunks but the last run here through ``forward`` (the decoder stack over ``cache``), each cut as it
    comes; the forward under way goes on with the last chunk only (its ``input_ids`` / ``inputs_embeds``
    and ``position_ids`` sliced, its 2D ``attention_mask`` whole), and the earlier chunks' last hidden
    states wait on the cache (``cache.leading_hidden``) for :func:`join_hidden`. Positions default to
    ``0 .. n - 1``, as the stock model's plain forward counts them. Returns the new ``(args, kwargs)``.

    Raises ``ValueError`` for what a split forward cannot return whole: ``output_attentions``,
    ``output_hidden_states`` (unless ``last_outputs``: ``generate``'s prefill, which returns them for
    the last chunk only, as stock chunked generation does), a prepared 4D mask."""
    if not last_outputs and (kwargs.get("output_attentions") or kwargs.get("output_hidden_states")):
        raise ValueError("chunk_size splits the prefill into forwards of chunk_size tokens: output_attentions and "
                         "output_hidden_states of the whole prompt cannot be returned; set chunk_size=None")
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() != 2 or isinstance(mask, dict):
        raise ValueError("chunk_size needs a 2D attention_mask [batch, tokens] (or none) to split the prompt")
    positional = kwargs.get("input_ids") is None and bool(args) and isinstance(args[0], torch.Tensor)
    ids = args[0] if positional else kwargs.get("input_ids")
    name, x = ("input_ids", ids) if ids is not None else ("inputs_embeds", kwargs.get("inputs_embeds"))
    b, n = x.shape[:2]
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(n, device=x.device)[None, :].expand(b, -1)
    cache.prefill_until, cache.prefill_chunk = n, chunk
    know_prompt(cache, ids if name == "input_ids" else None, mask)
    last = (n - 1) // chunk * chunk
    hidden = []
    for start in range(0, last, chunk):
        end = start + chunk
        out = forward(**{name: x[:, start:end]}, position_ids=position_ids[..., start:end],
                      attention_mask=None if mask is None else mask[:, :end])
        hidden.append(out[0])
    cache.leading_hidden = torch.cat(hidden, dim=1)
    kwargs = {**kwargs, name: x[:, last:], "position_ids": position_ids[..., last:]}
    return (args[1:] if positional else args), kwargs


def join_hidden(cache, output):
    """The forward's output with the earlier chunks' last hidden states (:func:`split_forward`) before
    its own: the hidden states, and so the logits, of the whole prompt."""
    leading = getattr(cache, "leading_hidden", None)
    if leading is None:
        return output
    cache.leading_hidden = None
    output["last_hidden_state"] = torch.cat([leading, output["last_hidden_state"]], dim=1)
    return output


def extend_prompt(cache, ids, new_tokens: int) -> None:
    """A chunk that continues the prompt (nothing was appended after it) joins it: its length, and its
    ids (the cut reads them for special tokens and word spans); without ids (``inputs_embeds``) the
    prompt's ids are no longer known. Called by the decoder's pre-hook for each chunk after the first."""
    seen = cache.layers[0].get_seq_length()
    if cache.prompt_length != seen:
        return  # tokens were appended after the prompt: this chunk is a new turn, not the prompt
    cache.prompt_length = seen + new_tokens
    prompt = cache.prompt_ids
    if prompt is not None and prompt.shape[1] == seen and isinstance(ids, torch.Tensor) and ids.dim() == 2 \
            and ids.shape[0] == prompt.shape[0]:
        cache.prompt_ids = torch.cat([prompt, ids.detach().to(prompt.device)], dim=1)
    else:
        cache.prompt_ids = None


def know_prompt(cache, ids, attention_mask=None) -> None:
    """The whole prompt a chunked prefill (or a new turn in chunks) is given, ``ids [b, n]`` int64 with
    ``attention_mask [b, n]`` (1 at real tokens; none: all real), kept as ``cache.prompt_ahead`` until its
    last cut for the method's ``lookup_ahead`` (:func:`jacap_attn.selection.units.prompt_end`); ``None``
    for what is not such ids (``inputs_embeds``) or a mask of another shape. An unset ``chunk_budget`` is
    resolved for this prefill: a prompt over an empty cache by its chunk size
    (:func:`jacap_attn.route_settings.prompt_chunk_budget`), a new turn over a compressed cache ``"seen"``. A
    repetitive prompt over an empty cache takes :func:`jacap_attn.route_settings.prompt_chunking`'s settings."""
    from ..route_settings import prompt_chunk_budget, prompt_chunking  # the rules of docs/method.md

    cache.prompt_ahead = None
    changes = {}
    if cache.config.chunk_budget is None:
        empty = cache.state == EMPTY
        changes["chunk_budget"] = prompt_chunk_budget(cache.config, cache.prefill_chunk) if empty else "seen"
    valid = None
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point():
        if attention_mask is None:
            valid = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
        elif isinstance(attention_mask, torch.Tensor) and tuple(attention_mask.shape) == tuple(ids.shape):
            valid = attention_mask.to(ids.device) != 0
    if valid is not None:
        cache.prompt_ahead = (ids.detach().to(torch.int64), valid)
        if cache.state == EMPTY:
            changes.update(prompt_chunking(cache.config, cache.prompt_ahead[0], valid))
    if changes:  # this prefill only: the cache's own settings come back at its last cut (ChunkRoute.finish)
        cache.prompt_config, cache.config = cache.config, dataclasses.replace(cache.config, **changes)


def begin_turn(cache, ids) -> None:
    """A new turn over a compressed ``cache`` that ``generate`` prefills in chunks: ``ids [b, N]`` are the
    whole conversation (``generate``'s ``input_ids``: what the cache holds, the tokens decoding wrote
    into it included, then the turn), so the first ``seen`` of them are the ids of every token held and
    the turn's chunks join them as chunks of a prompt do (:func:`extend_prompt`): a repeat-scored cut
    can replay them (before, the tokens decoding wrote were missing and such a cut raised). Nothing
    changes for ids of another batch size or shorter than what the cache holds."""
    seen = cache.layers[0].get_seq_length()
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < seen \
            or ids.shape[0] != cache.layers[0].batch_size():
        return
    cache.prompt_ids = ids[:, :seen].detach().clone()
    cache.prompt_length = seen


def prefill_in_chunks(cache, forward, input_ids: torch.Tensor, attention_mask, position_ids, chunk: int) -> None:
    """Prefill ``input_ids [b, n]`` into the empty ``cache`` a chunk of ``chunk`` tokens at a time through
    ``forward(input_ids=, attention_mask=, position_ids=)`` (the patched model over that cache), each
    chunk cut as it comes (:class:`ChunkRoute`); positions default to ``0 .. n - 1`` (``attention_mask``
    ``[b, n]`` for left padding: pass the positions it implies)."""
    n = input_ids.shape[1]
    if position_ids is None:
        position_ids = torch.arange(n, device=input_ids.device)[None, :].expand(input_ids.shape[0], -1)
    cache.prefill_until, cache.prefill_chunk = n, chunk
    know_prompt(cache, input_ids, attention_mask)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        # chunks of their own (a slice's strides and offset are the prompt's): a compiled forward sees
        # the same strides whatever the prompt's length, and recompiles for none
        forward(input_ids=_own(input_ids[:, start:end]), position_ids=_own(position_ids[:, start:end]),
                attention_mask=None if attention_mask is None else _own(attention_mask[:, :end]))


def _own(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` in its own storage with row-major strides (``contiguous()`` keeps a one-row
    slice's strides)."""
    return x.clone(memory_format=torch.contiguous_format)
