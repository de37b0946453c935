"""The RULER task generators (Hsieh et al. 2024, arXiv:2404.06654; NVIDIA/RULER
``scripts/data/synthetic/{niah,variable_tracking,common_words_extraction,freq_words_extraction}.py``
and ``constants.py``), rewritten over the harness's :class:`eval.synthetic.Sample`.

Each generator has the signature of :func:`eval.synthetic.generate`'s generators,
``(tokenizer, n_samples, context_tokens, seed, **options) -> list[Sample]``; sample ``i`` depends
only on ``(task, seed, i)``, the tokenizer and the haystack sources. ``context_tokens`` is the
length of :attr:`Sample.context` (the ``{context}`` part of RULER's template: the haystack with its
needles), the largest that fits; the template's instruction and question come on top
(:mod:`eval.ruler.prompts`).

Every sample's ``meta`` holds ``layout="ruler"`` (the harness formats it with
:func:`eval.ruler.prompts.prompt_parts`), ``instruction`` (the template's text before the
document, few-shot example included), ``separator`` (between the document and the question),
``metric`` (``"all"``, RULER's ``string_match_all``), ``value_spans`` (per expected answer, the
``[start, end)`` character spans of its occurrences in ``context``), ``needle_depths`` (token
depth of each inserted needle; empty for CWE and FWE, which have no needles, and whose
``Sample.depth`` is 0) and ``n_tokens``.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from jacap_attn.prompts import _number  # 7 digits, randint(10**6, 10**7 - 1): RULER's numbers
from jacap_attn.prose import count_tokens

from eval.synthetic.samples import Sample, _distinct, _token_depths

from . import haystack as H

__all__ = ["TASKS", "TEMPLATES", "MAX_NEW_TOKENS", "DEPTHS", "generate", "niah", "variable_tracking",
           "common_words", "freq_words"]

# RULER's templates (constants.py, TASKS[...]["template"] / ["answer_prefix"]): what the model reads.
TEMPLATES: dict[str, tuple[str, str]] = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
        "{type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are"),
    "variable_tracking": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        "assigned the value {query}, they are: "),
    "common_words_extraction": (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
        "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:"),
    "freq_words_extraction": (
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the "
        "dots '....'. What are the three most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:"),
}
"""RULER template family -> ``(template, answer_prefix)`` (``{context}``, ``{query}`` ...)."""

MAX_NEW_TOKENS = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120, "freq_words_extraction": 50}
"""RULER's ``tokens_to_generate`` per template family."""

DEPTHS = tuple(int(round(100 * i / 39)) for i in range(40))
"""RULER's needle depths in percent: 40 evenly spaced points of [0, 100]."""

_GOLDEN = 0.6180339887498949


# --------------------------------------------------------------------------------------------
# Values and the shared driver
# --------------------------------------------------------------------------------------------


def _word(rng: random.Random) -> str:
    """An ``adjective-noun`` pair of wonderwords' lists (RULER's needle words)."""
    lists = H.word_lists()
    return f"{rng.choice(lists['adjectives'])}-{rng.choice(lists['nouns'])}"


def _uuid(rng: random.Random) -> str:
    """A version-4 UUID string from 128 random bits (RULER's ``generate_random_uuid``)."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


VALUE_KINDS: dict[str, Callable[[random.Random], str]] = {"numbers": _number, "words": _word, "uuids": _uuid}
"""RULER's ``type_needle_k`` / ``type_needle_v`` kinds -> a draw."""


def spread_depth(task: str, seed: int | str, index: int) -> int:
    """Depth (percent, one of :data:`DEPTHS`) of the queried needle of sample ``index``: a
    golden-ratio sequence over the samples from a seeded offset, so any first ``n`` samples of a
    split cover the document evenly (RULER draws it at random per sample)."""
    offset = random.Random(f"jacap-ruler/{task}/{seed}/depth").random()
    return DEPTHS[int(((offset + index * _GOLDEN) % 1.0) * len(DEPTHS))]


@dataclass
class _Draft:
    """One sample before length fitting: ``render(units) -> (context, needle offsets, value
    spans)`` is deterministic in ``units`` (haystack lines, words or list entries)."""

    fields: dict[str, Any]
    render: Callable[[int], tuple[str, list[int], list[list[list[int]]]]]
    extra: dict[str, Any] = field(default_factory=dict)
    min_units: int = 1


