"""RULER's prompt layout for the harness and the lm-eval data.

A RULER prompt (``scripts/data/prepare.py``: ``model_template.format(task_template=...) +
answer_prefix``) is the task template filled in, ``instruction + context + separator + question``
(:mod:`eval.ruler.tasks` stores the parts), then the answer prefix. Plain form (RULER's ``base``
template, for base models): that text as it is. Chat form: the filled template is the single
user message of the tokenizer's chat template, and the answer prefix follows its generation
prompt, as RULER's chat templates put it after the assistant header.

The question-agnostic split (setting ``agnostic``) cuts after ``separator`` (the newline that
ends the document): the context part is the (templated) opening, the instruction, the document
and that newline; the question part the question, the end of the user turn, the generation
prompt and the answer prefix. For SmolLM2's tokenizer (chat form) and Gemma 3's (plain form) the
tokens of the context part are a prefix of the whole prompt's, on every task (``tests/test_ruler.py``,
slow).
"""

from __future__ import annotations

from typing import Any

from jacap_attn.prompts import _field, _use_chat, split_templated

__all__ = ["prompt_parts", "format_prompt", "is_ruler"]


def is_ruler(sample: Any) -> bool:
    """Whether ``sample`` (a :class:`~eval.synthetic.Sample` or a row) is laid out as RULER's."""
    meta = _field(sample, "meta", None) or {}
    return isinstance(meta, dict) and meta.get("layout") == "ruler"


def prompt_parts(sample: Any, tokenizer: Any = None, *, chat: bool | None = None) -> tuple[str, str]:
    """``(context_part, question_part)`` of a RULER sample's prompt; their concatenation is the
    question-aware prompt. ``chat=None``: the chat form exactly when ``tokenizer`` has a chat
    template. Raises ``ValueError`` for a chat form without a tokenizer, or when the chat template
    changes the user message."""
    meta = _field(sample, "meta")
    head = meta["instruction"] + _field(sample, "context") + meta["separator"]
    question = _field(sample, "question")
    answer_prefix = _field(sample, "answer_prefix", None) or ""
    if not _use_chat(tokenizer, chat):
        return head, question + answer_prefix
    prefix, suffix = split_templated(tokenizer, head, question, anchor=head + question)
    return prefix, suffix + answer_prefix


def format_prompt(sample: Any, tokenizer: Any = None, *, question_position: str = "end",
                  chat: bool | None = None) -> str:
    """The prompt text of a RULER sample: ``"end"`` the whole prompt, ``"none"`` its context part
    (see :func:`prompt_parts`). Raises ``ValueError`` for another ``question_position``."""
    head, tail = prompt_parts(sample, tokenizer, chat=chat)
    if question_position == "end":
        return head + tail
    if question_position == "none":
        return head
    raise ValueError(f"question_position must be 'end' or 'none', got {question_position!r}")
