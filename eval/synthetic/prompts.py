"""Prompt helpers of the synthetic tasks beyond the library's :mod:`jacap_attn.prompts` (the
options of a multiple-choice sample, splitting a prompt text, the passkey prompt) and the scorer."""

from __future__ import annotations

import json
from typing import Any, Mapping

from jacap_attn.prompts import _MARKER, _field, _use_chat, format_prompt

from .generators import single_needle
from .samples import Sample

__all__ = ["format_choices", "split_prompt", "score", "passkey_prompt"]


def format_choices(
    sample: Sample | Mapping[str, Any], tokenizer: Any = None, *, chat: bool | None = None
) -> list[str]:
    """Continuations to score after the question-aware prompt of a ``multiple_choice`` sample.

    When the prompt ends with an answer prefix (always, for samples of this module) or with
    ``"Answer:"`` (plain form), each option gets a leading space; after a bare chat-template
    generation prompt (typically ending in a newline) the options are used as they are.

    Parameters
    ----------
    sample:
        A sample (or row) with ``choices``.
    tokenizer:
        Only consulted when ``chat`` is ``None`` (chat iff it has a chat template).
    chat:
        As for :func:`format_prompt`.

    Returns
    -------
    list[str]
        One continuation per option, in ``choices`` order.
    """
    choices = _field(sample, "choices")
    if not choices:
        raise ValueError("sample has no choices")
    if _use_chat(tokenizer, chat) and not _field(sample, "answer_prefix", None):
        return list(choices)
    return [" " + c for c in choices]


def split_prompt(prompt: str) -> tuple[str, str]:
    """Split a question-aware prompt made by this module into (context part, question suffix).

    Splits right after the last ``"\\n\\nQuestion:"``, which is where :func:`format_prompt`
    puts the boundary, so model wrappers can run the question-agnostic setting from the prompt
    text alone.

    Parameters
    ----------
    prompt:
        A prompt from :func:`format_prompt` (chat or plain form).

    Returns
    -------
    tuple[str, str]
        ``(prefix, suffix)`` with ``prefix + suffix == prompt``.
    """
    at = prompt.rfind(_MARKER)
    if at < 0:
        raise ValueError("prompt has no '\\n\\nQuestion:' boundary")
    cut = at + len(_MARKER)
    return prompt[:cut], prompt[cut:]


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------


METRICS = ("all", "part")
"""RULER's string-match metrics: ``all`` (fraction of the answers found), ``part`` (1 if any is)."""


def metric_of(sample: Sample | Mapping[str, Any]) -> str:
    """The sample's metric: a row's ``metric`` field, else ``meta["metric"]`` (``meta`` may be the
    JSON string of an lm-eval doc), else ``"all"``. Raises ``ValueError`` for an unknown metric."""
    metric = _field(sample, "metric", None)
    if metric is None:
        meta = _field(sample, "meta", None) or {}
        if isinstance(meta, str):
            meta = json.loads(meta)
        metric = meta.get("metric", "all")
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; known: {', '.join(METRICS)}")
    return metric


def score(sample: Sample | Mapping[str, Any], output_text: str) -> float:
    """The sample's score of ``output_text``, as RULER scores (``scripts/eval/synthetic/constants.py``).

    Case-insensitive substring match of the strings in ``answers``: with metric ``"all"`` (the
    default; :func:`metric_of`) the fraction of them found, 1.0 or 0.0 when there is a single
    answer; with ``"part"`` 1.0 when any of them is found (QA's references), else 0.0.

    Parameters
    ----------
    sample:
        A :class:`Sample` or a mapping with ``answers`` (e.g. an lm-eval doc).
    output_text:
        The model's generated text.

    Returns
    -------
    float
        A value in [0, 1].
    """
    from jacap_attn.tasks import score_answers  # one scorer, shared with the tasks shipped in the package

    return score_answers(_field(sample, "answers"), output_text, metric_of(sample))


# --------------------------------------------------------------------------------------------
# Demo helpers
# --------------------------------------------------------------------------------------------


def passkey_prompt(
    tokenizer: Any, context_tokens: int = 1400, seed: int | str = 0, *, chat: bool | None = None
) -> tuple[str, str, str]:
    """A single-needle (passkey) prompt with the question at the end, for the library's demo.

    Parameters
    ----------
    tokenizer:
        The model's tokenizer (its chat template is used when ``chat`` is true).
    context_tokens:
        Length of the document in tokens (the prompt adds the instruction, the question and
        the chat template on top).
    seed:
        Seed of the sample.
    chat:
        As for :func:`format_prompt` (default: the chat template iff the tokenizer has one).

    Returns
    -------
    tuple[str, str, str]
        ``(prompt_text, expected_answer, question)``.
    """
    sample = single_needle(tokenizer, 1, context_tokens, seed)[0]
    return format_prompt(sample, tokenizer, chat=chat), sample.answers[0], sample.question
