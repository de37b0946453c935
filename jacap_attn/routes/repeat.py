"""The ``repeat`` route (``queries="repeat"``): question-agnostic queries for scoring the prompt
(docs/method.md#question-agnostic-scoring).

After the prompt's exact prefill and before any eviction, the model reads, teacher-forced, a repeat
instruction followed by the prompt itself, over the full prompt cache, the way KVzip (Kim et al.,
2025, arXiv:2505.23416, §3.2; kvpress's ``KVzipPress``) reconstructs its context. The queries of that
pass are the ones a model forms when it has to reproduce the document: they look at every part of
it, not only at the end the observation window sees. Each scored layer accumulates statistics of
the attention its prompt entries receive from them (:meth:`RepeatRoute.layer` during the pass), and
the method scores from those after the pass (:meth:`RepeatRoute.score_deferred`).

Chunks: the prompt is replayed ``repeat_chunk`` tokens at a time, each chunk one forward of
``repeat_ids + lead + chunk``, where ``lead`` is the last :data:`LEAD` prompt tokens before the chunk
(KVzip's "starting with" postfix; none for the first chunk). Every chunk attends the whole prompt
cache and, causally, its own tokens; its own K/V are never stored (:meth:`RepeatRoute.update`
returns them beside the prompt's), so the prompt's entries stay exactly the prefill's and the
pass's extra memory is that of one chunk's forward. Compute: about one more prefill (each chunk's
attention reads the whole prompt) plus ``len(repeat_ids) + LEAD`` tokens per chunk. The forwards
run through the ``forward`` callable the decoder's post-hook hands to :meth:`RepeatRoute.finish`.

Each scored layer's attention in the pass is computed once: :meth:`RepeatRoute.attend` replaces the
stock attention by :func:`jacap_attn.math.attention_stats.chunk_statistics`, which returns the chunk's
attention output (equal to the stock one within float32 rounding) beside the statistics, from the
same probabilities, a block of query rows at a time. Where the stock attention has extras the
statistics do not model (a sliding window, logit soft-capping, attention sinks, dropout), the stock
attention runs and :meth:`RepeatRoute.layer` computes the statistics alone.

Left padding: a padded row replays its padding masked out (keys masked, query rows ignored), with
RoPE positions continuing at its own length, so it scores its tokens as it does alone.

A chunked prefill (``chunk_size``) never holds the whole prompt; with ``chunk_scores="repeat"`` each
of its cuts before the last is scored the same way over what the cache holds
(:func:`held_repeat_statistics`, docs/method.md#question-agnostic-scoring): the chunk just written is
replayed after the instruction, its queries attend every held entry (the survivors of the earlier
cuts and the chunk itself), and nothing of the replay is stored (:class:`HeldRepeatPass`). KVzip
scores a long context this way, chunk by chunk (Kim et al., 2025, §3.3), over its whole cache; here
the keys are the held ones, so the pass's memory stays within the running budget plus one chunk.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..math import attention_stats
from ..math.masked import grouped_attention, position_mask
from ..selection import global_budget, heads, scorer
from ..config import JacapConfig
from ..storage.layer import PENDING
from . import Route, register_route
from .window import PrefillRoute, window_queries

LEAD = 8  # prompt tokens before a chunk that open its replay (KVzip's prev_postfix_size)
ALL_STATISTICS = ("mass", "peak", "sq", "sq_dist")  # every statistic a method or budget reads
# Attention-module extras that change the logits' softmax (logit soft-capping, attention sinks), and
# with the sliding window those that make the stock attention differ from the statistics' softmax (a
# non-None value, or a non-zero dropout): the stock attention runs for such a layer.
LOGIT_EXTRAS = ("softcap", "s_aux", "sinks")
ATTENTION_EXTRAS = ("sliding_window", *LOGIT_EXTRAS)


def stock_attention_only(kwargs: dict) -> bool:
    """Whether an attention call's ``kwargs`` need the stock attention: a non-zero ``dropout`` or one of
    :data:`ATTENTION_EXTRAS` set, which a route's own ``probs @ V`` would not reproduce."""
    return bool(kwargs.get("dropout")) or any(kwargs.get(name) is not None for name in ATTENTION_EXTRAS)


