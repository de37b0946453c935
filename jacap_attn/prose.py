"""The prose haystack: a corpus of real English paragraphs and the seeded document builder.

The prose is the paragraph text of the Python reference documentation that ships with every Python
install (:mod:`pydoc_data.topics`), with grammar blocks, code, headings and code-heavy paragraphs
removed, so no download is needed. :func:`_build_context` fills a seeded stream of its sentences
around short *needles* (facts) up to a token budget: the demo document of ``jacap run``
(:mod:`jacap_attn.prompts`) and the evaluation's synthetic tasks (``eval/synthetic``) use it.

Tokenizer protocol: length targeting only calls ``tokenizer.encode(text, add_special_tokens=False)``
and takes ``len()`` of the result (a ``tokenizers.Encoding`` with ``.ids`` is accepted too). Every
Hugging Face tokenizer satisfies this.

Length targeting: a document never exceeds ``context_tokens``; it ends on a whole sentence when that
keeps it within 2% of the target, else on a cut-off sentence at most one word's tokens short of it.
If the needles alone do not fit, a :class:`ValueError` is raised.

Determinism: a document depends only on the ``random.Random`` it is given, the tokenizer and the
corpus. The corpus is the ``pydoc_data`` of the running Python, which changes between Python
versions: the same seed gives the same text on the same Python version.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["count_tokens", "haystack_paragraphs"]


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


def count_tokens(tokenizer: Any, text: str) -> int:
    """Number of tokens of ``text`` without special tokens: the length of
    ``tokenizer.encode(text, add_special_tokens=False)`` (a Hugging Face tokenizer, or a raw
    ``tokenizers.Tokenizer`` whose ``Encoding`` has ``.ids``).
    """
    return len(_encode(tokenizer, text))


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` through the documented protocol (see the module docstring)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if hasattr(ids, "ids"):  # tokenizers.Encoding
        ids = ids.ids
    return list(ids)


# --------------------------------------------------------------------------------------------
# The prose corpus
# --------------------------------------------------------------------------------------------

_SKIP_START = (
    "Changed in version",
    "Added in version",
    "New in version",
    "Deprecated since",
    "See also",
    "Note:",
    "Footnotes",
    "Warning:",
    "[",
)
_FOOTNOTE = re.compile(r"\s*\[\d+\]")
_EMPHASIS = re.compile(r"\*{1,2}([^*\s][^*]*?)\*{1,2}")
# A word looks like code if it has brackets, operators, underscores, slashes ... or a dotted name.
_CODEY = re.compile(r"[()\[\]{}=<>*_\\|@#$%^~`/]|[a-z]\.[a-z_]{2}|\w\.\w+\(")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"“(])")
_MIN_WORDS = 12
_MAX_CODEY = 0.10
_MAX_QUOTED = 0.12


def _clean_block(block: str) -> str | None:
    """Turn one blank-line separated block of a pydoc topic into a prose paragraph, or ``None``.

    Rejects headings, grammar rules, interactive sessions, code (mixed indentation or many
    code-like words), version notes and short fragments; joins wrapped lines and removes
    footnote markers and reST emphasis.
    """
    lines = [line for line in block.split("\n") if line.strip()]
    if not lines:
        return None
    if len({len(line) - len(line.lstrip(" ")) for line in lines}) != 1:
        return None  # mixed indentation: code, tables, definition lists
    lines = [line.strip() for line in lines]
    if any(re.fullmatch(r"[*=\-~^+|]+", line) for line in lines):
        return None  # headings and table rules
    text = " ".join(lines)
    if text.startswith(_SKIP_START) or ">>>" in text or "::=" in text or "..." in text:
        return None
    text = _FOOTNOTE.sub("", text)
    text = _EMPHASIS.sub(r"\1", text)
    text = re.sub(r"\s+", " ", text).strip()
    words = text.split()
    if len(words) < _MIN_WORDS or not text.endswith("."):
        return None
    if sum(1 for w in words if _CODEY.search(w)) > _MAX_CODEY * len(words):
        return None
    if text.count('"') // 2 > _MAX_QUOTED * len(words):
        return None
    if re.search(r"\d{4,}", text):
        return None  # keep numbers that could look like needle values out of the haystack
    return text


@functools.lru_cache(maxsize=1)
def haystack_paragraphs() -> tuple[tuple[str, ...], ...]:
    """The prose corpus: paragraphs of the Python reference docs, each a tuple of its
    sentences, in a fixed order (topics sorted by name)."""
    from pydoc_data.topics import topics  # shipped with every CPython install

    paragraphs = []
    for key in sorted(topics):
        for block in re.split(r"\n[ \t]*\n", topics[key]):
            text = _clean_block(block)
            if text is not None:
                paragraphs.append(tuple(s for s in _SENTENCE_END.split(text) if s))
    if not paragraphs:  # pragma: no cover - would mean a broken Python install
        raise RuntimeError("pydoc_data.topics holds no usable prose")
    return tuple(paragraphs)


# --------------------------------------------------------------------------------------------
# Haystack assembly and length targeting
# --------------------------------------------------------------------------------------------


@dataclass
class _Needle:
    """A needle to place: a sentence inside a paragraph, or a block (its own paragraph)."""

    text: str
    depth: float
    block: bool = False


class _Stream:
    """Endless seeded stream of haystack sentences: paragraphs in shuffled order, reshuffled on
    every pass over the corpus. Each item is ``(words, starts_paragraph)``."""

    def __init__(self, rng: random.Random):
        self._rng = rng
        self.sentences: list[tuple[list[str], bool]] = []
        self.n_words = 0

    def sentence_boundary(self, n_words: int) -> int:
        """The largest word count <= ``n_words`` that ends on a whole sentence."""
        self.ensure(n_words)
        total = 0
        for words, _ in self.sentences:
            if total + len(words) > n_words:
                break
            total += len(words)
        return total

    def ensure(self, n_words: int) -> None:
        """Extend the stream until it holds at least ``n_words`` words."""
        paragraphs = haystack_paragraphs()
        while self.n_words < n_words:
            order = list(range(len(paragraphs)))
            self._rng.shuffle(order)
            for index in order:
                for j, sentence in enumerate(paragraphs[index]):
                    words = sentence.split()
                    self.sentences.append((words, j == 0))
                    self.n_words += len(words)


def _render(stream: _Stream, n_words: int, needles: Sequence[_Needle]) -> tuple[str, list[int]]:
    """Document made of the first ``n_words`` haystack words with the needles inserted.

    Needles go to the sentence boundary closest to ``depth * n_words`` (in the given order
    when they share one); the last haystack sentence may be cut short (closed with a period).
    Returns the text and the character offset of each needle (same order as ``needles``).
    """
    stream.ensure(n_words)
    units: list[tuple[str, bool]] = []
    left = n_words
    for words, para in stream.sentences:
        if left <= 0:
            break
        if len(words) <= left:
            units.append((" ".join(words), para))
        else:
            fragment = " ".join(words[:left]).rstrip(",;:-")
            if not fragment.endswith((".", "!", "?")):
                fragment += "."
            units.append((fragment, para))
        left -= len(words)
    n_units = len(units)
    # Sentence boundary i sits after bounds[i] haystack words; a needle goes to the boundary
    # closest to depth * n_words.
    bounds = [0]
    for text, _ in units:
        bounds.append(bounds[-1] + len(text.split()))
    slots: dict[int, list[int]] = {}
    for k, needle in enumerate(needles):
        goal = needle.depth * bounds[-1]
        slot = min(range(n_units + 1), key=lambda i: (abs(bounds[i] - goal), i))
        slots.setdefault(slot, []).append(k)

    pieces: list[tuple[str, str, int]] = []  # (text, kind, needle index or -1)
    for i in range(n_units + 1):
        for k in slots.get(i, ()):
            pieces.append((needles[k].text, "block" if needles[k].block else "sent", k))
        if i < n_units:
            text, para = units[i]
            pieces.append((text, "para" if para else "sent", -1))

    out: list[str] = []
    offsets = [0] * len(needles)
    position = 0
    previous_kind = None
    for text, kind, k in pieces:
        if previous_kind is None:
            sep = ""
        elif kind in ("block", "para") or previous_kind == "block":
            sep = "\n\n"
        else:
            sep = " "
        out.append(sep)
        position += len(sep)
        if k >= 0:
            offsets[k] = position
        out.append(text)
        position += len(text)
        previous_kind = kind
    return "".join(out), offsets


_WHOLE_SENTENCE_SLACK = 0.02
"""Fraction of ``context_tokens`` a document may fall short to end on a whole sentence."""


def _build_context(
    rng: random.Random, tokenizer: Any, context_tokens: int, needles: Sequence[_Needle]
) -> tuple[str, list[int], int]:
    """Fill a haystack around ``needles`` to at most ``context_tokens`` tokens, as long as possible.

    Bisects the number of haystack words, then drops a cut-off last sentence when the document
    stays within 2% of the target; otherwise the last haystack sentence is cut after the word
    that brings the document closest to the target (and closed with a period). Returns the
    document, the character offset of each needle and the document's token count.
    """
    if context_tokens <= 0:
        raise ValueError(f"context_tokens must be positive, got {context_tokens}")
    stream = _Stream(rng)
    cache: dict[int, tuple[str, list[int], int]] = {}

    def measure(n_words: int) -> tuple[str, list[int], int]:
        if n_words not in cache:
            text, offsets = _render(stream, n_words, needles)
            cache[n_words] = (text, offsets, count_tokens(tokenizer, text))
        return cache[n_words]

    base = measure(0)[2]
    if base > context_tokens:
        raise ValueError(
            f"the needles alone take {base} tokens, more than context_tokens={context_tokens}"
        )
    lo = 0  # invariant: measure(lo) <= context_tokens
    hi = max(8, int((context_tokens - base) / 1.3))
    while measure(hi)[2] <= context_tokens:
        if hi > 64 * context_tokens + 4096:  # a tokenizer that counts (almost) nothing
            raise ValueError("the tokenizer does not count the haystack's words as tokens")
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # invariant: measure(hi) > context_tokens
        mid = (lo + hi) // 2
        if measure(mid)[2] <= context_tokens:
            lo = mid
        else:
            hi = mid
    # Prefer ending on a whole sentence when that costs at most _WHOLE_SENTENCE_SLACK.
    boundary = stream.sentence_boundary(lo)
    if boundary < lo and (
        context_tokens * (1 - _WHOLE_SENTENCE_SLACK) <= measure(boundary)[2] <= context_tokens
    ):
        return measure(boundary)
    return measure(lo)
