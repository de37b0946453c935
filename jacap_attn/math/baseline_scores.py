"""Pure tensor functions: the scores of the baseline methods (docs/method.md#baselines).

Shapes as in :mod:`jacap_attn.math.scoring`: every ``<method>_scores`` function returns float32 scores
``[b, h, n]``, higher = keep; nothing here knows about modules, caches or configs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention_stats import all_query_attention
from .scoring import NEG_INF, keep_sinks, pool_scores, ridge_leverage


def snapkv_scores(probs: torch.Tensor, key_valid: torch.Tensor | None = None, *, pooling: str = "avg",
                  kernel: int = 5) -> torch.Tensor:
    """SnapKV (Li et al., 2024, arXiv:2404.14469): window attention summed over the window's
    queries, averaged over the GQA group, pooled. probs ``[b, h, g, w, n]`` -> ``[b, h, n]``."""
    return pool_scores(probs.sum(dim=3).mean(dim=2), pooling, kernel, key_valid)


def tova_scores(probs: torch.Tensor) -> torch.Tensor:
    """TOVA (Oren et al., 2024, arXiv:2401.06104): the last query's attention averaged over all query
    heads of the layer, the same score for every KV head. ``[b, h, g, w, n] -> [b, h, n]``."""
    b, h, _, _, n = probs.shape
    return probs[:, :, :, -1, :].mean(dim=(1, 2))[:, None, :].expand(b, h, n).contiguous()


def h2o_scores(queries: torch.Tensor, keys: torch.Tensor, scaling: float, key_valid: torch.Tensor,
               chunk: int = 512) -> torch.Tensor:
    """H2O (Zhang et al., 2023, arXiv:2306.14048): attention accumulated over *all* prompt queries
    (causal), summed over the GQA group. queries ``[b, h, g, n, d]``; computed in query chunks so the
    ``n x n`` matrix is never materialised. Returns ``[b, h, n]``."""
    b, h, _, n, _ = queries.shape
    total = torch.zeros(b, h, n, device=keys.device, dtype=torch.float32)
    for probs in all_query_attention(queries, keys, scaling, key_valid, chunk):
        total += probs.sum(dim=(2, 3))
    return total


def knorm_scores(keys: torch.Tensor) -> torch.Tensor:
    """KNorm (Devoto et al., 2024, arXiv:2406.11430): keep low-norm keys, score ``-||k_i||``."""
    return -keys.float().norm(dim=-1)


def keydiff_scores(keys: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """KeyDiff (Park et al., 2025, arXiv:2504.15364): keep keys least similar to the mean normalised
    key, score ``-cos(k_i, anchor)``. keys ``[b, h, n, d]`` -> ``[b, h, n]``."""
    unit = F.normalize(keys.float(), dim=-1)
    mask = key_valid[:, None, :, None].float()
    anchor = (unit * mask).sum(2, keepdim=True) / mask.sum(2, keepdim=True).clamp_min(1.0)
    return -(unit * F.normalize(anchor, dim=-1)).sum(-1)


def capkv_scores(window_queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 key_valid: torch.Tensor, *, temperature: float = 5.0, ridge: float = 1.0,
                 sinks: int = 4) -> torch.Tensor:
    """CapKV (arXiv:2604.25975), CapPress formula: ``w_i = exp(tau cos(k_i, qbar))``,
    ``s_i = w_i v_i^T (ridge I + sum_j w_j v_j v_j^T)^-1 v_i`` per query head, averaged over the GQA
    group; the first ``sinks`` tokens always kept.

    Deviation from kvpress's CapPress: the anchor ``qbar`` is the mean of the post-RoPE window
    queries (we never recompute pre-RoPE queries of the whole prompt), not the mean of all
    pre-RoPE queries rotated by an averaged future RoPE matrix.
    window_queries ``[b, h, g, w, d]``; keys/values ``[b, h, n, d]``. Returns ``[b, h, n]``.
    """
    b, h, g, _, d = window_queries.shape
    n = keys.shape[-2]
    anchor = F.normalize(window_queries.float().mean(dim=3), dim=-1)  # [b, h, g, d]
    cos = torch.einsum("bhgd,bhnd->bhgn", anchor, F.normalize(keys.float(), dim=-1))
    logits = (temperature * cos).masked_fill(~key_valid[:, None, None, :], NEG_INF)
    weights = torch.exp(logits - logits.amax(-1, keepdim=True)).reshape(b, h * g, n)
    v = values.float()[:, :, None].expand(b, h, g, n, d).reshape(b, h * g, n, d)
    scores = ridge_leverage(weights, v, ridge, relative=False).reshape(b, h, g, n).mean(2)
    return keep_sinks(scores, key_valid, sinks)


def streaming_scores(key_valid: torch.Tensor, sinks: int, heads: int) -> torch.Tensor:
    """StreamingLLM (Xiao et al., 2024, arXiv:2309.17453): attention sinks plus the most recent
    tokens. Scores rank later positions higher; the first ``sinks`` real positions are forced.
    key_valid ``[b, n]`` -> ``[b, h, n]``."""
    b, n = key_valid.shape
    pos = torch.arange(n, device=key_valid.device, dtype=torch.float32).expand(b, heads, n).clone()
    return keep_sinks(pos, key_valid, sinks)


def random_scores(key_valid: torch.Tensor, heads: int, seed: int, layer: int, first_head: int = 0) -> torch.Tensor:
    """Random eviction (a floor for every method): ``[b, h, n]`` float32 uniform in [0, 1).

    A counter-based hash of ``(seed, layer, head, position)``, the position counted from the row's
    first real token, so a row draws the same scores alone or in any left-padded batch, on any
    device, and the function compiles (no generator state). key_valid ``[b, n]``; the ``heads``
    heads are the model's ``first_head ..`` (a tensor-parallel rank's slice draws what one process
    draws for those heads).
    """
    position = (key_valid.long().cumsum(-1) - 1).clamp_min(0)[:, None, :]  # [b, 1, n]
    head = torch.arange(first_head, first_head + heads, device=key_valid.device)[None, :, None]
    # Tensor arithmetic throughout (under torch.compile, Python-int bit twiddling on symbolic ints is slow).
    seed_t = torch.full((), seed, dtype=torch.int64, device=key_valid.device) & _MASK32
    layer_t = torch.full((), layer, dtype=torch.int64, device=key_valid.device) & _MASK32
    stream = _mix32(_mix32(seed_t ^ 0x9E3779B9) ^ layer_t)
    x = _mix32(_mix32(head ^ stream) ^ position)
    return (x >> 8).to(torch.float32) * 2.0**-24


_MASK32 = 0xFFFFFFFF


def _mix32(x):
    """32-bit integer finaliser on int64 tensors (products stay below 2**59: no overflow)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def max_attention(probs: torch.Tensor) -> torch.Tensor:
    """The bounded observation attention of KVzip (Kim et al., 2025, arXiv:2505.23416, §3.2) and
    Layer-DefensiveKV (Feng et al., 2025, arXiv:2510.13334): each key's largest attention probability
    over the observation queries and the query heads of its GQA group, in [0, 1] and so comparable
    across layers and KV heads (docs/method.md#global-budget).

    probs: ``[b, h, g, w, n]`` float32 window attention (:func:`jacap_attn.math.scoring.window_attention`). Returns float32
    ``[b, h, n]`` (0 at padding)."""
    return probs.amax(dim=(2, 3))


def max_attention_all_queries(queries: torch.Tensor, keys: torch.Tensor, scaling: float, key_valid: torch.Tensor,
                              chunk: int = 512) -> torch.Tensor:
    """:func:`max_attention` over *every* prompt query (causal), for a method that scores with all of
    them (H2O). queries ``[b, h, g, n, d]``, keys ``[b, h, n, d]``, key_valid ``[b, n]``; computed in
    query chunks, so only ``[b, h, g, chunk, n]`` is held at once. Returns float32 ``[b, h, n]``."""
    b, h, _, n, _ = queries.shape
    best = torch.zeros(b, h, n, device=keys.device, dtype=torch.float32)
    for probs in all_query_attention(queries, keys, scaling, key_valid, chunk):
        best = torch.maximum(best, probs.amax(dim=(2, 3)))
    return best
