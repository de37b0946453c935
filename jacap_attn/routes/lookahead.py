"""The ``lookahead`` route (``lookahead=k``): the observation window plus the queries of the tokens
the model would write next (docs/method.md#d11-lookahead-queries).

The observation window's queries find what the question asks about (a key); the queries that then
*write* the answer look at what they copy (the value after the key), and the window does not have
them yet. After the prompt's exact prefill and before any eviction, this route lets the model write
``k`` tokens greedily over the full prompt cache, then scores the prompt from the window's attention
and those ``k`` tokens' attention together: one set of statistics summed over both sets of queries
(:func:`jacap_attn.math.attention_stats.attention_statistics` for the window,
:func:`~jacap_attn.math.attention_stats.chunk_statistics` for the lookahead tokens, as the repeat
route sums its chunks). Lookahead Q-Cache (Wang et al., 2025, arXiv:2505.20334) scores with such
pseudo queries; here they are the full model's own next tokens, and nothing of them is kept: their
K/V are never stored, the prompt's entries stay exactly the prefill's, and generation starts from
the compressed cache as without the route.

The writing needs no logits of the prefill: the first forward replays the prompt's last token with
its cached entry masked out (its output is the prefill's last one: exactly, except that in a
sliding-window layer the replay, one slot further on, no longer sees the oldest key of the prefill's
window), each later forward the ``j`` tokens written so far after the whole prompt cache, and the
output embeddings of the last position give the next token (greedy, ties to the lower id). The
forward of all ``k`` written tokens, teacher-forced, gives their statistics. Cost: ``k + 1`` forwards
of at most ``k`` tokens each over the prompt's cache (about ``k (k + 1) / 2 + 1`` decoded tokens'
worth), the K/V of none stored.
"""

from __future__ import annotations

import torch

from ..math import attention_stats, scoring
from ..selection import scorer
from . import register_route
from .repeat import HeldRepeatPass, RepeatRoute, accumulate, copy_statistics, repeat_statistics


@register_route("lookahead")
class LookaheadRoute(RepeatRoute):
    """A prefill scored by its observation window and ``cache.config.lookahead`` written tokens: the
    scored layers are deferred (their window queries kept, as the repeat route keeps them), and
    :meth:`complete` writes the tokens, sums both sets of statistics and scores."""

    prefill = False  # chosen for queries="window" with lookahead > 0 (routes.prefill_route), never by name

    def __init__(self, shared: dict | None = None, ratio: float | None = None):
        super().__init__(shared, ratio)
        self.observing = False  # the forward under way accumulates statistics (the teacher-forced one)
        self.written: torch.Tensor | None = None  # [b, k] the tokens written, after complete()

    def attend(self, cache, index, query, keys, values, scaling, **kwargs):
        return super().attend(cache, index, query, keys, values, scaling, **kwargs) if self.observing else None

    def layer(self, cache, index, query, keys, values, scaling) -> None:
        if self.replay_valid is None or self.observing:
            super().layer(cache, index, query, keys, values, scaling)

    def _observe_all(self, cache, forward) -> None:
        """The statistics of the window's queries (from the deferred layers) plus the written tokens'."""
        cfg = cache.config
        self.statistics = repeat_statistics(cfg)
        for index, (queries, scaling) in self.deferred.items():
            keys, _ = cache.layers[index].pending_entries()
            key_valid = scorer.reach(cache.layers[index], cache.prefill.key_valid.to(keys.device))
            accumulate(self.observed.setdefault(index, {}),
                       window_statistics(queries, keys, scaling, key_valid, self.statistics))
        seen = cache.prefill.key_valid.sum(-1)
        if scorer.cut_evicts(cfg, seen, seen, self.cut_ratio(cache)):  # else every entry stays: no pass
            if cfg.lookahead_share is not None:  # the window's own ranking comes first (math.share)
                self.own_window = copy_statistics(self.observed)
            self.run_pass(cache, forward)

    def run_pass(self, cache, forward) -> None:
        """Write ``cfg.lookahead`` tokens greedily over the pending prompt cache, then observe them."""
        key_valid = cache.prefill.key_valid
        b = key_valid.shape[0]
        device = next(iter(cache.last_input.values())).device
        n_valid = key_valid.sum(-1, keepdim=True).to(device)  # [b, 1]: the RoPE position after the prompt
        key_valid = key_valid.to(device)
        last_hidden = key_valid.clone()
        last_hidden[:, -1] = False  # the replayed last token stands in for its cached entry

        def step(replay: dict, c: int, first: bool, observe: bool):
            self.observing = observe
            self.replay_valid = torch.ones(b, c, dtype=torch.bool, device=device)
            mask = torch.cat([last_hidden if first else key_valid, self.replay_valid], dim=1).long()
            start = n_valid - 1 if first else n_valid
            return forward(**replay, attention_mask=mask, position_ids=start + torch.arange(c, device=device)[None, :])

        try:
            self.written = write(step, cache.last_input, cache.config.lookahead, forward.output_embeddings)
        finally:
            self.replay_valid = None
            self.observing = False


