"""Attention over entries that carry their own RoPE positions (a compressed cache's held entries, in
slot order rather than position order): the causal mask by position, SDPA over a GQA group without
repeating K/V to the query heads, and a chunk's attention split into its held part and its own causal
part (docs/architecture.md#chunked-prefill)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .scoring import NEG_INF


def position_mask(kv_pos: torch.Tensor, kv_valid: torch.Tensor, q_pos: torch.Tensor,
                  sliding_window: int | None = None) -> torch.Tensor:
    """Bool mask of causal attention by position: a query at ``q_pos`` reads a valid entry at
    ``kv_pos <= q_pos`` (and ``q_pos - kv_pos < sliding_window`` for a sliding-window layer).
    ``kv_pos`` / ``kv_valid`` ``[b, h, 1, k]`` int64 / bool, ``q_pos`` ``[b, 1, q, 1]`` int64;
    returns ``[b, h, q, k]`` bool (broadcast)."""
    mask = kv_valid & (kv_pos <= q_pos)
    if sliding_window is not None:
        mask = mask & (q_pos - kv_pos < sliding_window)
    return mask


def grouped_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                      scaling: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA of ``query [b, Hq, q, d]`` over ``keys/values [b, h, k, d]`` (``h`` KV heads, ``Hq = g h``)
    where ``allowed [b, h, q, k]`` bool: one additive float mask and one SDPA call per GQA group
    member, K/V never repeated (about 2x faster on the CPU for a 1,024-token chunk than a bool mask
    expanded over the group; the same outputs). ``bias [b, h, k]`` float (optional): added to every
    allowed logit of its entry (:func:`carried_bias`). Returns ``out [b, q, Hq, dv]``, the layout
    transformers' attention functions return."""
    b, hq, q, d = query.shape
    h = keys.shape[1]
    mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
    if bias is not None:
        mask = mask + bias[:, :, None, :].to(query.dtype)
    mask = mask.masked_fill_(~allowed, NEG_INF)
    grouped = query.reshape(b, h, hq // h, q, d)
    out = torch.stack([F.scaled_dot_product_attention(grouped[:, :, i], keys, values, attn_mask=mask, scale=scaling)
                       for i in range(hq // h)], dim=2)
    return out.reshape(b, hq, q, values.shape[-1]).transpose(1, 2).contiguous()


def carried_bias(table: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, pads: torch.Tensor) -> torch.Tensor:
    """The logit bias of held entries that carry evicted attention mass (``chunk_mass``,
    docs/method.md#carried-mass): ``table [b, h, L]`` float32, ``log(1 + m)`` per prompt index (``m`` the
    entries evicted into it, :mod:`jacap_attn.selection.mass`), read at each slot's index ``positions +
    pads`` (``positions/valid [b, h, c]``, ``pads [b]``). Returns ``[b, h, c]`` float32: 0 at invalid
    slots and at indices past the table (the tokens written since the cut carry nothing)."""
    length = table.shape[-1]
    index = positions + pads.to(positions.device)[:, None, None]
    inside = valid & (index < length) & (index >= 0)
    return table.gather(2, index.clamp(0, length - 1)).masked_fill(~inside, 0.0)


def split_attention_runs(query: torch.Tensor) -> bool:
    """Whether :func:`chunk_attention` can run for ``query``: eager, on the CPU, where PyTorch's CPU
    flash-attention kernel (the one SDPA dispatches to there) returns its log-sum-exp. Elsewhere the
    caller attends with :func:`grouped_attention` (same outputs, to float rounding)."""
    return (query.device.type == "cpu" and not torch.compiler.is_compiling()
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def split_point(query: torch.Tensor, write_pos: torch.Tensor, logical: torch.Tensor, pads: torch.Tensor,
                sliding_window: int | None, bias: torch.Tensor | None) -> int | None:
    """Where :func:`chunk_attention` splits the last ``q`` tokens written (``query [b, Hq, q, d]``) from
    what a layer held before them: ``write_pos - q`` slots, for a layer that writes a forward's tokens in
    order at its slots ``write_pos ..`` (0-d int64 ``write_pos``, ``logical`` tokens seen with padding,
    ``pads [b]`` left padding). ``None`` where the split may not run: one token, under ``torch.compile``
    or off the CPU (:func:`split_attention_runs`), a sliding window shorter than the chunk, left padding
    reaching into the chunk, a carried ``bias [b, h, capacity]`` on the chunk's own tokens."""
    q = query.shape[-2]
    if q < 2 or not split_attention_runs(query) or (sliding_window is not None and sliding_window < q):
        return None
    if int((logical - q - pads).min()) < 0:  # left padding reaches into the chunk
        return None
    held = int(write_pos) - q
    if bias is not None and bool(bias[..., held:held + q].any()):
        return None
    return held


def _attention_lse(query, keys, values, mask, scaling, causal):
    """``(out [b, h, q, dv], lse [b, h, q] float32)``: SDPA and the log-sum-exp of its scaled logits."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, keys, values, 0.0, causal, attn_mask=mask, scale=scaling)


def chunk_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, held: int,
                    allowed: torch.Tensor, scaling: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk's attention over a compressed cache, in two parts merged by their log-sum-exp (the
    softmax over a union of disjoint key sets, as FlashAttention merges its blocks: Dao et al. 2022,
    section 3.1): the ``held`` entries the cache held before the chunk, read as ``allowed`` says, and
    the chunk's own ``q`` tokens, read causally with no mask, so the kernel skips the upper triangle
    that :func:`grouped_attention`'s explicit mask makes it compute, and no ``[q, capacity]`` mask is
    built (a quarter less SDPA time in a chunked prefill of 8k tokens at 10% kept,
    docs/results.md#a-chunk-reads-its-own-tokens-causally-2026-12-06).

    ``query [b, Hq, q, d]``; ``keys/values [b, h, held + q, d]``: the held entries in slots
    ``[0, held)``, then the chunk's tokens in position order (every one a real token); ``allowed
    [b, h, 1 or q, held]`` bool: which held entry each query reads (the validity of its slot, and for
    a sliding-window layer its distance); ``bias [b, h, held]`` float (optional): added to every allowed
    logit of its entry (:func:`carried_bias`). A query that reads no held entry reads its own part
    only. Runs where :func:`split_attention_runs`. Returns ``out [b, q, Hq, dv]``, as
    :func:`grouped_attention` (the same values to float rounding)."""
    b, hq, q, d = query.shape
    h = keys.shape[1]
    grouped = query.reshape(b, h, hq // h, q, d)
    own_keys, own_values = keys[:, :, held:held + q], values[:, :, held:held + q]
    mask = reads = None
    if held:
        held_keys, held_values = keys[:, :, :held], values[:, :, :held]
        reads = allowed.any(-1)  # [b, h, 1 or q]
        if bias is not None or not bool(allowed.all()):
            mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
            if bias is not None:
                mask = mask + bias[:, :, None, :].to(query.dtype)
            mask = mask.masked_fill_(~allowed, NEG_INF)
    outs = []
    for i in range(hq // h):
        out, lse = _attention_lse(grouped[:, :, i], own_keys, own_values, None, scaling, True)
        if held:
            out_held, lse_held = _attention_lse(grouped[:, :, i], held_keys, held_values, mask, scaling, False)
            lse_held = lse_held.masked_fill(~reads, NEG_INF)  # the kernel gives 0, not -inf, to a fully masked row
            total = torch.logaddexp(lse, lse_held)
            out = (out.float() * torch.exp(lse - total)[..., None]
                   + out_held.float() * torch.exp(lse_held - total)[..., None]).to(query.dtype)
        outs.append(out)
    return torch.stack(outs, dim=2).reshape(b, hq, q, values.shape[-1]).transpose(1, 2).contiguous()
