"""The look-alike retrieval family (issue 34): several facts whose keys differ in one character or
word, values of four forms, in four kinds of text (:mod:`eval.synthetic.sources`).

A sample hides ``n_keys`` facts of one form, e.g. "The access code for the Marlow-7 vault is
5594285." beside "The access code for the Marlow-3 vault is 8120467.", and asks for one of them;
the prompt ends with an answer prefix that repeats the asked fact's opening words ("The access
code for the Marlow-7 vault is"), so the model's next tokens are the value itself. Every value form
has its own fact template (:data:`FACTS`):

* ``number``: a 7-digit access code (8 tokens on SmolLM2 and Gemma 3 with its space);
* ``code``: an 8-4-4 hex serial number ("3f9a1c2e-7b4d-4e2a", 14-19 tokens);
* ``words``: a two-word passphrase in quotes ("velvet lantern"; without the quotes SmolLM2's full
  cache found 7 of 12 on a probe, with them 8 of 12, hyphenated 4 of 12);
* ``date``: a delivery date ("17 March 2034").

Sample ``i`` takes the form ``FORMS[i % 4]`` unless ``value`` is given, so 24 samples hold 6 of each.
Keys (``keys``): ``"numbered"`` (default) a surname and a digit, the same surname for every fact of a
sample ("Marlow-7", "Marlow-3", ...); ``"named"`` a colour and an animal ("crimson heron").

Tasks (:data:`TASKS`, one per source; the harness finds them through :func:`eval.ruler.generate_task`):
``lookalike_docstrings``, ``lookalike_chat`` (and ``lookalike_pycode``, code kept for diagnosis and
tuning, ``eval/configs/lookalike_pycode.json``) are the family's tuning side, ``lookalike_code`` and
``lookalike_essays`` its confirmation side (``eval/configs/lookalike_tuning.json``,
``eval/configs/lookalike_confirm.json``). Split by source: no text of the confirmation side is read
while tuning.

Each sample's ``meta`` records, besides the driver's fields: ``source``, ``form``, ``keys``,
``values`` (asked first), ``facts`` (their sentences), ``fact_spans`` (``[start, end)`` characters of
every fact sentence in ``context``, asked first), ``key_spans`` (of the asked key in its fact),
``value_spans`` (per expected answer, its spans: the harness's span recall,
:func:`eval.quality.span_recall`), ``separator`` (``"\\n\\nQuestion:"``: where the document ends in
the prompt's context part) and ``corpus`` (:func:`eval.synthetic.sources.fingerprint`).
"""

from __future__ import annotations

import random
import re
from typing import Any

from jacap_attn.prompts import _ADJECTIVES, _NOUNS
from jacap_attn.prose import count_tokens

from . import sources
from .samples import _COLORS, _MONTHS, Sample, _distinct, _uuid

__all__ = ["FORMS", "FACTS", "KEYS", "TASKS", "lookalike"]

FORMS = ("number", "code", "words", "date")
KEYS = ("numbered", "named")
SEPARATOR = "\n\nQuestion:"
_WORD = re.compile(r"\w")  # a haystack unit that separates two facts has a word character

# form -> (fact sentence, question, answer prefix)
FACTS: dict[str, tuple[str, str, str]] = {
    "number": ("The access code for the {key} vault is {value}.",
               "What is the access code for the {key} vault?", "The access code for the {key} vault is"),
    "code": ("The serial number of the {key} unit is {value}.",
             "What is the serial number of the {key} unit?", "The serial number of the {key} unit is"),
    "words": ('The passphrase for the {key} account is "{value}".',
              "What is the passphrase for the {key} account?", 'The passphrase for the {key} account is "'),
    "date": ("The {key} shipment is due on {value}.",
             "On which date is the {key} shipment due?", "The {key} shipment is due on"),
}

_SURNAMES = ("Marlow", "Harlan", "Kessler", "Brandt", "Varga", "Ostrova", "Linden", "Corbin", "Halloway",
             "Renner", "Sorensen", "Abernathy", "Whitlock", "Dunmore", "Castell", "Petrakis")
_ANIMALS = ("heron", "otter", "lynx", "falcon", "badger", "marten", "ibis", "gecko", "bison", "condor",
            "ferret", "tapir")


def _keys(rng: random.Random, kind: str, n: int) -> list[str]:
    """``n`` distinct look-alike keys of one kind."""
    if kind == "numbered":
        stem = rng.choice(_SURNAMES)
        return [f"{stem}-{d}" for d in rng.sample(range(1, 10), n)]
    return _distinct(rng, lambda r: f"{r.choice(_COLORS)} {r.choice(_ANIMALS)}", n)


