"""The registered attention function: exact prefill plus scoring, then decode over the kept slots.

``jacap_attention`` is registered with transformers' ``AttentionInterface`` under
``jacap_sdpa`` / ``jacap_eager`` (see :mod:`jacap_attn.patching`); the patched attention-module
forward passes the layer's :class:`~jacap_attn.cache.JacapLayer` as ``jacap_layer``. Three cases:

* no Jacap layer (no cache, or another cache type): the stock attention, unchanged;
* a pending layer (the prefill): the stock attention over the full prompt (exact outputs), then the
  layer's scores from its window queries (:func:`score_layer`);
* a compressed layer: :func:`decode_attention` over the static buffers with the layer's own mask.

:func:`finalize_prefill` runs after the last layer: budgets, top-k, gather into the cache.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from . import budget as budgets
from . import scoring
from .budget import bucket
from .cache import PENDING, JacapCache
from .config import JacapConfig


def stock_attention(impl: str):
    """The original attention function for ``impl`` (``"sdpa"`` or ``"eager"``)."""
    if impl == "eager":
        def eager(module, *args, **kwargs):
            return sys.modules[type(module).__module__].eager_attention_forward(module, *args, **kwargs)
        return eager
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return ALL_ATTENTION_FUNCTIONS[impl]


def make_attention_function(impl: str):
    """Build the function registered as ``jacap_<impl>``."""
    stock = stock_attention(impl)

    def jacap_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        jacap_layer=None, **kwargs):
        if jacap_layer is None:
            return stock(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        if jacap_layer.state == PENDING:
            out = stock(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
            score_layer(jacap_layer, query, key, value, scaling)
            return out
        return decode_attention(query, key, value, jacap_layer.attention_mask(query.shape[-2]), scaling), None

    jacap_attention.__name__ = f"jacap_{impl}_attention"
    return jacap_attention


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """SDPA of ``query [b, Hq, q, d]`` over the static buffers ``keys/values [b, h, C, d]`` with the
    per-KV-head mask ``[b, h, q, C]``. The GQA group is folded into the query axis, so K/V are never
    repeated to query heads. Returns ``[b, q, Hq, d]`` (the layout transformers expects)."""
    b, hq, q, d = query.shape
    h, c = keys.shape[1], keys.shape[2]
    g = hq // h
    folded = query.reshape(b, h, g * q, d)
    mask = mask[:, :, None].expand(b, h, g, q, c).reshape(b, h, g * q, c)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, q, values.shape[-1]).transpose(1, 2).contiguous()


def score_layer(layer, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> None:
    """Compute the layer's scores ``[b, h, n]`` (float32) and budget demand from the prefill's
    post-RoPE ``query [b, Hq, n, d]`` and ``keys/values [b, h, n, d]``; stored on the layer."""
    cfg: JacapConfig = layer.config
    if layer.is_sliding or not cfg.compresses:
        return
    b, hq, n, d = query.shape
    h = keys.shape[1]
    g = hq // h
    key_valid = layer.key_valid.to(keys.device)
    w = min(cfg.window, n)
    window_queries = query[:, :, n - w:].reshape(b, h, g, w, d)
    method = cfg.method
    needs_probs = method in ("jacap", "snapkv", "pyramidkv", "tova", "adakv") or cfg.budget == "capacity"
    probs = scoring.window_attention(window_queries, keys, scaling, key_valid) if needs_probs else None
    weights = None
    if method == "jacap":
        steps = 0
        if cfg.selector == "greedy":
            # Picks per row: its layer budget (exact for uniform budgets), twice the mean budget for
            # the adaptive ones (beyond it the ranking is the leverage conditional on the picks).
            mean = budgets.layer_budget(key_valid.sum(-1), cfg.ratio, cfg.window).to(keys.device)
            steps = (mean if cfg.budget == "uniform" else 2 * mean) - w
        leverage, weights = scoring.jacap_scores(probs, keys, values, key_valid, scaling=scaling, beta=cfg.beta,
                                                 ridge=cfg.resolved_ridge(), pooling=cfg.pooling,
                                                 kernel=cfg.resolved_kernel(), selector=cfg.selector,
                                                 steps=steps, window=w)
        layer.leverage = leverage  # the cross-layer consensus reads the leverage alone
        scores = scoring.add_attention_mass(leverage, probs, key_valid, cfg.resolved_mass())
    elif method in ("snapkv", "pyramidkv", "adakv"):
        scores = scoring.snapkv_scores(probs, key_valid, pooling=cfg.pooling, kernel=cfg.resolved_kernel())
    elif method == "tova":
        scores = scoring.tova_scores(probs)
    elif method == "h2o":
        scores = scoring.h2o_scores(query.reshape(b, h, g, n, d), keys, scaling, key_valid)
    elif method == "knorm":
        scores = scoring.knorm_scores(keys)
    elif method == "keydiff":
        scores = scoring.keydiff_scores(keys, key_valid)
    elif method == "capkv":
        scores = scoring.capkv_scores(window_queries, keys, values, key_valid, temperature=cfg.temperature,
                                      ridge=cfg.resolved_ridge(), sinks=cfg.sinks)
    elif method == "streaming_llm":
        scores = scoring.streaming_scores(key_valid, cfg.sinks, h)
    elif method == "random":
        scores = scoring.random_scores(b, h, n, cfg.seed + 7919 * layer.index, keys.device)
    else:  # pragma: no cover - JacapConfig validates the method
        raise ValueError(f"unknown method {method!r}")
    layer.scores = scores
    if cfg.budget == "capacity":
        if weights is None:
            weights = probs.sum(dim=(2, 3))
        layer.need = budgets.capacity_need(weights, key_valid)


def _layer_budgets(cfg: JacapConfig, n_valid: torch.Tensor, layers) -> torch.Tensor:
    """``[b, L_compressed]`` budgets of the compressed layers under ``cfg.budget``."""
    count = len(layers)
    if not cfg.compresses:
        return n_valid[:, None].expand(-1, count).clone()
    if cfg.budget == "uniform":
        return budgets.uniform_budgets(n_valid, cfg.ratio, cfg.window, count)
    if cfg.budget == "pyramid":
        return budgets.pyramid_budgets(n_valid, cfg.ratio, cfg.window, count, cfg.pyramid_beta)
    need = torch.stack([layer.need.to(n_valid.device) for layer in layers], dim=-1)
    return budgets.capacity_budgets(need, n_valid, cfg.ratio, cfg.window, cfg.capacity_alpha)


def finalize_prefill(cache: JacapCache) -> None:
    """Select and gather every pending layer of ``cache`` (called after the prefill's last layer).

    Budgets come from ``cache.config`` over the full-attention layers; sliding-window layers keep
    their most recent ``sliding_window - 1`` tokens. All layers share one capacity: the largest
    kept count plus room for the tokens still to come, rounded up to a bucket.
    """
    layers = [layer for layer in cache.layers if layer.state == PENDING]
    if not layers:
        return
    cfg = cache.config
    key_valid = layers[0].key_valid
    n = key_valid.shape[-1]
    n_valid = key_valid.sum(-1).cpu()
    pads = n - n_valid
    full = [layer for layer in layers if not layer.is_sliding]
    per_layer = dict(zip(map(id, full), _layer_budgets(cfg, n_valid, full).unbind(-1))) if full else {}
    plans = []
    for layer in layers:
        h = layer.keys.shape[1]
        device = layer.keys.device
        valid = key_valid.to(device)
        if layer.is_sliding:
            keep = torch.minimum(n_valid, torch.tensor(layer.sliding_window - 1))
            scores = torch.arange(n, device=device, dtype=torch.float32).expand(valid.shape[0], h, n)
            window = 0
        else:
            keep = per_layer[id(layer)]
            scores = layer.scores if layer.scores is not None else torch.zeros(valid.shape[0], h, n, device=device)
            window = cfg.window
        head_budgets = keep[:, None].expand(-1, h).clone()
        if cfg.method == "adakv" and cfg.compresses and not layer.is_sliding:
            head_budgets = budgets.adakv_head_budgets(scores, keep.to(device), valid, cfg.window, cfg.adakv_alpha).cpu()
        plans.append((layer, scores, head_budgets.to(device), valid, window))
    if cfg.method == "jacap" and cfg.consensus > 0 and cfg.compresses and full:
        consensus = scoring.consensus_scores([p[0].leverage for p in plans if not p[0].is_sliding], key_valid)
        # The sinks are kept anyway: they must not spend the consensus share (nor drag the tokens
        # after them in through the forward pooling).
        sinks = scoring.first_valid(key_valid, cfg.sinks)
        consensus = consensus.masked_fill(sinks.to(consensus.device), 0.0)
        consensus = scoring.pool_scores(consensus[:, None], "forward", cfg.consensus_kernel)[:, 0]
        plans = [(layer, scoring.blend_consensus(scores, consensus.to(scores.device), hb, window, cfg.consensus,
                                                 sinks.sum(-1).to(hb.device))
                  if not layer.is_sliding else scores, hb, valid, window)
                 for layer, scores, hb, valid, window in plans]
    if cfg.method == "jacap" and cfg.sinks and cfg.compresses:
        plans = [(layer, scores if layer.is_sliding else scoring.keep_sinks(scores, valid, cfg.sinks),
                  hb, valid, window) for layer, scores, hb, valid, window in plans]
    kept_max = max(int(p[2].max()) for p in plans)
    room = cfg.reserve if cache.max_length is None else max(cache.max_length - n, 1)
    capacity = bucket(kept_max + room)
    for layer, scores, head_budgets, valid, window in plans:
        indices, kept = scoring.select_indices(scores, head_budgets, valid, window)
        gather = indices[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
        keys = layer.keys.gather(2, gather)
        values = layer.values.gather(2, indices[..., None].expand(-1, -1, -1, layer.values.shape[-1]))
        layer_pads = pads.to(indices.device)
        layer.compress(keys, values, indices - layer_pads[:, None, None], kept, capacity, n, layer_pads)
    cache.prompt_kept = [layer.kept_counts().cpu() for layer in cache.layers]