def window_statistics(queries: torch.Tensor, keys: torch.Tensor, scaling: float, key_valid: torch.Tensor,
                      names) -> dict:
    """The statistics ``names`` (``{name: [b, h, n]}`` float32) of the observation window's attention
    (:func:`jacap_attn.math.scoring.window_attention`: ``queries [b, h, g, w, d]`` over ``keys [b, h, n, d]``,
    ``key_valid [b, n]``), the part of the sum a lookahead adds its written tokens' to."""
    return attention_stats.attention_statistics(scoring.window_attention(queries, keys, scaling, key_valid), keys, names)


def write(step, last: dict, k: int, head) -> torch.Tensor:
    """The ``k`` tokens the model writes greedily after ``last`` (the forward's last token,
    ``{"input_ids": [b, 1]}`` or ``{"inputs_embeds": [b, 1, d]}``), then their teacher-forced forward:
    ``step(replay, c, first, observe)`` runs one forward of the decoder stack over ``replay`` (keyword
    inputs of ``c`` tokens; ``first``: the last token, standing in for its cached entry; else the
    tokens written so far, after every cached entry; ``observe``: the forward of all ``k`` tokens,
    whose statistics count) and returns its output; ``head`` maps hidden states to logits. Returns
    the written tokens ``[b, k]`` int64."""
    first = next(iter(last.values()))
    tokens = torch.zeros(first.shape[0], 0, dtype=torch.int64, device=first.device)
    with torch.no_grad():
        for index in range(k):
            out = step(last if index == 0 else {"input_ids": tokens}, max(index, 1), index == 0, False)
            logits = head(out[0][:, -1])  # [b, vocab]
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
        step({"input_ids": tokens}, k, False, True)
    return tokens


def held_lookahead_statistics(cache, forward, windows: dict, evicts: bool | None = None,
                              policy: str | None = None) -> tuple[dict, dict]:
    """The lookahead over a compressed ``cache`` (a chunked prefill's last cut, a new turn's): the
    statistics ``{layer: {name: [b, h, E]}}`` over each (row, KV head)'s held entries (the order of
    :meth:`~jacap_attn.storage.layer.JacapLayer.held_entries`), for each full-attention layer of
    ``windows`` (``{layer: (window queries [b, Hq, w, d], scaling)}``): its observation window's plus
    those of the ``cache.config.lookahead`` tokens the model writes after the forward's last token
    (``cache.last_input``) over what the cache holds (:class:`~jacap_attn.routes.repeat.HeldRepeatPass`:
    every held entry and the written tokens, by position; nothing stored). A sliding-window layer is
    left to its window (as the repeat pass leaves it). ``evicts``: whether the cut these statistics
    serve can evict anything (``False``: no tokens are written, the window's statistics alone are
    returned); default: a chunked prefill's last cut at ``ratio`` (:func:`~jacap_attn.selection.scorer.cut_evicts`).
    Returns ``(observed, own)``: ``own`` the window's own statistics per layer where the tokens were
    written under ``lookahead_share`` (what :func:`~jacap_attn.selection.scorer.score_held` reads as
    ``window_observed``), else ``{}``. ``policy``: the budget policy of the cut they serve (default
    ``cache.config.budget``; question-time reselection's ``reselect_budget``), which decides what is gathered."""
    cfg = cache.config
    names = repeat_statistics(cfg, policy)
    observed: dict = {}
    for index, (query, scaling) in windows.items():
        layer = cache.layers[index]
        if layer.is_sliding:
            continue
        keys, _, _, valid = layer.held_entries()
        b, h, end = valid.shape
        hq, w, d = query.shape[1:]
        stats = window_statistics(query.reshape(b * h, 1, hq // h, w, d), keys.reshape(b * h, 1, end, keys.shape[-1]),
                                  scaling, valid.reshape(b * h, end), names)
        observed[index] = {name: t.reshape(b, h, end) for name, t in stats.items()}
    scored = set(observed)
    device = next(iter(cache.last_input.values())).device
    seen = cache.layers[0].next_positions().to(device)  # [b] the position after every token seen
    if evicts is None:
        held = torch.stack([_held(cache.layers[i]) for i in scored]).amax(0) \
            if scored else torch.zeros_like(seen.cpu())  # [b] the most entries a scored layer's head holds
        evicts = scorer.cut_evicts(cfg, seen, held)
    if not evicts:  # the cut keeps every held entry: no pass
        return observed, {}
    own = {} if cfg.lookahead_share is None else copy_statistics(observed)
    route = cache.route
    passes: list = []

    def step(replay: dict, c: int, first: bool, observe: bool):
        start = seen[:, None] - 1 if first else seen[:, None]
        positions = start + torch.arange(c, device=device)[None, :]
        own = torch.ones(seen.shape[0], c, dtype=torch.bool, device=device)
        cache.route = held = HeldRepeatPass(scored if observe else (), names, own, positions,
                                            hidden=seen - 1 if first else None)
        passes.append(held)
        return forward(**replay, position_ids=positions)

    try:
        write(step, cache.last_input, cfg.lookahead, forward.output_embeddings)
    finally:
        cache.route = route
    for index, stats in passes[-1].observed.items():
        accumulate(observed[index], stats)
    return observed, own


def _held(layer) -> torch.Tensor:
    """``[b]`` the most entries one KV head of compressed ``layer`` holds (kept and appended)."""
    return layer.kept_counts().amax(-1).cpu()