_VALUES = {
    "number": lambda r: str(r.randint(1_000_000, 9_999_999)),
    "code": _uuid,
    "words": lambda r: f"{r.choice(_ADJECTIVES)} {r.choice(_NOUNS)}",
    "date": lambda r: f"{r.randint(1, 28)} {r.choice(_MONTHS)} {r.randint(2031, 2049)}",
}


def _places(units: list[str]) -> list[int]:
    """Per boundary of ``units`` (``len(units) + 1`` of them), how many units before it have a word
    character: boundaries with no word between them (a blank line, a comment line of operators) are one
    place, and a fact per place keeps haystack words between any two facts."""
    place = [0]
    for unit in units:
        place.append(place[-1] + bool(_WORD.search(unit)))
    return place


def _render(pool: list[str], k: int, facts: list[str], depths: list[float], frame, rng_state) -> tuple[str, list[int]]:
    """The document of the first ``k`` haystack units with the facts inserted at the unit boundary
    closest (in characters) to each depth; returns the text and each fact's character offset."""
    rng = random.Random()
    rng.setstate(rng_state)  # the same frames (chat leads) for every k tried
    hay = pool[:k]
    bounds = [0]
    for unit in hay:
        bounds.append(bounds[-1] + len(unit))
    place = _places(hay)
    slots: dict[int, list[int]] = {}
    held: set[int] = set()
    for j, depth in enumerate(depths):
        goal = depth * bounds[-1]
        # The closest boundary in a place no other fact holds, so that haystack words separate any two
        # facts; only when there are fewer places than facts (a document of almost no haystack, which
        # _document refuses) do facts share one.
        free = [i for i in range(k + 1) if place[i] not in held] or list(range(k + 1))
        chosen = min(free, key=lambda i: (abs(bounds[i] - goal), i))
        held.add(place[chosen])
        slots.setdefault(chosen, []).append(j)
    pieces: list[tuple[str, int, int]] = []  # (text, fact index or -1, fact offset in text)
    for i in range(k + 1):
        for j in slots.get(i, ()):
            text, at = frame(facts[j], hay[i] if i < k else "", rng)
            pieces.append((text, j, at))
        if i < k:
            pieces.append((hay[i], -1, 0))
    out, offsets, position = [], [0] * len(facts), 0
    for n_piece, (text, j, at) in enumerate(pieces):
        if n_piece == 0:
            stripped = text.lstrip("\n ")
            at -= len(text) - len(stripped)
            text = stripped
        if j >= 0:
            offsets[j] = position + at
        out.append(text)
        position += len(text)
    return "".join(out), offsets


def _document(rng: random.Random, tokenizer: Any, context_tokens: int, source: str, facts: list[str],
              depths: list[float]) -> tuple[str, list[int], int]:
    """The longest document of ``source`` units with the facts that has at most ``context_tokens``
    tokens (a whole number of units); ``(text, fact offsets, tokens)``. ``ValueError`` when the facts
    alone are longer."""
    stream = sources.units(source, rng)
    frame = sources.SOURCES[source].frame
    state = rng.getstate()
    pool: list[str] = []
    cache: dict[int, tuple[str, list[int], int]] = {}

    def measure(k: int):
        while len(pool) < k:
            pool.append(next(stream))
        if k not in cache:
            text, offsets = _render(pool, k, facts, depths, frame, state)
            cache[k] = (text, offsets, count_tokens(tokenizer, text))
        return cache[k]

    if measure(0)[2] > context_tokens:
        raise ValueError(f"the facts alone take {measure(0)[2]} tokens, more than context_tokens={context_tokens}")
    lo, hi = 0, 16
    while measure(hi)[2] <= context_tokens:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if measure(mid)[2] <= context_tokens else (lo, mid)
    places = _places(pool[:lo])[-1] + 1
    if places < len(facts):
        raise ValueError(f"context_tokens={context_tokens} leaves {places - 1} haystack units with words of {source!r}, too few to "
                         f"separate {len(facts)} facts: give more tokens or fewer keys")
    return measure(lo)


