"""Prompt formatting and the demo document of ``jacap run``.

Prompt layout and the question-agnostic split
---------------------------------------------
A prompt is ``PREAMBLE + "\\n\\n" + context + "\\n\\nQuestion: " + question`` (plus
``"\\nAnswer:"`` in the plain-completion form; in the chat form this text is the single user
message of the model's chat template, followed by its generation prompt). Multiple-choice
samples append their ``answer_prefix`` at the very end. The split point between the
question-agnostic *context part* and the *question suffix* is right after ``"Question:"``: the
prefix ends with ``":"`` and the suffix starts with ``" " + question``. That boundary was
chosen because it is a clean token boundary for byte-level BPE tokenizers with GPT-2 style
pre-tokenization (SmolLM2, GPT-2, ...) and Llama-3/Qwen style pre-tokenization alike (and for
Gemma 3's): ``encode(prefix)`` is a token prefix of ``encode(prefix + suffix)``. A boundary
after ``"\\n\\n"`` is *not* clean for GPT-2 style tokenizers (``"\\n\\n"`` alone is one token,
but ``"\\n\\nQuestion"`` splits into ``"\\n"``, ``"\\n"``, ``"Question"``). Use
:func:`is_token_prefix` to check a tokenizer, and tokenize the prefix once and the suffix
separately when reusing a cache.

A *sample* is anything with ``context`` and ``question`` (optionally ``answer_prefix``) fields:
a mapping such as a JSONL row or lm-eval doc, or an object such as ``eval``'s ``Sample``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Mapping

from .prose import _build_context, _encode, _Needle

__all__ = [
    "PREAMBLE",
    "QUESTION_LABEL",
    "DemoDoc",
    "demo_document",
    "format_prompt",
    "format_question",
    "is_token_prefix",
    "repeat_instruction_ids",
    "split_chat",
]

PREAMBLE = "Read the following document carefully. A question about it follows the document."
"""Instruction that opens every prompt; it does not depend on the task or the question."""

QUESTION_LABEL = "Question:"
"""Label after which the question-agnostic prefix ends (see the module docstring)."""

_MARKER = "\n\n" + QUESTION_LABEL


def _field(sample: Any, name: str, default: Any = ...) -> Any:
    """Read field ``name`` from a sample object or a mapping (e.g. an lm-eval doc).

    A missing field raises unless a ``default`` is given.
    """
    if isinstance(sample, Mapping):
        return sample[name] if default is ... else sample.get(name, default)
    return getattr(sample, name) if default is ... else getattr(sample, name, default)


# --------------------------------------------------------------------------------------------
# Needle words (shared with the synthetic tasks)
# --------------------------------------------------------------------------------------------

_ADJECTIVES = (
    "amber", "ancient", "bold", "brave", "bright", "calm", "clever", "cosmic", "crimson",
    "curious", "daring", "dusty", "eager", "early", "fierce", "flying", "frosty", "gentle",
    "gilded", "glad", "golden", "hidden", "hollow", "humble", "icy", "jolly", "lively",
    "lonely", "lucky", "mellow", "misty", "noble", "odd", "pale", "proud", "quiet", "rapid",
    "rustic", "shiny", "silent", "silver", "sleepy", "smooth", "sunny", "swift", "tidy",
    "velvet", "wandering", "wild", "witty",
)
_NOUNS = (
    "badger", "beacon", "canyon", "cheetah", "comet", "compass", "cricket", "dolphin", "ember",
    "falcon", "fern", "fjord", "glacier", "harbor", "hedgehog", "heron", "island", "jaguar",
    "kettle", "lantern", "lemur", "lighthouse", "lynx", "magnet", "meadow", "meteor", "otter",
    "owl", "panther", "pebble", "pelican", "pine", "quartz", "raven", "reef", "river", "saddle",
    "sparrow", "summit", "teapot", "thistle", "tiger", "tortoise", "tulip", "volcano", "walrus",
    "willow", "wombat", "yak", "zephyr",
)
_CITIES = (
    "Amsterdam", "Athens", "Bangkok", "Barcelona", "Berlin", "Bogota", "Boston", "Brussels",
    "Budapest", "Cairo", "Chicago", "Copenhagen", "Dublin", "Edinburgh", "Florence", "Geneva",
    "Hanoi", "Havana", "Helsinki", "Istanbul", "Jakarta", "Kyoto", "Lagos", "Lima", "Lisbon",
    "London", "Madrid", "Manila", "Marrakesh", "Melbourne", "Montreal", "Moscow", "Mumbai",
    "Munich", "Nairobi", "Naples", "Oslo", "Paris", "Prague", "Quito", "Reykjavik", "Riga",
    "Rome", "Santiago", "Seoul", "Seville", "Stockholm", "Sydney", "Tallinn", "Tokyo",
    "Toronto", "Valencia", "Venice", "Vienna", "Warsaw", "Zurich",
)


def _key(rng: random.Random) -> str:
    """A needle key such as ``"amber-falcon"``."""
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _number(rng: random.Random) -> str:
    """A 7-digit magic number."""
    return str(rng.randint(1_000_000, 9_999_999))


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def _use_chat(tokenizer: Any, chat: bool | None) -> bool:
    """Resolve ``chat=None`` to whether the tokenizer has a chat template."""
    if chat is None:
        return bool(getattr(tokenizer, "chat_template", None))
    return chat


def _prompt_split(sample: Any, tokenizer: Any, chat: bool | None) -> tuple[str, str]:
    """The question-agnostic prefix and the question suffix of a prompt (see module docstring)."""
    question = _field(sample, "question")
    answer_prefix = _field(sample, "answer_prefix", None) or ""
    head = f"{PREAMBLE}\n\n{_field(sample, 'context')}{_MARKER}"
    if not _use_chat(tokenizer, chat):
        return head, f" {question}\nAnswer:" + (f" {answer_prefix}" if answer_prefix else "")
    prefix, suffix = split_templated(tokenizer, head, f" {question}")
    return prefix, suffix + answer_prefix


def split_templated(tokenizer: Any, head: str, tail: str, *, anchor: str | None = None) -> tuple[str, str]:
    """The user message ``head + tail`` through the tokenizer's chat template (with the generation
    prompt), cut right after ``head``: ``(everything up to and including head, the rest)``, whose
    concatenation is the templated prompt. ``anchor``: the text located in the templated string
    (default ``head``). Raises ``ValueError`` without a tokenizer, or when the template changed the
    anchor."""
    if tokenizer is None:
        raise ValueError("chat=True needs a tokenizer with a chat template")
    full = tokenizer.apply_chat_template([{"role": "user", "content": head + tail}], tokenize=False,
                                         add_generation_prompt=True)
    at = full.find(head if anchor is None else anchor)
    if at < 0:
        raise ValueError("the chat template changed the user message; cannot split the prompt")
    cut = at + len(head)
    return full[:cut], full[cut:]


def format_prompt(sample: Any, tokenizer: Any = None, *, question_position: str = "end",
                  chat: bool | None = None) -> str:
    """Prompt text for a ``sample`` (a mapping or object with ``context``, ``question`` and
    optionally ``answer_prefix``, e.g. a JSONL row).

    Layout: ``PREAMBLE``, the document, then ``"Question: <question>"``. ``chat=True``: that text
    is the single user message of ``tokenizer.apply_chat_template(..., tokenize=False,
    add_generation_prompt=True)``; ``chat=False``: it is followed by ``"\\nAnswer:"`` (plain
    completion form for base models); ``None`` (default): the chat template exactly when the
    tokenizer has one (``tokenizer=None`` gets the plain form). A sample's ``answer_prefix``
    (multiple choice) follows the generation prompt, or ``"Answer: "`` in the plain form. No
    special tokens beyond what the chat template writes.

    ``question_position="end"`` (default): the full, question-aware prompt. ``"none"``: only the
    question-agnostic context part, which ends right after ``"Question:"``; append
    :func:`format_question` after compressing it. ``prefix + suffix`` equals the ``"end"`` prompt
    exactly, in both forms (for chat, the templated string is split at the question boundary, so
    the suffix holds the question, the end of the user turn and the generation prompt).
    """
    prefix, suffix = _prompt_split(sample, tokenizer, chat)
    if question_position == "end":
        return prefix + suffix
    if question_position == "none":
        return prefix
    raise ValueError(f"question_position must be 'end' or 'none', got {question_position!r}")


def format_question(sample: Any, tokenizer: Any = None, *, chat: bool | None = None) -> str:
    """The question suffix to append after the context part (question-agnostic setting); it
    starts with a space and the question. Arguments as for :func:`format_prompt`;
    ``format_prompt(s, t, question_position="none", chat=c) + format_question(s, t, chat=c)
    == format_prompt(s, t, chat=c)``.
    """
    return _prompt_split(sample, tokenizer, chat)[1]


def split_chat(tokenizer: Any, context: str, question: str = "", *, system: str | None = None,
               separator: str = "\n\n") -> tuple[str, str]:
    """Split a one-turn conversation into the compressible context and the later question.

    The user turn is ``context + separator + question`` (after an optional ``system`` message),
    rendered by ``tokenizer.apply_chat_template(..., tokenize=False, add_generation_prompt=True)``;
    the text is cut right after the context, so the first part holds the template's opening and the
    context *inside the user turn*, as the model's template writes it, and the second the separator,
    the question, the end of the turn and the generation prompt. Compress the first
    (:meth:`jacap_attn.Document.compress` with ``prompt_format={"chat": True, "layout": "split_chat",
    "separator": separator}``), append the second per question. Trailing whitespace of ``context``
    is dropped, so the cut falls on a token boundary for byte-level BPE tokenizers (check with
    :func:`is_token_prefix`).

    Returns ``(context_part, question_part)``; ``context_part + question_part`` is the full rendered
    prompt. Raises ``ValueError`` without a chat template, or when the template changes the context.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("split_chat needs a tokenizer with a chat template")
    context = context.rstrip()
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": f"{context}{separator}{question}"}]
    full = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    marker = f"{context}{separator}{question}"
    at = full.find(marker)
    if at < 0:
        raise ValueError("the chat template changed the user message; cannot split the conversation")
    cut = at + len(context)
    return full[:cut], full[cut:]


