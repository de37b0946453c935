"""Seeded synthetic long-context tasks in the style of RULER, with real prose haystacks.

Every task hides one or more short *needles* (facts) in a long document made of real English
prose and asks a question whose answer is only in the needles. The prose is the paragraph text
of the Python reference documentation that ships with every Python install
(:mod:`pydoc_data.topics`), with grammar blocks, code, headings and code-heavy paragraphs
removed, so no download is needed.

Tasks (see :data:`TASKS`)
-------------------------
``single_needle``
    Passkey retrieval: one "The special magic number for <key> is: <7 digits>." needle.
``multikey_needle``
    Several magic-number needles with different keys; the question asks for one key's number.
``multivalue_needle``
    One key with several numbers scattered over the document; all of them are asked for.
``variable_tracking``
    Chains ``VAR A = 12345.``, ``VAR B = A.`` ... (plus a distractor chain); which variables
    hold the value?
``kv_retrieval``
    A JSON object of many short UUID-like key/value pairs embedded in the prose; the value of one
    key is asked for.
``multiple_choice``
    A few facts of different kinds ("The archive of <city> is kept in the <color> tower.",
    ...) and a four-way multiple-choice question about one of them, for loglikelihood scoring
    (``same_kind=True``: all facts of one kind, every option stated in the document).

Tokenizer protocol
------------------
Length targeting only calls ``tokenizer.encode(text, add_special_tokens=False)`` and takes
``len()`` of the result (a ``tokenizers.Encoding`` with ``.ids`` is accepted too). Every
Hugging Face tokenizer satisfies this. Chat formatting (``chat=True``) additionally calls
``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``.

Length targeting
----------------
``context_tokens`` is the length, in tokens of the given tokenizer, of :attr:`Sample.context`
(the document with its needles, without the prompt's instruction, question or chat template,
which add about 30-80 tokens). The document never exceeds ``context_tokens``: it ends on a
whole sentence when that keeps it within 2% of the target, else on a cut-off sentence at most one
word's tokens short of it. If the needles alone do not fit, a :class:`ValueError` is raised.

Determinism
-----------
Sample ``i`` of a task depends only on ``(task, seed, i)`` (its own ``random.Random`` seeded with
a string, which Python hashes with SHA-512, so ``PYTHONHASHSEED`` does not matter), on the
tokenizer and on the prose corpus. The corpus is the ``pydoc_data`` of the running Python, which
changes between Python versions: the same seed gives the same samples on the same Python
version; :data:`CORPUS_FINGERPRINT` (stored in every sample's ``meta``) identifies the corpus.
Generated data sets should be kept as files (see ``eval/make_tasks.py``) rather than regenerated
on another interpreter.

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
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import random
import re
import string
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

__all__ = [
    "Sample",
    "DemoDoc",
    "TASKS",
    "GENERATE_TASKS",
    "PREAMBLE",
    "QUESTION_LABEL",
    "CORPUS_FINGERPRINT",
    "ApproxTokenizer",
    "single_needle",
    "multikey_needle",
    "multivalue_needle",
    "variable_tracking",
    "kv_retrieval",
    "multiple_choice",
    "generate",
    "format_prompt",
    "format_question",
    "format_choices",
    "split_prompt",
    "is_token_prefix",
    "score",
    "passkey_prompt",
    "demo_document",
    "haystack_paragraphs",
    "count_tokens",
]

PREAMBLE = "Read the following document carefully. A question about it follows the document."
"""Instruction that opens every prompt; it does not depend on the task or the question."""

QUESTION_LABEL = "Question:"
"""Label after which the question-agnostic prefix ends (see the module docstring)."""

_MARKER = "\n\n" + QUESTION_LABEL


# --------------------------------------------------------------------------------------------
# Samples
# --------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One synthetic long-context example.

    Attributes
    ----------
    task:
        Name of the task in :data:`TASKS`.
    id:
        Unique id, ``"<task>-<seed>-<index>"``.
    context:
        The long document with the needles (about ``context_tokens`` tokens).
    question:
        The question, without any label or chat formatting.
    answers:
        Strings that must all appear in a model's output for full credit (see :func:`score`).
        For ``multiple_choice`` this is ``[choices[gold]]``.
    choices:
        The four answer options of ``multiple_choice`` (short phrases, scored as continuations
        of the prompt); ``None`` for the other tasks.
    gold:
        Index of the correct option in ``choices``; ``None`` for the other tasks.
    depth:
        Relative position in ``[0, 1]``, in tokens, of the first-placed needle (the one the
        question is about for ``single_needle``, ``multikey_needle``, ``kv_retrieval`` and
        ``multiple_choice``; the first value for ``multivalue_needle``; the first assignment
        of the queried chain for ``variable_tracking``).
    meta:
        Extra information: ``seed``, ``index``, ``context_tokens`` (target), ``n_tokens``
        (actual length of ``context``), ``needle_depths`` (token depth of every needle, in the
        order they were placed), ``corpus`` (:data:`CORPUS_FINGERPRINT`) and task-specific keys.
    answer_prefix:
        Text the prompt puts after ``"Answer:"`` (plain form) or after the chat template's
        generation prompt, so that the answer continues it (``multiple_choice`` only, e.g.
        ``"The archive of Lima is kept in"``); ``None`` for the other tasks.
    """

    task: str
    id: str
    context: str
    question: str
    answers: list[str]
    choices: list[str] | None = None
    gold: int | None = None
    depth: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    answer_prefix: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return the sample as a JSON-serialisable dict (the dataclass fields)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> "Sample":
        """Build a sample from a dict such as a JSONL row; keys that are not fields are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in row.items() if k in names})


def _field(sample: Sample | Mapping[str, Any], name: str, default: Any = ...) -> Any:
    """Read field ``name`` from a :class:`Sample` or a mapping (e.g. an lm-eval doc).

    A missing field raises unless a ``default`` is given.
    """
    if isinstance(sample, Mapping):
        return sample[name] if default is ... else sample.get(name, default)
    return getattr(sample, name) if default is ... else getattr(sample, name, default)


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


def count_tokens(tokenizer: Any, text: str) -> int:
    """Number of tokens of ``text`` without special tokens.

    Parameters
    ----------
    tokenizer:
        Anything with ``encode(text, add_special_tokens=False)`` returning a sequence of ids
        (Hugging Face tokenizers) or an object with ``.ids`` (a raw ``tokenizers.Tokenizer``).
    text:
        The text to measure.

    Returns
    -------
    int
        The token count.
    """
    return len(_encode(tokenizer, text))


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` through the documented protocol (see the module docstring)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if hasattr(ids, "ids"):  # tokenizers.Encoding
        ids = ids.ids
    return list(ids)


class ApproxTokenizer:
    """Approximate, model-free token counter for when no real tokenizer is at hand.

    Counts one token per run of letters (plus one per further 8 letters), one per digit, one per
    run of other symbols and one per run of newlines: about 1.4 tokens per word on the haystack
    prose, like byte-level BPE tokenizers (a real tokenizer may still differ by 10-20%). Only
    for rough data generation: prefer the model's own tokenizer. Token ids are meaningless.
    """

    _PIECE = re.compile(r"[A-Za-z]+|\d|\n+|[^\sA-Za-z\d]+")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Return one fake id per approximate token of ``text``.

        Parameters
        ----------
        text:
            Text to tokenize.
        add_special_tokens:
            Ignored (no special tokens exist).

        Returns
        -------
        list[int]
            ``list(range(n))`` where ``n`` is the approximate token count.
        """
        n = 0
        for piece in self._PIECE.findall(text):
            n += 1 + (len(piece) - 1) // 8 if piece[0].isalpha() else 1
        return list(range(n))


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
    """The prose corpus: paragraphs of the Python reference docs, each split into sentences.

    Returns
    -------
    tuple[tuple[str, ...], ...]
        One tuple of sentences per paragraph, in a fixed order (topics sorted by name).
    """
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


