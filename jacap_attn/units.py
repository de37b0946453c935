"""Units larger than a word for a method's cross-layer step (issue 34;
docs/method.md#d9-clause-units-for-the-consensus).

A method that reads units (``Method.units`` other than ``"none"``, e.g. ``Jacap(units="clauses")``)
finds ``parts["units"]``, ``[b, n]`` int64 labels of the prompt's positions, in every compressed
layer's plan when its ``across_layers`` step runs: :func:`label_units` is one step of the selection
(:func:`jacap_attn.selection.finalize_prefill`, right before the method's step), a function of
``(cache, plans)`` so that any cut can call it. The labels themselves are pure functions of tensors
(:func:`jacap_attn.spans.clause_ids`, :func:`jacap_attn.spans.chunk_ids`):

* ``"clauses"``: spans between newlines and clause punctuation before a word, from the prompt ids
  and the model's vocabulary tables (the tokenizer given to ``patch`` or found in the model's folder,
  as for ``spans="words"``), each at most ``Method.unit_len`` tokens; without a vocabulary or prompt
  ids (``inputs_embeds``), no labels: the method falls back to its token-level step;
* ``"chunks"``: fixed chunks of ``Method.unit_len`` real tokens (ChunkKV's units), needing nothing.
"""

from __future__ import annotations

import torch

from . import spans

UNITS = ("none", "clauses", "chunks")
PART = "units"  # the plan part holding the labels


def unit_labels(kind: str, size: int, key_valid: torch.Tensor, prompt_ids: torch.Tensor | None,
                tables: tuple | None) -> torch.Tensor | None:
    """``[b, n]`` int64 unit labels of a prompt (see the module docstring), or ``None`` when ``kind`` is
    ``"none"`` or clauses lack what they need. ``key_valid [b, n]`` bool; ``prompt_ids [b, n]`` (or
    ``None``); ``tables`` the vocabulary tables of :func:`jacap_attn.spans.tables` (or ``None``).
    ``ValueError`` for an unknown kind."""
    if kind not in UNITS:
        raise ValueError(f"units must be one of {', '.join(UNITS)}; got units={kind!r}")
    if kind == "chunks":
        return spans.chunk_ids(key_valid, size)
    if kind == "none" or prompt_ids is None or tables is None or len(tables) < 3 \
            or tuple(prompt_ids.shape) != tuple(key_valid.shape):
        return None
    starts, specials, clauses = tables[:3]
    return spans.clause_ids(prompt_ids, starts, clauses, specials, size).to(key_valid.device)


def label_units(cache, plans: list) -> None:
    """Selection step: ``plan.parts["units"]`` of every plan, the prompt's unit labels ``[b, n]`` under
    the config's method (``Method.units``, ``Method.unit_len``); nothing when the method reads none or
    the labels cannot be made (see :func:`unit_labels`)."""
    method = cache.config.method
    kind = getattr(method, "units", "none")
    if kind == "none" or not plans or cache.prefill is None:
        return
    model = cache._model() if getattr(cache, "_model", None) is not None else None
    tables = getattr(getattr(model, "_jacap_state", None), "spans", None)
    labels = unit_labels(kind, method.unit_len, cache.prefill.key_valid, cache.prompt_ids, tables)
    if labels is None:
        return
    for plan in plans:
        plan.parts[PART] = labels.to(plan.scores.device)


def label_positions(cache, plans: list, length: int) -> None:
    """Question-time reselection's counterpart of :func:`label_units` (docs/method.md#question-time-reselection):
    ``plan.parts["units"]`` over the cache's ``[b, T]`` position space (``T = length``, the logical
    length with the new tokens; left padding first): the stored prompt's unit labels where the cache
    knows its ids (``cache.prompt_ids``, ``[b, n]``, ``n <= T``), a label of its own for every later
    position; chunks over the positions some head still holds (``plans[0].key_valid``). Nothing when the
    method reads no units or clauses lack their vocabulary or the prompt ids."""
    method = cache.config.method
    kind = getattr(method, "units", "none")
    if kind == "none" or not plans:
        return
    valid = plans[0].key_valid
    if kind == "chunks":
        labels = spans.chunk_ids(valid, method.unit_len)
    else:
        model = cache._model() if getattr(cache, "_model", None) is not None else None
        tables = getattr(getattr(model, "_jacap_state", None), "spans", None)
        ids = cache.prompt_ids
        if ids is None or tables is None or len(tables) < 3 or ids.shape[1] > length or ids.shape[0] != valid.shape[0]:
            return
        prompt = spans.clause_ids(ids, tables[0], tables[2], tables[1], method.unit_len).to(valid.device)
        later = prompt.amax(-1, keepdim=True) + 1 + torch.arange(length - ids.shape[1], device=valid.device)
        labels = torch.cat([prompt, later], 1)
    for plan in plans:
        plan.parts[PART] = labels.to(plan.scores.device)
