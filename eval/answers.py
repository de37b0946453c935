"""Greedy answers of many compressed caches of one prompt, fast and exactly as one-by-one decoding.

:func:`answer_rows` gives, for every row (a compressed cache of the same prompt), the text greedy
decoding writes over it: what ``model.generate(full_ids, cache=row_cache, do_sample=False)`` with
the harness's stopping rule (stop once every answer is found, at EOS, or after ``max_new`` tokens)
returns. It gets there in two cheaper steps (eval/README.md#how-answers-are-decoded):

1. **Teacher-forced check against the reference.** The reference is the full cache's own greedy
   output ``g_1..g_m``. All rows are stacked into one batch and ``suffix + g_1..g_{m-1}`` is
   teacher-forced over it in one forward. A row whose argmax at every position is the reference
   token would decode exactly ``g_1..g_m`` (by induction over the steps) and stop where the
   reference stopped (the stopping rule reads only the text): its answer *is* the reference, and
   it is not decoded.
2. **Batched greedy decoding of the others.** The rows that differ from the reference somewhere
   decode together, stacked in one batch, each with its own stop.

Both are greedy decoding; they differ from one-row ``generate`` only in floating-point summation
order (a batched matrix product, one forward over ``m`` tokens instead of ``m`` steps), which can
flip an argmax where two logits tie to rounding. ``python -m eval.quality --check-decoding``
measures the agreement on real cases (eval/README.md#how-answers-are-decoded).
"""

from __future__ import annotations

import dataclasses
import json

import torch

from jacap_attn.storage.cache import JacapCache


class RowStop:
    """Stopping criterion of a batch: per row, True once every answer is in its text (the score can
    no longer change) or when it was already stopped; ``generate`` handles EOS itself."""

    def __init__(self, tokenizer, sample, start: int):
        self.tokenizer, self.sample, self.start = tokenizer, sample, start

    def __call__(self, input_ids, scores, **kwargs):
        from eval.synthetic import score

        texts = self.tokenizer.batch_decode(input_ids[:, self.start:], skip_special_tokens=True)
        return torch.tensor([score(self.sample, t) >= 1.0 for t in texts], device=input_ids.device)


def stack_caches(model, caches: list[JacapCache], prompt_ids: torch.Tensor) -> JacapCache:
    """One cache of batch ``len(caches)`` holding, in row ``i``, the compressed prompt of
    ``caches[i]`` (each a batch-1 compressed cache of ``prompt_ids [1, n]``, left unchanged). Each
    layer's kept slots are padded to the largest row's with invalid slots (never attended); the batch
    takes the first cache's config. Raises ``ValueError`` when a question would read the caches'
    configs differently (:func:`shared_config`)."""
    shared_config(caches)
    layers = []
    for index in range(len(caches[0].layers)):
        parts = [c.layers[index] for c in caches]
        width = max(int(layer.write_pos) for layer in parts)

        def padded(name, layer):
            t = getattr(layer, name)[:, :, :int(layer.write_pos)]  # zeros (valid=False) after a row's own slots
            return torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[2]) if t.dim() == 4 else (0, width - t.shape[2]))

        layers.append(tuple(torch.cat([padded(name, layer) for layer in parts]) for name in
                            ("keys", "values", "positions", "valid")))
    b = len(caches)
    return JacapCache.from_kept(model, layers, logical=prompt_ids.shape[1], pads=torch.zeros(b, dtype=torch.int64),
                                config=caches[0].config, prompt_ids=prompt_ids.expand(b, -1))


def question_settings(config) -> str:
    """What a question's forward over a cache of ``config`` depends on, as a JSON string: ``"append"``
    for a config that selects nothing at question time (no ``reselect``, no ``chunk_size``: the
    question's tokens are appended and every later step decodes over what the cache holds), else the
    whole config (``reselect``, ``reselect_budget``, ``lookahead``, the method and its options, the
    running budget of a new turn: :mod:`jacap_attn.routes.reselect`, :mod:`jacap_attn.routes.chunk`)."""
    if config.reselect is None and config.chunk_size is None:
        return "append"
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


