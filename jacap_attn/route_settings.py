"""The checks of the settings that choose and drive a route (:mod:`jacap_attn.routes`): the prefill's
queries and repeat instruction, question-time reselection, a chunked prefill's scoring and budgets.
:class:`~jacap_attn.config.JacapConfig` runs them when it is built."""

from __future__ import annotations

import numbers

from . import methods
from .methods.base import INT_MAX, Method, check_number
from .routes import prefill_routes

RESELECT_BUDGETS = ("uniform", "global")
CHUNK_SCORES = ("rescore", "carry", "repeat")
CHUNK_BUDGETS = ("seen", "final")  # what a chunked prefill's cuts before its last take their fraction of
MAX_LOOKAHEAD = 256  # tokens a lookahead writes: k + 1 forwards of up to k tokens each
# The cosine above which a document's repeat-scored chunk cuts hand an evicted entry's mass on
# (docs/method.md, "Carried mass for near-duplicates in a document's chunked prefill").
DOCUMENT_MASS_COSINE = 0.95
# A prompt is repetitive where at least REPETITIVE_SHARE of its real tokens lie inside an n-gram of
# REPEAT_NGRAM tokens that occurs twice or more in it (docs/method.md, "Repetitive prompts").
REPETITIVE_SHARE = 0.5
REPEAT_NGRAM = 8


def chunk_scoring(chunk_scores: str | None, method, document: bool = False) -> str:
    """How a chunked prefill scores its cuts (``JacapConfig.chunk_scoring``):
    ``chunk_scores`` when set; else, for a ``document`` (``Document.compress``, ``jacap compress``: the
    questions come after compression) ``"repeat"`` for a ``method`` (a :class:`Method` or its class)
    that compresses and reads the repeat pass (``repeat_stats``), and ``"rescore"`` otherwise: a prompt
    answered in the same call ends with its question, which lookup ahead reads at every cut (the rule
    of docs/method.md, 2026-12-06, "Chunk cuts scored by use")."""
    if chunk_scores is not None:
        return chunk_scores
    return "repeat" if document and method.compresses and method.repeat_stats else "rescore"


def prompt_chunk_budget(config, chunk: int | None) -> str:
    """What the cuts before the last of a prompt's chunked prefill in chunks of ``chunk`` tokens take their kept
    fraction of (``"seen"`` or ``"final"``, :attr:`~jacap_attn.config.JacapConfig.chunk_budget`): the config's
    ``chunk_budget`` when set; else ``"final"`` where the first cut's budget ``ceil(ratio * chunk)`` is below the
    slots every cut sets aside, the observation window plus the forced sinks plus the free slots prompt lookup
    needs (:func:`reserved_slots`; 60 at Jacap's defaults, so chunks of at most 590 tokens at 10% kept), and
    ``"seen"`` otherwise or without a chunk size. The rule of docs/method.md, "The final budget where a first
    cut is smaller than what it sets aside" (issue 33, confirmed 2026-12-07). ``Document.compress`` sets
    ``"seen"`` (:func:`document_chunking`)."""
    if config.chunk_budget is not None:
        return config.chunk_budget
    if chunk is None:
        return "seen"
    import torch

    from .math.budget import layer_budget  # the cut's own rounding

    first = int(layer_budget(torch.tensor([int(chunk)]), float(config.ratio), config.window)[0])
    return "final" if first < reserved_slots(config) else "seen"


def reserved_slots(config) -> int:
    """The slots a cut of ``config`` sets aside in every head before ranking: the observation window, the
    method's forced sinks and the free slots its prompt lookup needs to force a run
    (:attr:`~jacap_attn.methods.base.Method.lookup_slots`)."""
    return int(config.window) + int(config.method.forced_sinks) + int(config.method.lookup_slots)


def document_chunking(config) -> dict:
    """The settings a chunked prefill of a document whose questions come later (``Document.compress``,
    ``jacap compress``) takes where ``config`` (a :class:`~jacap_attn.config.JacapConfig`) leaves them
    unset: ``chunk_scores`` from :func:`chunk_scoring` with ``document=True``; where those cuts are
    repeat-scored, ``chunk_mass=True`` with ``mass_cosine`` :data:`DOCUMENT_MASS_COSINE` (the rule of
    docs/method.md, "Carried mass for near-duplicates in a document's chunked prefill", confirmed on the
    held-out split 2026-12-07); ``chunk_budget="seen"`` (a prompt's default, :func:`prompt_chunk_budget`, was
    confirmed for prompts only). Returns the fields to replace (empty: nothing unset)."""
    changes = {}
    scoring = chunk_scoring(config.chunk_scores, config.method, document=True)
    if config.chunk_scores is None:
        changes["chunk_scores"] = scoring
    if config.chunk_mass is None and scoring == "repeat":
        changes.update(chunk_mass=True, mass_cosine=DOCUMENT_MASS_COSINE)
    if config.chunk_budget is None:  # a document's cuts keep their fraction of the tokens seen
        changes["chunk_budget"] = "seen"
    return changes