@functools.lru_cache(maxsize=1)
def _corpus_words() -> frozenset[str]:
    """Lower-cased words of the whole corpus, to keep generated names out of the prose."""
    words: set[str] = set()
    for paragraph in haystack_paragraphs():
        for sentence in paragraph:
            words.update(re.findall(r"[a-z]+", sentence.lower()))
    return frozenset(words)


def _fingerprint() -> str:
    """Short identifier of the corpus: Python version and a hash of the paragraphs."""
    digest = hashlib.sha256("\n".join(" ".join(p) for p in haystack_paragraphs()).encode())
    version = ".".join(map(str, sys.version_info[:3]))
    return f"pydoc_data.topics/python-{version}/sha256:{digest.hexdigest()[:12]}"


CORPUS_FINGERPRINT = _fingerprint()
"""Identifies the haystack corpus (Python version + content hash); stored in ``Sample.meta``."""


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

    Returns
    -------
    tuple[str, list[int]]
        The text and the character offset of each needle (same order as ``needles``).
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
    that brings the document closest to the target (and closed with a period).

    Returns
    -------
    tuple[str, list[int], int]
        The document, the character offset of each needle and the document's token count.
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


def _token_depths(tokenizer: Any, context: str, offsets: Sequence[int], total: int) -> list[float]:
    """Relative token position of each character offset in ``context`` (rounded to 4 places)."""
    if total == 0:
        return [0.0 for _ in offsets]
    return [round(count_tokens(tokenizer, context[:off].rstrip()) / total, 4) for off in offsets]


