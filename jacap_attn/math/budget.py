"""Per-layer and per-head budget allocation: pure functions of counts, scores and layer statistics;
and the cache's capacity buckets.

All budgets are int64 token counts. ``n_valid`` ``[b]`` is each sample's prompt length without
padding; a compressed layer keeps at least ``min(window, n)`` tokens (the observation window) and at
most ``n``. Every policy gives each sample the same total, ``ceil(ratio * n_b)`` (clipped to the
floor/cap) per compressed layer and KV head, so policies differ only in where the tokens go: over
layers (:func:`pyramid_budgets`, :func:`capacity_budgets`), over one layer's heads
(:func:`adakv_head_budgets`) or over layers and heads at once (:func:`global_head_budgets`).
"""

from __future__ import annotations

import torch


def stock_entries(n: int, sliding_window: int | None) -> int:
    """Entries one KV head of a stock (uncompressed) transformers cache holds after ``n`` tokens: all of
    them in a full-attention layer (``sliding_window`` ``None``), the last ``sliding_window - 1`` in a
    sliding-window one (transformers' ``DynamicSlidingWindowLayer``). The reference a compressed cache
    and its file are compared with (``JacapCache.full_bytes``, ``cache_file.summary``)."""
    return n if sliding_window is None else min(n, int(sliding_window) - 1)


def layer_budget(n_valid: torch.Tensor, ratio: float, window: int) -> torch.Tensor:
    """Mean per-layer budget ``B_b = clamp(ceil(ratio * n_b), min(window, n_b), n_b)``, ``[b]`` int64."""
    n = n_valid.to(torch.int64)
    # ceil, less a rounding slack: 0.07 * 100 is 7.000000000000001 in floating point, and keeps 7.
    want = torch.ceil(n.double() * ratio * (1.0 - 1e-12)).to(torch.int64)
    return torch.minimum(torch.maximum(want, n.clamp(max=window)), n)


def free_budget(budgets: torch.Tensor, window: int, n: int, reserved: torch.Tensor | int = 0) -> torch.Tensor:
    """What each head's budget (``budgets`` ``[b, h]`` int64) leaves beyond its observation window (the
    last ``min(window, n)`` of ``n`` positions) and ``reserved`` tokens kept by force (the sinks: an int
    or ``[b, 1]``), never below 0: ``[b, h]`` int64. The shares of the free budget read it: Jacap's
    consensus, ``carry_top`` and ``carry_force_share`` (docs/method.md#cross-layer-consensus)."""
    return (budgets - min(window, n) - reserved).clamp_min(0)


