"""Samples of the synthetic tasks: :class:`Sample`, the corpus fingerprint, the word lists and
random helpers of the generators, and the shared driver that builds each sample's document."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import random
import re
import string
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from jacap_attn.prose import _build_context, _Needle, count_tokens, haystack_paragraphs

__all__ = ["Sample", "ApproxTokenizer", "CORPUS_FINGERPRINT"]


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


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


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
# The corpus: words and fingerprint
# --------------------------------------------------------------------------------------------


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


def _token_depths(tokenizer: Any, context: str, offsets: Sequence[int], total: int) -> list[float]:
    """Relative token position of each character offset in ``context`` (rounded to 4 places)."""
    if total == 0:
        return [0.0 for _ in offsets]
    return [round(count_tokens(tokenizer, context[:off].rstrip()) / total, 4) for off in offsets]


# --------------------------------------------------------------------------------------------
# Word lists for facts (keys, numbers and cities: jacap_attn.prompts)
# --------------------------------------------------------------------------------------------

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
# The shared driver
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