# --------------------------------------------------------------------------------------------
# Word lists for keys, names and facts
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
_COLORS = (
    "red", "blue", "green", "yellow", "purple", "orange", "white", "black", "grey", "brown",
    "pink", "violet", "golden", "silver", "crimson", "turquoise",
)
_MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
)
_ANIMALS = (
    "parrot", "tortoise", "ferret", "rabbit", "goat", "peacock", "hedgehog", "lizard", "owl",
    "donkey", "llama", "goldfish", "canary", "pony", "raccoon", "chinchilla",
)
_MATERIALS = (
    "granite", "marble", "oak", "iron", "brick", "limestone", "steel", "sandstone", "cedar",
    "bronze", "basalt", "copper",
)

# (fact sentence, question, answer prefix, answer phrase, fillers). The answer prefix repeats
# the fact's opening words after "Answer:" (or the assistant header), and the answer phrase is
# the scored continuation, so it is short and the same shape for every option.
_MC_TEMPLATES: tuple[tuple[str, str, str, str, tuple[str, ...]], ...] = (
    (
        "The archive of {city} is kept in the {x} tower.",
        "In which tower is the archive of {city} kept?",
        "The archive of {city} is kept in",
        "the {x} tower",
        _COLORS,
    ),
    (
        "The annual lantern festival of {city} is held in {x}.",
        "In which month is the annual lantern festival of {city} held?",
        "The annual lantern festival of {city} is held in",
        "{x}",
        _MONTHS,
    ),
    (
        "The mayor of {city} keeps a pet {x}.",
        "What pet does the mayor of {city} keep?",
        "The mayor of {city} keeps a pet",
        "{x}",
        _ANIMALS,
    ),
    (
        "The oldest bridge in {city} is made of {x}.",
        "What is the oldest bridge in {city} made of?",
        "The oldest bridge in {city} is made of",
        "{x}",
        _MATERIALS,
    ),
)


def _distinct(rng: random.Random, make: Callable[[random.Random], Any], n: int) -> list[Any]:
    """``n`` distinct values drawn with ``make(rng)``."""
    out: list[Any] = []
    seen: set[Any] = set()
    while len(out) < n:
        value = make(rng)
        if value not in seen:
            seen.add(value)
            out.append(value)
    return out


def _key(rng: random.Random) -> str:
    """A needle key such as ``"amber-falcon"``."""
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _number(rng: random.Random) -> str:
    """A 7-digit magic number."""
    return str(rng.randint(1_000_000, 9_999_999))


def _var_name(rng: random.Random) -> str:
    """A 5-letter upper-case variable name that is not an English word of the corpus."""
    while True:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name.lower() not in _corpus_words():
            return name


def _uuid(rng: random.Random) -> str:
    """A short UUID-like string, e.g. ``"3f9a1c2e-7b4d-4e2a"`` (8-4-4 hex digits)."""
    return f"{rng.getrandbits(32):08x}-{rng.getrandbits(16):04x}-{rng.getrandbits(16):04x}"


def _depths(rng: random.Random, n: int, first: float | None) -> list[float]:
    """``n`` needle depths: the first is ``first`` (or uniform), the others uniform in [0, 1]."""
    if first is not None and not 0.0 <= first <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {first}")
    head = rng.random() if first is None else first
    return [head] + [rng.random() for _ in range(n - 1)]