def repeat_instruction_ids(tokenizer: Any, *, chat: bool | None = None,
                           instruction: str = "\n\nRepeat the previous context exactly.") -> list[int]:
    """Token ids of the repeat instruction of ``queries="repeat"`` (the ``repeat_ids`` setting;
    docs/method.md#question-agnostic-scoring), KVzip's (Kim et al., 2025, arXiv:2505.23416, §3.2;
    kvpress's ``KVzipPress``): ``instruction``, then, in the chat form, the end of the user turn and
    the generation prompt as ``tokenizer``'s chat template writes them (so the replayed prompt reads
    as the assistant's answer), without special tokens beyond the template's. ``chat=None``: the chat
    form exactly when the tokenizer has a chat template. For a prompt that is a user turn left open
    (:func:`format_prompt` with ``question_position="none"``, :func:`split_chat`)."""
    text = instruction
    if _use_chat(tokenizer, chat):
        _, tail = split_chat(tokenizer, "x", "", separator="")
        text = instruction + tail
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenizer_instruction(tokenizer: Any) -> tuple | None:
    """The repeat instruction's ids as ``tokenizer`` writes them (:func:`repeat_instruction_ids`; what
    :func:`jacap_attn.patch` gives a repeat pass without ``repeat_ids``): the chat form where it has a
    chat template, the instruction alone where that template cannot be split; ``None`` for an object
    that only lists a vocabulary (not callable)."""
    if not callable(tokenizer):
        return None
    try:
        return tuple(repeat_instruction_ids(tokenizer))
    except Exception:  # a chat template split_chat cannot split: the instruction alone
        return tuple(repeat_instruction_ids(tokenizer, chat=False))