def _fit(draft: _Draft, tokenizer: Any, context_tokens: int) -> tuple[str, list[int], list, int]:
    """The rendering of ``draft`` with the most units whose context has at most
    ``context_tokens`` tokens; ``(context, offsets, spans, n_tokens)``. Raises ``ValueError`` when
    even ``min_units`` does not fit."""
    cache: dict[int, tuple] = {}

    def measure(units: int):
        if units not in cache:
            text, offsets, spans = draft.render(units)
            cache[units] = (text, offsets, spans, count_tokens(tokenizer, text))
        return cache[units]

    lo = draft.min_units
    if measure(lo)[3] > context_tokens:
        raise ValueError(f"{measure(lo)[3]} tokens at the smallest haystack, more than context_tokens={context_tokens}")
    hi = max(2 * lo, lo + 8)
    while measure(hi)[3] <= context_tokens:
        if hi > 64 * context_tokens + 4096:
            raise ValueError("the tokenizer does not count the haystack as tokens")
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if measure(mid)[3] <= context_tokens:
            lo = mid
        else:
            hi = mid
    return measure(lo)


def _samples(task: str, n_samples: int, seed: int | str, tokenizer: Any, context_tokens: int,
             make: Callable[[random.Random, int], _Draft]) -> list[Sample]:
    """Shared driver: one ``random.Random`` per sample, length fitting, metadata."""
    if n_samples < 0:
        raise ValueError(f"n_samples must be >= 0, got {n_samples}")
    out = []
    for index in range(n_samples):
        rng = random.Random(f"jacap-ruler/{task}/{seed}/{index}")
        draft = make(rng, index)
        context, offsets, spans, n_tokens = _fit(draft, tokenizer, context_tokens)
        depths = _token_depths(tokenizer, context, offsets, n_tokens)
        meta = {"seed": seed, "index": index, "context_tokens": context_tokens, "n_tokens": n_tokens,
                "needle_depths": depths, "layout": "ruler", "metric": "all", "value_spans": spans,
                **draft.extra}
        fields = dict(draft.fields)
        meta["instruction"], meta["separator"] = fields.pop("instruction"), fields.pop("separator")
        out.append(Sample(task=task, id=f"{task}-{seed}-{index}", context=context,
                          depth=depths[0] if depths else 0.0, meta=meta, **fields))
    return out


def _split_template(template: str, answer_prefix: str, **values: Any) -> dict[str, str]:
    """``instruction`` (text before ``{context}``), ``separator`` (the newline after it, or ``""``),
    ``question`` (the rest) and ``answer_prefix`` of a RULER template filled with ``values``."""
    before, after = template.split("{context}")
    before, after = before.format(**values), after.format(**values)
    sep = "\n" if after.startswith("\n") else ""
    return {"instruction": before, "separator": sep, "question": after[len(sep):],
            "answer_prefix": answer_prefix.format(**values)}


def _join_lines(lines: list[str], needles: dict[int, str]) -> tuple[str, dict[int, int]]:
    """``"\\n".join`` of ``lines`` (a list with the needle lines inserted); ``needles``: line index
    -> needle id; returns the text and needle id -> character offset."""
    offsets, pos = {}, 0
    for i, line in enumerate(lines):
        if i in needles:
            offsets[needles[i]] = pos
        pos += len(line) + 1
    return "\n".join(lines), offsets


def _insert(base: list[str], items: list[tuple[int, str]]) -> tuple[list[str], dict[int, int]]:
    """``base`` with ``items`` (``(position in base, text)``, in order) inserted before those
    positions; returns the list and item number -> its index in the list."""
    order = sorted(range(len(items)), key=lambda k: (items[k][0], k))
    out, where, j = [], {}, 0
    for pos in range(len(base) + 1):
        while j < len(order) and items[order[j]][0] == pos:
            where[order[j]] = len(out)
            out.append(items[order[j]][1])
            j += 1
        if pos < len(base):
            out.append(base[pos])
    return out, where


def _value_span(context: str, offset: int, needle: str, value: str) -> list[list[int]]:
    """The span of ``value`` inside the needle placed at ``offset``."""
    start = offset + needle.index(value)
    assert context[start:start + len(value)] == value
    return [[start, start + len(value)]]


# --------------------------------------------------------------------------------------------
# NIAH
# --------------------------------------------------------------------------------------------

_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."