# --------------------------------------------------------------------------------------------
# Task generators
# --------------------------------------------------------------------------------------------


def _samples(
    task: str,
    n_samples: int,
    seed: int | str,
    make: Callable[[random.Random], tuple[dict[str, Any], list[_Needle], Callable]],
    tokenizer: Any,
    context_tokens: int,
) -> list[Sample]:
    """Shared driver: one independent ``random.Random`` per sample, haystack filling, metadata.

    ``make(rng)`` returns the sample's fields, its needles and a ``finish(context, offsets,
    depths, n_tokens) -> (depth, extra_meta)`` callback run once the document exists.
    """
    if n_samples < 0:
        raise ValueError(f"n_samples must be >= 0, got {n_samples}")
    out = []
    for index in range(n_samples):
        rng = random.Random(f"jacap-tasks/{task}/{seed}/{index}")
        fields, needles, finish = make(rng)
        context, offsets, n_tokens = _build_context(rng, tokenizer, context_tokens, needles)
        depths = _token_depths(tokenizer, context, offsets, n_tokens)
        depth, extra = finish(context, offsets, depths, n_tokens)
        meta = {
            "seed": seed,
            "index": index,
            "context_tokens": context_tokens,
            "n_tokens": n_tokens,
            "needle_depths": depths,
            "corpus": CORPUS_FINGERPRINT,
            **extra,
        }
        out.append(
            Sample(
                task=task,
                id=f"{task}-{seed}-{index}",
                context=context,
                depth=depth,
                meta=meta,
                **fields,
            )
        )
    return out


def single_needle(
    tokenizer: Any,
    n_samples: int,
    context_tokens: int,
    seed: int | str = 0,
    *,
    depth: float | None = None,
) -> list[Sample]:
    """Passkey retrieval: one "The special magic number for <key> is: <7 digits>." needle.

    Parameters
    ----------
    tokenizer:
        Tokenizer used to measure the document (see the module docstring).
    n_samples:
        Number of samples.
    context_tokens:
        Target length of each ``Sample.context`` in tokens.
    seed:
        Seed; sample ``i`` depends only on ``(task, seed, i)``.
    depth:
        Fixed relative depth in [0, 1] for the needle (for depth sweeps); random if ``None``.

    Returns
    -------
    list[Sample]
        Samples whose ``answers`` is ``[number]``.
    """

    def make(rng: random.Random):
        key, value = _key(rng), _number(rng)
        text = f"The special magic number for {key} is: {value}."
        needles = [_Needle(text, _depths(rng, 1, depth)[0])]
        fields = {
            "question": f"What is the special magic number for {key} mentioned in the document?",
            "answers": [value],
        }
        return fields, needles, lambda c, o, d, n: (d[0], {"key": key})

    return _samples("single_needle", n_samples, seed, make, tokenizer, context_tokens)


def multikey_needle(
    tokenizer: Any,
    n_samples: int,
    context_tokens: int,
    seed: int | str = 0,
    *,
    n_keys: int = 4,
    depth: float | None = None,
) -> list[Sample]:
    """Several magic-number needles with different keys; the question asks for one key's number.

    Parameters
    ----------
    tokenizer, n_samples, context_tokens, seed:
        As for :func:`single_needle`.
    n_keys:
        Number of needles (the queried one plus ``n_keys - 1`` distractors), at least 1.
    depth:
        Fixed depth of the queried needle; random if ``None``. Distractors are uniform.

    Returns
    -------
    list[Sample]
        Samples whose ``answers`` is the queried key's number; ``meta["keys"]`` and
        ``meta["values"]`` list all needles (queried first).
    """
    if n_keys < 1:
        raise ValueError("n_keys must be >= 1")

    def make(rng: random.Random):
        keys = _distinct(rng, _key, n_keys)
        values = _distinct(rng, _number, n_keys)
        depths = _depths(rng, n_keys, depth)
        needles = [
            _Needle(f"The special magic number for {k} is: {v}.", d)
            for k, v, d in zip(keys, values, depths, strict=True)
        ]
        fields = {
            "question": (
                f"What is the special magic number for {keys[0]} mentioned in the document?"
            ),
            "answers": [values[0]],
        }
        return fields, needles, lambda c, o, d, n: (d[0], {"keys": keys, "values": values})

    return _samples("multikey_needle", n_samples, seed, make, tokenizer, context_tokens)


