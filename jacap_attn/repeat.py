"""The repeat pass of ``queries="repeat"``: question-agnostic queries for scoring the prompt
(docs/method.md#question-agnostic-scoring).

After the prompt's exact prefill and before any eviction, the model reads, teacher-forced, a repeat
instruction followed by the prompt itself, over the full prompt cache, the way KVzip (Kim et al.,
2025, arXiv:2505.23416, §3.2; kvpress's ``KVzipPress``) reconstructs its context. The queries of that
pass are the ones a model forms when it has to reproduce the document: they look at every part of
it, not only at the end the observation window sees. Each compressed layer accumulates statistics
of the attention its prompt entries receive from them (:func:`observe_repeat`),
and the method scores from those (:func:`score_deferred`).

Chunks: the prompt is replayed ``repeat_chunk`` tokens at a time, each chunk one forward of
``repeat_ids + lead + chunk``, where ``lead`` is the last :data:`LEAD` prompt tokens before the chunk
(KVzip's "starting with" postfix; none for the first chunk). Every chunk attends the whole prompt
cache and, causally, its own tokens; its own K/V are never stored (:class:`~jacap_attn.layer.JacapLayer`
in its pending state returns them beside the prompt's), so the prompt's entries stay exactly the
prefill's and the pass's extra memory is that of one chunk's forward. Compute: about one more prefill
(each chunk's attention reads the whole prompt) plus ``len(repeat_ids) + LEAD`` tokens per chunk.

Left padding: a padded row replays its padding masked out (keys masked, query rows ignored), with
RoPE positions continuing at its own length, so it scores its tokens as it does alone.
"""

from __future__ import annotations

import torch

from . import budget as budgets
from . import global_budget, scoring
from .cache import JacapCache
from .config import JacapConfig
from .methods import PrefillInputs
from .selection import checked_parts, layer_validity_and_budget, reach

LEAD = 8  # prompt tokens before a chunk that open its replay (KVzip's prev_postfix_size)


def needs_pass(cache: JacapCache) -> bool:
    """Whether ``cache``'s prefill under way waits for a repeat pass (``queries="repeat"`` and a layer
    the method scores)."""
    return cache.prefill is not None and cache.prefill.replay_valid is None and bool(cache.prefill.deferred)


def chunks(prompt_ids: torch.Tensor, key_valid: torch.Tensor, instruction: torch.Tensor, chunk: int):
    """The repeat pass's forwards: yields ``(ids [b, c], valid [b, c] bool)`` per chunk of ``chunk``
    prompt positions, ``ids = instruction + lead + prompt chunk`` (:data:`LEAD` tokens before the
    chunk, none for the first), ``valid`` False where the replayed prompt is padding."""
    b, n = prompt_ids.shape
    head = instruction.to(prompt_ids.device, prompt_ids.dtype)[None, :].expand(b, -1)
    ones = torch.ones(b, head.shape[1], dtype=torch.bool, device=prompt_ids.device)
    for start in range(0, n, chunk):
        lo = max(start - LEAD, 0)
        ids = torch.cat([head, prompt_ids[:, lo:start + chunk]], dim=1)
        yield ids, torch.cat([ones, key_valid[:, lo:start + chunk]], dim=1)


def run_pass(base_model, cache: JacapCache, keyword: str) -> None:
    """Run the repeat pass of ``cache``'s pending prefill through ``base_model`` (the decoder stack,
    called with ``keyword=cache``), filling ``cache.prefill.observed``.

    Raises ``ValueError`` when the prefill had no ``input_ids`` (``inputs_embeds``: nothing to replay).
    """
    state, cfg = cache.prefill, cache.config
    if cache.prompt_ids is None or tuple(cache.prompt_ids.shape) != tuple(state.key_valid.shape):
        raise ValueError("queries='repeat' replays the prompt's token ids; this prefill had none "
                         "(inputs_embeds): use input_ids, or queries='window'")
    instruction = torch.tensor(cfg.repeat_ids or (), dtype=torch.int64)
    key_valid = state.key_valid
    n_valid = key_valid.sum(-1, keepdim=True)
    layers = cache.layers  # every layer is pending: each reads the prompt's K/V plus the chunk's
    try:
        for layer in layers:
            layer.replaying = True
        with torch.no_grad():
            for ids, valid in chunks(cache.prompt_ids, key_valid, instruction, cfg.repeat_chunk):
                state.replay_valid = valid
                valid = valid.to(ids.device)
                mask = torch.cat([key_valid.to(ids.device), valid], dim=1).long()
                position_ids = n_valid.to(ids.device) + valid.long().cumsum(-1) - 1
                base_model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                           **{keyword: cache})
    finally:
        for layer in layers:
            layer.replaying = False
        state.replay_valid = None