def _niah_template(singular: bool) -> tuple[str, str]:
    """RULER's niah template and answer prefix, made singular as ``niah.py`` does when one value
    is asked for ('Some' -> 'A', 'are all' -> 'is', 'are' -> 'is', 'answers' -> 'answer')."""
    template, prefix = TEMPLATES["niah"]
    if singular:
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template, prefix = template.replace(old, new), prefix.replace(old, new)
    return template, prefix


def niah(tokenizer: Any, n_samples: int, context_tokens: int, seed: int | str = 0, *, task: str = "niah",
         type_haystack: str = "essay", type_needle_k: str = "words", type_needle_v: str = "numbers",
         num_needle_k: int = 1, num_needle_v: int = 1, num_needle_q: int = 1) -> list[Sample]:
    """Needle in a haystack, RULER's ``niah.py``: ``num_needle_k`` keys (``max(k, q)``), each with
    ``num_needle_v`` values, every (key, value) a needle "One of the special magic <kind> for <key>
    is: <value>." inserted at a distinct depth of :data:`DEPTHS`; ``num_needle_q`` keys are asked
    for, every value of each is expected (``answers``, in query order).

    ``type_haystack``: ``"noise"`` (:data:`eval.ruler.haystack.NOISE` lines, needles as lines),
    ``"essay"`` (Paul Graham's essays from their start, needles between sentences) or ``"needle"``
    (every line a distractor needle whose key and value have the kinds of the asked one, keys
    distinct from the asked keys). ``type_needle_k`` / ``type_needle_v``: ``"numbers"`` (7 digits),
    ``"words"`` (adjective-noun), ``"uuids"``. The first asked needle's depth follows
    :func:`spread_depth`; the others are drawn from the remaining depths.

    Returns samples whose ``answers`` are the asked values; ``meta`` adds ``keys``, ``values``
    (per key), ``queries``, ``haystack``, ``depths_percent`` (per needle, asked first). Raises
    ``ValueError`` for an unknown kind or haystack or counts below 1.
    """
    if type_needle_k not in VALUE_KINDS or type_needle_v not in VALUE_KINDS:
        raise ValueError(f"needle kinds must be among {sorted(VALUE_KINDS)}")
    if type_haystack not in ("noise", "essay", "needle"):
        raise ValueError(f"type_haystack must be noise, essay or needle, got {type_haystack!r}")
    if min(num_needle_k, num_needle_v, num_needle_q) < 1:
        raise ValueError("needle counts must be >= 1")
    num_needle_k = max(num_needle_k, num_needle_q)
    singular = num_needle_q * num_needle_v == 1
    template, answer_prefix = _niah_template(singular)
    draw_k, draw_v = VALUE_KINDS[type_needle_k], VALUE_KINDS[type_needle_v]
    kind = type_needle_v[:-1] if singular else type_needle_v

    def make(rng: random.Random, index: int) -> _Draft:
        keys = _distinct(rng, draw_k, num_needle_k)
        flat = _distinct(rng, draw_v, num_needle_k * num_needle_v)
        values = [flat[i * num_needle_v:(i + 1) * num_needle_v] for i in range(num_needle_k)]
        asked = rng.sample(range(num_needle_k), num_needle_q)
        # needles: the asked keys' values first (the first of them at the spread depth), then the rest
        order = [(k, j) for k in asked for j in range(num_needle_v)]
        order += [(k, j) for k in range(num_needle_k) if k not in asked for j in range(num_needle_v)]
        first = spread_depth(task, seed, index)
        depths = [first] + rng.sample([d for d in DEPTHS if d != first], len(order) - 1)
        texts = [_NEEDLE.format(type_needle_v=type_needle_v, key=keys[k], value=values[k][j]) for k, j in order]
        queries = [keys[k] for k in asked]
        query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
        fields = _split_template(template, answer_prefix, type_needle_v=kind, query=query)
        fields["answers"] = [values[k][j] for k in asked for j in range(num_needle_v)]
        taken = set(keys) | set(flat)
        distractors: list[tuple[str, str]] = []
        noise_rng = random.Random(f"jacap-ruler/{task}/{seed}/{index}/haystack")

        def distractor(i: int) -> str:
            while len(distractors) <= i:
                k, v = draw_k(noise_rng), draw_v(noise_rng)
                if k not in taken and v not in taken:
                    taken.update((k, v))
                    distractors.append((k, v))
            k, v = distractors[i]
            return _NEEDLE.format(type_needle_v=type_needle_v, key=k, value=v)

        def render(units: int):
            if type_haystack == "essay":
                sents = H.sentences(" ".join(H.essay_words()[:units]))
                base = sents
            else:
                base = [H.NOISE] * units if type_haystack == "noise" else [distractor(i) for i in range(units)]
            items = [(int(len(base) * d / 100), t) for d, t in zip(depths, texts)]
            lines, where = _insert(base, items)
            if type_haystack == "essay":
                context = " ".join(lines)
                starts, pos = [], 0
                for line in lines:
                    starts.append(pos)
                    pos += len(line) + 1
                offsets = [starts[where[k]] for k in range(len(texts))]
            else:
                context, by_id = _join_lines(lines, {where[k]: k for k in range(len(texts))})
                offsets = [by_id[k] for k in range(len(texts))]
            spans = [_value_span(context, offsets[i], texts[i], values[k][j])
                     for i, (k, j) in enumerate(order[:len(fields["answers"])])]
            return context, offsets, spans

        extra = {"keys": keys, "values": values, "queries": queries, "haystack": type_haystack,
                 "depths_percent": depths, "type_needle_k": type_needle_k, "type_needle_v": type_needle_v}
        return _Draft(fields, render, extra, min_units=1)

    return _samples(task, n_samples, seed, tokenizer, context_tokens, make)


