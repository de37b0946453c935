"""Prefill selection in named steps (docs/architecture.md#prefill-selection).

During the prefill, :func:`score_layer` runs once per layer (called by the registered attention
function right after the exact attention) and stores the method's scores in the cache's
:class:`~jacap_attn.cache.PrefillState`. After the last layer, :func:`finalize_prefill`:

1. :func:`plan_layers`: one :class:`LayerPlan` per pending layer (scores, key validity, window,
   whether the method selects it);
2. :func:`assign_layer_budgets`: tokens per layer under the budget policy, per layer and KV head
   under ``global`` (:func:`jacap_attn.global_budget.global_budgets`; sliding-window layers within their window; rows shorter
   than ``min_tokens`` keep everything);
3. :func:`assign_head_budgets`: tokens per KV head (the method's hook, e.g. Ada-KV; else equal);
4. the method's ``across_layers`` hook (e.g. Jacap's consensus and sinks);
5. :func:`keep_special_tokens`: in a short prompt row, the model's special tokens are kept too;
6. :func:`gather`: top-k per head, the kept K/V moved into each layer's static buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import budget as budgets
from . import global_budget, scoring
from .cache import PENDING, JacapCache
from .layer import JacapLayer
from .config import JacapConfig
from .methods import Method, PrefillInputs

_COMPILED: dict = {}


@dataclass
class LayerPlan:
    """What the selection knows about one pending layer.

    scores: ``[b, h, n]`` float32, higher = keep. head_budgets: ``[b, h]`` int64 tokens to keep
    (set by :func:`assign_layer_budgets` / :func:`assign_head_budgets`). key_valid: ``[b, n]`` bool
    on the layer's device: the tokens the layer can still attend (a sliding-window layer's last
    ``sliding_window - 1`` real tokens). window: last positions always kept (0 for a sliding-window
    layer that keeps its window unscored). parts: the method's extra tensors for this layer
    (:meth:`Method.score_parts`). compressed: whether the method scores and selects this layer (a
    full-attention layer, or a sliding one under :func:`sliding_compressed`; ``False`` for every
    layer without compression: ``ratio=1``, ``full``, a prompt shorter than ``min_tokens``).
    global_heads: its per-head budgets come from the ``global`` policy (the method's
    ``head_budgets`` hook is then not called).
    """

    index: int
    layer: JacapLayer
    scores: torch.Tensor
    key_valid: torch.Tensor
    window: int
    parts: dict = field(default_factory=dict)
    head_budgets: torch.Tensor | None = None
    compressed: bool = True
    global_heads: bool = False


def sliding_compressed(config: JacapConfig, layers) -> bool:
    """Whether the method scores and selects the sliding-window layers among ``layers``: under
    ``sliding="compress"``, and always on a model whose layers all slide (Mistral, Phi3 with
    ``sliding_window`` set), which has no other layer to compress (docs/method.md#sliding-window-layers)."""
    return config.sliding == "compress" or all(layer.is_sliding for layer in layers)


def compresses_prompt(config: JacapConfig, n: int) -> bool:
    """Whether a prefill of ``n`` positions (padding included) evicts anything: the method
    compresses, ``ratio < 1``, and not every row is shorter than ``min_tokens``."""
    return config.compresses and n >= config.min_tokens


def reach(layer: JacapLayer, key_valid: torch.Tensor) -> torch.Tensor:
    """``[b, n]`` bool: the real prompt tokens ``layer`` can attend again after the prompt: all of
    them for full attention, the last ``sliding_window - 1`` positions for a sliding window (the
    decode mask hides the others for ever)."""
    if not layer.is_sliding:
        return key_valid
    n = key_valid.shape[-1]
    return key_valid & (torch.arange(n, device=key_valid.device) >= n - (layer.sliding_window - 1))


def _scored(cache: JacapCache, index: int) -> bool:
    """Whether layer ``index`` of ``cache`` is scored by the method in the prefill under way."""
    cfg: JacapConfig = cache.config
    if not compresses_prompt(cfg, cache.prefill.key_valid.shape[-1]):
        return False
    return not cache.layers[index].is_sliding or sliding_compressed(cfg, cache.layers)


def _sliding_budget(cfg: JacapConfig, n_valid: torch.Tensor, reach_valid: torch.Tensor, all_sliding: bool):
    """``[b]`` budget of a scored sliding-window layer (docs/method.md#sliding-window-layers)."""
    if all_sliding:  # as on any model: ceil(ratio * n), at most what the window can use
        return torch.minimum(budgets.layer_budget(n_valid, cfg.ratio, cfg.window), reach_valid)
    return budgets.layer_budget(reach_valid, cfg.ratio, cfg.window)  # ratio of what the window holds


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


def layer_validity_and_budget(cache: JacapCache, index: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``key_valid [b, n]`` (the tokens layer ``index`` can still attend, :func:`reach`) and the
    layer's mean budget ``[b]`` during ``cache``'s prefill."""
    cfg, layer = cache.config, cache.layers[index]
    key_valid = reach(layer, cache.prefill.key_valid.to(device))
    n_valid = cache.prefill.key_valid.sum(-1).cpu()
    if layer.is_sliding:
        budget = _sliding_budget(cfg, n_valid, key_valid.sum(-1).cpu(), all(x.is_sliding for x in cache.layers))
    else:
        budget = budgets.layer_budget(n_valid, cfg.ratio, cfg.window)
    return key_valid, budget


def build_inputs(cache: JacapCache, index: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 scaling: float) -> tuple[PrefillInputs, torch.Tensor | None] | None:
    """The :class:`PrefillInputs` of layer ``index`` during ``cache``'s prefill (``query [b, Hq, n, d]``,
    ``keys/values [b, h, n, d]`` post-RoPE), and the window attention ``[b, h, g, w, n]`` when the
    method or the ``capacity`` budget needs it; ``None`` for a layer the method does not score."""
    cfg: JacapConfig = cache.config
    if not _scored(cache, index):
        return None
    method = cfg.method
    b, hq, n, d = query.shape
    h = keys.shape[1]
    # A sliding-window layer is scored over the tokens it can still attend (the others look like
    # left padding to the method, and are dropped).
    key_valid, budget = layer_validity_and_budget(cache, index, keys.device)
    w = min(cfg.window, n)
    window_queries = query[:, :, n - w:].reshape(b, h, hq // h, w, d)
    want_probs = method.needs_window_attention or cfg.budget == "capacity" or (
        global_budget.ranks_attention(cfg) and not method.needs_all_queries)
    probs = scoring.window_attention(window_queries, keys, scaling, key_valid) if want_probs else None
    inputs = PrefillInputs(
        queries=window_queries, keys=keys, values=values, key_valid=key_valid, scaling=float(scaling),
        layer_index=index, budget=budget,
        adaptive=cfg.budget != "uniform", probs=probs if method.needs_window_attention else None,
        all_queries=query.reshape(b, h, hq // h, n, d) if method.needs_all_queries else None)
    return inputs, probs


def score_layer(cache: JacapCache, index: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                scaling: float) -> None:
    """Score layer ``index`` of ``cache`` from the prefill's post-RoPE ``query [b, Hq, n, d]`` and
    ``keys/values [b, h, n, d]``; the result goes to ``cache.prefill.parts[index]``. Calls the
    cache's ``on_prefill(index, query, keys, values, scaling)`` first, if set. On CUDA with
    ``compile=True`` the method's scoring runs compiled (:func:`compiled_scorer`)."""
    if cache.on_prefill is not None:
        cache.on_prefill(index, query, keys, values, scaling)
    cfg, method = cache.config, cache.config.method
    if cfg.queries == "repeat":
        if _scored(cache, index):  # scored after the repeat pass (repeat.score_deferred)
            b, hq, n, d = query.shape
            h, w = keys.shape[1], min(cfg.window, n)
            cache.prefill.deferred[index] = (query[:, :, n - w:].reshape(b, h, hq // h, w, d), float(scaling))
        return
    built = build_inputs(cache, index, query, keys, values, scaling)
    if built is None:
        return
    inputs, probs = built
    use_compiled = cfg.compile and keys.device.type == "cuda" and method.compilable
    parts = checked_parts(method, (compiled_scorer(method) if use_compiled else method.score_parts)(inputs),
                           tuple(keys.shape[:3]))
    if cfg.budget == "capacity":
        weights = parts.get("weights")
        parts["need"] = budgets.capacity_need(probs.sum(dim=(2, 3)) if weights is None else weights,
                                              inputs.key_valid)
    if global_budget.ranks_attention(cfg):  # [b, h, n] only: the [b, h, g, w, n] attention is not kept
        parts[global_budget.GLOBAL_ATTENTION] = global_budget.observation_peak(inputs, probs, method)
    cache.prefill.parts[index] = parts


def checked_parts(method: Method, parts, shape: tuple) -> dict:
    """The method's output, checked: a dict whose ``"scores"`` is a real floating tensor of ``shape``
    ``[b, h, n]`` (else a ``ValueError`` naming the method), as float32, NaN ranked last (a NaN never
    displaces the window or another token)."""
    name = method.name or type(method).__qualname__
    if not isinstance(parts, dict) or "scores" not in parts:
        raise ValueError(f"method {name!r}: score_parts must return a dict with 'scores', got {type(parts).__name__}")
    scores = parts["scores"]
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point() or tuple(scores.shape) != shape:
        got = f"{type(scores).__name__} {tuple(getattr(scores, 'shape', ()))} {getattr(scores, 'dtype', '')}"
        raise ValueError(f"method {name!r}: score must return a float tensor [b, h, n] = {list(shape)}, got {got}")
    scores = scores.float()
    return {**parts, "scores": torch.nan_to_num(scores, nan=float("-inf"))}


def plan_layers(cache: JacapCache) -> list[LayerPlan]:
    """Step 1: a plan per pending layer. Layers the method does not select rank by recency (a
    sliding-window layer kept unscored keeps its window; without compression every token)."""
    key_valid = cache.prefill.key_valid
    n = key_valid.shape[-1]
    plans = []
    for index, layer in enumerate(cache.layers):
        if layer.state != PENDING:
            continue
        device, h = layer.keys.device, layer.keys.shape[1]
        parts = dict(cache.prefill.parts.get(index, {}))
        scores = parts.pop("scores", None)
        scored = _scored(cache, index) and scores is not None
        if not scored:
            scores = torch.arange(n, device=device, dtype=torch.float32).expand(key_valid.shape[0], h, n)
        window = 0 if layer.is_sliding and not scored else cache.config.window
        valid = reach(layer, key_valid.to(device)) if scored else key_valid.to(device)
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
            keep = _sliding_budget(cfg, n_valid, can, all_sliding)[:, None].expand(-1, h)
        else:
            keep = can[:, None].expand(-1, h)
        keep = torch.where(short[:, None], can[:, None], keep)
        plan.head_budgets = keep.to(plan.scores.device)


def _attendable(layer: JacapLayer, n_valid: torch.Tensor) -> torch.Tensor:
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


def gather(cache: JacapCache, plans: list[LayerPlan]) -> None:
    """Step 6: top-k per (row, KV head), the window always kept; each layer compressed into static
    buffers of its own capacity, ``bucket(largest kept count of the layer + room for the tokens to
    come)`` (docs/cache.md#capacity-buckets-and-growth): a layer whose heads keep few tokens does not
    pad to the layer that keeps most (per-head budgets of the ``global`` policy differ by layer)."""
    key_valid = cache.prefill.key_valid
    n = key_valid.shape[-1]
    pads = n - key_valid.sum(-1).cpu()
    room = cache.config.reserve if cache.max_length is None else max(cache.max_length - n, 1)
    for plan in plans:
        layer = plan.layer
        capacity = budgets.bucket(int(plan.head_budgets.max()) + room)
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
    if cache.prefill.deferred:
        from .repeat import score_deferred  # the repeat pass's module reads this one's steps

        score_deferred(cache)
    plans = plan_layers(cache)
    assign_layer_budgets(plans, cfg, cache.prefill.key_valid.sum(-1).cpu())
    assign_head_budgets(plans, cfg)
    compressed = [p for p in plans if p.compressed]
    if compressed:
        cfg.method.across_layers(compressed, cache.prefill.key_valid, cfg.window)
    keep_special_tokens(cache, plans)
    gather(cache, plans)
    cache.prompt_kept = [layer.kept_counts().cpu() for layer in cache.layers]
    cache.prefill = None


def compress_recorded(model, records: list, config: JacapConfig, prompt_ids: torch.Tensor, *,
                      parts: dict | None = None, observed: dict | None = None) -> JacapCache:
    """The compressed cache a patched prefill of ``prompt_ids [b, n]`` (no padding) would make under
    ``config``, from recorded inputs: ``records[i] = (query, keys, values, scaling)`` of layer ``i``,
    as passed to a cache's ``on_prefill`` callback. Lets an evaluation run one exact prefill per
    prompt and replay the selection for many configurations. ``model`` must be patched.

    ``parts``: scores shared between calls with the same ``records`` and configs that differ only
    in ``ratio``. An empty dict is filled with this call's per-layer scores (before selection);
    a filled one is used (copied) instead of scoring again. Valid only when the method's scores do
    not depend on the ratio (``not config.method.reads_budget``, else ``ValueError``).

    ``observed`` (``queries="repeat"`` only): the repeat pass's statistics shared between calls with
    the same ``records`` (:func:`jacap_attn.repeat.observe_shared`): an empty dict is filled by this
    call's pass, a filled one spares it. ``None``: this call runs its own pass."""
    if parts is not None and config.method.reads_budget:
        raise ValueError(f"method {config.method.name!r} reads the budget: its scores cannot be reused across ratios")
    if observed is not None and config.queries != "repeat":
        raise ValueError(f"observed= holds repeat-pass statistics; this config has queries={config.queries!r}")
    cache = JacapCache(model, config=config)
    b, n = prompt_ids.shape
    cache.begin_prefill(None, n, b, prompt_ids.device)
    for layer, (_, keys, values, _) in zip(cache.layers, records):
        layer.update(keys, values)
    cache.prompt_ids = prompt_ids.detach().clone()  # as the patched model's pre-hook sets it
    if parts:
        cache.prefill.parts = _copied(parts)  # the selection steps may change the scores in place
    else:
        for index, (query, keys, values, scaling) in enumerate(records):
            score_layer(cache, index, query, keys, values, scaling)
        if cache.prefill.deferred:  # queries="repeat": the pass, then the deferred scoring
            from .repeat import observe_shared, score_deferred

            observe_shared(model, cache, {} if observed is None else observed)
            score_deferred(cache)
        if parts is not None:
            parts.update(_copied(cache.prefill.parts))
    finalize_prefill(cache)
    return cache


def _copied(parts: dict) -> dict:
    return {index: {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in layer.items()}
            for index, layer in parts.items()}
