"""Attention of blocks of queries over the prompt's keys, and the per-token statistics methods score
from: the repeat pass's chunks (docs/method.md#question-agnostic-scoring) and every prompt query
(H2O). Pure tensor functions, as :mod:`jacap_attn.scoring`; shapes as there (``b`` batch, ``h`` KV
heads, ``g`` GQA group, ``n`` prompt length, ``d`` head dim)."""

from __future__ import annotations

import torch

from .scoring import NEG_INF


def repeat_attention(queries: torch.Tensor, keys: torch.Tensor, own_keys: torch.Tensor, scaling: float,
                     key_valid: torch.Tensor, own_valid: torch.Tensor) -> torch.Tensor:
    """Attention that the prompt's entries receive from the queries of one chunk of the repeat pass
    (docs/method.md#question-agnostic-scoring; KVzip, Kim et al., 2025, arXiv:2505.23416, §3.2).

    The chunk's ``c`` tokens follow the whole prompt, so each query sees every valid prompt key and,
    causally, the chunk's own keys; the softmax runs over both, as in the pass itself, and the
    prompt's columns are returned (a row sums to at most 1: the rest is on the chunk's own tokens,
    which are not candidates).

    queries: ``[b, h, g, c, d]`` post-RoPE, grouped by KV head; keys: ``[b, h, n, d]`` the prompt's;
    own_keys: ``[b, h, c, d]`` the chunk's; key_valid: ``[b, n]`` bool (False at left padding, or
    beyond a sliding window's reach); own_valid: ``[b, c]`` bool (False at the replayed padding).
    Returns float32 ``[b, h, g, c, n]``, rows of invalid queries zero. Memory ``O(c (n + c))`` per head.
    """
    c = queries.shape[3]
    q = queries.float()
    # In place on fresh tensors (same values as out-of-place ops): the [.., c, n] blocks are large
    # and memory-bound, and each new one costs an allocation (page faults on the CPU).
    prompt = torch.einsum("bhgcd,bhnd->bhgcn", q, keys.float()).mul_(scaling)
    own = torch.einsum("bhgcd,bhed->bhgce", q, own_keys.float()).mul_(scaling)
    prompt.masked_fill_(~key_valid[:, None, None, None, :], NEG_INF)
    causal = torch.ones(c, c, dtype=torch.bool, device=keys.device).tril()
    own.masked_fill_(~(causal[None, None, None] & own_valid[:, None, None, None, :]), NEG_INF)
    probs = torch.softmax(torch.cat([prompt, own], dim=-1), dim=-1)[..., : keys.shape[-2]].contiguous()
    return probs.nan_to_num_(nan=0.0).mul_(own_valid[:, None, None, :, None])


STATISTICS = ("mass", "peak", "sq", "sq_dist")


def attention_statistics(probs: torch.Tensor, keys: torch.Tensor, names) -> dict:
    """Per-token statistics of one block of queries' attention, each ``[b, h, n]`` float32, that a
    method scores from and that add up (``mass``, ``sq``, ``sq_dist``: sums over queries) or combine by
    maximum (``peak``) over the query chunks of the repeat pass (docs/method.md#question-agnostic-scoring):

    * ``mass``: ``sum_t p_ti`` averaged over the GQA group (SnapKV's score before pooling, Jacap's
      attention mass);
    * ``peak``: ``max_t p_ti`` over the queries and the GQA group (KVzip's score, :func:`max_attention`);
    * ``sq``: ``sum_t p_ti^2`` and ``sq_dist``: ``sum_t p_ti^2 ||k_i - kbar_t||^2`` over the queries and
      the GQA group, with ``kbar_t`` the attention-weighted mean key of query ``t`` over these keys:
      Jacap's importance weight is ``sq + beta s^2 sq_dist`` (:func:`jacap_weights`).

    probs: ``[b, h, g, t, n]`` float32 (window or repeat attention); keys: ``[b, h, n, d]``; names:
    which to compute (a subset of :data:`STATISTICS`; ``ValueError`` for another name)."""
    unknown = sorted(set(names) - set(STATISTICS))
    if unknown:
        raise ValueError(f"unknown attention statistic(s) {unknown}; known: {', '.join(STATISTICS)}")
    out = {}
    if "mass" in names:
        out["mass"] = probs.sum(dim=3).mean(dim=2)
    if "peak" in names:
        out["peak"] = probs.amax(dim=(2, 3))
    if "sq" in names or "sq_dist" in names:
        b, h, g, t, n = probs.shape
        p = probs.reshape(b, h, g * t, n)
        p2 = p * p
        if "sq" in names:
            out["sq"] = p2.sum(dim=2)
        if "sq_dist" in names:
            k = keys.float()
            kbar = (p @ k) / p.sum(-1, keepdim=True).clamp_min(1e-30)  # [b, h, T, d]
            # ||k_i||^2 - 2 k_i.kbar_t + ||kbar_t||^2, in place on the one [b, h, T, n] product
            # (the same values as out of place, without three more blocks of that size).
            dist2 = (kbar @ k.transpose(-1, -2)).mul_(-2.0).add_((k * k).sum(-1)[:, :, None, :]) \
                .add_((kbar * kbar).sum(-1)[..., None])
            out["sq_dist"] = dist2.clamp_min_(0.0).mul_(p2).sum(dim=2)
    return out


def all_query_attention(queries: torch.Tensor, keys: torch.Tensor, scaling: float, key_valid: torch.Tensor,
                         chunk: int):
    """Causal attention of every prompt query, one chunk of ``chunk`` queries at a time: yields
    float32 ``[b, h, g, c, n]`` (``c <= chunk``), the rows of pad queries zeroed."""
    n = queries.shape[3]
    k = keys.float()
    positions = torch.arange(n, device=keys.device)
    for start in range(0, n, chunk):
        q = queries[:, :, :, start:start + chunk].float()
        logits = torch.einsum("bhgqd,bhnd->bhgqn", q, k) * scaling
        allowed = positions[None, :] <= positions[start:start + chunk, None]
        allowed = allowed[None, None, None] & key_valid[:, None, None, None, :]
        probs = torch.nan_to_num(torch.softmax(logits.masked_fill(~allowed, NEG_INF), -1), nan=0.0)
        # Pad queries see nothing useful; drop their rows.
        yield probs * key_valid[:, None, None, start:start + chunk, None]
