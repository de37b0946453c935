"""Prefill selection in named steps (docs/architecture.md#prefill-selection).

During the prefill the route (:mod:`jacap_attn.routes`) scores each layer
(:func:`jacap_attn.scorer.score_layer`) into the cache's :class:`~jacap_attn.cache.PrefillState`.
After the last layer, :func:`finalize_prefill`:

1. :func:`plan_layers`: one :class:`LayerPlan` per pending layer (scores, key validity, window,
   whether the method selects it);
2. :func:`assign_layer_budgets`: tokens per layer under the budget policy, per layer and KV head
   under ``global`` (:func:`jacap_attn.global_budget.global_budgets`; sliding-window layers within their window; rows shorter
   than ``min_tokens`` keep everything);
3. :func:`assign_head_budgets`: tokens per KV head (the method's hook, e.g. Ada-KV; else equal);
4. the method's ``across_layers`` hook (e.g. Jacap's consensus and sinks);
5. :func:`keep_special_tokens`: in a short prompt row, the model's special tokens are kept too;
6. :func:`close_spans`: under ``spans="words"``, every token ranks as the best of its word;
7. :func:`gather`: top-k per head, the kept K/V moved into each layer's static buffers.
"""

from __future__ import annotations

import torch

from . import budget as budgets
from . import global_budget, scorer, scoring, spans, units
from .cache import PENDING, JacapCache
from .config import JacapConfig
from .types import LayerPlan


def plan_layers(cache: JacapCache) -> list[LayerPlan]:
    """Step 1: a plan per pending layer. Layers the method does not select rank by recency (a
    sliding-window layer kept unscored keeps its window; without compression every token)."""
    key_valid = cache.prefill.key_valid
    n = key_valid.shape[-1]
    plans = []
    for index, layer in enumerate(cache.layers):
        if layer.state != PENDING:
            continue
        keys = layer.pending_entries()[0]
        device, h = keys.device, keys.shape[1]
        parts = dict(cache.prefill.parts.get(index, {}))
        scores = parts.pop("scores", None)
        scored = scores is not None and scorer.compresses_prompt(cache.config, n) \
            and scorer.scores_layer(cache.config, cache.layers, index)
        if not scored:
            scores = torch.arange(n, device=device, dtype=torch.float32).expand(key_valid.shape[0], h, n)
        window = 0 if layer.is_sliding and not scored else cache.config.window
        valid = scorer.reach(layer, key_valid.to(device)) if scored else key_valid.to(device)
        plans.append(LayerPlan(index, layer, scores, valid, window, parts, compressed=scored))
    return plans


def assign_layer_budgets(plans: list[LayerPlan], cfg: JacapConfig, n_valid: torch.Tensor) -> None:
    """Step 2: ``head_budgets [b, h]`` of every plan (docs/method.md#budgets).

    The policy's per-layer budgets go to the compressed full-attention layers, or, on a model whose
    layers all slide, to its sliding layers (each clipped to ``min(n, sliding_window - 1)``); a
    compressed sliding layer of a mixed model keeps ``ceil(ratio * min(n, sliding_window - 1))``
    (at least the window); a layer the method does not select keeps what it can attend: every
    token, ``min(n, sliding_window - 1)`` for a sliding window. A row with fewer than
    ``cfg.min_tokens`` real tokens keeps, in every layer, what it can attend.
    """
    compressed = [p for p in plans if p.compressed]
    policy = [p for p in compressed if not p.layer.is_sliding]
    all_sliding = bool(plans) and all(p.layer.is_sliding for p in plans)
    if all_sliding:
        policy = compressed
    count = len(policy)
    per_head = {}  # the `global` policy's [b, h] budgets, by plan
    if not count:
        per_layer = n_valid[:, None].expand(-1, 0)
    elif cfg.budget in ("uniform", "global"):
        per_layer = budgets.uniform_budgets(n_valid, cfg.ratio, cfg.window, count)
    elif cfg.budget == "pyramid":
        per_layer = budgets.pyramid_budgets(n_valid, cfg.ratio, cfg.window, count, cfg.pyramid_beta)
    else:
        need = torch.stack([p.parts["need"].to(n_valid.device) for p in policy], dim=-1)
        per_layer = budgets.capacity_budgets(need, n_valid, cfg.ratio, cfg.window, cfg.capacity_alpha)
    column = {id(plan): i for i, plan in enumerate(policy)}
    if count and cfg.budget == "global":
        uniform = torch.stack([torch.minimum(per_layer[:, i], p.key_valid.sum(-1).cpu()) for i, p in enumerate(policy)],
                              dim=-1)
        per_head = dict(zip(map(id, policy), global_budget.global_budgets(policy, cfg, uniform)))
    short = n_valid < cfg.min_tokens
    for plan in plans:
        h = plan.scores.shape[1]
        can = plan.key_valid.sum(-1).cpu() if plan.compressed else _attendable(plan.layer, n_valid)
        if id(plan) in per_head:
            keep, plan.global_heads = per_head[id(plan)].cpu(), True
        elif id(plan) in column:
            keep = torch.minimum(per_layer[:, column[id(plan)]], can)[:, None].expand(-1, h)
        elif plan.compressed:
            keep = scorer.sliding_budget(cfg, n_valid, can, all_sliding)[:, None].expand(-1, h)
        else:
            keep = can[:, None].expand(-1, h)
        keep = torch.where(short[:, None], can[:, None], keep)
        plan.head_budgets = keep.to(plan.scores.device)