def is_token_prefix(tokenizer: Any, prefix: str, full: str) -> bool:
    """Whether ``full`` starts with ``prefix`` and tokenizing ``full`` reproduces
    ``encode(prefix)`` at its start (so a cache of the prefix tokens can be extended with the rest
    of ``full``); ``tokenizer`` with the ``encode`` protocol of :mod:`jacap_attn.prose`.
    """
    if not full.startswith(prefix):
        return False
    head = _encode(tokenizer, prefix)
    return _encode(tokenizer, full)[: len(head)] == head


# --------------------------------------------------------------------------------------------
# The demo document
# --------------------------------------------------------------------------------------------


@dataclass
class DemoDoc:
    """A document holding two different facts, with one question about each.

    ``document``: the raw document text; ``questions``: ``[magic-number question, secret-city
    question]``; ``answers``: the expected answer of each; ``prefix``: the shared prompt text up to
    and including ``"Question:"`` (instruction and document, inside the chat template when
    ``chat``); ``suffixes``: the rest of the prompt for each question; ``chat``: whether the
    prompts use the chat template.

    The prompt for question ``i`` is ``prefix + suffix(i)``, so a (compressed) cache of the prefix
    tokens can be reused for every question. Tokenize ``prefix`` once and each suffix separately;
    :func:`is_token_prefix` checks that this matches tokenizing the whole prompt (true for GPT-2
    and Llama-3 style byte-level BPE tokenizers).
    """

    document: str
    questions: list[str]
    answers: list[str]
    prefix: str
    suffixes: list[str]
    chat: bool

    def prompt(self, i: int) -> str:
        """The full prompt for question ``i`` (``prefix + suffixes[i]``)."""
        return self.prefix + self.suffixes[i]

    def suffix(self, i: int) -> str:
        """The part of question ``i``'s prompt after the shared prefix."""
        return self.suffixes[i]