def multivalue_needle(
    tokenizer: Any,
    n_samples: int,
    context_tokens: int,
    seed: int | str = 0,
    *,
    n_values: int = 4,
    depth: float | None = None,
) -> list[Sample]:
    """One key with several magic numbers scattered over the document; all are asked for.

    Parameters
    ----------
    tokenizer, n_samples, context_tokens, seed:
        As for :func:`single_needle`.
    n_values:
        Number of values (needles), at least 1.
    depth:
        Fixed depth of the first-placed value; random if ``None``.

    Returns
    -------
    list[Sample]
        Samples whose ``answers`` are all ``n_values`` numbers.
    """
    if n_values < 1:
        raise ValueError("n_values must be >= 1")

    def make(rng: random.Random):
        key = _key(rng)
        values = _distinct(rng, _number, n_values)
        depths = _depths(rng, n_values, depth)
        needles = [
            _Needle(f"One of the special magic numbers for {key} is: {v}.", d)
            for v, d in zip(values, depths, strict=True)
        ]
        fields = {
            "question": (
                f"What are all the special magic numbers for {key} mentioned in the document?"
            ),
            "answers": values,
        }
        return fields, needles, lambda c, o, d, n: (d[0], {"key": key})

    return _samples("multivalue_needle", n_samples, seed, make, tokenizer, context_tokens)


def variable_tracking(
    tokenizer: Any,
    n_samples: int,
    context_tokens: int,
    seed: int | str = 0,
    *,
    n_hops: int = 4,
    n_chains: int = 2,
    depth: float | None = None,
) -> list[Sample]:
    """Variable tracking: chains ``VAR A = 12345.``, ``VAR B = A.``, ... spread over the document.

    The first chain is queried; the other ``n_chains - 1`` chains carry other values and act as
    distractors. Each chain's statements appear in chain order.

    Parameters
    ----------
    tokenizer, n_samples, context_tokens, seed:
        As for :func:`single_needle`.
    n_hops:
        Number of ``VAR B = A.`` hops per chain (each chain has ``n_hops + 1`` variables).
    n_chains:
        Number of chains, at least 1.
    depth:
        Fixed depth of the queried chain's first statement; random if ``None``. Its other
        statements are uniform after it.

    Returns
    -------
    list[Sample]
        Samples whose ``answers`` are the names of the queried chain's variables;
        ``meta["chains"]`` lists every chain's names and ``meta["values"]`` their values.
    """
    if n_hops < 0 or n_chains < 1:
        raise ValueError("need n_hops >= 0 and n_chains >= 1")

    def make(rng: random.Random):
        names = _distinct(rng, _var_name, (n_hops + 1) * n_chains)
        values = _distinct(rng, lambda r: str(r.randint(10_000, 99_999)), n_chains)
        chains = [names[c * (n_hops + 1):(c + 1) * (n_hops + 1)] for c in range(n_chains)]
        needles: list[_Needle] = []
        for c, chain in enumerate(chains):
            start = _depths(rng, 1, depth if c == 0 else None)[0]
            rest = sorted(start + (1.0 - start) * rng.random() for _ in range(n_hops))
            texts = [f"VAR {chain[0]} = {values[c]}."] + [
                f"VAR {chain[h + 1]} = {chain[h]}." for h in range(n_hops)
            ]
            needles += [_Needle(t, d) for t, d in zip(texts, [start] + rest, strict=True)]
        fields = {
            "question": (
                f"Which variables are assigned the value {values[0]}, directly or through "
                "other variables? List all of them."
            ),
            "answers": list(chains[0]),
        }
        return fields, needles, lambda c, o, d, n: (d[0], {"chains": chains, "values": values})

    return _samples("variable_tracking", n_samples, seed, make, tokenizer, context_tokens)


