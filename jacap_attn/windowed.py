"""Sliding-window attention at prefill in blocks of queries: each block reads only the keys its window
can reach (docs/architecture.md#sliding-window-prefill).

Stock SDPA with a sliding-window mask computes every query-key pair of the prompt and masks most of
them away: at ``n`` prompt tokens and window ``W`` it does ``n * n`` products where ``n * W``
matter (on Gemma-3 at 4,096 tokens, 15 of 18 layers slide with ``W = 512``; their attention is
half of a CPU prefill's time). :func:`windowed_prefill` runs the stock function block by block
instead, ``block`` queries at a time over the keys ``[start - W, end)`` of that block, with the
model's own mask sliced to them. It is exact, not an approximation: before it runs, it checks that
the mask masks every key outside each block's slice (else it returns ``None`` and the caller runs
the stock attention over everything), so any mask (padding, a model's own window convention) is
honoured; the output differs from the one-call result only in floating-point summation order.
"""

from __future__ import annotations

import torch

__all__ = ["windowed_prefill"]


def _blocks(mask: torch.Tensor, q_len: int, k_len: int, window: int, block: int) -> list[tuple] | None:
    """``[(q_start, q_end, k_start, k_end)]`` covering the queries, or ``None`` where ``mask``
    (bool ``[b, 1|h, q_len, k_len]``, True = attend) lets some query of a block see a key outside
    its slice."""
    offset = k_len - q_len  # keys already held before this forward's queries (0 for a fresh prefill)
    spans = []
    for start in range(0, q_len, block):
        end = min(q_len, start + block)
        k_start, k_end = max(0, offset + start - window), offset + end
        rows = mask[:, :, start:end]
        if bool(rows[..., :k_start].any()) or bool(rows[..., k_end:].any()):
            return None
        spans.append((start, end, k_start, k_end))
    return spans


def windowed_prefill(stock, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, window: int | None, *, block: int | None = None,
                     **kwargs):
    """Sliding-window attention of ``query`` over ``key``/``value`` in query blocks, or ``None``
    where blocks would not save work or cannot be proved exact (the caller then runs ``stock``).

    Args:
        stock: the stock attention function (transformers' ``sdpa_attention_forward`` signature:
            ``stock(module, query, key, value, attention_mask, **kwargs) -> (out [b, q, h, d], None)``).
        query: ``[b, h_q, q, d]``; key, value: ``[b, h_kv, k, d]`` with ``k >= q`` (the last ``q``
            keys are the queries' own tokens), any float dtype.
        attention_mask: the model's prepared mask for this layer, bool ``[b, 1|h_q, q, >= k]``
            (True = attend). ``None`` or a float mask: returns ``None``.
        window: the layer's sliding window in tokens (a query sees at most ``window`` keys, its own
            included), or ``None`` for a full-attention layer (returns ``None``).
        block: queries per block; default ``window``. Each block reads at most ``block + window``
            keys.
        kwargs: passed to every ``stock`` call (``dropout``, ``scaling``, ...).

    Returns:
        ``(out [b, q, h_q, d], None)`` as ``stock`` returns it, or ``None``.

    Raises:
        ValueError: ``block`` or ``window`` not a positive int.
    """
    if window is None or attention_mask is None or attention_mask.dtype != torch.bool:
        return None
    block = window if block is None else block
    for name, value_ in (("window", window), ("block", block)):
        if not isinstance(value_, int) or isinstance(value_, bool) or value_ < 1:
            raise ValueError(f"windowed_prefill: {name} must be a positive int, got {name}={value_!r}")
    q_len, k_len = query.shape[2], key.shape[2]
    if torch.compiler.is_compiling() or k_len < q_len or k_len <= 2 * window + block \
            or attention_mask.dim() != 4 or attention_mask.shape[-2] != q_len or attention_mask.shape[-1] < k_len:
        return None
    mask = attention_mask[..., :k_len]
    spans = _blocks(mask, q_len, k_len, window, block)
    if spans is None:
        return None
    outs = [stock(module, query[:, :, qs:qe], key[:, :, ks:ke], value[:, :, ks:ke], mask[:, :, qs:qe, ks:ke],
                  **kwargs)[0] for qs, qe, ks, ke in spans]
    return torch.cat(outs, dim=1), None