# --------------------------------------------------------------------------------------------
# Variable tracking
# --------------------------------------------------------------------------------------------


def variable_tracking(tokenizer: Any, n_samples: int, context_tokens: int, seed: int | str = 0, *,
                      task: str = "vt", num_chains: int = 1, num_hops: int = 4) -> list[Sample]:
    """Variable tracking, RULER's ``variable_tracking.py`` (noise haystack, no few-shot example, as
    its defaults): ``num_chains`` chains ``VAR X1 = 12345``, ``VAR X2 = VAR X1``, ... of
    ``num_hops`` hops, each chain's lines in order at random lines of the noise haystack; the
    first chain's value is asked for, its ``num_hops + 1`` variable names (5 upper-case letters)
    are expected. RULER writes the hop lines with a trailing space; here they end at the name.

    Returns samples whose ``answers`` are the first chain's names; ``meta`` adds ``chains``,
    ``chain_values``; ``value_spans`` lists every occurrence of each name. Raises ``ValueError``
    for ``num_chains < 1`` or ``num_hops < 0``.
    """
    if num_chains < 1 or num_hops < 0:
        raise ValueError("need num_chains >= 1 and num_hops >= 0")
    template, answer_prefix = TEMPLATES["variable_tracking"]
    fixed = (template + answer_prefix + H.NOISE).lower()

    def name(rng: random.Random) -> str:
        while True:
            text = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if text.lower() not in fixed:
                return text

    def make(rng: random.Random, index: int) -> _Draft:
        names = _distinct(rng, name, (num_hops + 1) * num_chains)
        chains = [names[c * (num_hops + 1):(c + 1) * (num_hops + 1)] for c in range(num_chains)]
        chain_values = _distinct(rng, lambda r: str(r.randint(10000, 99999)), num_chains)
        statements = [[f"VAR {chain[0]} = {chain_values[c]}"] + [f"VAR {chain[h + 1]} = VAR {chain[h]}"
                                                              for h in range(num_hops)]
                      for c, chain in enumerate(chains)]
        fractions = [sorted(rng.random() for _ in chain) for chain in chains]
        fields = _split_template(template, answer_prefix, query=chain_values[0], num_v=num_hops + 1)
        fields["answers"] = list(chains[0])

        def render(units: int):
            lines = [H.NOISE] * units
            for c, chain in enumerate(statements):  # RULER inserts chain by chain, each in order
                positions = [min(int(f * len(lines)), len(lines)) for f in fractions[c]]
                for j, (pos, text) in enumerate(zip(positions, chain)):
                    lines.insert(pos + j, text)
            context = "\n".join(lines)
            offsets = [context.index(statements[c][0]) for c in range(num_chains)]
            spans = [_find_all(context, v, r"(?<![A-Z]){}(?![A-Z])") for v in fields["answers"]]
            return context, offsets, spans

        extra = {"chains": chains, "chain_values": chain_values, "haystack": "noise"}
        return _Draft(fields, render, extra, min_units=1)

    return _samples(task, n_samples, seed, tokenizer, context_tokens, make)