def repeated_share(ids, valid=None):
    """``[b]`` float32: the share of each row's real tokens (``valid [b, n]`` bool, default all) that lie
    inside an n-gram of :data:`REPEAT_NGRAM` consecutive real tokens occurring at least twice in the row
    (``ids [b, n]`` int64); 0 for a row shorter than the n-gram. Exact (n-grams compared whole, not hashed)."""
    import torch

    rows = []
    for row, keep in zip(ids, valid if valid is not None else [None] * len(ids)):
        tokens = row if keep is None else row[keep.to(torch.bool)]
        n = tokens.numel()
        if n < REPEAT_NGRAM:
            rows.append(0.0)
            continue
        grams = tokens.unfold(0, REPEAT_NGRAM, 1)  # [n - k + 1, k]
        _, inverse, counts = torch.unique(grams, dim=0, return_inverse=True, return_counts=True)
        repeated = (counts[inverse] >= 2).to(torch.int8)
        covered = torch.zeros(n, dtype=torch.int8, device=tokens.device)
        for offset in range(REPEAT_NGRAM):
            covered[offset:offset + repeated.numel()] |= repeated
        rows.append(float(covered.float().mean()))
    return torch.tensor(rows, dtype=torch.float32)


def prompt_chunking(config, ids, valid=None) -> dict:
    """The settings a chunked prefill of a prompt answered in the same call (``generate``, ``compress``)
    takes where ``config`` leaves ``chunk_scores`` and ``chunk_mass`` unset: for a repetitive prompt (every
    row's :func:`repeated_share` at least :data:`REPETITIVE_SHARE`; ``ids [b, n]`` int64, ``valid [b, n]``
    bool) and a method that reads the repeat pass, a document's (repeat-scored cuts carrying the mass of
    near-duplicates, :func:`document_chunking`); else none. Returns the fields to replace (empty: none).
    The rule of docs/method.md, "Repetitive prompts" (issue 33)."""
    if config.chunk_scores is not None or config.chunk_mass is not None or ids is None:
        return {}
    if not (config.method.compresses and config.method.repeat_stats):
        return {}
    if not bool((repeated_share(ids, valid) >= REPETITIVE_SHARE).all()):
        return {}
    return {"chunk_scores": "repeat", "chunk_mass": True, "mass_cosine": DOCUMENT_MASS_COSINE}


