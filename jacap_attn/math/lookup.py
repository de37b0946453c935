"""Prompt lookup for the cut (issue 34; docs/method.md#d12-prompt-lookup): the prompt's runs that repeat a
run of the observation window token for token, and the tokens after them, pure tensor functions.

A retrieval question repeats its key ("the access code for the Brandt-4 vault"); the model answers by
copying what follows the key's earlier occurrence, as an induction head does, and as prompt lookup
decoding drafts the tokens that follow a match of the last n-gram in the prompt (transformers'
``prompt_lookup_num_tokens``). The window's queries alone often do not tell the asked key from its
look-alikes ("the Brandt-2 vault"): they share all tokens but one. The longest exact match with the
window does.
"""

from __future__ import annotations

import torch

PART = "lookup"  # the plan part holding the strengths [b, T] (jacap_attn.types.LayerPlan.parts)
ROOM = "lookup_room"  # the plan part holding [b, h] int64: budget added for the runs (selection.units.hold_ahead)
MAX_MATCH = 64  # matches are counted up to this many tokens
ORDER = 4096.0  # a run's tokens rank by distance d in its order, their strength lowered by d / ORDER of itself
FLOOR = 0.5 / MAX_MATCH  # a threshold above 0 and below every marked strength (at least 0.9 / MAX_MATCH)


def match_lengths(ids: torch.Tensor, key_valid: torch.Tensor, window: int, max_len: int = MAX_MATCH,
                  max_count: int = 0, probe: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``[b, T]`` int64: at each position ``j`` before the observation window, the length of the longest
    run of tokens ending at ``j`` that equals a run inside the window (the last ``window`` real
    positions of the row), token ids compared exactly, at most ``max_len``; 0 in the window, at
    padding and where the token occurs nowhere in the window.

    With ``max_count`` > 0 a run counts only where it is its window run's longest match in the context
    and at most ``max_count`` context positions share that length (the match is *specific*, as the
    copy an induction head makes is unambiguous): "the Brandt-" that four look-alike facts share with the
    question does not count, "the Brandt-4 vault" that one fact shares does.

    ``ids [b, T]`` int64 token ids of the index space, ``key_valid [b, T]`` bool (False at padding
    and at indices without ids), ``window`` >= 0. Cost ``O(max_len * T * window)`` comparisons and a
    ``[b, T, window]`` table. A run may not cross padding nor start inside the window. ``ValueError`` if
    the shapes differ or ``max_count`` < 0.

    ``probe``: ``(probe_ids [b, w] int64, probe_valid [b, w] bool)``, a window that is not part of ``ids``
    (a chunked prefill's cut before the last reads the prompt's own end, which it has not reached:
    docs/method.md#lookup-ahead-in-a-chunked-prefill); then every valid position of ``ids`` is context and
    ``window`` is ignored."""
    if ids.shape != key_valid.shape or ids.dim() != 2:
        raise ValueError(f"ids {tuple(ids.shape)} and key_valid {tuple(key_valid.shape)} must both be [b, T]")
    if max_count < 0:
        raise ValueError(f"max_count must be >= 0, got {max_count}")
    if probe is not None and (probe[0].shape != probe[1].shape or probe[0].dim() != 2 or probe[0].shape[0] != ids.shape[0]):
        raise ValueError(f"probe ids {tuple(probe[0].shape)} and valid {tuple(probe[1].shape)} must both be "
                         f"[{ids.shape[0]}, w]")
    b, length = ids.shape
    valid = key_valid.to(ids.device)
    if probe is not None:
        win_ids, win_ok = probe[0].to(ids.device), probe[1].to(ids.device)
        w, context = win_ids.shape[1], valid
    else:
        w = min(window, length)
    if w <= 0 or length == 0:
        return torch.zeros(b, length, dtype=torch.int64, device=ids.device)
    if probe is None:
        order = valid.long().cumsum(-1)
        in_window = valid & (order > order[:, -1:] - window)  # [b, T]
        win_ids = ids[:, -w:]
        win_ok = in_window[:, -w:]  # the window's real positions (the last w indices hold them)
        context = valid & ~in_window
    # run[b, j, t]: the length of the run ending at context position j and window position t.
    eq = (ids[:, :, None] == win_ids[:, None, :]) & context[:, :, None] & win_ok[:, None, :]
    run = torch.zeros(eq.shape, dtype=torch.int16, device=ids.device)
    alive = eq
    for k in range(1, max_len + 1):
        if not bool(alive.any()):
            break
        run += alive.to(torch.int16)
        if k == max_len or k >= length or k >= w:
            break
        nxt = torch.zeros_like(alive)  # extend each run one token back: (j - k, t - k) must match too
        nxt[:, k:, k:] = alive[:, k:, k:] & eq[:, :-k, :-k]
        alive = nxt
    if max_count:
        best = run.amax(dim=1, keepdim=True)  # [b, 1, w]: each window run's longest match
        at_best = (run == best) & (best > 0)
        specific = at_best & (at_best.sum(dim=1, keepdim=True) <= max_count)
        run = torch.where(specific, run, torch.zeros_like(run))
    return run.amax(dim=-1).to(torch.int64)


def lookup_strength(lengths: torch.Tensor, min_len: int, reach: int) -> torch.Tensor:
    """``[b, T]`` float32 in [0, 1]: each match of at least ``min_len`` tokens (from
    :func:`match_lengths` ``[b, T]`` int64) marks its own tokens and the ``reach`` tokens after its end with
    its length over :data:`MAX_MATCH`, lowered by ``d / 4096`` of itself at distance ``d`` in the run's
    order: its end first (``d = 0``), then the tokens after it (``d = 1 .. reach``, the value), then its
    earlier tokens (``d = reach + 1 ..``), so that a head that can keep only part of a run keeps the value
    after the key, and a longer match still ranks above a shorter one. A position two matches mark takes
    the higher. Only a match's end counts (a position whose successor does not extend it); 0 elsewhere.
    ``ValueError`` for ``min_len < 1`` or ``reach < 0``."""
    if min_len < 1 or reach < 0:
        raise ValueError(f"min_len must be >= 1 and reach >= 0, got min_len={min_len}, reach={reach}")
    b, length = lengths.shape
    nxt = torch.cat([lengths[:, 1:], torch.zeros_like(lengths[:, :1])], dim=1)
    ends = (lengths >= min_len) & (nxt != lengths + 1)
    strength = torch.where(ends, lengths.float() / MAX_MATCH, torch.zeros_like(lengths, dtype=torch.float32))
    out = strength.clone()
    for shift in range(1, max(MAX_MATCH, reach + 1)):
        if shift >= length:
            break
        if shift < MAX_MATCH:  # a match ending `shift` later covers this token if it is longer than `shift`
            moved = torch.zeros_like(strength)
            moved[:, :-shift] = strength[:, shift:] * (1.0 - (reach + shift) / ORDER)
            covers = torch.zeros_like(ends)
            covers[:, :-shift] = ends[:, shift:] & (lengths[:, shift:] > shift)
            out = torch.maximum(out, torch.where(covers, moved, torch.zeros_like(moved)))
        if shift <= reach:  # the tokens after a match's end
            after = torch.zeros_like(strength)
            after[:, shift:] = strength[:, :-shift] * (1.0 - shift / ORDER)
            out = torch.maximum(out, after)
    return out