def _find_all(context: str, value: str, pattern: str) -> list[list[int]]:
    """``[start, end)`` spans of ``value`` in ``context`` where ``pattern`` (``{}`` for the escaped
    value) matches."""
    return [[m.start(), m.end()] for m in re.finditer(pattern.format(re.escape(value)), context)]


# --------------------------------------------------------------------------------------------
# Common words extraction
# --------------------------------------------------------------------------------------------


def _cwe_words() -> tuple[str, ...]:
    """RULER's CWE vocabulary: wonderwords' nouns, adjectives and verbs, deduplicated, sorted."""
    lists = H.word_lists()
    return tuple(sorted(set(lists["nouns"]) | set(lists["adjectives"]) | set(lists["verbs"])))


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def common_words(tokenizer: Any, n_samples: int, context_tokens: int, seed: int | str = 0, *,
                 task: str = "cwe", num_cw: int = 10, freq_cw: int | None = None, freq_ucw: int | None = None,
                 num_fewshot: int = 1) -> list[Sample]:
    """Common words extraction, RULER's ``common_words_extraction.py``: a numbered list where
    ``num_cw`` words appear ``freq_cw`` times each and the other words ``freq_ucw`` times, shuffled;
    the ``num_cw`` common words are expected. ``freq_cw`` / ``freq_ucw`` default as RULER's (30 / 3,
    or 6 / 1 below 4,096 tokens); one few-shot example (20 words repeated 3 / 1 times, or 40 words
    10 / 3 times at 4,096 tokens and more) with its answer opens the prompt (``meta["instruction"]``).

    Returns samples whose ``answers`` are the common words; ``value_spans`` lists every occurrence
    of each in the list. Raises ``ValueError`` when the vocabulary is too small for the length.
    """
    short = context_tokens < 4096
    freq_cw = (6 if short else 30) if freq_cw is None else freq_cw
    freq_ucw = (1 if short else 3) if freq_ucw is None else freq_ucw
    shot = (20, 3, 1) if short else (40, 10, 3)
    template, answer_prefix = TEMPLATES["common_words_extraction"]

    def make(rng: random.Random, index: int) -> _Draft:
        vocab = list(_cwe_words())
        rng.shuffle(vocab)
        shots = []
        for s in range(num_fewshot):  # drawn from the end of the shuffled vocabulary, the sample from its start
            words = vocab[len(vocab) - (s + 1) * shot[0]:len(vocab) - s * shot[0]]
            listed = words[:num_cw] * shot[1] + words[num_cw:] * shot[2]
            rng.shuffle(listed)
            shots.append(template.format(context=_numbered(listed), query="") + answer_prefix.format()
                         + " " + _numbered(words[:num_cw]))
        fields = _split_template(template, answer_prefix, query="")
        fields["instruction"] = "".join(s + "\n" for s in shots) + fields["instruction"]
        limit = len(vocab) - num_fewshot * shot[0]
        common = vocab[:num_cw]
        fields["answers"] = list(common)

        def render(units: int):
            if units > limit:
                raise ValueError(f"the vocabulary has {limit} words, {units} asked for")
            listed = common * freq_cw + vocab[num_cw:num_cw + units] * freq_ucw
            random.Random(f"jacap-ruler/{task}/{seed}/{index}/{units}").shuffle(listed)
            context = _numbered(listed)
            spans = [_find_all(context, w, r"(?<=\d\. ){}(?= \d|$)") for w in common]
            return context, [], spans

        return _Draft(fields, render, {"num_cw": num_cw, "freq_cw": freq_cw, "freq_ucw": freq_ucw}, min_units=0)

    return _samples(task, n_samples, seed, tokenizer, context_tokens, make)


# --------------------------------------------------------------------------------------------
# Frequent words extraction
# --------------------------------------------------------------------------------------------