def check_routes(config, method: Method) -> None:
    """Validate and normalise the route settings of ``config`` (a :class:`~jacap_attn.config.JacapConfig`
    in its ``__post_init__``) for ``method``: ``queries``, ``repeat_ids``, ``repeat_chunk``, ``reselect``,
    ``reselect_budget`` and the chunked prefill's ``chunk_scores``, ``chunk_ratio``, ``chunk_size``.
    Raises ``ValueError`` naming the bad value."""
    queries = config.queries
    if queries not in prefill_routes():
        raise ValueError(f"queries must be one of {', '.join(prefill_routes())}; got queries={config.queries!r}")
    for name, value in (("queries", queries), ("chunk_scores", config.chunk_scores)):
        if value == "repeat" and method.compresses and not method.repeat_stats:
            able = [n for n in methods.names() if methods.get_method(n).repeat_stats]
            raise ValueError(f"{name}='repeat' needs a method that scores from the repeat pass's queries "
                             f"({', '.join(able)}); method={method.name!r} does not")
    object.__setattr__(config, "queries", queries)
    check_int(config, "lookahead", 0, MAX_LOOKAHEAD)
    if config.lookahead:
        if queries != "window":
            raise ValueError(f"lookahead={config.lookahead} adds written tokens' queries to the observation window; "
                             f"it needs queries='window', got queries={queries!r}")
        if method.compresses and not method.repeat_stats:
            able = [n for n in methods.names() if methods.get_method(n).repeat_stats]
            raise ValueError(f"lookahead={config.lookahead} needs a method that scores from summed attention "
                             f"statistics ({', '.join(able)}); method={method.name!r} does not")
    if config.lookahead_share is not None:
        check_number("lookahead_share", config.lookahead_share)
        if not 0.0 < float(config.lookahead_share) <= 1.0:
            raise ValueError(f"lookahead_share must be a share of each head's budget in (0, 1] or None, "
                             f"got lookahead_share={config.lookahead_share!r}")
        if not config.lookahead:
            raise ValueError(f"lookahead_share={config.lookahead_share} is the share of a head's budget the "
                             "lookahead fills: it needs lookahead > 0, got lookahead=0")
        object.__setattr__(config, "lookahead_share", float(config.lookahead_share))
    if config.mass_cosine != -1.0 and not config.chunk_mass:
        raise ValueError(f"mass_cosine={config.mass_cosine} gates the mass that chunk_mass carries between chunk cuts: "
                         f"it needs chunk_mass=True, got chunk_mass={config.chunk_mass}")
    if config.repeat_ids is not None:
        ids = config.repeat_ids
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"repeat_ids must be a sequence of token ids, got repeat_ids={ids!r}")
        ids = tuple(ids.tolist() if hasattr(ids, "tolist") else ids)
        if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0 for i in ids):
            raise ValueError(f"repeat_ids must be non-negative integer token ids, got repeat_ids={config.repeat_ids!r}")
        object.__setattr__(config, "repeat_ids", tuple(int(i) for i in ids))
    check_int(config, "repeat_chunk", 1)
    if config.reselect is not None:
        check_number("reselect", config.reselect)
        if not 0.0 < float(config.reselect) <= 1.0:
            raise ValueError(f"reselect must be a kept fraction in (0, 1] or None, got reselect={config.reselect!r}")
        if method.needs_all_queries:
            raise ValueError(f"reselect needs a method that scores from window queries; method={method.name!r} "
                             "reads every prompt query")
        object.__setattr__(config, "reselect", float(config.reselect))
    if config.reselect_budget not in RESELECT_BUDGETS:
        raise ValueError(f"reselect_budget must be one of {', '.join(RESELECT_BUDGETS)}; "
                         f"got reselect_budget={config.reselect_budget!r}")
    if config.chunk_scores is not None and config.chunk_scores not in CHUNK_SCORES:
        raise ValueError(f"chunk_scores must be one of {', '.join(CHUNK_SCORES)} or None (the method's default); "
                         f"got chunk_scores={config.chunk_scores!r}")
    if config.chunk_ratio is not None:
        check_number("chunk_ratio", config.chunk_ratio)
        if not float(config.ratio) <= float(config.chunk_ratio) <= 1.0:
            raise ValueError(f"chunk_ratio must be a kept fraction in [ratio, 1] = [{config.ratio}, 1] or None, "
                             f"got chunk_ratio={config.chunk_ratio!r}")
        object.__setattr__(config, "chunk_ratio", float(config.chunk_ratio))
    if config.chunk_budget is not None and config.chunk_budget not in CHUNK_BUDGETS:
        raise ValueError(f"chunk_budget must be one of {', '.join(CHUNK_BUDGETS)} or None (by the chunk size); "
                         f"got chunk_budget={config.chunk_budget!r}")
    if config.chunk_size is not None:
        check_int(config, "chunk_size", 1)
        check_chunkable(method, f"chunk_size={config.chunk_size}")
        if queries == "repeat":
            raise ValueError("queries='repeat' replays the whole prompt over its exact cache, which a chunked "
                             "prefill never holds: use it without chunk_size, or chunk_scores='repeat' (a "
                             f"document's default) to score each chunk by a repeat pass (got chunk_size={config.chunk_size})")


def check_chunkable(method, what: str) -> None:
    """``ValueError`` naming ``what`` (the chunking setting) for a method that reads every prompt query
    (H2O): a chunk's cut sees only the chunk's own queries."""
    if method.needs_all_queries:
        raise ValueError(f"{what}: method={method.name!r} scores from every prompt query, which a chunked "
                         "prefill never has together; prefill it whole (no chunk_size / prefill_chunk_size)")


def check_int(config, name, minimum, maximum=INT_MAX):
    """Set ``config.<name>`` to its integer value; ``ValueError`` naming it unless in ``[minimum, maximum]``."""
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an integer in [{minimum}, {maximum}], got {name}={value!r}")
    object.__setattr__(config, name, int(value))
