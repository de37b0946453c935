"""Units larger than a word for a method's cross-layer step (issue 34;
docs/method.md#d9-clause-units-for-the-consensus).

A method that reads units (``Method.units`` other than ``"none"``, e.g. ``Jacap(units="clauses")``)
finds ``parts["units"]``, ``[b, T]`` int64 labels of the cut's index space, in every compressed
layer's plan when its ``across_layers`` step runs: :func:`label_units` is a step of the one cut
(:func:`jacap_attn.selection.cut`, right before the method's step), so the prefill, a chunk of a
chunked prefill and question-time reselection all label the same token alike. The labels themselves
are pure functions of tensors (:func:`jacap_attn.selection.spans.clause_ids`,
:func:`jacap_attn.selection.spans.chunk_ids`); the carry along them is
:func:`jacap_attn.math.carry.carry_forward`:

* ``"clauses"``: spans between newlines and clause punctuation before a word, from the prompt ids
  and the model's vocabulary tables (the tokenizer given to ``patch`` or found in the model's folder,
  as for ``spans="words"``), each at most ``Method.unit_len`` tokens; every index past the prompt's
  ids (a question's or a turn's token) a unit of its own; without a vocabulary or prompt ids
  (``inputs_embeds``), no labels: the method falls back to its token-level step;
* ``"sentences"``: the same, ended by newlines and ``. ! ?`` before a word only (a value after a
  colon stays in its key's unit);
* ``"chunks"``: fixed chunks of ``Method.unit_len`` positions (ChunkKV's units), counted from each
  row's first real token, needing nothing.
"""

from __future__ import annotations

import torch

from ..math import budget, lookup
from ..math.carry import PART, UNITS
from ..storage.cache import PENDING
from . import spans

__all__ = ["PART", "UNITS", "label_lookup", "label_units", "unit_labels"]


def unit_labels(kind: str, size: int, key_valid: torch.Tensor, prompt_ids: torch.Tensor | None,
                tables: tuple | None, pads: torch.Tensor | None = None) -> torch.Tensor | None:
    """``[b, T]`` int64 unit labels of an index space (see the module docstring), or ``None`` when
    ``kind`` is ``"none"`` or clauses lack what they need. ``key_valid [b, T]`` bool; ``prompt_ids
    [b, n]`` (``n <= T``; or ``None``); ``tables`` the vocabulary tables of
    :func:`jacap_attn.selection.spans.tables` (or ``None``); ``pads [b]`` each row's left padding
    (default: ``key_valid`` is left padding only). ``ValueError`` for an unknown kind."""
    if kind not in UNITS:
        raise ValueError(f"units must be one of {', '.join(UNITS)}; got units={kind!r}")
    if kind == "chunks":
        return spans.chunk_ids(key_valid, size, pads)
    b, length = key_valid.shape
    if kind == "none" or prompt_ids is None or tables is None or len(tables) < 3 \
            or prompt_ids.shape[0] != b or prompt_ids.shape[1] > length:
        return None
    starts, specials, clauses = tables[:3]
    labels = spans.clause_ids(prompt_ids, starts, clauses, specials, size,
                              sentences=kind == "sentences").to(key_valid.device)
    extra = length - prompt_ids.shape[1]
    if extra:
        own = labels[:, -1:] + 1 + torch.arange(extra, device=labels.device)
        labels = torch.cat([labels, own], dim=1)
    return labels


def label_units(cache, plans: list, cut) -> None:
    """Step 3a of the cut (:func:`jacap_attn.selection.cut`): ``plan.parts["units"]`` of every plan, the
    unit labels ``[b, T]`` of the cut's index space (``cut.key_valid``) under the config's method
    (``Method.units``, ``Method.unit_len``); nothing when the method reads none or the labels cannot be
    made (see :func:`unit_labels`)."""
    method = cache.config.method
    kind = getattr(method, "units", "none")
    if kind == "none" or not plans:
        return
    key_valid = cut.key_valid
    held = [p.layer for p in plans if p.layer is not None and p.layer.state != PENDING]
    # Left padding: a prefill's from the prompt's validity, a compressed layer's its own.
    pads = held[0].pads if held else key_valid.shape[-1] - key_valid.sum(-1)
    labels = unit_labels(kind, method.unit_len, key_valid, cache.prompt_ids, getattr(cache, "span_tables", None),
                         pads.to(key_valid.device))
    if labels is None:
        return
    for plan in plans:
        plan.parts[PART] = labels.to(plan.scores.device)


