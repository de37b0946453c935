"""Prefill selection in named steps (docs/architecture.md#prefill-selection).

During the prefill, :func:`score_layer` runs once per layer (called by the registered attention
function right after the exact attention) and stores the method's scores in the cache's
:class:`~jacap_attn.cache.PrefillState`. After the last layer, :func:`finalize_prefill`:

1. :func:`plan_layers`: one :class:`LayerPlan` per pending layer (scores, key validity, window);
2. :func:`assign_layer_budgets`: tokens per compressed layer under the budget policy;
3. :func:`assign_head_budgets`: tokens per KV head (the method's hook, e.g. Ada-KV; else equal);
4. the method's ``across_layers`` hook (e.g. Jacap's consensus and sinks);
5. :func:`gather`: top-k per head, the kept K/V moved into each layer's static buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import budget as budgets
from . import scoring
from .cache import PENDING, JacapCache, JacapLayer
from .config import JacapConfig
from .methods import Method, PrefillInputs

_COMPILED: dict = {}


@dataclass
class LayerPlan:
    """What the selection knows about one pending layer.

    scores: ``[b, h, n]`` float32, higher = keep. head_budgets: ``[b, h]`` int64 tokens to keep
    (set by :func:`assign_layer_budgets` / :func:`assign_head_budgets`). key_valid: ``[b, n]`` bool
    on the layer's device. window: last positions always kept (0 for sliding-window layers).
    parts: the method's extra tensors for this layer (:meth:`Method.score_parts`).
    """

    index: int
    layer: JacapLayer
    scores: torch.Tensor
    key_valid: torch.Tensor
    window: int
    parts: dict = field(default_factory=dict)
    head_budgets: torch.Tensor | None = None

    @property
    def compressed(self) -> bool:
        """Whether the method's budget applies (a full-attention layer); sliding layers keep their window."""
        return not self.layer.is_sliding


def compiled_scorer(method: Method, *, fullgraph: bool = False):
    """``method.score_parts`` under ``torch.compile`` with a dynamic sequence length, memoised per
    method instance. The compiled code is the method's own ``score`` (or its own ``score_parts``),
    so methods never share a code object, nor its recompile budget. ``fullgraph=True`` makes a graph
    break an error (the tests compile every registered method so); the default falls back to eager
    if torch gives up (e.g. past its recompile limit after many option values)."""
    key = (method, fullgraph)
    fn = _COMPILED.get(key)
    if fn is None:
        if type(method).score_parts is Method.score_parts:
            score = torch.compile(method.score, dynamic=True, fullgraph=fullgraph)
            fn = lambda inputs: {"scores": score(inputs)}  # noqa: E731
        else:
            fn = torch.compile(method.score_parts, dynamic=True, fullgraph=fullgraph)
        _COMPILED[key] = fn
    return fn