def demo_document(
    tokenizer: Any, context_tokens: int = 1400, seed: int | str = 0, *, chat: bool | None = None
) -> DemoDoc:
    """A document of ``context_tokens`` tokens (of ``tokenizer``) with a magic number and a
    secret city, one question about each, and the shared-prefix prompt parts (:class:`DemoDoc`).
    The same ``seed`` gives the same document; ``chat`` as for :func:`format_prompt` (default:
    the chat template iff the tokenizer has one).
    """
    rng = random.Random(f"jacap-tasks/demo/{seed}")
    key, number, city = _key(rng), _number(rng), rng.choice(_CITIES)
    needles = [
        _Needle(f"The special magic number for {key} is: {number}.", rng.uniform(0.15, 0.45)),
        _Needle(f"The secret city is {city}.", rng.uniform(0.55, 0.9)),
    ]
    document, _, _ = _build_context(rng, tokenizer, context_tokens, needles)
    questions = [
        f"What is the special magic number for {key} mentioned in the document?",
        "What is the secret city mentioned in the document?",
    ]
    use_chat = _use_chat(tokenizer, chat)
    parts = [
        _prompt_split({"context": document, "question": q}, tokenizer, use_chat) for q in questions
    ]
    prefix = parts[0][0]
    if any(p != prefix for p, _ in parts):
        raise ValueError("the chat template renders the document differently per question")
    return DemoDoc(
        document=document,
        questions=questions,
        answers=[number, city],
        prefix=prefix,
        suffixes=[s for _, s in parts],
        chat=use_chat,
    )