def label_lookup(cache, plans: list, cut, ids: torch.Tensor | None) -> None:
    """Step 3b of the cut (:func:`jacap_attn.selection.cut`): under a method's prompt lookup
    (``Method.lookup`` > 0, docs/method.md#d12-prompt-lookup), ``plan.parts["lookup"]``, ``[b, T]`` float32
    strengths of the runs that repeat a run of the observation window (:func:`jacap_attn.math.lookup.match_lengths`,
    :func:`jacap_attn.math.lookup.lookup_strength`), on a prefill's cut and at question time, where the
    window holds the question, and on a chunked prefill's last cut; nothing on the cuts of the chunks before it
    (their window is the chunk's end, not the question) or without ``ids`` (``[b, T]`` the index space's token
    ids, :func:`jacap_attn.selection.steps._ids_over`; ``None`` where they are not all known).

    Under ``lookup_ahead`` (docs/method.md#lookup-ahead-in-a-chunked-prefill) every cut before the last of
    a chunked prefill that was given its whole prompt (``cache.prompt_ahead``) reads the runs that repeat a
    run of the prompt's own last ``window`` tokens (the question, when it ends the prompt) instead."""
    method = cache.config.method
    min_len = getattr(method, "lookup", 0)
    if not min_len or not plans or cut.window <= 0 or ids is None:
        return
    probe = None
    if getattr(method, "lookup_ahead", False) and not cut.bucketed:  # a cut before a chunked prefill's last
        probe = prompt_end(cache, cut.window, ids.shape[0])
        if probe is None:
            return
    elif cut.kind == "chunk" and not cut.bucketed:
        return
    key_valid = cut.key_valid.to(ids.device)
    lengths = lookup.match_lengths(ids, key_valid, cut.window, max_count=method.lookup_count, probe=probe)
    strength = lookup.lookup_strength(lengths, min_len, method.lookup_len)
    for plan in plans:
        plan.parts[lookup.PART] = strength.to(plan.scores.device)
    if probe is not None and getattr(method, "lookup_room", False):
        hold_ahead(cache, plans, cut, strength)


def hold_ahead(cache, plans: list, cut, strength: torch.Tensor) -> None:
    """Under ``lookup_room`` (docs/method.md#lookup-room), a cut before a chunked prefill's last holds the
    runs it looks up beyond its running budget: each compressed plan's ``head_budgets [b, h]`` grow by the
    candidates outside the window that ``strength [b, T]`` (:func:`jacap_attn.math.lookup.lookup_strength`)
    marks, at most the prompt's final budget (:func:`jacap_attn.math.budget.layer_budget` of its real tokens,
    as the running budgets are) plus the window less the layer's running budget: what the cut keeps then
    leaves room for the next chunk within the chunked prefill's bound (final budget + chunk + window). The
    growth is ``plan.parts[lookup.ROOM]``, which the method forces first (the cut then keeps it)."""
    ahead = _ahead(cache, strength.shape[0])
    if ahead is None:
        return
    _, valid, repeat = ahead
    final = budget.layer_budget(valid.sum(-1).repeat_interleave(repeat).cpu(), cache.config.ratio, cut.window)  # [b]
    length = strength.shape[-1]
    marked = (strength > 0) & (torch.arange(length, device=strength.device) < length - cut.window)
    for plan in plans:
        if plan.budget is None:
            continue
        candidates = plan.candidates().to(strength.device)
        count = (candidates & marked[:, None, :]).sum(-1).cpu()  # [b, h]
        room = torch.minimum(count, (final + cut.window - plan.budget.cpu()).clamp_min(0)[:, None])
        budgets = plan.head_budgets
        plan.head_budgets = torch.minimum(budgets + room.to(budgets.device), candidates.sum(-1).to(budgets.device))
        plan.parts[lookup.ROOM] = plan.head_budgets - budgets


def _ahead(cache, rows: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``(ids [r, n], valid [r, n], repeat)``: the whole prompt a chunked prefill was given
    (``cache.prompt_ahead``) and how often ``generate`` repeats each of its ``r`` rows among ``rows`` (beams,
    ``num_return_sequences``), or ``None`` where it was not given (``inputs_embeds``) or ``r`` does not
    divide ``rows``."""
    ahead = getattr(cache, "prompt_ahead", None)
    if ahead is None or rows % ahead[0].shape[0]:
        return None
    return ahead[0], ahead[1], rows // ahead[0].shape[0]


def prompt_end(cache, window: int, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(ids [rows, window] int64, valid [rows, window] bool)``: the last ``window`` tokens of the whole
    prompt a chunked prefill was given (``cache.prompt_ahead``, its rows repeated as ``generate`` repeats
    them for beams or ``num_return_sequences``), or ``None`` where it was not given (``inputs_embeds``) or
    its rows do not divide ``rows``."""
    ahead = _ahead(cache, rows)
    if ahead is None:
        return None
    ids, valid, repeat = ahead
    return (ids[:, -window:].repeat_interleave(repeat, dim=0), valid[:, -window:].repeat_interleave(repeat, dim=0))