def shared_config(caches: list[JacapCache]):
    """The config a stacked batch of ``caches`` runs its question under (the first cache's). Raises
    ``ValueError`` when two of them would not answer alike under it (:func:`question_settings`
    differ), naming the first field they differ in: stacked, every row would be answered under the
    first one's config."""
    first = question_settings(caches[0].config)
    for index, cache in enumerate(caches[1:], 1):
        if question_settings(cache.config) != first:
            a, b = caches[0].config.to_dict(), cache.config.to_dict()
            name = "method" if a["method"] != b["method"] else next(
                k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
            raise ValueError(f"caches 0 and {index} differ in {name!r} ({a.get(name)!r} vs {b.get(name)!r}), "
                             "which a question over them reads: a stacked batch answers every row under one "
                             "config; batch them apart")
    return caches[0].config


def greedy(model, tokenizer, cache: JacapCache, full_ids: torch.Tensor, sample, max_new: int) -> list[list[int]]:
    """Greedy decoding of every row of ``cache`` after ``full_ids [1, n + q]`` (its prompt plus the
    uncompressed suffix); per row the new token ids up to its stop (EOS included)."""
    from transformers import StoppingCriteriaList

    b = cache.layers[0].keys.shape[0]
    ids = full_ids.expand(b, -1)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop = StoppingCriteriaList([RowStop(tokenizer, sample, full_ids.shape[1])])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=max_new,
                             do_sample=False, stopping_criteria=stop, disable_compile=True, pad_token_id=pad)
    eos = eos_ids(model, tokenizer)
    return [until_stop(tokenizer, sample, row, eos) for row in out[:, full_ids.shape[1]:].tolist()]


def eos_ids(model, tokenizer) -> set[int]:
    """The token ids that end ``generate``'s decoding (the generation config's, else the tokenizer's)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = tokenizer.eos_token_id if eos is None else eos
    return set(eos) if isinstance(eos, (list, tuple)) else {eos}


def until_stop(tokenizer, sample, row: list[int], eos: set[int]) -> list[int]:
    """The tokens a one-row ``generate`` returns: up to the first step that met the stopping rule
    (an ``eos`` id, or every answer found), or all of them; in a batch the rows that stopped first
    go on with padding."""
    from eval.synthetic import score

    for i, tok in enumerate(row):
        if tok in eos or score(sample, tokenizer.decode(row[:i + 1], skip_special_tokens=True)) >= 1:
            return row[:i + 1]
    return row


def matches_reference(model, cache: JacapCache, suffix: torch.Tensor, reference: list[int]) -> torch.Tensor:
    """``[b]`` bool: whether greedy decoding over row ``i`` of ``cache`` would write exactly
    ``reference`` after ``suffix [1, q]``: a teacher-forced forward of ``suffix + reference[:-1]``,
    the argmax at each of the last ``len(reference)`` positions compared with the reference token.
    Under question-time reselection (``cache.config.reselect``) the suffix goes first, alone, as
    ``generate``'s first forward does (its last positions are the observation window), then the
    reference tokens with reselection off (``generate`` decodes them one at a time, which never
    reselects). ``cache`` is consumed (the forwards append to it)."""
    b = cache.layers[0].keys.shape[0]
    target = torch.tensor(reference, dtype=torch.long)
    with torch.no_grad():
        if cache.config.reselect is None:
            inputs = torch.cat([suffix, target[None, :-1]], 1).expand(b, -1)
            logits = model(input_ids=inputs, cache=cache, use_cache=True, logits_to_keep=len(reference)).logits
        else:
            logits = model(input_ids=suffix.expand(b, -1), cache=cache, use_cache=True, logits_to_keep=1).logits
            if len(reference) > 1:
                cache.config = dataclasses.replace(cache.config, reselect=None)
                rest = model(input_ids=target[None, :-1].expand(b, -1), cache=cache, use_cache=True).logits
                logits = torch.cat([logits, rest], 1)  # [b, m, V]
    return (logits.argmax(-1) == target[None, :]).all(-1)


def answer_rows(model, tokenizer, caches: list[JacapCache], prompt_ids: torch.Tensor, full_ids: torch.Tensor,
                sample, max_new: int, reference: list[int]) -> list[tuple[list[int], str]]:
    """Per row (``caches[i]``, batch-1 compressed caches of ``prompt_ids [1, n]``, left unchanged):
    ``(tokens, how)``, the greedy answer after ``full_ids [1, n + q]`` and ``"reference"`` (equal to
    the reference, by the teacher-forced check) or ``"decoded"`` (batched greedy decoding).
    ``reference``: the full cache's greedy tokens for the same sample (non-empty). Rows are batched
    by their question-time reselection setting (``config.reselect``), which a batch shares."""
    out: list = [None] * len(caches)
    groups: dict = {}
    for i, cache in enumerate(caches):
        groups.setdefault(question_settings(cache.config), []).append(i)
    suffix = full_ids[:, prompt_ids.shape[1]:]
    for rows in groups.values():
        batch = [caches[i] for i in rows]
        same = matches_reference(model, stack_caches(model, batch, prompt_ids), suffix, reference).tolist()
        todo = [i for i, s in zip(rows, same) if not s]
        for i, s in zip(rows, same):
            if s:
                out[i] = (list(reference), "reference")
        if todo:
            decoded = greedy(model, tokenizer, stack_caches(model, [caches[i] for i in todo], prompt_ids), full_ids,
                             sample, max_new)
            for i, tokens in zip(todo, decoded):
                out[i] = (tokens, "decoded")
    return out
