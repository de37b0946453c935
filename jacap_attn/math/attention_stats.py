"""Attention of blocks of queries over the prompt's keys, and the per-token statistics methods score
from: the repeat pass's chunks (docs/method.md#question-agnostic-scoring) and every prompt query
(H2O). Pure tensor functions, as :mod:`jacap_attn.math.scoring`; shapes as there (``b`` batch, ``h`` KV
heads, ``g`` GQA group, ``n`` prompt length, ``d`` head dim)."""

from __future__ import annotations

import torch

from .scoring import NEG_INF, squared_weights


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

# Elements of one block of logits in chunk_statistics: about 4 MB of float32 on the CPU (a block
# stays in cache, and the logits' buffer is reused instead of faulting in fresh pages); on CUDA
# blocks as large as the whole chunk's attention of a small model (fewer, larger kernels).
BLOCK_ELEMENTS = {"cpu": 1 << 20}
DEFAULT_BLOCK_ELEMENTS = 1 << 27


def chunk_statistics(queries: torch.Tensor, keys: torch.Tensor, scaling: float, key_valid: torch.Tensor,
                     own_valid: torch.Tensor, names, values: torch.Tensor | None = None, *,
                     block_elements: int | None = None):
    """The statistics ``names`` of one repeat-pass chunk's attention over the prompt, and optionally
    the chunk's attention output, without materialising the chunk's attention more than one block of
    query rows at a time (docs/method.md#question-agnostic-scoring).

    Equal, within float32 rounding, to :func:`reference_chunk_statistics` (the probabilities
    materialised, then the definitions of :func:`attention_statistics`). Per block of query rows of
    every (batch row, KV head): the logits over the prompt's and the chunk's own
    keys (one matmul; the GQA group is folded into the rows, keys never repeated), their softmax,
    then ``mass`` and ``peak`` as column sums and maxima of the prompt's columns, and the squares
    summed through matmuls instead of ``[t, n]`` products: with ``kbar_t = sum_i p_ti k_i / sum_i
    p_ti`` (one matmul of the probabilities against ``[k | 1]``), ``sq_i = sum_t p_ti^2``,
    ``sq_dist_i = ||k_i||^2 sq_i - 2 k_i . sum_t p_ti^2 kbar_t + sum_t p_ti^2 ||kbar_t||^2`` (one
    matmul of the squares against ``[kbar | ||kbar||^2 | 1]``, accumulated over the blocks; clamped
    at 0 once, where the reference clamps each ``||k_i - kbar_t||^2``). Every sum accumulates in
    float32.

    queries: ``[b, h, g, c, d]`` post-RoPE, grouped by KV head; keys ``[b, h, n + c, d]`` the
    prompt's then the chunk's own (what the chunk attends); key_valid ``[b, n]`` bool, own_valid
    ``[b, c]`` bool (as :func:`repeat_attention`); names: a subset of :data:`STATISTICS`
    (``ValueError`` for another); values ``[b, h, n + c, dv]``: if given, the chunk's attention
    output is computed from the same probabilities (the softmax over the prompt and, causally, the
    chunk; rows of invalid queries attend as valid ones do). block_elements: logits per block
    (default :data:`BLOCK_ELEMENTS` by device type).

    Returns ``(stats, out)``: ``stats`` ``{name: [b, h, n] float32}``; ``out`` ``[b, h, g, c, dv]`` in
    the queries' dtype, or ``None`` without ``values``. Memory: one block of ``[b h, rows, n + c]``
    float32 twice, plus ``[b h, n, d + 2]`` accumulators."""
    names = _checked_names(names)
    b, h, g, c, d = queries.shape
    n, rows, width = key_valid.shape[-1], g * c, keys.shape[2]
    heads, device = b * h, keys.device
    if block_elements is None:
        block_elements = BLOCK_ELEMENTS.get(device.type, DEFAULT_BLOCK_ELEMENTS)
    block = max(1, min(rows, block_elements // (heads * width)))
    q = queries.float().reshape(heads, rows, d) * scaling
    all_keys = keys.float().reshape(heads, width, d)
    keys_t, prompt_keys = all_keys.transpose(1, 2), all_keys[:, :n]
    # Right-hand sides of the one matmul of the probabilities: the values (the output, over all
    # columns), then, over the prompt's columns only, [k | 1] for kbar (sq_dist) or nothing.
    sides = []
    if values is not None:
        sides.append(values.float().reshape(heads, width, -1))
    distances = "sq_dist" in names
    if distances:
        sides.append(torch.cat([torch.cat([prompt_keys, prompt_keys.new_ones(heads, n, 1)], dim=-1),
                                prompt_keys.new_zeros(heads, c, d + 1)], dim=1))
    right = torch.cat(sides, dim=-1) if sides else None
    dv = values.shape[-1] if values is not None else 0
    # The chunk's own columns: causal, and only its valid tokens; query row r is chunk token r % c.
    own_allowed = torch.ones(c, c, dtype=torch.bool, device=device).tril()[None] & own_valid[:, None, :]
    own_bias = torch.zeros(b, c, c, device=device).masked_fill_(~own_allowed, NEG_INF)
    prompt_masked = not bool(key_valid.all())
    prompt_hidden = (~key_valid)[:, None, None, :]
    rows_masked = not bool(own_valid.all())
    row_valid = own_valid.float()[:, None, None, :].expand(b, h, g, c).reshape(heads, rows, 1)
    mass = torch.zeros(heads, n, device=device) if "mass" in names else None
    peak = torch.zeros(heads, n, device=device) if "peak" in names else None
    squares = None  # sum_t p^2 [kbar | ||kbar||^2 | 1] [heads, n, d + 2] with sq_dist, else sum_t p^2 [heads, n]
    if distances or "sq" in names:
        squares = torch.zeros(heads, n, *((d + 2,) if distances else ()), device=device)
    out = torch.empty(heads, rows, dv, device=device) if values is not None else None
    logits = torch.empty(heads, block, width, device=device)
    for start in range(0, rows, block):
        r = min(block, rows - start)
        part = logits[:, :r]
        torch.bmm(q[:, start:start + r], keys_t, out=part)
        view = part.view(b, h, r, width)
        token = torch.arange(start, start + r, device=device) % c
        view[..., n:].add_(own_bias[:, None, token])
        if prompt_masked:
            view[..., :n].masked_fill_(prompt_hidden, NEG_INF)
        probs = torch.softmax(part, dim=-1)
        if prompt_masked or rows_masked:
            probs.nan_to_num_(nan=0.0)
        if right is not None:
            product = torch.bmm(probs, right)
            if out is not None:
                out[:, start:start + r] = product[..., :dv]
        if rows_masked:
            probs.mul_(row_valid[:, start:start + r])
        prompt = probs[..., :n]
        if mass is not None:
            mass.add_(prompt.sum(dim=1))
        if peak is not None:
            torch.maximum(peak, prompt.amax(dim=1), out=peak)
        if squares is None:
            continue
        prompt.mul_(prompt)
        if not distances:
            squares.add_(prompt.sum(dim=1))
            continue
        kbar = product[..., dv:dv + d] / product[..., dv + d:].clamp_min(1e-30)
        weights = torch.cat([kbar, (kbar * kbar).sum(-1, keepdim=True), torch.ones_like(kbar[..., :1])], dim=-1)
        squares.baddbmm_(prompt.transpose(1, 2), weights)
    stats = {}
    if mass is not None:
        stats["mass"] = (mass / g).reshape(b, h, n)
    if peak is not None:
        stats["peak"] = peak.reshape(b, h, n)
    if squares is not None:
        sq = squares[..., d + 1] if distances else squares
        if "sq" in names:
            stats["sq"] = sq.reshape(b, h, n)
        if distances:
            dist = ((prompt_keys * prompt_keys).sum(-1) * sq - 2.0 * (prompt_keys * squares[..., :d]).sum(-1)
                    + squares[..., d])
            stats["sq_dist"] = dist.clamp_min_(0.0).reshape(b, h, n)
    if out is not None:
        out = out.reshape(b, h, g, c, dv).to(queries.dtype)
    return stats, out


def reference_chunk_statistics(queries: torch.Tensor, keys: torch.Tensor, scaling: float, key_valid: torch.Tensor,
                               own_valid: torch.Tensor, names, values=None, **_) -> tuple[dict, None]:
    """:func:`chunk_statistics` by the definitions: the chunk's probabilities materialised
    (:func:`repeat_attention`), then :func:`attention_statistics`; no output (``values`` ignored).
    What the pass computed before the blocked statistics: the reference of the tests and of
    ``eval/repeat_pass_variants.py``. Same arguments and shapes."""
    n = key_valid.shape[-1]
    probs = repeat_attention(queries, keys[:, :, :n], keys[:, :, n:], scaling, key_valid, own_valid)
    return attention_statistics(probs, keys[:, :, :n], names), None


def _checked_names(names) -> set:
    """``names`` as a set; ``ValueError`` naming any that is not in :data:`STATISTICS`."""
    names = set(names)
    unknown = sorted(names - set(STATISTICS))
    if unknown:
        raise ValueError(f"unknown attention statistic(s) {unknown}; known: {', '.join(STATISTICS)}")
    return names


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
    names = _checked_names(names)
    out = {}
    if "mass" in names:
        out["mass"] = probs.sum(dim=3).mean(dim=2)
    if "peak" in names:
        out["peak"] = probs.amax(dim=(2, 3))
    if "sq" in names or "sq_dist" in names:
        b, h, g, t, n = probs.shape
        p = probs.reshape(b, h, g * t, n)
        if "sq_dist" in names:
            k = keys.float()
            kbar = (p @ k) / p.sum(-1, keepdim=True).clamp_min(1e-30)  # [b, h, T, d]
            sq, out["sq_dist"] = squared_weights(p, k, kbar)
        else:
            sq = (p * p).sum(dim=2)
        if "sq" in names:
            out["sq"] = sq
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