def repeat_statistics(cfg: JacapConfig) -> tuple[str, ...]:
    """The statistics (:func:`scoring.attention_statistics`) the repeat pass accumulates under ``cfg``:
    the method's ``repeat_stats``, ``peak`` for the ``global`` policy's attention score, ``mass`` for
    the ``capacity`` policy."""
    names = set(cfg.method.repeat_stats)
    if global_budget.ranks_attention(cfg):
        names.add("peak")
    if cfg.budget == "capacity":
        names.add("mass")
    return tuple(sorted(names))


def observe_repeat(cache: JacapCache, index: int, query: torch.Tensor, keys: torch.Tensor, scaling: float) -> None:
    """Accumulate the statistics of one repeat-pass chunk's queries for layer ``index``
    (docs/method.md#question-agnostic-scoring): ``query [b, Hq, c, d]`` post-RoPE, ``keys [b, h, n + c, d]``
    the prompt's entries then the chunk's own. Sums (``mass``, ``sq``, ``sq_dist``) add up and ``peak``
    takes the maximum over chunks, in ``cache.prefill.observed[index]``. A layer the method does
    not score is skipped."""
    state = cache.prefill
    if index not in state.deferred:
        return
    layer = cache.layers[index]
    n = layer.keys.shape[-2]
    b, hq, c, d = query.shape
    h = keys.shape[1]
    key_valid = reach(layer, state.key_valid.to(keys.device))
    probs = scoring.repeat_attention(query.reshape(b, h, hq // h, c, d), keys[:, :, :n], keys[:, :, n:], scaling,
                                     key_valid, state.replay_valid.to(keys.device))
    names = state.statistics or repeat_statistics(cache.config)
    stats = scoring.attention_statistics(probs, keys[:, :, :n], names)
    seen = state.observed.setdefault(index, {})
    for name, value in stats.items():
        if name not in seen:
            seen[name] = value
        elif name == "peak":
            seen[name] = torch.maximum(seen[name], value)
        else:
            seen[name] = seen[name] + value


ALL_STATISTICS = ("mass", "peak", "sq", "sq_dist")  # every statistic a method or budget reads


def observe_shared(model, cache: JacapCache, shared: dict) -> None:
    """Fill ``cache.prefill.observed`` (a pending prefill with ``queries="repeat"``) from ``shared``,
    the repeat-pass statistics of the same prompt, ``{layer index: {name: [b, h, n] float32}}``, when
    it holds what this config needs (copies: the selection may change scores in place); otherwise
    run the pass through the patched ``model`` once, accumulating every statistic
    (:data:`ALL_STATISTICS`), and add its results to ``shared``. The statistics depend only on the
    prompt, the layer and ``repeat_ids`` / ``repeat_chunk``, not on the ratio or the method, so
    configs that share those may share one pass (:func:`jacap_attn.selection.compress_recorded`)."""
    from .patching import run_repeat_pass

    state = cache.prefill
    names = repeat_statistics(cache.config)
    if not all(i in shared and all(name in shared[i] for name in names) for i in state.deferred):
        state.statistics = ALL_STATISTICS
        run_repeat_pass(model, cache)
        for index, stats in state.observed.items():
            shared.setdefault(index, {}).update(stats)
    state.observed = {i: {name: t.clone() for name, t in shared[i].items()} for i in state.deferred}


def score_deferred(cache: JacapCache) -> None:
    """After the repeat pass, score every layer the prefill deferred (``queries="repeat"``): the
    method's ``score_parts`` over :class:`PrefillInputs` whose ``observed`` holds the pass's statistics
    (``probs`` is ``None``; ``queries`` still the window's). Raises ``RuntimeError`` if the pass did not
    run. Eager (never compiled)."""
    state, cfg = cache.prefill, cache.config
    method = cfg.method
    for index, (window_queries, scaling) in sorted(state.deferred.items()):
        if index not in state.observed:
            raise RuntimeError(f"queries='repeat': layer {index} was not observed by a repeat pass")
        layer = cache.layers[index]
        keys, values = layer.keys, layer.values
        key_valid, budget = layer_validity_and_budget(cache, index, keys.device)
        seen = state.observed[index]
        inputs = PrefillInputs(queries=window_queries, keys=keys, values=values, key_valid=key_valid,
                               scaling=scaling, layer_index=index, budget=budget, adaptive=cfg.budget != "uniform",
                               observed=seen)
        parts = checked_parts(method, method.score_parts(inputs), tuple(keys.shape[:3]))
        if cfg.budget == "capacity":
            weights = parts.get("weights")
            parts["need"] = budgets.capacity_need(seen["mass"] if weights is None else weights, key_valid)
        if global_budget.ranks_attention(cfg):
            parts[global_budget.GLOBAL_ATTENTION] = seen["peak"]
        state.parts[index] = parts
    state.deferred.clear()
    state.observed.clear()
