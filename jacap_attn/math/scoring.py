"""Pure tensor functions: window attention, Jacap scores, the scores the ``global`` budget compares,
and top-k selection (the baselines' scores are in :mod:`jacap_attn.math.baseline_scores`).

Shapes (docs/method.md#notation): ``b`` batch, ``h`` KV heads, ``g`` query heads per KV head (GQA group),
``w`` window length, ``n`` prompt length, ``d`` head dim. Every ``<method>_scores`` function returns
float32 scores ``[b, h, n]``, higher = keep. Nothing here knows about modules, caches or configs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .budget import free_budget
from .ranking import in_top, ranking_keys, top_order

NEG_INF = float("-inf")
POOLINGS = ("avg", "max", "forward", "none")


def window_attention(window_queries: torch.Tensor, keys: torch.Tensor, scaling: float,
                     key_valid: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of the observation-window queries over the whole prompt.

    Parameters
    ----------
    window_queries: ``[b, h, g, w, d]`` post-RoPE queries of the last ``w`` prompt positions, grouped
        by the KV head they read (GQA).
    keys: ``[b, h, n, d]`` post-RoPE keys, exactly as stored in the cache.
    scaling: the module's attention scale ``s`` (``1/sqrt(d)`` for most models).
    key_valid: ``[b, n]`` bool, False at padding positions; or ``[b, h, n]``, per KV head (the held
        entries of a compressed cache at question-time reselection, docs/method.md#question-time-reselection).

    Returns
    -------
    ``p`` of shape ``[b, h, g, w, n]``, float32; rows sum to 1 over valid causal keys (docs/method.md#window-attention).
    """
    b, h, g, w, d = window_queries.shape
    n = keys.shape[-2]
    queries = (window_queries.float() * scaling).reshape(b, h, g * w, d)  # scaled here, not the w x n logits
    logits = torch.matmul(queries, keys.float().transpose(-1, -2)).view(b, h, g, w, n)
    # Masked in place: padding in every row (one broadcast pass; on the CPU, outside compiled code, none where every
    # key is valid: no host sync elsewhere), the causal triangle only in the window's own w x w block.
    if padded := key_valid.device.type != "cpu" or torch.compiler.is_compiling() or not bool(key_valid.all()):
        logits.masked_fill_(~key_valid.view(b, -1, 1, 1, n), NEG_INF)  # [b, 1 or h, 1, 1, n]
    future = torch.ones(w, w, dtype=torch.bool, device=keys.device).triu_(1)  # [w, w]: a later window key
    logits[..., n - w:].masked_fill_(future, NEG_INF)
    probs = torch.softmax(logits, dim=-1)
    # A pad query (left padding shorter than the window) sees no key: zero row, not NaN.
    return probs.nan_to_num_(nan=0.0) if padded else probs


