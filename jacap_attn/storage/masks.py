"""Checks of a prompt's 2D ``attention_mask``: left padding only, no holes, the prompt's shape
(:class:`jacap_attn.storage.cache.JacapCache` at prefill, the patched ``generate`` before a chunked
prefill splits the prompt), and no padding in what is appended over a filled cache."""

from __future__ import annotations

import torch


def refuse_holes(key_valid: torch.Tensor) -> None:
    """``ValueError`` naming the first row and positions of ``key_valid [b, n]`` (True = real token) that
    are masked after a real token of their row. Only left padding is served: every stored position is
    ``index - padding``, and a hole would shift the tokens before it to negative positions (and
    stock transformers gives the tokens after a hole positions from the mask's cumulative sum)."""
    hole = key_valid[:, :-1] & ~key_valid[:, 1:]  # [b, n - 1]: a real token, then a masked one
    if not bool(hole.any()):
        return
    row, before = (int(i) for i in torch.nonzero(hole)[0])
    after = torch.nonzero(key_valid[row, before + 1:])
    end = before + int(after[0]) if after.numel() else key_valid.shape[1] - 1
    raise ValueError(f"attention_mask row {row} is 0 at positions {before + 1}..{end}, after real tokens (a hole): "
                     "jacap_attn serves left padding only (every 0 of a row before its first 1); remove the masked "
                     "tokens from the prompt instead of masking them")


def check_mask_shape(attention_mask: torch.Tensor, shape: tuple) -> None:
    """``ValueError`` naming both shapes when a 2D ``attention_mask`` is not ``shape`` ``(b, n)``."""
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; the prompt is {tuple(shape)}")


def refuse_right_padding(key_valid: torch.Tensor) -> None:
    """``ValueError`` naming the rows of ``key_valid [b, n]`` (True = real token) whose last position is
    padding: the observation window must be a row's last positions."""
    if not bool(key_valid[:, -1].all()):
        raise ValueError("jacap_attn needs left padding at prefill (a padded row ends with a pad token); "
                         f"attention_mask rows {[int(i) for i in torch.nonzero(~key_valid[:, -1]).flatten()]} end "
                         "with 0: set tokenizer.padding_side = 'left'")


def check_prompt_mask(attention_mask, shape: tuple) -> None:
    """``ValueError`` for a 2D ``attention_mask`` that does not fit a prompt of ``shape`` ``(b, n)``, that
    pads on the right or has holes (:func:`refuse_holes`), checked on the whole prompt before a
    chunked prefill splits it (each chunk alone can look left-padded). ``None`` or a mask that is not
    a 2D tensor (a prepared 4D one) passes: the forward checks it."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return
    check_mask_shape(attention_mask, shape)
    key_valid = attention_mask.to(torch.bool)
    refuse_right_padding(key_valid)
    refuse_holes(key_valid)


def check_rows(held: int, rows: int, what: str) -> None:
    """``ValueError`` unless ``rows`` (the rows of ``what``, a forward's or ``generate``'s inputs over a filled
    cache) equal the ``held`` rows the cache holds (nothing to check while it is empty, ``held`` 0)."""
    if held and rows != held:
        raise ValueError(f"{what} have {rows} rows but this cache holds {held}: a cache continues its own rows (give "
                         "each continuation of one prompt its own copy.deepcopy(cache); generate repeats a given "
                         "cache's rows itself for num_return_sequences and num_beams)")


def refuse_padded_continuation(attention_mask, new_tokens: int) -> None:
    """``ValueError`` naming the rows of a 2D ``attention_mask`` ``[b, m]`` (1 = real token; ``m`` the held
    tokens plus the new ones, or the new ones alone) that mask one of the ``new_tokens`` tokens a forward
    appends over a filled cache (its last ``new_tokens`` columns). A compressed cache stores a
    continuation unpadded, each new token at the next position of its row, so a masked one would be
    attended, not skipped (stock transformers skips it). One new token (a decode step), ``None`` or a
    mask that is not a 2D tensor passes unchecked."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or new_tokens < 2:
        return
    tail = attention_mask[:, -new_tokens:].to(torch.bool)
    if bool(tail.all()):
        return
    rows = [int(i) for i in torch.nonzero(~tail.all(-1)).flatten()]
    raise ValueError(f"attention_mask rows {rows} mask some of the {new_tokens} tokens appended over a filled cache: "
                     "jacap_attn serves padding in the prompt only (a continuation is stored unpadded, so masked "
                     "tokens would be attended); give every row's continuation the same length, or run such rows "
                     "as batches of their own")