def _attendable(layer, n_valid: torch.Tensor) -> torch.Tensor:
    """``[b]`` real prompt tokens ``layer`` can attend again: ``n``, or ``min(n, sliding_window - 1)``."""
    if not layer.is_sliding:
        return n_valid
    return torch.clamp(n_valid, max=layer.sliding_window - 1)


def assign_head_budgets(plans: list[LayerPlan], cfg: JacapConfig) -> None:
    """Step 3: the method's per-head budgets (same total per layer), where it defines them. Under the
    ``global`` policy the heads' budgets are the policy's own and the method's hook is not called."""
    for plan in plans:
        if plan.compressed and not plan.global_heads:
            total = plan.head_budgets[:, 0]
            split = cfg.method.head_budgets(plan.scores, total, plan.key_valid, cfg.window)
            if split is not None:
                plan.head_budgets = _checked_head_budgets(cfg, plan, split, total)


def special_token_ids(model) -> list[int]:
    """The model's special token ids: ``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` (ints or
    lists) of its ``generation_config`` and its ``config``."""
    ids = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(source, name, None)
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
                    ids.add(item)
    return sorted(ids)


def keep_special_tokens(cache: JacapCache, plans: list[LayerPlan]) -> None:
    """Step 5 (``keep_special``, docs/method.md#short-prompts): in every row whose budget is no more
    than the observation window (``ceil(ratio * n) <= window``: the window alone would be kept), the
    prompt positions holding one of :func:`special_token_ids` are kept too, in every compressed
    layer and head (within a sliding layer's reach), on top of the budget. A prefill without ids
    (``inputs_embeds``) keeps the window alone."""
    cfg: JacapConfig = cache.config
    compressed = [p for p in plans if p.compressed]
    model = cache._model() if getattr(cache, "_model", None) is not None else None
    if not cfg.keep_special or not compressed or cache.prompt_ids is None or model is None:
        return
    key_valid = cache.prefill.key_valid
    n_valid = key_valid.sum(-1).cpu()
    short = torch.ceil(n_valid.double() * cfg.ratio).to(torch.int64) <= cfg.window  # [b]
    ids = special_token_ids(model)
    if not ids or not bool(short.any()) or tuple(cache.prompt_ids.shape) != tuple(key_valid.shape):
        return
    prompt = cache.prompt_ids.to(key_valid.device)
    special = torch.isin(prompt, torch.tensor(ids, device=prompt.device)) & key_valid & short[:, None].to(key_valid.device)
    if not bool(special.any()):
        return
    for plan in compressed:
        n = plan.key_valid.shape[-1]
        keep = special.to(plan.key_valid.device) & plan.key_valid  # [b, n]
        outside = keep & (torch.arange(n, device=keep.device) < n - min(plan.window, n))
        extra = outside.sum(-1)[:, None].to(plan.head_budgets.device)
        cap = plan.key_valid.sum(-1)[:, None].to(plan.head_budgets.device)
        plan.scores = plan.scores.masked_fill(keep[:, None, :].to(plan.scores.device), float("inf"))
        plan.head_budgets = torch.minimum(plan.head_budgets + extra, cap)