def pool_scores(scores: torch.Tensor, pooling: str, kernel: int, key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Local smoothing along the sequence (SnapKV's pooling): ``[b, h, n] -> [b, h, n]``.

    ``key_valid`` ``[b, n]``: average pooling then averages over valid neighbours only, so a
    left-padded row scores its tokens exactly as the same row without padding.
    """
    if pooling == "none" or kernel == 1:
        return scores
    b, h, n = scores.shape
    flat = scores.reshape(b * h, 1, n)
    if pooling == "avg":
        if key_valid is None:
            return F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=False).reshape(b, h, n)
        weight = key_valid[:, None, :].expand(b, h, n).reshape(b * h, 1, n).to(flat.dtype)
        total = F.avg_pool1d(flat * weight, kernel, stride=1, padding=kernel // 2, count_include_pad=True)
        count = F.avg_pool1d(weight, kernel, stride=1, padding=kernel // 2, count_include_pad=True)
        return (total / count.clamp_min(1e-12)).reshape(b, h, n)
    if pooling == "max":
        return F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2).reshape(b, h, n)
    if pooling == "forward":
        # Causal max: a token inherits the largest score of the `kernel - 1` tokens before it (the
        # value that follows a key phrase in text is kept with the key).
        padded = F.pad(flat, (kernel - 1, 0), value=float("-inf"))
        return F.max_pool1d(padded, kernel, stride=1).reshape(b, h, n)
    raise ValueError(f"pooling must be avg, max, forward or none; got pooling={pooling!r}")


def spread(x: torch.Tensor, index: torch.Tensor, length: int, fill: float) -> torch.Tensor:
    """One value per held entry laid out by position: ``x [b, h, m]`` at ``index [b, h, m]`` of a
    ``[b, h, length]`` tensor (an index of ``length`` drops its entry), ``fill`` elsewhere. Bool stays
    bool, anything else becomes float32. (The index space of a cut: docs/architecture.md#the-cut.)"""
    dtype = torch.bool if x.dtype == torch.bool else torch.float32
    out = torch.full((*x.shape[:2], length + 1), fill, dtype=dtype, device=x.device)
    return out.scatter(2, index.to(x.device), x.to(dtype))[..., :length]


def first_valid(key_valid: torch.Tensor, count: int) -> torch.Tensor:
    """``[b, n]`` bool: the first ``count`` real (non-pad) positions of each row (attention sinks)."""
    return key_valid & (key_valid.cumsum(-1) <= min(int(count), key_valid.shape[-1]))


# Ranks of the tokens kept by force, above every score: the window (+inf, see `select_indices`),
# then the sinks (earliest first), then the cross-layer consensus tokens.
_SINK_TOP = torch.finfo(torch.float32).max
_LOWEST = torch.finfo(torch.float32).min  # a valid token's rank floor: above every invalid one (-inf)
CONSENSUS_RANK = _SINK_TOP / 4


def keep_sinks(scores: torch.Tensor, key_valid: torch.Tensor, count: int) -> torch.Tensor:
    """Keep the first ``count`` real positions of each row (attention sinks; Xiao et al., 2024,
    arXiv:2309.17453) in every head: scores ``[b, h, n]`` -> float32 ``[b, h, n]`` in which the sinks
    rank below the window but above every other token, the earliest sink first (so a budget with
    fewer free slots than sinks keeps the first ones)."""
    sinks = first_valid(key_valid, count)
    order = (key_valid.cumsum(-1) - 1).clamp(0, 2**20).to(torch.float32)  # 0 for the first sink
    ladder = _SINK_TOP * (1.0 - (order + 1.0) * 2.0**-21)
    return torch.where(sinks[:, None, :], ladder[:, None, :], scores.float())


def jacap_weights(probs: torch.Tensor, keys: torch.Tensor, scaling: float, beta: float) -> torch.Tensor:
    """Softmax-aware importance weights ``omega_i = sum_t p_ti^2 (1 + beta s^2 ||k_i - kbar_t||^2)``.

    docs/method.md#importance-weights: the zeroth-order term is the query relevance ``p^2``; the first-order term is the
    squared softmax sensitivity ``||dp_ti/dq_t||^2 = s^2 p_ti^2 ||k_i - kbar_t||^2`` with
    ``kbar_t = sum_i p_ti k_i``, summed over ``t`` by :func:`squared_weights` (never a ``T x n x d`` tensor).

    probs: ``[b, h, g, w, n]`` float32; keys: ``[b, h, n, d]``. Returns ``[b, h, n]`` float32.
    """
    p, k = probs.flatten(2, 3), keys.float()  # [b, h, T, n]
    if beta == 0:  # the zeroth-order term alone: the same numbers, without the two [T, n] x d products
        return (p * p).sum(dim=2)
    sq, sq_dist = squared_weights(p, k, p @ k)
    return sq + (beta * scaling * scaling) * sq_dist


def squared_weights(p: torch.Tensor, k: torch.Tensor, kbar: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sq, sq_dist)`` ``[b, h, n]``: ``sum_t p_ti^2``, ``sum_t p_ti^2 ||k_i - kbar_t||^2`` (float32 ``p [b, h, T, n]``,
    ``k [b, h, n, d]``, ``kbar [b, h, T, d]``), summed over ``t`` first: ``||k_i||^2 sq_i + sum_t p_ti^2 ||kbar_t||^2
    - 2 k_i . sum_t p_ti^2 kbar_t``, clamped at 0 (no ``[T, n]`` block beyond ``p^2``; the pairwise form before 2026-12-07)."""
    p2 = p * p
    rows = torch.stack((torch.ones_like(kbar[..., 0]), (kbar * kbar).sum(-1)), dim=-2)  # [b, h, 2, T]
    sq, far = (rows @ p2).unbind(-2)
    near = ((p2.transpose(-1, -2) @ kbar) * k).sum(-1)  # k_i . sum_t p_ti^2 kbar_t
    return sq, ((k * k).sum(-1) * sq + far - 2.0 * near).clamp_min(0.0)


def ridge_leverage(weights: torch.Tensor, directions: torch.Tensor, ridge: float, *,
                   relative: bool = True) -> torch.Tensor:
    """Ridge leverage scores ``l_i = phi_i^T (Phi^T Phi + lambda I)^-1 phi_i``, ``phi_i = sqrt(w_i) u_i``.

    weights: ``[b, h, n]`` non-negative; directions: ``[b, h, n, d]`` (the ``u_i``).
    ``lambda = ridge * tr(Phi^T Phi) / d`` if ``relative`` (Jacap, docs/method.md#ridge-leverage-scores), else ``ridge``
    (CapKV). One ``d x d`` Cholesky factorisation per (batch, head), float32, batched; a degenerate
    Gram matrix (all values equal, zero weights) is regularised, never an error.
    Returns ``[b, h, n]`` float32 in [0, 1].
    """
    u = directions.float()
    d = u.shape[-1]
    gram = (u * weights[..., None]).transpose(-1, -2) @ u  # [b, h, d, d]
    if relative:
        lam = ridge * gram.diagonal(dim1=-2, dim2=-1).sum(-1) / d
    else:
        lam = torch.full(gram.shape[:-2], float(ridge), device=u.device)
    inverse = _ridge_inverse(gram, lam)
    quad = torch.einsum("bhnd,bhnd->bhn", u @ inverse, u)  # no [b, h, n, d] product kept
    return weights * quad


def _ridge_inverse(gram: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``(gram + lambda I)^-1`` for ``gram [..., d, d]`` (symmetric PSD) and ``lam [...]`` (clamped
    to 1e-12): one batched Cholesky factorisation, in ``gram``'s dtype; never an error."""
    eye = torch.eye(gram.shape[-1], device=gram.device, dtype=gram.dtype)
    factor, _ = torch.linalg.cholesky_ex(gram + lam.clamp_min(1e-12)[..., None, None] * eye)
    return torch.cholesky_inverse(factor)


def greedy_logdet_scores(weights: torch.Tensor, directions: torch.Tensor, ridge: float,
                         steps: int | torch.Tensor, window: int) -> torch.Tensor:
    """Exact greedy maximisation of ``C(S) = log det(lambda I + sum_{i in S} phi_i phi_i^T)``.

    docs/method.md#greedy-log-det-selector, ``selector="greedy"``: ``phi_i = sqrt(w_i) u_i``, ``lambda = ridge * tr(Phi^T Phi) / d``
    (as :func:`ridge_leverage`). The last ``window`` positions are kept anyway, so the greedy starts
    from ``A = lambda I + sum_window phi phi^T``. Each step adds the token of largest marginal gain
    ``log(1 + g_i)``, ``g_i = phi_i^T A^-1 phi_i``, then updates ``A^-1`` and every ``g`` with one
    rank-one (Sherman-Morrison) step: ``O(n d)`` per step and (batch, head), batched over both;
    ``steps`` iterations (a Python loop over picks, not over tokens or heads), float64.

    weights ``[b, h, n]`` (non-negative, zero at padding), directions ``[b, h, n, d]``; ``steps`` the
    number of picks (clipped to ``n - window``): an int, or an int64 ``[b]`` tensor giving each row
    its own count, so that a row of a padded batch gets exactly the scores it gets alone.
    Returns ``[b, h, n]`` float32 scores: a picked token scores ``g / (1 + g)`` at the moment it was
    picked (its leverage in the set it joins; non-increasing in pick order because ``C`` is
    submodular), any other token its final ``g / (1 + g)``, which is no larger. So the top ``k`` of
    the scores is the greedy set of size ``k`` for every ``k <= steps``, and the scores stay in
    [0, 1] like leverage scores. The window positions score their leverage in ``A``.
    """
    b, h, n, d = directions.shape
    w = min(window, n)
    phi = directions.double() * weights.double().clamp_min(0.0).sqrt()[..., None]
    lam = ridge * (phi * phi).sum(dim=(-1, -2)) / d
    in_window = torch.arange(n, device=phi.device) >= n - w
    phi_w = phi * in_window[:, None].to(phi.dtype)
    inverse = _ridge_inverse(phi_w.transpose(-1, -2) @ phi_w, lam)  # [b, h, d, d]
    g = ((phi @ inverse) * phi).sum(-1)  # [b, h, n]
    scores = g / (1.0 + g)
    gain = g.masked_fill(in_window | (weights <= 0), NEG_INF)
    row_steps = torch.as_tensor(steps, device=phi.device).clamp(0, n - w).expand(b)
    for step in range(int(row_steps.max()) if b else 0):
        best, j = gain.max(dim=-1, keepdim=True)  # [b, h, 1]
        live = torch.isfinite(best) & (step < row_steps)[:, None, None]
        phi_j = phi.gather(2, j[..., None].expand(b, h, 1, d))  # [b, h, 1, d]
        v = phi_j @ inverse  # [b, h, 1, d]; A^-1 is symmetric
        denom = 1.0 + (v * phi_j).sum(-1)  # [b, h, 1]
        coupling = (phi @ v.transpose(-1, -2)).squeeze(-1)  # [b, h, n]
        scores = scores.scatter(-1, j, torch.where(live, best / (1.0 + best), scores.gather(-1, j)))
        gain = torch.where(live, (gain - coupling * coupling / denom).scatter(-1, j, NEG_INF), gain)
        inverse = inverse - torch.where(live[..., None], v.transpose(-1, -2) @ v / denom[..., None], 0.0)
    rest = gain.clamp_min(0.0)
    return torch.where(torch.isfinite(gain), rest / (1.0 + rest), scores).float()


def jacap_scores(probs: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_valid: torch.Tensor, *,
                 scaling: float, beta: float = 1.0, ridge: float = 0.1, pooling: str = "avg",
                 kernel: int = 7, selector: str = "leverage", steps: int | torch.Tensor = 0,
                 window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Jacap: ridge leverage of the softmax-aware capacity features (docs/method.md#jacap-scores, our reconstruction).

    ``omega`` from :func:`jacap_weights`, pooled along the sequence, zero at padding; output
    directions ``u_i = v_i - vbar`` with ``vbar`` the omega-weighted mean value; scores are the ridge
    leverage of ``phi_i = sqrt(omega_i) u_i``, i.e. each token's share of the retained Jacobian
    capacity ``log det(lambda I + sum_S phi phi^T)``.

    ``selector="greedy"`` replaces the leverage by :func:`greedy_logdet_scores` with ``steps`` picks
    after the last ``window`` positions.

    probs ``[b, h, g, w, n]``, keys/values ``[b, h, n, d]``, key_valid ``[b, n]``.
    Returns ``(scores, omega)``, both ``[b, h, n]`` float32 (``omega`` pooled and masked).
    """
    return jacap_scores_from_weights(jacap_weights(probs, keys, scaling, beta), values, key_valid, ridge=ridge,
                                     pooling=pooling, kernel=kernel, selector=selector, steps=steps, window=window)


def jacap_scores_from_weights(weights: torch.Tensor, values: torch.Tensor, key_valid: torch.Tensor, *,
                              ridge: float = 0.1, pooling: str = "avg", kernel: int = 7, selector: str = "leverage",
                              steps: int | torch.Tensor = 0, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`jacap_scores` from the unpooled importance weights ``omega`` ``[b, h, n]`` (from
    :func:`jacap_weights` over the window, or summed over the repeat pass's query chunks,
    docs/method.md#question-agnostic-scoring). values ``[b, h, n, d]``, key_valid ``[b, n]``.
    Returns ``(scores, omega)``, both ``[b, h, n]`` float32 (``omega`` pooled and masked)."""
    omega = pool_scores(weights, pooling, kernel, key_valid)
    omega = omega * key_valid[:, None, :]
    v = values.float()
    vbar = (omega[..., None, :] @ v) / omega.sum(-1)[..., None, None].clamp_min(1e-30)  # [b, h, 1, d]
    if selector == "greedy":
        return greedy_logdet_scores(omega, v - vbar, ridge, steps, window), omega
    return ridge_leverage(omega, v - vbar, ridge, relative=True), omega


def add_attention_mass(leverage: torch.Tensor, probs: torch.Tensor, key_valid: torch.Tensor,
                       weight: float) -> torch.Tensor:
    """Jacap's per-head ranking: leverage share plus ``weight`` times attention-mass share.

    ``r_i = (l_i / sum_j l_j + weight * a_i / sum_j a_j) / (1 + weight)`` with ``a_i = sum_t p_ti`` the
    window's attention to token ``i``, summed over the window and averaged over the GQA group: the
    SnapKV score without its pooling (the leverage, from pooled weights, already keeps spans
    together; a per-token mass term measured a lower KL than a pooled one on the tuning split).

    Why (our addition, docs/method.md#attention-mass-term): evicting a set
    ``D`` changes a query's output by ``-sum_{i in D} p_i (v_i - o) / (1 - m_D)`` with
    ``m_D = sum_{i in D} p_i``. The leverage ranks the numerator (the Jacobian capacity at the full
    cache); the ``1 / (1 - m_D)`` renormalisation, which amplifies every error as the evicted mass
    grows, is first-order invisible there, and dominates at the smallest kept ratios.

    leverage ``[b, h, n]`` (non-negative), probs ``[b, h, g, w, n]``, key_valid ``[b, n]``.
    Returns ``[b, h, n]`` float32 in [0, 1] summing to 1 over each row's tokens (computed in float64,
    so any finite ``weight`` is safe), zero at padding; ``weight = 0`` gives the leverage share alone.
    """
    return mix_attention_mass(leverage, None if weight == 0 else probs.sum(dim=3).mean(dim=2), key_valid, weight)


def mix_attention_mass(leverage: torch.Tensor, mass: torch.Tensor | None, key_valid: torch.Tensor,
                       weight: float) -> torch.Tensor:
    """:func:`add_attention_mass` from the attention mass ``a`` ``[b, h, n]`` itself (``sum_t p_ti``
    averaged over the GQA group: the window's, or summed over the repeat pass's chunks); ``mass`` may
    be ``None`` when ``weight == 0``. Returns ``[b, h, n]`` float32."""
    valid = key_valid[:, None, :].double()
    lev = leverage.double() * valid
    ranking = lev / lev.sum(-1, keepdim=True).clamp_min(1e-300)
    if weight == 0:
        return ranking.float()
    mass = mass.double() * valid
    mass = mass / mass.sum(-1, keepdim=True).clamp_min(1e-300)
    return ((ranking + weight * mass) / (1.0 + weight)).float()


def top_of_budget(scores: torch.Tensor, budgets: torch.Tensor, key_valid: torch.Tensor, window: int,
                  reserved: int, share: float) -> torch.Tensor:
    """``[b, h, n]`` bool: each head's ``ceil(share * (budget - window - reserved))`` best-scored tokens
    outside the observation window (ties to the later position, as :func:`select_indices`): the part
    of the free budget its ranking is surest of. scores ``[b, h, n]``, budgets ``[b, h]`` int64,
    key_valid ``[b, n]`` bool; ``share`` in [0, 1]. Used by Jacap's ``carry_top``
    (docs/method.md#d10-scores-carried-along-a-unit)."""
    n = scores.shape[-1]
    free = free_budget(budgets.to(scores.device), window, n, reserved).double()
    return top_tokens(scores, torch.ceil(share * free - 1e-9).to(torch.int64), key_valid, window)


def top_tokens(scores: torch.Tensor, counts: torch.Tensor | int, key_valid: torch.Tensor, window: int,
               exclude: torch.Tensor | None = None) -> torch.Tensor:
    """``[b, h, n]`` bool: each head's ``counts`` best-scored valid tokens outside the observation
    window (the last ``window`` positions) and outside ``exclude`` (``[b, n]`` bool, optional: e.g. the
    sinks), ties to the later position (as :func:`select_indices`). scores ``[b, h, n]``, counts
    ``[b, h]`` int64 or an int, key_valid ``[b, n]`` bool. Used by Jacap's ``carry_top`` and
    ``carry_count`` (docs/method.md#d10-scores-carried-along-a-unit)."""
    b, h, n = scores.shape
    out = ~key_valid if exclude is None else ~key_valid | exclude.to(key_valid.device)
    s = scores.float().masked_fill(out[:, None, :].to(scores.device), NEG_INF)
    s = s.masked_fill(torch.arange(n, device=s.device) >= n - min(window, n), NEG_INF)
    counts = torch.as_tensor(counts, device=s.device).expand(b, h)
    return in_top(ranking_keys(s), counts) & torch.isfinite(s)


def peaks(scores: torch.Tensor, key_valid: torch.Tensor, factor: float) -> torch.Tensor:
    """``[b, h, n]`` bool: the tokens whose score is at least ``factor`` times their head's mean score
    over its valid tokens, ``s_i >= factor * (sum_j s_j) / n_valid``: the outliers of a head's ranking
    (a key a retrieval head finds), few in a head whose ranking is spread over the text, as in prose.
    scores ``[b, h, n]`` non-negative float (a share per head, e.g. Jacap's ranking), key_valid ``[b, n]``
    bool, ``factor`` >= 0 (0: every valid token). Scale-free: a head's scores times any positive
    constant give the same set. Used by Jacap's ``carry_peak``
    (docs/method.md#d10-scores-carried-along-a-unit)."""
    if factor < 0:
        raise ValueError(f"factor must be >= 0, got {factor}")
    valid = key_valid[:, None, :].to(scores.device)
    s = scores.double().masked_fill(~valid, 0.0)
    mean = s.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp_min(1)
    return (s >= factor * mean) & valid & torch.isfinite(scores)


def force_keep(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Set ``scores`` to +inf where ``keep`` (broadcastable bool) is True."""
    return scores.masked_fill(keep, float("inf"))


def consensus_scores(layer_scores: list[torch.Tensor], key_valid: torch.Tensor) -> torch.Tensor:
    """Cross-layer consensus ``[b, n]``: the largest share ``s_i / sum_j s_j`` a token has in any
    (layer, KV head) of ``layer_scores`` (each ``[b, h, n]``, non-negative, e.g. leverage scores).

    A token that dominates the capacity of some head (a retrieval head finding a needle) ranks high
    even in layers where the window queries ignore it, which is where copy (induction) heads will
    look for it at decode time.
    """
    best = None
    for scores in layer_scores:
        s = scores.float().clamp_min(0.0) * key_valid[:, None, :].to(scores.device)
        share = (s / s.sum(-1, keepdim=True).clamp_min(1e-30)).amax(dim=1).to(key_valid.device)
        best = share if best is None else torch.maximum(best, share)
    return best


def blend_consensus(scores: torch.Tensor, consensus: torch.Tensor, budgets: torch.Tensor, window: int,
                    share: float, reserved: torch.Tensor | int = 0) -> torch.Tensor:
    """Force the top ``floor(share * (budget - window - reserved))`` consensus tokens into every
    head's kept set (``reserved``: tokens kept by force besides the window, e.g. the sinks; an int
    or ``[b]``).

    scores ``[b, h, n]``, consensus ``[b, n]``, budgets ``[b, h]``. Returns new float32 scores
    ``[b, h, n]`` in which the forced tokens rank above every scored token (below the window, which
    is +inf, and the sinks of :func:`keep_sinks`).
    """
    n = scores.shape[-1]
    # The window is kept anyway: rank only the positions before it.
    consensus = consensus.masked_fill(torch.arange(n, device=consensus.device) >= n - min(window, n), -1.0)
    reserved = torch.as_tensor(reserved, device=budgets.device).reshape(-1, 1)
    forced_count = torch.floor(share * free_budget(budgets, window, n, reserved).double()).to(torch.int64)
    forced = in_top(ranking_keys(consensus), forced_count).to(scores.device)  # ties to the later position
    return scores.float().masked_fill(forced, CONSENSUS_RANK)


def select_indices(scores: torch.Tensor, budgets: torch.Tensor, key_valid: torch.Tensor,
                   window: int, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k selection per (batch, KV head), the observation window always kept.

    scores: ``[b, h, n]`` (any float dtype; compared in float32).
    budgets: ``[b, h]`` int64, the number of tokens to keep (``<=`` the valid count of that row and head).
    key_valid: ``[b, n]`` bool (left padding only: the last ``window`` positions are the window), or
        ``[b, h, n]``, per KV head (the entries each head holds, at a cut over a compressed cache). A
        valid position always ranks above an invalid one, even at a score of ``-inf``.
    window: number of last positions forced in (clipped to ``n``).
    k: number of slots ``K`` returned, ``budgets.max() <= k <= n``; ``None`` reads ``budgets.max()``
        (a host sync, and a data-dependent shape under ``torch.compile``: pass a static ``k`` there).

    Returns ``(indices, kept)``: ``indices`` ``[b, h, K]`` int64 with ``K = k`` or ``budgets.max()``, kept
    positions sorted ascending first, then filler; ``kept`` ``[b, h, K]`` bool, True for the first
    ``budgets[b, h]`` slots. Ties are broken deterministically in favour of the later position;
    padding positions are never selected while the budget does not exceed the valid count.
    """
    b, h, n = scores.shape
    s = scores.float()
    in_window = torch.arange(n, device=s.device) >= n - min(window, n)
    valid = key_valid[:, None, :] if key_valid.dim() == 2 else key_valid
    s = force_keep(s, in_window).clamp_min(_LOWEST).masked_fill(~valid, NEG_INF)
    # Among equal scores the later position comes first (ranking_keys).
    k = int(budgets.max()) if k is None else k
    top = top_order(s, k)
    kept = torch.arange(k, device=s.device) < budgets[..., None]
    # Sort the kept positions ascending, leaving the unused filler behind them.
    top = torch.sort(torch.where(kept, top, top + n), dim=-1).values
    return torch.where(top >= n, top - n, top), kept