def freq_words(tokenizer: Any, n_samples: int, context_tokens: int, seed: int | str = 0, *,
               task: str = "fwe", alpha: float = 2.0, coded_wordlen: int = 6,
               vocab_size: int | None = None) -> list[Sample]:
    """Frequent words extraction, RULER's ``freq_words_extraction.py``: a text of random
    ``coded_wordlen``-letter words whose counts follow a Zipf law of exponent ``alpha`` over a
    shuffled vocabulary (``vocab_size``, default ``max(context_tokens // 50, 10)``, RULER's), the
    most frequent replaced by the noise word ``"..."``; the three next most frequent are expected.

    Returns samples whose ``answers`` are those three words; ``value_spans`` lists every
    occurrence of each. Raises ``ValueError`` for ``alpha <= 1``.
    """
    if alpha <= 1:
        raise ValueError("alpha must be > 1")
    from scipy.special import zeta

    size = max(context_tokens // 50, 10) if vocab_size is None else vocab_size
    template, answer_prefix = TEMPLATES["freq_words_extraction"]
    norm = float(zeta(alpha))

    def make(rng: random.Random, index: int) -> _Draft:
        vocab = sorted(set(_distinct(rng, lambda r: "".join(r.choice(string.ascii_lowercase)
                                                            for _ in range(coded_wordlen)), size)))
        rng.shuffle(vocab)
        vocab[0] = "..."
        fields = _split_template(template, answer_prefix, query="")
        fields["answers"] = vocab[1:4]

        def render(units: int):
            words = [w for k, w in enumerate(vocab, 1) for _ in range(int(units * k ** -alpha / norm))]
            random.Random(f"jacap-ruler/{task}/{seed}/{index}/{units}").shuffle(words)
            context = " ".join(words)
            spans = [_find_all(context, w, r"(?<!\S){}(?!\S)") for w in fields["answers"]]
            return context, [], spans

        return _Draft(fields, render, {"vocab_size": size, "alpha": alpha}, min_units=8)

    return _samples(task, n_samples, seed, tokenizer, context_tokens, make)


# --------------------------------------------------------------------------------------------
# The suite
# --------------------------------------------------------------------------------------------

# RULER's scripts/synthetic.yaml: task name -> (generator, arguments, template family).
SUITE: dict[str, tuple[Callable[..., list[Sample]], dict[str, Any], str]] = {
    "niah_single_1": (niah, {"type_haystack": "noise", "type_needle_k": "words", "type_needle_v": "numbers"}, "niah"),
    "niah_single_2": (niah, {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "numbers"}, "niah"),
    "niah_single_3": (niah, {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "uuids"}, "niah"),
    "niah_multikey_1": (niah, {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "numbers",
                               "num_needle_k": 4}, "niah"),
    "niah_multikey_2": (niah, {"type_haystack": "needle", "type_needle_k": "words", "type_needle_v": "numbers"},
                        "niah"),
    "niah_multikey_3": (niah, {"type_haystack": "needle", "type_needle_k": "uuids", "type_needle_v": "uuids"},
                        "niah"),
    "niah_multivalue": (niah, {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "numbers",
                               "num_needle_v": 4}, "niah"),
    "niah_multiquery": (niah, {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "numbers",
                               "num_needle_q": 4}, "niah"),
    "vt": (variable_tracking, {"num_chains": 1, "num_hops": 4}, "variable_tracking"),
    "cwe": (common_words, {"freq_cw": None, "freq_ucw": None, "num_cw": 10}, "common_words_extraction"),
    "fwe": (freq_words, {"alpha": 2.0}, "freq_words_extraction"),
}
"""RULER's synthetic tasks (``scripts/synthetic.yaml``) but QA (see ``eval/ruler/README.md``)."""


def _bind(name: str) -> Callable[..., list[Sample]]:
    make, args, _ = SUITE[name]

    def generator(tokenizer: Any, n_samples: int, context_tokens: int, seed: int | str = 0,
                  **options: Any) -> list[Sample]:
        return make(tokenizer, n_samples, context_tokens, seed, task=name, **{**args, **options})

    generator.__name__ = name
    generator.__doc__ = f"RULER's ``{name}``: :func:`{make.__name__}` with {args}."
    return generator


TASKS: dict[str, Callable[..., list[Sample]]] = {name: _bind(name) for name in SUITE}
"""Task name -> generator ``(tokenizer, n_samples, context_tokens, seed, **options)``."""


def max_new_tokens(task: str) -> int:
    """RULER's ``tokens_to_generate`` of suite task ``task``."""
    return MAX_NEW_TOKENS[SUITE[task][2]]


def generate(task: str, tokenizer: Any, n_samples: int, context_tokens: int, seed: int | str = 0,
             **options: Any) -> list[Sample]:
    """``n_samples`` samples of suite task ``task`` (a key of :data:`TASKS`), as
    :func:`eval.synthetic.generate` does for its tasks. Raises ``KeyError`` for an unknown task."""
    if task not in TASKS:
        raise KeyError(f"unknown RULER task {task!r}; known: {', '.join(TASKS)}")
    return TASKS[task](tokenizer, n_samples, context_tokens, seed, **options)