def lookalike(tokenizer: Any, n_samples: int, context_tokens: int, seed: int | str = 0, *, source: str,
              n_keys: int = 4, value: str | None = None, keys: str = "numbered", task: str | None = None) -> list[Sample]:
    """Samples of the look-alike family (see the module docstring).

    Parameters
    ----------
    tokenizer:
        Tokenizer that measures the document (``encode(text, add_special_tokens=False)``).
    n_samples, context_tokens, seed:
        As for :func:`eval.synthetic.single_needle`; sample ``i`` depends only on ``(task, seed, i)``,
        the tokenizer and the source's text.
    source:
        A source of :data:`eval.synthetic.sources.SOURCES`.
    n_keys:
        Facts per sample (the asked one and ``n_keys - 1`` look-alikes), 1 to 9.
    value:
        A form of :data:`FORMS` for every sample; ``None`` (default): ``FORMS[i % 4]`` for sample ``i``.
    keys:
        ``"numbered"`` or ``"named"`` (:data:`KEYS`).
    task:
        The task name in ids and seeds (default ``"lookalike_<source>"``).

    Returns
    -------
    list[Sample]
        Samples with ``answers == [value of the asked fact]`` and ``answer_prefix`` set. Raises
        ``ValueError`` for a bad ``n_keys``, ``value`` or ``keys``, ``KeyError`` for an unknown source.
    """
    if source not in sources.SOURCES:
        raise KeyError(f"unknown source {source!r}; known: {', '.join(sources.SOURCES)}")
    if isinstance(n_keys, bool) or not isinstance(n_keys, int) or not 1 <= n_keys <= 9:
        raise ValueError(f"n_keys must be an integer in [1, 9], got n_keys={n_keys!r}")
    if value is not None and value not in FORMS:
        raise ValueError(f"value must be one of {', '.join(FORMS)} or None, got value={value!r}")
    if keys not in KEYS:
        raise ValueError(f"keys must be one of {', '.join(KEYS)}, got keys={keys!r}")
    if n_samples < 0:
        raise ValueError(f"n_samples must be >= 0, got {n_samples}")
    task = task or f"lookalike_{source}"
    out = []
    for index in range(n_samples):
        rng = random.Random(f"jacap-tasks/{task}/{seed}/{index}")
        form = value or FORMS[index % len(FORMS)]
        fact, question, prefix = FACTS[form]
        names = _keys(rng, keys, n_keys)
        values = _distinct(rng, _VALUES[form], n_keys)
        sentences = [fact.format(key=k, value=v) for k, v in zip(names, values)]
        # Stratified depths: one fact in each of n_keys equal bins of [0.05, 0.95], in a seeded order,
        # so that look-alikes never sit side by side and the asked one is anywhere.
        bins = rng.sample(range(n_keys), n_keys)
        depths = [0.05 + 0.9 * (b + rng.uniform(0.15, 0.85)) / n_keys for b in bins]
        context, offsets, n_tokens = _document(rng, tokenizer, context_tokens, source, sentences, depths)
        spans = [[at, at + len(s)] for at, s in zip(offsets, sentences)]
        sentences = [context[a:b] for a, b in spans]  # as written (a chat turn lowers the first letter)
        key_at = offsets[0] + sentences[0].index(names[0])
        value_at = offsets[0] + sentences[0].rindex(values[0])
        token_depths = [round(count_tokens(tokenizer, context[:at].rstrip()) / max(n_tokens, 1), 4) for at in offsets]
        meta = {"seed": seed, "index": index, "context_tokens": context_tokens, "n_tokens": n_tokens,
                "needle_depths": token_depths, "corpus": sources.fingerprint(source), "source": source,
                "form": form, "keys": names, "values": values, "facts": sentences, "fact_spans": spans,
                "key_spans": [[key_at, key_at + len(names[0])]],
                "value_spans": [[[value_at, value_at + len(values[0])]]], "separator": SEPARATOR}
        out.append(Sample(task=task, id=f"{task}-{seed}-{index}", context=context,
                          question=question.format(key=names[0]), answers=[values[0]], depth=token_depths[0],
                          meta=meta, answer_prefix=prefix.format(key=names[0])))
    return out


def _task(source: str):
    def generate(tokenizer: Any, n_samples: int, context_tokens: int, seed: int | str = 0, **options: Any) -> list[Sample]:
        return lookalike(tokenizer, n_samples, context_tokens, seed, source=source, **options)

    generate.__name__ = f"lookalike_{source}"
    generate.__doc__ = f"The look-alike family on the ``{source}`` source (:func:`lookalike`)."
    return generate


TASKS = {f"lookalike_{name}": _task(name) for name in sources.SOURCES}
"""Task name -> generator, one per source (``lookalike_docstrings``, ``lookalike_chat``,
``lookalike_code``, ``lookalike_essays``)."""