def score_layer(cache: JacapCache, index: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                scaling: float) -> None:
    """Score layer ``index`` of ``cache`` from the prefill's post-RoPE ``query [b, Hq, n, d]`` and
    ``keys/values [b, h, n, d]``; the result goes to ``cache.prefill.parts[index]``. Calls the
    cache's ``on_prefill(index, query, keys, values, scaling)`` first, if set."""
    if cache.on_prefill is not None:
        cache.on_prefill(index, query, keys, values, scaling)
    cfg: JacapConfig = cache.config
    if cache.layers[index].is_sliding or not cfg.compresses:
        return
    method = cfg.method
    b, hq, n, d = query.shape
    h = keys.shape[1]
    key_valid = cache.prefill.key_valid.to(keys.device)
    w = min(cfg.window, n)
    window_queries = query[:, :, n - w:].reshape(b, h, hq // h, w, d)
    want_probs = method.needs_window_attention or cfg.budget == "capacity"
    probs = scoring.window_attention(window_queries, keys, scaling, key_valid) if want_probs else None
    inputs = PrefillInputs(
        queries=window_queries, keys=keys, values=values, key_valid=key_valid, scaling=float(scaling),
        layer_index=index, budget=budgets.layer_budget(key_valid.sum(-1).cpu(), cfg.ratio, cfg.window),
        adaptive=cfg.budget != "uniform", probs=probs if method.needs_window_attention else None,
        all_queries=query.reshape(b, h, hq // h, n, d) if method.needs_all_queries else None)
    use_compiled = cfg.compile and keys.device.type == "cuda" and method.compilable
    parts = dict((compiled_scorer(method) if use_compiled else method.score_parts)(inputs))
    if cfg.budget == "capacity":
        weights = parts.get("weights")
        parts["need"] = budgets.capacity_need(probs.sum(dim=(2, 3)) if weights is None else weights, key_valid)
    cache.prefill.parts[index] = parts


def plan_layers(cache: JacapCache) -> list[LayerPlan]:
    """Step 1: a plan per pending layer. Sliding-window layers rank by recency (they keep their window)."""
    key_valid = cache.prefill.key_valid
    n = key_valid.shape[-1]
    plans = []
    for index, layer in enumerate(cache.layers):
        if layer.state != PENDING:
            continue
        device, h = layer.keys.device, layer.keys.shape[1]
        parts = dict(cache.prefill.parts.get(index, {}))
        scores = parts.pop("scores", None)
        if layer.is_sliding or scores is None:
            scores = torch.arange(n, device=device, dtype=torch.float32).expand(key_valid.shape[0], h, n)
        window = 0 if layer.is_sliding else cache.config.window
        plans.append(LayerPlan(index, layer, scores, key_valid.to(device), window, parts))
    return plans


def assign_layer_budgets(plans: list[LayerPlan], cfg: JacapConfig, n_valid: torch.Tensor) -> None:
    """Step 2: ``head_budgets [b, h]`` of every plan: the policy's per-layer budget for compressed
    layers (all of ``n_valid`` without compression), ``min(n, sliding_window - 1)`` for sliding ones."""
    compressed = [p for p in plans if p.compressed]
    count = len(compressed)
    if not cfg.compresses:
        per_layer = n_valid[:, None].expand(-1, count)
    elif cfg.budget == "uniform":
        per_layer = budgets.uniform_budgets(n_valid, cfg.ratio, cfg.window, count)
    elif cfg.budget == "pyramid":
        per_layer = budgets.pyramid_budgets(n_valid, cfg.ratio, cfg.window, count, cfg.pyramid_beta)
    else:
        need = torch.stack([p.parts["need"].to(n_valid.device) for p in compressed], dim=-1)
        per_layer = budgets.capacity_budgets(need, n_valid, cfg.ratio, cfg.window, cfg.capacity_alpha)
    for plan, keep in zip(compressed, per_layer.unbind(-1)):
        plan.head_budgets = keep[:, None].expand(-1, plan.scores.shape[1]).to(plan.scores.device)
    for plan in plans:
        if not plan.compressed:
            keep = torch.minimum(n_valid, torch.tensor(plan.layer.sliding_window - 1))
            plan.head_budgets = keep[:, None].expand(-1, plan.scores.shape[1]).to(plan.scores.device)


def assign_head_budgets(plans: list[LayerPlan], cfg: JacapConfig) -> None:
    """Step 3: the method's per-head budgets (same total per layer), where it defines them."""
    for plan in plans:
        if plan.compressed and cfg.compresses:
            split = cfg.method.head_budgets(plan.scores, plan.head_budgets[:, 0], plan.key_valid, cfg.window)
            if split is not None:
                plan.head_budgets = split.to(plan.scores.device)


def gather(cache: JacapCache, plans: list[LayerPlan]) -> None:
    """Step 5: top-k per (row, KV head), the window always kept; every layer compressed into static
    buffers of one shared capacity (the largest kept count plus room for the tokens to come)."""
    key_valid = cache.prefill.key_valid
    n = key_valid.shape[-1]
    pads = n - key_valid.sum(-1).cpu()
    kept_max = max(int(p.head_budgets.max()) for p in plans)
    room = cache.config.reserve if cache.max_length is None else max(cache.max_length - n, 1)
    capacity = budgets.bucket(kept_max + room)
    for plan in plans:
        layer = plan.layer
        indices, kept = scoring.select_indices(plan.scores, plan.head_budgets, plan.key_valid, plan.window)
        keys = layer.keys.gather(2, indices[..., None].expand(-1, -1, -1, layer.keys.shape[-1]))
        values = layer.values.gather(2, indices[..., None].expand(-1, -1, -1, layer.values.shape[-1]))
        layer_pads = pads.to(indices.device)
        layer.compress(keys, values, indices - layer_pads[:, None, None], kept, capacity, n, layer_pads)


def finalize_prefill(cache: JacapCache) -> None:
    """Select and gather every pending layer of ``cache`` (after the prefill's last layer)."""
    if cache.prefill is None or not any(layer.state == PENDING for layer in cache.layers):
        return
    cfg = cache.config
    plans = plan_layers(cache)
    assign_layer_budgets(plans, cfg, cache.prefill.key_valid.sum(-1).cpu())
    assign_head_budgets(plans, cfg)
    if cfg.compresses:
        compressed = [p for p in plans if p.compressed]
        cfg.method.across_layers(compressed, cache.prefill.key_valid, cfg.window)
    gather(cache, plans)
    cache.prompt_kept = [layer.kept_counts().cpu() for layer in cache.layers]
    cache.prefill = None


def compress_recorded(model, records: list, config: JacapConfig, prompt_ids: torch.Tensor) -> JacapCache:
    """The compressed cache a patched prefill of ``prompt_ids [b, n]`` (no padding) would make under
    ``config``, from recorded inputs: ``records[i] = (query, keys, values, scaling)`` of layer ``i``,
    as passed to a cache's ``on_prefill`` callback. Lets an evaluation run one exact prefill per
    prompt and replay the selection for many configurations."""
    cache = JacapCache(model, config=config)
    b, n = prompt_ids.shape
    cache.begin_prefill(None, n, b, prompt_ids.device)
    for index, (layer, (_, keys, values, _)) in enumerate(zip(cache.layers, records)):
        layer.update(keys, values)
    for index, (query, keys, values, scaling) in enumerate(records):
        score_layer(cache, index, query, keys, values, scaling)
    finalize_prefill(cache)
    cache.prompt_ids = prompt_ids.detach().clone()
    return cache