def _checked_head_budgets(cfg: JacapConfig, plan: LayerPlan, split, total: torch.Tensor) -> torch.Tensor:
    """A method's per-head budgets, checked: integer ``[b, h]``, each head between the window and the
    row's real tokens, the heads summing to ``h * budget`` (else a ``ValueError`` naming the method)."""
    b, h, _ = plan.scores.shape
    n_valid = plan.key_valid.sum(-1).to(plan.scores.device)
    ok = isinstance(split, torch.Tensor) and tuple(split.shape) == (b, h) and not split.is_floating_point()
    if ok:
        split = split.to(plan.scores.device, torch.int64)
        low = n_valid.clamp(max=cfg.window)[:, None]
        ok = bool(((split >= low) & (split <= n_valid[:, None])).all()) and torch.equal(
            split.sum(-1), total.to(split.device) * h)
    if not ok:
        raise ValueError(f"method {cfg.method.name!r}: head_budgets must be int64 [b, h] = {[b, h]}, each in "
                         f"[window, real tokens], summing to h * budget per row; got {split!r}")
    return split


def prompt_spans(cache: JacapCache) -> torch.Tensor | None:
    """``[b, n]`` int64 word-span labels of the prompt under way (:func:`jacap_attn.spans.span_ids`), or
    ``None`` when spans are off: ``spans="none"``, no vocabulary table on the patched model, or a
    prefill without ids (``inputs_embeds``)."""
    labels = prompt_span_labels(cache)
    if labels is None or tuple(labels.shape) != tuple(cache.prefill.key_valid.shape):
        return None
    return labels


def prompt_span_labels(cache: JacapCache) -> torch.Tensor | None:
    """``[b, n]`` word-span labels of ``cache.prompt_ids`` under ``spans="words"`` with the patched
    model's vocabulary tables (:func:`jacap_attn.spans.span_ids`); ``None`` when spans are off, the
    model has no tables or the cache knows no prompt ids. At prefill and at question time alike."""
    model = cache._model() if getattr(cache, "_model", None) is not None else None
    tables = getattr(getattr(model, "_jacap_state", None), "spans", None)
    if cache.config.spans != "words" or tables is None or cache.prompt_ids is None:
        return None
    return spans.span_ids(cache.prompt_ids, tables[0], tables[1])


def close_spans(cache: JacapCache, plans: list[LayerPlan]) -> None:
    """Step 6 (``spans="words"``, docs/method.md#d8-answers-kept-whole): in every compressed layer and
    KV head, each token's score becomes the largest of its word's (:func:`jacap_attn.spans.pool_spans`),
    so a word that is kept is kept whole (a word cut only where the budget ends). Forced tokens
    (consensus, sinks, special ids) lend their rank to their word; the budgets stay as they are."""
    labels = prompt_spans(cache)
    if labels is None:
        return
    for plan in plans:
        if plan.compressed:
            valid = plan.key_valid[:, None, :].to(plan.scores.device)
            scores = plan.scores.float().masked_fill(~valid, scoring.NEG_INF)  # padding lends no score
            plan.scores = spans.pool_spans(scores, labels, cache.config.max_span)


def gather(cache: JacapCache, plans: list[LayerPlan]) -> None:
    """Step 7: top-k per (row, KV head), the window always kept; each layer compressed into storage of
    its own capacity, the largest kept count of the layer plus room for the tokens to come
    (:meth:`JacapLayer.select_pending`; docs/cache.md#capacity-buckets-and-growth): a layer whose heads
    keep few tokens does not pad to the layer that keeps most (per-head budgets of the ``global``
    policy differ by layer)."""
    key_valid = cache.prefill.key_valid
    n = key_valid.shape[-1]
    pads = n - key_valid.sum(-1).cpu()
    room = cache.room(n)
    for plan in plans:
        indices, kept = scoring.select_indices(plan.scores, plan.head_budgets, plan.key_valid, plan.window)
        plan.layer.select_pending(indices, kept, pads, room)


def finalize_prefill(cache: JacapCache) -> None:
    """Select and gather every pending layer of ``cache`` (after the prefill's last layer)."""
    if cache.prefill is None or not any(layer.state == PENDING for layer in cache.layers):
        return
    cfg = cache.config
    plans = plan_layers(cache)
    assign_layer_budgets(plans, cfg, cache.prefill.key_valid.sum(-1).cpu())
    assign_head_budgets(plans, cfg)
    compressed = [p for p in plans if p.compressed]
    units.label_units(cache, compressed)  # a method's units larger than a word (issue 34), before its step
    if compressed:
        cfg.method.across_layers(compressed, cache.prefill.key_valid, cfg.window)
    keep_special_tokens(cache, plans)
    close_spans(cache, plans)
    gather(cache, plans)
    cache.prompt_kept = [layer.kept_counts().cpu() for layer in cache.layers]
    cache.prefill = None