def chunks(prompt_ids: torch.Tensor, key_valid: torch.Tensor, instruction: torch.Tensor, chunk: int):
    """The repeat pass's forwards: yields ``(ids [b, c], valid [b, c] bool)`` per chunk of ``chunk`` of each
    row's own prompt tokens, ``ids = instruction + lead + prompt chunk`` (:data:`LEAD` tokens before the
    chunk, none for the first). Chunks are counted from each row's first real token (left padding
    skipped), so a padded row is replayed in the chunks it has alone, its padding after its replayed
    tokens (a sliding-window mask counts slots); ``valid`` is False at those padding slots, and in a
    row with no token left in the chunk, at the instruction too (it then adds nothing)."""
    b, n = prompt_ids.shape
    device = prompt_ids.device
    n_valid = key_valid.to(device).sum(-1)  # [b]; left padding only, so a row's tokens are its last n_valid
    pads = n - n_valid
    head = instruction.to(device, prompt_ids.dtype)[None, :].expand(b, -1)
    longest = int(n_valid.max())
    for start in range(0, longest, chunk):
        offsets = torch.arange(max(start - LEAD, 0), min(start + chunk, longest), device=device)[None, :]
        has = (n_valid > start)[:, None]  # [b, 1]: the row has tokens in this chunk (else it sits the chunk out)
        valid = (offsets < n_valid[:, None]) & has  # [b, c]
        ids = prompt_ids.gather(1, (pads[:, None] + offsets).clamp(max=n - 1))
        yield torch.cat([head, ids], dim=1), torch.cat([has.expand(b, head.shape[1]), valid], dim=1)


def repeat_statistics(cfg: JacapConfig, policy: str | None = None) -> tuple[str, ...]:
    """The statistics (:func:`jacap_attn.math.attention_stats.attention_statistics`) the repeat pass
    accumulates under ``cfg`` and the budget policy ``policy`` (default ``cfg.budget``; question-time
    reselection's is ``cfg.reselect_budget``): those of the method's ``repeat_stats`` it reads under its options
    (``Method.reads_repeat_stats``: Jacap with ``beta=0`` skips ``sq_dist``), ``peak`` for the
    ``global`` policy's attention score, ``mass`` for the ``capacity`` policy."""
    names = set(cfg.method.reads_repeat_stats())
    policy = cfg.budget if policy is None else policy
    if global_budget.ranks_attention(cfg, policy):
        names.add("peak")
    if policy == "capacity":
        names.add("mass")
    return tuple(sorted(names))