def distribute(total: torch.Tensor, weights: torch.Tensor, floor: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """Split ``total[b]`` tokens over ``L`` layers in proportion to ``weights[b, L]`` (water-filling).

    Every layer gets at least ``floor[b]`` and at most its cap: ``cap[b]`` for every layer, or ``cap[b, L]``
    per layer (what each can hold); whatever a capped layer cannot take goes to the others in proportion to
    their weights; integer rounding by largest remainder, so the result sums to ``total`` exactly whenever
    ``L*floor <= total <= sum of the caps`` (and every cap is at least ``floor``). Returns ``[b, L]`` int64.
    """
    w = weights.double().clamp_min(0.0) + 1e-12
    L = w.shape[-1]
    lo = floor.double()[:, None]
    hi = cap.double() if cap.dim() == 2 else cap.double()[:, None]
    tot = total.double()[:, None]
    free = torch.ones_like(w, dtype=torch.bool)
    alloc = lo.expand_as(w).clone()
    for _ in range(L):  # each pass caps at least one more layer, or finishes
        rest = tot - (hi * ~free).sum(-1, keepdim=True) - lo * free.sum(-1, keepdim=True)
        wf = w * free
        share = lo + rest.clamp_min(0.0) * wf / wf.sum(-1, keepdim=True).clamp_min(1e-30)
        alloc = torch.where(free, torch.minimum(share, hi), hi.expand_as(w))
        over = free & (share > hi)
        if not bool(over.any()):
            break
        free &= ~over
    base = torch.floor(alloc)
    missing = (tot.squeeze(-1) - base.sum(-1)).round().to(torch.int64).clamp(0, L)
    room = (hi - base) > 0.5
    frac = (alloc - base).masked_fill(~room, -1.0)
    rank = torch.argsort(torch.argsort(frac, dim=-1, descending=True, stable=True), dim=-1)
    extra = (rank < missing[:, None]) & room
    return (base + extra.double()).to(torch.int64)


def uniform_budgets(n_valid: torch.Tensor, ratio: float, window: int, num_layers: int) -> torch.Tensor:
    """Every layer keeps ``B_b`` tokens. Returns ``[b, L]``."""
    return layer_budget(n_valid, ratio, window)[:, None].expand(-1, num_layers).clone()


def pyramid_budgets(n_valid: torch.Tensor, ratio: float, window: int, num_layers: int,
                    beta: float = 20.0, cap: torch.Tensor | None = None) -> torch.Tensor:
    """PyramidKV schedule (Cai et al., 2024, arXiv:2406.02069, §3.3).

    Above the window, the first layer gets ``max = 2(B - w) - min`` and the last ``min = (B - w)/beta``,
    linear in between; the integer total equals the uniform one. ``cap`` ``[b, L]``: what each layer can
    hold (default ``n_valid`` for all), its surplus going to the others (:func:`distribute`). Returns ``[b, L]``.
    """
    mean = layer_budget(n_valid, ratio, window)
    w = n_valid.clamp(max=window).double()
    extra = (mean.double() - w).clamp_min(0.0)
    lo = extra / beta
    hi = 2.0 * extra - lo
    step = torch.linspace(0.0, 1.0, num_layers, dtype=torch.float64) if num_layers > 1 else torch.zeros(1, dtype=torch.float64)
    shape = hi[:, None] - (hi - lo)[:, None] * step[None, :]  # [b, L], mean equals `extra`
    floor = n_valid.clamp(max=window)
    return distribute(mean * num_layers, shape + 1e-9, floor, n_valid.to(torch.int64) if cap is None else cap)


def capacity_budgets(need: torch.Tensor, n_valid: torch.Tensor, ratio: float, window: int,
                     alpha: float = 0.5, cap: torch.Tensor | None = None) -> torch.Tensor:
    """Adaptive per-layer budgets: a uniform floor ``alpha * B`` plus the rest shared by ``need``.

    need: ``[b, L]`` non-negative per-layer demand (see :func:`capacity_need`). As in Ada-KV's
    mixing, ``alpha = 1`` is uniform and ``alpha = 0`` fully adaptive. ``cap`` as in
    :func:`pyramid_budgets`. Returns ``[b, L]``.
    """
    mean = layer_budget(n_valid, ratio, window)
    L = need.shape[-1]
    norm = need.double() / need.double().sum(-1, keepdim=True).clamp_min(1e-30)
    weights = alpha / L + (1.0 - alpha) * norm
    floor = n_valid.clamp(max=window)
    return distribute(mean * L, weights, floor, n_valid.to(torch.int64) if cap is None else cap)


def capacity_need(weights: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """A layer's demand for the ``capacity`` policy: concentration of its Jacap weights.

    ``weights`` ``[b, h, n]`` (the importance weights ``omega`` of one layer). With
    ``pi = omega / sum(omega)`` over valid tokens, the demand is the inverse normalised entropy
    ``log(n) / H(pi)``, averaged over heads: layers whose Jacobian capacity sits on few tokens get
    more budget. This is the direction measured to help retrieval on SmolLM2 (the reversed
    pyramid, docs/method.md#capacity-budget), not a derived optimum. Returns ``[b]`` float32, the
    mean over heads of :func:`capacity_need_heads`.
    """
    return capacity_need_heads(weights, key_valid).mean(-1)


def capacity_need_heads(weights: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """:func:`capacity_need` of each KV head, ``[b, h]`` float32 (``log(n) / H(pi)`` of each head's
    weights): what a layer's scoring keeps, so that the heads of a tensor-parallel model's ranks are
    averaged together at the cut (docs/architecture.md#tensor-parallelism)."""
    w = weights.float() * key_valid[:, None, :]
    pi = w / w.sum(-1, keepdim=True).clamp_min(1e-30)
    entropy = -(pi * torch.log(pi.clamp_min(1e-30))).sum(-1)  # [b, h]
    n = key_valid.sum(-1).clamp_min(2).float()
    return torch.log(n)[:, None] / entropy.clamp_min(1e-6)


def adakv_head_budgets(scores: torch.Tensor, budgets: torch.Tensor, key_valid: torch.Tensor,
                       window: int, alpha: float = 0.2) -> torch.Tensor:
    """Ada-KV head-wise allocation (Feng et al., 2024, arXiv:2407.11550, Alg. 1).

    scores ``[b, h, n]`` (SnapKV scores; comparable across heads); budgets ``[b]`` the layer's mean
    per-head budget ``B``. Each head gets the count of its entries in the layer-wide top ``h * B``,
    mixed with the uniform share: ``round((1 - alpha) n_h + alpha B)``, rounded so that the heads sum
    to ``h * B``; every head keeps at least ``min(window, n)``. Returns ``[b, h]`` int64.
    """
    b, h, n = scores.shape
    s = scores.float().masked_fill(~key_valid[:, None, :], float("-inf"))
    # Position-major, latest position first: equal scores alternate between heads and prefer
    # later positions, so ties never depend on the sort's whim.
    flat = s.flip(-1).transpose(1, 2).reshape(b, n * h)
    order = torch.sort(flat, dim=-1, descending=True, stable=True).indices[:, : int(budgets.max()) * h]
    rank = torch.arange(order.shape[-1], device=s.device)[None, :]
    counted = (rank < (budgets[:, None] * h)).to(torch.float64)
    counts = torch.zeros(b, h, dtype=torch.float64, device=s.device).scatter_add_(1, order % h, counted)
    weights = (1.0 - alpha) * counts + alpha * budgets.double()[:, None]
    n_valid = key_valid.sum(-1)
    return distribute(budgets * h, weights, n_valid.clamp(max=window), n_valid.to(torch.int64))


def mix_with_uniform(counts: torch.Tensor, uniform: torch.Tensor, alpha: float) -> torch.Tensor:
    """Ada-KV's safeguard (Feng et al., 2024, arXiv:2407.11550, Alg. 1, as in
    :func:`adakv_head_budgets`): each head gets ``(1 - alpha) * counts + alpha * uniform``, so at
    least ``floor(alpha * uniform)``, rounded by largest remainder (ties to the earlier head) so that
    each row keeps ``sum(counts)`` exactly.

    counts, uniform: ``[b, H]`` int64 per-head budgets with equal row sums (the ``global`` ranking's
    and the uniform policy's). Returns ``[b, H]`` int64, between ``min(counts, uniform)`` and
    ``max(counts, uniform)`` entry by entry.
    """
    target = (1.0 - alpha) * counts.double() + alpha * uniform.double()
    base = torch.floor(target + 1e-9)
    missing = (counts.sum(-1) - base.sum(-1).to(torch.int64)).clamp_min(0)  # [b]
    order = torch.sort(target - base, dim=-1, descending=True, stable=True).indices
    extra = torch.zeros_like(counts).scatter_(
        1, order, (torch.arange(order.shape[-1], device=order.device)[None, :] < missing[:, None]).to(counts.dtype))
    return base.to(torch.int64) + extra


def fill_to_total(base: torch.Tensor, room: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Raise per-head budgets to a row total, water-filling: ``min(room, base + t)`` with the smallest
    integer level ``t >= 0`` that reaches ``min(total, sum(room))``, the last units of the row going
    one each to the first heads (in order) that can still take one.

    base: ``[b, H]`` int64, each at most its ``room``; room: ``[b, H]`` int64, what each head can hold;
    total: ``[b]`` int64. Returns ``[b, H]`` int64 between ``base`` and ``room`` entry by entry, each
    row summing to ``max(sum(base), min(total, sum(room)))``: ``base`` itself where it already
    reaches the total (every head's candidates at least its uniform budget, as at a prefill).
    """
    room = torch.maximum(room, base)
    goal = torch.maximum(torch.minimum(total.to(base.device), room.sum(-1)), base.sum(-1))  # [b]
    lo = torch.zeros_like(goal)  # the level reached: sum(min(room, base + lo)) <= goal
    hi = (room - base).amax(-1).clamp_min(0)
    while bool((lo < hi).any()):  # the largest level whose sum stays within the goal, by bisection
        mid = (lo + hi + 1) // 2
        fits = torch.minimum(room, base + mid[:, None]).sum(-1) <= goal
        lo, hi = torch.where(fits, mid, lo), torch.where(fits, hi, mid - 1)
    filled = torch.minimum(room, base + lo[:, None])
    can = (filled < room).to(torch.int64)
    left = (goal - filled.sum(-1))[:, None]  # fewer than the heads that can take one more
    return filled + can * (torch.cumsum(can, dim=-1) <= left).to(torch.int64)


def global_head_budgets(scores: list[torch.Tensor], candidates: list[torch.Tensor], forced: list[torch.Tensor],
                        uniform: torch.Tensor, floor_fraction: float) -> list[torch.Tensor]:
    """The ``global`` policy: one ranking over every (layer, KV head, token) shares the uniform total.

    KVzip's allocation (Kim et al., 2025, arXiv:2505.23416, §3.2: one threshold over the scores of
    every layer and KV head) and Layer-DefensiveKV's (Feng et al., 2025, arXiv:2510.13334), with
    Ada-KV's per-head safeguard (Feng et al., 2024, arXiv:2407.11550, Alg. 1).
    docs/method.md#global-budget.

    Per row ``b`` the total is the uniform one, ``T_b = sum_l h_l * uniform[b, l]`` (at most the row's
    candidates). A head with fewer candidates than its uniform budget (at a cut over a compressed cache,
    whose earlier cuts gave the heads unequal shares) passes what it lacks to the heads with room
    (:func:`fill_to_total`), so a chunk cut or a reselection keeps the same total as the prefill.

    1. Every KV head first takes the tokens it keeps by force (its window and sinks; at most its
       uniform budget). The remaining slots of ``T_b`` go to the best of all other candidates of
       all layers and heads, by ``scores``: a head's count is its forced tokens plus its entries
       among those.
    2. Each head's budget is that count mixed with its uniform budget by :func:`mix_with_uniform`,
       ``(1 - floor_fraction) * count + floor_fraction * uniform``: every head keeps at least
       ``floor(floor_fraction * uniform)`` tokens and its forced ones, and the spread between the
       heads of a layer, which the cache pads to its largest head (docs/cache.md#storage), shrinks.

    The budgets sum to ``min(T_b, candidates)`` exactly and no head exceeds its candidates. Ties rank
    the later position first, then the later layer and KV head (a stable sort of the reversed
    position-major order, as in :func:`adakv_head_budgets`): heads whose scores tie take turns, and a
    left-padded row, whose candidates keep their relative order, gets the budgets it gets alone.

    Parameters
    ----------
    scores: per layer ``[b, h_l, n]`` float scores comparable across layers and heads (higher = keep;
        :func:`jacap_attn.math.baseline_scores.max_attention`, :func:`jacap_attn.selection.global_budget.head_shares`). NaN ranks
        last.
    candidates: per layer ``[b, n]`` bool, the tokens the layer may keep (real, within its reach), or
        ``[b, h_l, n]`` per KV head (the entries each head holds, at a cut over a compressed cache): a
        head never gets more than its candidates, its uniform share capped at them.
    forced: per layer ``[b, n]`` or ``[b, h_l, n]`` bool, the tokens a head keeps by force (its
        observation window and sinks), within ``candidates``.
    uniform: ``[b, L]`` int64, the uniform policy's per-head budget of each layer (at most its
        candidates).
    floor_fraction: Ada-KV's ``alpha``, in [0, 1]: 0 is the ranking alone, 1 the uniform budgets.

    Returns
    -------
    Per layer ``[b, h_l]`` int64 per-head budgets, on the device of ``scores[0]``.

    Memory: a float64 and an int64 ``[b, sum_l h_l n]`` tensor for the ranking.
    """
    device = scores[0].device
    uniform = uniform.to(device)
    n = scores[0].shape[-1]
    heads = [s.shape[1] for s in scores]
    pool, floors = [], []
    caps, rooms = [], []
    for i, (s, cand, force) in enumerate(zip(scores, candidates, forced)):
        cand = cand.to(device) if cand.dim() == 3 else cand.to(device)[:, None, :]
        force = (force.to(device) if force.dim() == 3 else force.to(device)[:, None, :]) & cand
        room = cand.sum(-1).expand(-1, s.shape[1])  # [b, h]: the head's candidates
        cap = torch.minimum(room, uniform[:, i, None])  # [b, h]
        rooms.append(room)
        floor = torch.minimum(force.sum(-1).expand(-1, s.shape[1]), cap)  # [b, h]
        caps.append(cap)
        finite = torch.nan_to_num(s.to(device).double(), nan=-1e300, posinf=1e300, neginf=-1e300)
        ranked = torch.where(force, float("inf"), finite).masked_fill(~cand, float("-inf"))  # [b, h, n]
        # Each head's own order (ties to the later position): its first `floor` tokens are its floor.
        order = torch.sort(ranked.flip(-1), dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=device).expand_as(order)).flip(-1)
        pool.append(ranked.masked_fill(rank < floor[..., None], float("-inf")))
        floors.append(floor)
    floor = torch.cat(floors, dim=-1)  # [b, H], H = sum_l h_l
    width = floor.shape[-1]
    # Position-major, (layer, head) inner: [b, n * H]. A stable sort of the reversed order puts, among
    # equal scores, the later position first, then the later layer and head: tied heads take turns.
    pool = torch.cat(pool, dim=1).transpose(1, 2).reshape(floor.shape[0], -1)
    per_head = fill_to_total(torch.cat(caps, dim=-1), torch.cat(rooms, dim=-1),
                             (uniform * torch.tensor(heads, device=device)).sum(-1))  # [b, H]
    rest = (per_head.sum(-1) - floor.sum(-1)).clamp_min(0)  # [b]
    order = torch.sort(pool.flip(-1), dim=-1, descending=True, stable=True).indices[:, : int(rest.max())]
    taken = (torch.arange(order.shape[-1], device=device)[None, :] < rest[:, None]).to(torch.int64)
    counts = floor + torch.zeros_like(floor).scatter_add_(1, (pool.shape[-1] - 1 - order) % width, taken)
    return list(mix_with_uniform(counts, per_head, floor_fraction).split(heads, dim=-1))


def bucket(size: int, steps: int = 8, minimum: int = 64) -> int:
    """Round a slot count up so caches of similar size share compiled shapes: to a multiple of
    ``2**(floor(log2(size)) - log2(steps))``, i.e. ``steps`` to ``2 * steps`` sizes per octave (at
    most ``1/steps`` more slots than asked: 12.5% with the default 8), and at least ``minimum``.

    Geometric rather than a fixed multiple (256 before), because each layer sizes its own buffers
    and the adaptive policies give layers small, different capacities, which a coarse multiple pads
    most (docs/cache.md#capacity-buckets-and-growth). ``steps`` is a power of two.
    """
    size = max(int(size), minimum, 1)
    step = 1 << max(0, size.bit_length() - 1 - (steps.bit_length() - 1))
    return -(-size // step) * step
