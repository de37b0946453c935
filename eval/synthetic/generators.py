"""The task generators (see :mod:`eval.synthetic`): one function per task, :data:`TASKS` and
:func:`generate`."""

from __future__ import annotations

import json
import random
from typing import Any, Callable

from jacap_attn.prompts import _CITIES, _key, _number
from jacap_attn.prose import _Needle

from .samples import (
    _MC_TEMPLATES,
    Sample,
    _depths,
    _distinct,
    _samples,
    _token_depths,
    _uuid,
    _var_name,
)

__all__ = [
    "TASKS",
    "GENERATE_TASKS",
    "generate",
    "single_needle",
    "multikey_needle",
    "multivalue_needle",
    "variable_tracking",
    "kv_retrieval",
    "multiple_choice",
]


def single_needle(
    tokenizer: Any,
    n_samples: int,
    context_tokens: int,
    seed: int | str = 0,
    *,
    depth: float | None = None,
    value: str = "number",
) -> list[Sample]:
    """Passkey retrieval: one "The special magic number for <key> is: <7 digits>." needle, or with
    ``value="code"`` one "The special magic code for <key> is: <code>." needle whose value is a short
    UUID-like hex code (``"3f9a1c2e-7b4d-4e2a"``, 18 characters, 14-19 tokens on SmolLM2 and Gemma 3:
    a value longer than a word of digits, the tuning side's long-value task of issue 23).

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
    value:
        ``"number"`` (7 digits) or ``"code"`` (a short UUID-like hex code). ``ValueError`` otherwise.

    Returns
    -------
    list[Sample]
        Samples whose ``answers`` is ``[value]``.
    """
    if value not in ("number", "code"):
        raise ValueError(f"value must be 'number' or 'code', got {value!r}")
    draw = _number if value == "number" else _uuid

    def make(rng: random.Random):
        key, answer = _key(rng), draw(rng)
        text = f"The special magic {value} for {key} is: {answer}."
        needles = [_Needle(text, _depths(rng, 1, depth)[0])]
        fields = {
            "question": f"What is the special magic {value} for {key} mentioned in the document?",
            "answers": [answer],
        }
        meta = {"key": key} if value == "number" else {"key": key, "value": value}
        return fields, needles, lambda c, o, d, n: (d[0], meta)

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