def kv_retrieval(
    tokenizer: Any,
    n_samples: int,
    context_tokens: int,
    seed: int | str = 0,
    *,
    n_pairs: int | None = None,
    depth: float | None = None,
) -> list[Sample]:
    """Key-value retrieval from a JSON object of short UUID-like keys and values.

    The JSON object (one pair per line) forms its own paragraph inside the prose.

    Parameters
    ----------
    tokenizer, n_samples, context_tokens, seed:
        As for :func:`single_needle`.
    n_pairs:
        Number of pairs; default ``max(8, context_tokens // 100)``.
    depth:
        Fixed depth of the JSON block; random if ``None``. The queried pair is a random one.

    Returns
    -------
    list[Sample]
        Samples whose ``answers`` is the queried key's value; ``Sample.depth`` is the token depth
        of the queried pair (not of the block); ``meta["block_depth"]`` is the block's.
    """
    pairs_wanted = max(8, context_tokens // 100) if n_pairs is None else n_pairs
    if pairs_wanted < 1:
        raise ValueError("n_pairs must be >= 1")

    def make(rng: random.Random):
        uuids = _distinct(rng, _uuid, 2 * pairs_wanted)
        keys, values = uuids[:pairs_wanted], uuids[pairs_wanted:]
        target = rng.randrange(pairs_wanted)
        block = "JSON data:\n" + json.dumps(dict(zip(keys, values, strict=True)), indent=1)
        needles = [_Needle(block, _depths(rng, 1, depth)[0], block=True)]
        fields = {
            "question": (
                f'What is the value associated with the key "{keys[target]}" in the JSON data '
                "in the document?"
            ),
            "answers": [values[target]],
        }

        def finish(context: str, offsets: list[int], depths: list[float], n_tokens: int):
            where = offsets[0] + block.index(f'"{keys[target]}"')
            (pair_depth,) = _token_depths(tokenizer, context, [where], n_tokens)
            extra = {"n_pairs": pairs_wanted, "key": keys[target], "block_depth": depths[0]}
            return pair_depth, extra

        return fields, needles, finish

    return _samples("kv_retrieval", n_samples, seed, make, tokenizer, context_tokens)


def multiple_choice(
    tokenizer: Any,
    n_samples: int,
    context_tokens: int,
    seed: int | str = 0,
    *,
    n_choices: int = 4,
    n_facts: int = 4,
    same_kind: bool = False,
    depth: float | None = None,
) -> list[Sample]:
    """Multiple choice about facts stated in the prose, scored by loglikelihood.

    The document states ``n_facts`` facts of different kinds about different cities ("The
    archive of <city> is kept in the <color> tower.", "The mayor of <city> keeps a pet
    <animal>.", ...); the question asks about the first one. The options are the true answer
    phrase and ``n_choices - 1`` other phrases of the same kind that the document does not state,
    so a model that kept the fact in its cache picks it and one that lost it falls back to its
    prior. The prompt ends with an answer prefix that repeats the fact's opening words
    (:attr:`Sample.answer_prefix`, e.g. "The archive of Lima is kept in"), so the options are
    scored as the continuation of that sentence.

    With ``same_kind=True`` the document instead states ``n_choices`` facts of the *same* kind
    about different cities and the options are all of their answers, so every wrong option is in
    the document too: a harder test of binding the answer to the right city (135M-parameter
    models are at chance there).

    Parameters
    ----------
    tokenizer, n_samples, context_tokens, seed:
        As for :func:`single_needle`.
    n_choices:
        Number of options (2 to 12).
    n_facts:
        Number of facts, one per kind (1 to 4); ignored with ``same_kind=True``.
    same_kind:
        See above.
    depth:
        Fixed depth of the queried fact; random if ``None``.

    Returns
    -------
    list[Sample]
        Samples with ``choices`` (short phrases such as ``"the red tower"``), ``gold``,
        ``answers == [choices[gold]]`` and ``answer_prefix``.
    """
    if not 2 <= n_choices <= 12:
        raise ValueError("n_choices must lie in [2, 12]")
    if not same_kind and not 1 <= n_facts <= len(_MC_TEMPLATES):
        raise ValueError(f"n_facts must lie in [1, {len(_MC_TEMPLATES)}]")

    def make(rng: random.Random):
        if same_kind:
            kinds = [rng.randrange(len(_MC_TEMPLATES))] * n_choices
        else:
            kinds = rng.sample(range(len(_MC_TEMPLATES)), n_facts)
        cities = rng.sample(_CITIES, len(kinds))
        asked = _MC_TEMPLATES[kinds[0]]
        fills = rng.sample(asked[4], n_choices)  # fills[0] is the true answer
        stated = []
        for i, kind in enumerate(kinds):
            if same_kind or i == 0:
                stated.append(fills[i])
            else:
                stated.append(rng.choice(_MC_TEMPLATES[kind][4]))
        depths = _depths(rng, len(kinds), depth)
        needles = [
            _Needle(_MC_TEMPLATES[k][0].format(city=c, x=x), d)
            for k, c, x, d in zip(kinds, cities, stated, depths, strict=True)
        ]
        options = [asked[3].format(x=x) for x in fills]
        order = list(range(n_choices))
        rng.shuffle(order)
        choices = [options[i] for i in order]
        gold = order.index(0)
        fields = {
            "question": asked[1].format(city=cities[0]),
            "answers": [choices[gold]],
            "choices": choices,
            "gold": gold,
            "answer_prefix": asked[2].format(city=cities[0]),
        }
        extra = {"cities": cities, "facts": [n.text for n in needles], "same_kind": same_kind}
        return fields, needles, lambda c, o, d, n: (d[0], extra)

    return _samples("multiple_choice", n_samples, seed, make, tokenizer, context_tokens)


TASKS: dict[str, Callable[..., list[Sample]]] = {
    "single_needle": single_needle,
    "multikey_needle": multikey_needle,
    "multivalue_needle": multivalue_needle,
    "variable_tracking": variable_tracking,
    "kv_retrieval": kv_retrieval,
    "multiple_choice": multiple_choice,
}
"""Task name -> generator ``(tokenizer, n_samples, context_tokens, seed, **options)``."""

GENERATE_TASKS = tuple(name for name in TASKS if name != "multiple_choice")
"""Tasks scored by generating text (all but ``multiple_choice``, which is loglikelihood)."""


def generate(
    task: str,
    tokenizer: Any,
    n_samples: int,
    context_tokens: int,
    seed: int | str = 0,
    **options: Any,
) -> list[Sample]:
    """Generate ``n_samples`` samples of ``task``.

    Parameters
    ----------
    task:
        A key of :data:`TASKS`.
    tokenizer:
        Tokenizer used for length targeting (see the module docstring).
    n_samples:
        Number of samples.
    context_tokens:
        Target document length in tokens.
    seed:
        Seed (int or str); sample ``i`` depends only on ``(task, seed, i)``, so a larger
        ``n_samples`` extends a smaller set.
    **options:
        Task-specific keywords (e.g. ``depth``, ``n_keys``, ``n_pairs``).

    Returns
    -------
    list[Sample]
        The samples.
    """
    if task not in TASKS:
        raise KeyError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    return TASKS[task](tokenizer, n_samples, context_tokens, seed, **options)


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def _use_chat(tokenizer: Any, chat: bool | None) -> bool:
    """Resolve ``chat=None`` to whether the tokenizer has a chat template."""
    if chat is None:
        return bool(getattr(tokenizer, "chat_template", None))
    return chat


def _prompt_split(
    sample: Sample | Mapping[str, Any], tokenizer: Any, chat: bool | None
) -> tuple[str, str]:
    """The question-agnostic prefix and the question suffix of a prompt (see module docstring)."""
    question = _field(sample, "question")
    answer_prefix = _field(sample, "answer_prefix", None) or ""
    head = f"{PREAMBLE}\n\n{_field(sample, 'context')}{_MARKER}"
    if not _use_chat(tokenizer, chat):
        return head, f" {question}\nAnswer:" + (f" {answer_prefix}" if answer_prefix else "")
    if tokenizer is None:
        raise ValueError("chat=True needs a tokenizer with a chat template")
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{head} {question}"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    at = full.find(head)
    if at < 0:
        raise ValueError("the chat template changed the user message; cannot split the prompt")
    cut = at + len(head)
    return full[:cut], full[cut:] + answer_prefix


def format_prompt(
    sample: Sample | Mapping[str, Any],
    tokenizer: Any = None,
    *,
    question_position: str = "end",
    chat: bool | None = None,
) -> str:
    """Prompt text for a sample.

    Layout: ``PREAMBLE``, the document, then ``"Question: <question>"``. With ``chat=True``
    that text is the single user message of ``tokenizer.apply_chat_template(...,
    tokenize=False, add_generation_prompt=True)``; with ``chat=False`` it is followed by
    ``"\\nAnswer:"`` (plain completion form for base models). A sample's ``answer_prefix``
    (multiple choice) follows the generation prompt, or ``"Answer: "`` in the plain form.

    Parameters
    ----------
    sample:
        A :class:`Sample` or a mapping with ``context`` and ``question`` (and optionally
        ``answer_prefix``), e.g. a JSONL row.
    tokenizer:
        Needed for ``chat=True`` (its chat template); unused otherwise.
    question_position:
        ``"end"``: the full, question-aware prompt. ``"none"``: only the question-agnostic
        context part, which ends right after ``"Question:"``; append
        :func:`format_question` after compressing it. ``prefix + suffix`` equals the ``"end"``
        prompt exactly, in both the chat and the plain form (for chat, the templated string is
        split at the question boundary, so the suffix holds the question, the end of the user
        turn and the generation prompt).
    chat:
        ``True`` for the chat template, ``False`` for the plain form, ``None`` (default) for
        the chat template exactly when the tokenizer has one (instruct models; base models and
        ``tokenizer=None`` get the plain form).

    Returns
    -------
    str
        The prompt text (no special tokens beyond what the chat template writes).
    """
    prefix, suffix = _prompt_split(sample, tokenizer, chat)
    if question_position == "end":
        return prefix + suffix
    if question_position == "none":
        return prefix
    raise ValueError(f"question_position must be 'end' or 'none', got {question_position!r}")


def format_question(
    sample: Sample | Mapping[str, Any], tokenizer: Any = None, *, chat: bool | None = None
) -> str:
    """The question suffix to append after the context part (question-agnostic setting).

    ``format_prompt(s, t, question_position="none", chat=c) + format_question(s, t, chat=c)
    == format_prompt(s, t, chat=c)``. It starts with a space and the question.

    Parameters
    ----------
    sample, tokenizer, chat:
        As for :func:`format_prompt`.

    Returns
    -------
    str
        The suffix text.
    """
    return _prompt_split(sample, tokenizer, chat)[1]


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


def is_token_prefix(tokenizer: Any, prefix: str, full: str) -> bool:
    """Whether the tokens of ``prefix`` are a prefix of the tokens of ``full``.

    Parameters
    ----------
    tokenizer:
        Tokenizer with the ``encode`` protocol.
    prefix:
        Text that ``full`` starts with.
    full:
        The whole text.

    Returns
    -------
    bool
        ``True`` when tokenizing ``full`` reproduces ``encode(prefix)`` at its start (so a cache
        of the prefix tokens can be extended with the rest of ``full``).
    """
    if not full.startswith(prefix):
        return False
    head = _encode(tokenizer, prefix)
    return _encode(tokenizer, full)[: len(head)] == head


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------


def score(sample: Sample | Mapping[str, Any], output_text: str) -> float:
    """Fraction of the sample's answers found in ``output_text``.

    Case-insensitive substring match of every string in ``answers``; 1.0 or 0.0 when there is a
    single answer.

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
    answers = list(_field(sample, "answers"))
    if not answers:
        raise ValueError("sample has no answers")
    text = (output_text or "").lower()
    return sum(1 for a in answers if a.lower() in text) / len(answers)


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


@dataclass
class DemoDoc:
    """A document holding two different facts, with one question about each.

    The prompt for question ``i`` is ``prefix + suffix(i)``; ``prefix`` (instruction, document
    and ``"Question:"``, inside the chat template when ``chat``) is the same for every question,
    so a (compressed) cache of its tokens can be reused for all of them. Tokenize ``prefix``
    once and each suffix separately; :func:`is_token_prefix` checks that this matches
    tokenizing the whole prompt (true for GPT-2 and Llama-3 style byte-level BPE tokenizers).

    Attributes
    ----------
    document:
        The raw document text.
    questions:
        ``[magic-number question, secret-city question]``.
    answers:
        The expected answer of each question.
    prefix:
        The shared prompt text up to and including ``"Question:"``.
    suffixes:
        The rest of the prompt for each question.
    chat:
        Whether the prompts use the chat template.
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
    """A document with a magic number and a secret city, and one question about each.

    Parameters
    ----------
    tokenizer:
        The model's tokenizer.
    context_tokens:
        Length of the document in tokens.
    seed:
        Seed.
    chat:
        As for :func:`format_prompt` (default: the chat template iff the tokenizer has one).

    Returns
    -------
    DemoDoc
        The document, questions, answers and the shared-prefix prompt parts.
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
