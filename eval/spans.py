"""Character spans of expected values -> token positions in a prompt (for a span-recall metric).

RULER samples (:mod:`eval.ruler`) record, per expected value, the ``[start, end)`` character
spans of its occurrences in the document (``Sample.meta["value_spans"]``). :func:`prompt_spans`
moves them into prompt coordinates and :func:`value_token_positions` maps them to the positions of
the tokens that cover them in the prompt's ids, from a fast tokenizer's offsets, and
:func:`kept_share` measures which of them a compressed cache kept (the harness's span recall,
:func:`eval.quality.span_recall`).
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["prompt_spans", "value_token_positions", "kept_share"]

Span = Sequence[int]


def prompt_spans(prompt: str, context: str, spans: Sequence[Sequence[Span]], *, start: int | None = None
                 ) -> list[list[list[int]]]:
    """Shift document spans into ``prompt`` coordinates.

    Parameters
    ----------
    prompt:
        The prompt text, which holds ``context`` verbatim.
    context:
        The document the spans refer to.
    spans:
        Per value, its ``[start, end)`` character spans in ``context``.
    start:
        Where ``context`` begins in ``prompt``; default: its first occurrence.

    Returns
    -------
    list[list[list[int]]]
        The same nesting, shifted. Raises ``ValueError`` when ``prompt`` does not hold ``context``
        at ``start``.
    """
    at = prompt.find(context) if start is None else start
    if at < 0 or prompt[at:at + len(context)] != context:
        raise ValueError("the prompt does not hold the document verbatim")
    return [[[s + at, e + at] for s, e in value] for value in spans]


def value_token_positions(tokenizer: Any, prompt: str, spans: Sequence[Sequence[Span]], *,
                          add_special_tokens: bool = False) -> list[list[int]]:
    """Token positions, in ``tokenizer(prompt)``'s ids, of each value's character spans.

    A token belongs to a value when its character range overlaps one of the value's spans (a token
    that straddles the value's edge, e.g. ``" 123"``, counts). Positions index the ids the tokenizer
    returns with ``add_special_tokens`` (a BOS token shifts them by one), so they are the cache
    positions of the prompt's tokens when the prompt is encoded that way.

    Parameters
    ----------
    tokenizer:
        A fast Hugging Face tokenizer (``return_offsets_mapping`` support), or any callable
        ``tokenizer(text, add_special_tokens=..., return_offsets_mapping=True)`` returning a mapping
        with ``"offset_mapping"``: per token ``(start, end)`` characters, ``(0, 0)`` for special tokens.
    prompt:
        The prompt text.
    spans:
        Per value, its ``[start, end)`` character spans in ``prompt`` (see :func:`prompt_spans`).
    add_special_tokens:
        As the prompt's ids were encoded.

    Returns
    -------
    list[list[int]]
        Per value, the sorted token positions covering its spans (empty for a value without spans).
        Raises ``ValueError`` for a span outside the prompt or empty, or a span no token covers.
    """
    encoded = tokenizer(prompt, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    offsets = [tuple(o) for o in encoded["offset_mapping"]]
    out = []
    for value in spans:
        positions: set[int] = set()
        for s, e in value:
            if not 0 <= s < e <= len(prompt):
                raise ValueError(f"span {[s, e]} is empty or outside the prompt ({len(prompt)} characters)")
            hit = [i for i, (a, b) in enumerate(offsets) if b > a and a < e and b > s]
            if not hit:
                raise ValueError(f"no token covers span {[s, e]}")
            positions.update(hit)
        out.append(sorted(positions))
    return out


def kept_share(cache: Any, positions: Sequence[int], layers: Sequence[int]) -> float:
    """The share of the prompt token ``positions`` a cache keeps, averaged over ``layers`` and
    their KV heads (and rows).

    Parameters
    ----------
    cache:
        A :class:`jacap_attn.JacapCache` (any object whose ``layers[i].export()`` returns
        ``(keys, values, positions, valid)``, ``positions`` and ``valid`` ``[b, h, K]``: the logical
        prompt positions of the held slots and whether each slot holds an entry).
    positions:
        Logical positions (non-empty; a repeated one counts once), e.g. a value's tokens
        (:func:`value_token_positions`).
    layers:
        The layer indices to average over (non-empty).

    Returns
    -------
    float
        ``mean over (layer, row, KV head) of |kept ∩ positions| / |positions|``. Raises
        ``ValueError`` for empty ``positions`` or ``layers``.
    """
    import torch

    if not positions or not layers:
        raise ValueError("kept_share needs positions and layers")
    shares = []
    for index in layers:
        _, _, held, valid = cache.layers[index].export()
        wanted = torch.tensor(sorted(set(positions)), dtype=held.dtype, device=held.device)
        kept = (torch.isin(held, wanted) & valid.bool()).sum(-1)  # [b, h]: each position is held once per head
        shares.append(kept.double().flatten() / len(wanted))
    return float(torch.cat(shares).mean())