@register_route("repeat")
class RepeatRoute(PrefillRoute):
    """The prefill defers the scored layers (their window queries are kept); :meth:`finish` runs the
    pass, scores them from its statistics, then cuts.

    ``ratio``: the kept fraction of its cut and of the budgets its scoring reads (default the
    config's; a chunked prefill's first chunk passes its running budget).

    ``shared``: repeat-pass statistics shared between replays of the same prompt
    (:func:`jacap_attn.routes.replay.compress_recorded`'s ``observed``), ``{layer: {name: [b, h, n]}}``:
    when it holds what this config needs the pass is skipped; otherwise the pass accumulates every
    statistic (:data:`ALL_STATISTICS`) and adds them to it.

    ``shares_attention`` (class attribute): compute a scored layer's attention in the pass with its
    statistics (:meth:`attend`); ``False``: the stock attention, then the statistics."""

    shares_attention: ClassVar[bool] = True

    def __init__(self, shared: dict | None = None, ratio: float | None = None):
        self.shared = shared
        self.ratio = ratio  # the kept fraction its cut keeps (default: the config's ratio)
        self.deferred: dict = {}  # layer -> (window queries [b, h, g, w, d], scaling)
        self.observed: dict = {}  # layer -> {statistic: [b, h, n] float32}
        self.own_window: dict = {}  # layer -> the window's own statistics (a lookahead under lookahead_share)
        self.statistics: tuple = ()  # what the pass accumulates (set by _observe_all)
        self.replay_valid: torch.Tensor | None = None  # [b, c] validity of the chunk under way, else None
        self.attended: int | None = None  # the layer whose attention attend() computed in this forward

    def cut_ratio(self, cache) -> float:
        return cache.config.ratio if self.ratio is None else self.ratio

    def score(self, cache, index, query, keys, values, scaling) -> None:
        self.deferred[index] = (window_queries(query, keys.shape[1], cache.config.window), float(scaling))

    def update(self, layer, key_states, value_states):
        if self.replay_valid is None or layer.state != PENDING:
            return None
        # A chunk of the pass attends the prompt's entries and its own; the prompt's stay exactly the
        # prefill's, the chunk's are dropped.
        return layer.pending_with(key_states, value_states)

    def attend(self, cache, index, query, keys, values, scaling, **kwargs):
        """In the pass, a scored layer's attention and its statistics at once (``None`` elsewhere, or
        for a sliding-window layer or one with :data:`ATTENTION_EXTRAS`): ``(out [b, c, Hq, d], None)``."""
        if (self.replay_valid is None or index not in self.deferred or not self.shares_attention
                or cache.layers[index].is_sliding or stock_attention_only(kwargs)):
            return None
        out = self._observe(cache, index, query, keys, scaling, values)
        self.attended = index
        b, hq, c, d = query.shape
        return out.reshape(b, hq, c, -1).transpose(1, 2).contiguous(), None

    def layer(self, cache, index, query, keys, values, scaling) -> None:
        if self.replay_valid is None:
            super().layer(cache, index, query, keys, values, scaling)
        elif self.attended == index:
            self.attended = None  # observed by attend()
        elif index in self.deferred:
            self._observe(cache, index, query, keys, scaling)

    def finish(self, cache, forward) -> None:
        if self.replay_valid is None:  # not a forward of the pass itself
            super().finish(cache, forward)

    def complete(self, cache, forward) -> None:
        if self.deferred:
            self._observe_all(cache, forward)
            self.score_deferred(cache)

    def _observe(self, cache, index, query, keys, scaling, values=None):
        """Accumulate one chunk's statistics for layer ``index``
        (:func:`jacap_attn.math.attention_stats.chunk_statistics`): ``query [b, Hq, c, d]`` post-RoPE,
        ``keys [b, h, n + c, d]`` (and ``values``, if given) the prompt's entries then the chunk's own.
        Sums (``mass``, ``sq``, ``sq_dist``) add up and ``peak`` takes the maximum over chunks.
        Returns the chunk's attention output ``[b, h, g, c, d]`` with ``values``, else ``None``."""
        b, hq, c, d = query.shape
        h = keys.shape[1]
        key_valid = scorer.reach(cache.layers[index], cache.prefill.key_valid.to(keys.device))
        stats, out = attention_stats.chunk_statistics(query.reshape(b, h, hq // h, c, d), keys, scaling, key_valid,
                                                      self.replay_valid.to(keys.device), self.statistics, values)
        accumulate(self.observed.setdefault(index, {}), stats)
        return out

    def _observe_all(self, cache, forward) -> None:
        """The pass's statistics: from ``shared`` when it holds what the config needs (copies: the
        selection may change scores in place), else by running the pass (and filling ``shared``)."""
        names = repeat_statistics(cache.config)
        shared = self.shared
        if shared is not None and all(i in shared and all(k in shared[i] for k in names) for i in self.deferred):
            self.observed = copy_statistics({i: shared[i] for i in self.deferred})
            return
        self.statistics = ALL_STATISTICS if shared is not None else names
        self.run_pass(cache, forward)
        if shared is not None:
            for index, stats in copy_statistics(self.observed).items():
                shared.setdefault(index, {}).update(stats)

    def run_pass(self, cache, forward) -> None:
        """Run the repeat pass over ``cache``'s pending prompt through ``forward`` (the decoder stack).

        Raises ``ValueError`` when the prefill had no ``input_ids`` (``inputs_embeds``: nothing to replay)."""
        state, cfg = cache.prefill, cache.config
        if cache.prompt_ids is None or tuple(cache.prompt_ids.shape) != tuple(state.key_valid.shape):
            raise ValueError("queries='repeat' replays the prompt's token ids; this prefill had none "
                             "(inputs_embeds): use input_ids, or queries='window'")
        instruction = torch.tensor(instruction_ids(cache), dtype=torch.int64)
        key_valid = state.key_valid
        n_valid = key_valid.sum(-1, keepdim=True)
        try:
            with torch.no_grad():
                for ids, valid in chunks(cache.prompt_ids, key_valid, instruction, cfg.repeat_chunk):
                    self.replay_valid = valid
                    valid = valid.to(ids.device)
                    mask = torch.cat([key_valid.to(ids.device), valid], dim=1).long()
                    position_ids = n_valid.to(ids.device) + valid.long().cumsum(-1) - 1
                    forward(input_ids=ids, attention_mask=mask, position_ids=position_ids)
        finally:
            self.replay_valid = None

    def score_deferred(self, cache) -> None:
        """After the pass, score every deferred layer from its statistics (``PrefillInputs.observed``;
        ``probs`` is ``None``, ``queries`` still the window's). Raises ``RuntimeError`` if a layer was
        not observed. Eager (never compiled)."""
        cfg = cache.config
        for index, (queries, scaling) in sorted(self.deferred.items()):
            if index not in self.observed:
                raise RuntimeError(f"queries='repeat': layer {index} was not observed by a repeat pass")
            keys, values = cache.layers[index].pending_entries()
            key_valid, budget = scorer.layer_inputs(cfg, cache.layers, index, cache.prefill.key_valid, keys.device,
                                                    self.cut_ratio(cache))
            cache.prefill.parts[index] = scorer.score_layer(cfg, index, queries, keys, values, scaling, key_valid,
                                                            budget, observed=self.observed[index],
                                                            heads=heads.group_of(cache, keys.shape[1]),
                                                            window_observed=self.own_window.get(index),
                                                            gains=scorer.prefill_gains(cache, index, values, key_valid))
        self.deferred.clear()
        self.observed.clear()
        self.own_window.clear()


def copy_statistics(observed: dict) -> dict:
    """A copy of per-layer statistics ``{layer: {name: tensor}}`` whose tensors are clones (the
    selection changes scores in place; a pass adds to what it accumulated)."""
    return {index: {name: t.clone() for name, t in stats.items()} for index, stats in observed.items()}


def accumulate(into: dict, stats: dict) -> None:
    """Add one forward's repeat-pass statistics ``stats`` (``{name: tensor}``) into ``into``, in place:
    the sums (``mass``, ``sq``, ``sq_dist``) add up, ``peak`` takes the maximum."""
    for name, value in stats.items():
        old = into.get(name)
        into[name] = value if old is None else (torch.maximum(old, value) if name == "peak" else old + value)


def instruction_ids(cache) -> tuple:
    """The ids a repeat pass replays before the prompt or chunk: the config's ``repeat_ids``, else the
    instruction of the tokenizer given to :func:`jacap_attn.patch` (``cache.repeat_instruction``), else
    none (``()``)."""
    if cache.config.repeat_ids is not None:
        return cache.config.repeat_ids
    return tuple(getattr(cache, "repeat_instruction", None) or ())


NO_IDS_TO_REPLAY = ("chunk_scores='repeat' replays each chunk's token ids, which this cache does not hold "
                    "(a prefill from inputs_embeds): use input_ids, or chunk_scores='rescore'")


class HeldRepeatPass(Route):
    """The forwards of a repeat pass over a compressed cache (:func:`held_repeat_statistics`; the
    ``lookahead`` route's over a chunked prefill's held entries too): a route of its own for their
    duration (``cache.route``). Every layer attends its held entries plus the
    replayed tokens, causally by position (within the window for a sliding layer), and stores nothing
    (:meth:`update`); a layer in ``scored`` accumulates the statistics of that attention over its held
    entries, in the order of :meth:`~jacap_attn.storage.layer.JacapLayer.held_entries` (:meth:`attend`).

    ``observed``: ``{layer: {statistic: [b, h, E] float32}}`` (``E`` the layer's written slots),
    sums over the pass's forwards (``peak`` their maximum). Not registered: only
    :func:`held_repeat_statistics` sets it; its forward ends as any route's (``cache.route = None``),
    and the caller puts its own route back."""

    prefill: ClassVar[bool] = False
    attends_held: ClassVar[bool] = True  # computes the attention of compressed layers (jacap_attn.attention)

    def __init__(self, scored, statistics: tuple, own_valid: torch.Tensor, positions: torch.Tensor,
                 hidden: torch.Tensor | None = None):
        self.scored = set(scored)
        self.statistics = statistics
        self.own_valid = own_valid  # [b, c] bool: the replayed tokens that are not padding
        self.positions = positions  # [b, c] int64 RoPE positions of the replayed tokens
        self.hidden = hidden  # [b] int64: a held position the replay stands in for (masked out), or None
        self.observed: dict = {}
        self.held: dict = {}  # id(layer) -> (positions, valid) of its held entries, this forward (update -> attend)

    def update(self, layer, key_states, value_states):
        keys, values, positions, valid = layer.held_entries()
        if self.hidden is not None:
            valid = valid & (positions != self.hidden.to(positions.device)[:, None, None])
        self.held[id(layer)] = (positions, valid)
        return torch.cat([keys, key_states], dim=2), torch.cat([values, value_states], dim=2)

    def attend(self, cache, index, query, keys, values, scaling, **kwargs):
        """The attention of the replayed tokens (``query [b, Hq, c, d]``) over ``keys/values [b, h, E + c, d]``
        (what :meth:`update` returned): ``(out [b, c, Hq, d], None)``. Raises ``ValueError`` for an
        attention with logit soft-capping or attention sinks, which this pass does not model."""
        if any(kwargs.get(name) is not None for name in LOGIT_EXTRAS):
            raise ValueError("chunk_scores='repeat' computes the replay's attention itself and does not model "
                             "logit soft-capping or attention sinks; use chunk_scores='rescore' with this model")
        layer = cache.layers[index]
        positions, valid = self.held.pop(id(layer))
        b, hq, c, d = query.shape
        h, end = valid.shape[1], valid.shape[2]
        g = hq // h
        own_valid = self.own_valid.to(query.device)
        if index in self.scored and not layer.is_sliding:
            folded_valid = own_valid.repeat_interleave(h, dim=0)  # [b h, c]
            stats, out = attention_stats.chunk_statistics(
                query.reshape(b * h, 1, g, c, d), keys.reshape(b * h, 1, end + c, d), scaling,
                valid.reshape(b * h, end), folded_valid, self.statistics,
                values.reshape(b * h, 1, end + c, values.shape[-1]))
            accumulate(self.observed.setdefault(index, {}), {k: v.reshape(b, h, end) for k, v in stats.items()})
            return out.reshape(b, hq, c, -1).transpose(1, 2).contiguous(), None
        # Not scored (or sliding): the exact attention over what the layer holds, by position.
        own_pos = self.positions.to(query.device)[:, None, None, :].expand(b, h, 1, c)
        k_pos = torch.cat([positions[:, :, None, :], own_pos], dim=-1)  # [b, h, 1, E + c]
        k_valid = torch.cat([valid, own_valid[:, None, :].expand(b, h, c)], dim=-1)[:, :, None, :]
        allowed = position_mask(k_pos, k_valid, self.positions.to(query.device)[:, None, :, None], layer.sliding_window)
        return grouped_attention(query, keys, values, allowed, scaling), None


def held_repeat_statistics(cache, forward, start: int, end: int, scored) -> dict:
    """The repeat pass over a compressed ``cache`` for the prompt tokens ``start .. end`` (padded index
    space) it has just written: ``{layer: {statistic: [b, h, E]}}`` for each layer in ``scored``, over
    the entries each (row, KV head) holds (their order that of
    :meth:`~jacap_attn.storage.layer.JacapLayer.held_entries`; ``E`` the written slots). The tokens are
    replayed ``repeat_chunk`` at a time as ``repeat_ids + lead + tokens`` (:func:`chunks`), at RoPE
    positions after every token seen; nothing is stored.

    Raises ``ValueError`` when the cache has no prompt ids for ``start .. end`` (an ``inputs_embeds``
    prefill: nothing to replay)."""
    cfg = cache.config
    ids = cache.prompt_ids
    if ids is None or ids.shape[1] < end:
        raise ValueError(NO_IDS_TO_REPLAY)
    layer = cache.layers[0]
    pads = layer.pads.to(ids.device)
    seen = layer.next_positions().to(ids.device)  # [b] the RoPE position after every token seen
    instruction = torch.tensor(instruction_ids(cache), dtype=torch.int64, device=ids.device)
    b = ids.shape[0]
    names = repeat_statistics(cfg)
    observed: dict = {}
    route = cache.route
    try:
        with torch.no_grad():
            for lo in range(start, end, cfg.repeat_chunk):
                hi = min(lo + cfg.repeat_chunk, end)
                lead = max(lo - LEAD, 0)
                replay = torch.cat([instruction[None, :].expand(b, -1), ids[:, lead:hi]], dim=1)
                index = torch.arange(lead, hi, device=ids.device)
                valid = torch.cat([torch.ones(b, instruction.shape[0], dtype=torch.bool, device=ids.device),
                                   index[None, :] >= pads[:, None]], dim=1)  # [b, c]
                positions = seen[:, None] + valid.long().cumsum(-1) - 1
                cache.route = held = HeldRepeatPass(scored, names, valid, positions)
                forward(input_ids=replay, position_ids=positions)
                for i, stats in held.observed.items():
                    accumulate(observed.setdefault(i, {}), stats)
    finally:
        cache.route = route
    return observed
