"""`JacapConfig`: the settings shared by every method (kept fraction, window, budget policy, cache
room, compilation) around one :class:`~jacap_attn.methods.Method` instance holding the method's own
options (docs/architecture.md#configuration)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from . import methods
from .storage import xformers_backend
from .methods.base import Method, check_number, is_method_class, registered_fields
from .route_settings import (CHUNK_BUDGETS, CHUNK_SCORES, RESELECT_BUDGETS, check_int as _check_int, check_routes, chunk_scoring)  # noqa: F401,E501

BUDGETS = ("uniform", "pyramid", "capacity", "global")
GLOBAL_SCORES = ("attention", "normalized", "output")
SLIDING, SPANS = ("window", "compress"), ("words", "none")
# `min_tokens` when a config does not give it (docs/method.md#short-prompts): shorter prompts keep every
# entry. 256 since 2026-12-01 (tools/short_prompts.py; 0 before); the tests run with 0 (tests/conftest.py).
DEFAULT_MIN_TOKENS = 256
BACKENDS = xformers_backend.BACKENDS
QUERIES = ("window", "repeat")  # the built-in prefill routes; `queries` accepts every registered one
# Method option defaults of format-1 files that changed since (Jacap's kernel: 7 until 2026-12-01,
# docs/method.md#defaults-re-tuned-2026-12-01; its ``beta`` was always written out).
_FORMAT_1_DEFAULTS = {"jacap": {"kernel": 7}}
# Shared settings added since files were first written (chunk_scores 2026-12-03, chunk_mass 2026-12-06), with the
# behaviour before each: a saved config without one reads as that (the file answers as it was saved).
SETTINGS_BEFORE = {"spans": "none", "max_span": 16, "chunk_scores": "rescore", "chunk_mass": False}
# Method options whose default changed after they were added: a config saved without them reads as before (Jacap's
# carry and prompt lookup (lookup_ahead: 2026-12-06), since 2026-12-05/06: docs/method.md#d10-scores-carried-along-a-unit, #d12-prompt-lookup).
OPTIONS_BEFORE = {"jacap": {"carry": 0.0, "carry_len": 64, "carry_count": 0, "carry_by": "score", "lookup": 0,
                            "lookup_share": 0.5, "lookup_free": 0, "lookup_ahead": False}}
# Settings of the selection shared by every compressing method; `full` takes only the last three.
COMMON_OPTIONS = ("window", "budget", "pyramid_beta", "capacity_alpha", "global_score", "head_floor", "sliding",
                  "keep_special", "min_tokens", "spans", "max_span", "queries", "lookahead", "lookahead_share", "repeat_ids",
                  "repeat_chunk", "reselect", "reselect_budget", "chunk_size", "chunk_scores", "chunk_ratio", "chunk_budget",
                  "chunk_mass", "mass_cosine", "reserve", "compile", "backend")
_FULL_OPTIONS = ("reserve", "compile", "backend")


@dataclass(frozen=True)
class JacapConfig:
    """Settings of one compression; :func:`jacap_attn.patch` builds it from keyword options.

    Parameters
    ----------
    ratio:
        Kept fraction of each prompt's tokens, in (0, 1] (0.1 keeps about 10% of the KV entries of
        every compressed layer). The removed fraction is ``1 - ratio``.
    method:
        A :class:`~jacap_attn.methods.Method` instance, or a registered name (its default options);
        default ``Jacap()``.
    window:
        Observation window ``w``: the last ``w`` prompt positions, whose queries score the prompt and
        which are always kept (default 32, clipped to the prompt length).
    budget:
        Budget policy (docs/method.md#budgets): ``"uniform"`` (every compressed layer keeps
        ``ceil(ratio * n)`` tokens per KV head), ``"pyramid"`` (PyramidKV schedule), ``"capacity"``
        (adaptive per layer, :func:`jacap_attn.math.budget.capacity_budgets`) or ``"global"`` (one ranking
        over every compressed layer, KV head and token sets each head's budget,
        docs/method.md#global-budget); the total is the uniform one, ``ceil(ratio * n)`` per layer and
        KV head, for all four. ``None`` (default): the method's own schedule (``pyramidkv``) or its
        default (``Method.default_budget``): ``"global"`` for Jacap (measured: docs/results.md#budget-policies),
        ``"uniform"`` for the other methods.
    pyramid_beta:
        PyramidKV's ``beta`` (default 20): the last layer gets ``(B - w) / beta`` tokens above the window.
    capacity_alpha:
        The ``capacity`` policy's uniform floor: ``alpha * B`` per layer, plus its share of the rest (default 0.5).
    global_score:
        What the ``global`` policy ranks across layers and KV heads (docs/method.md#global-budget):
        ``"attention"`` (default; KVzip, Layer-DefensiveKV): each token's largest attention probability
        from the queries the method scores with (the window, or every prompt query for a method that
        reads them all), over those queries and the GQA group; ``"normalized"``: the method's scores as
        a distribution per KV head; ``"output"``: the attention times each entry's output norm through
        its query head's ``W_O`` (CriticalKV's factor), scaled to mean 1 per layer.
    head_floor:
        Per-head floor of the ``global`` policy, Ada-KV's safeguard ``alpha`` (arXiv:2407.11550,
        Alg. 1), in [0, 1]: each KV head's budget is ``(1 - head_floor)`` times its count in the
        global ranking plus ``head_floor`` times the uniform budget, so at least
        ``floor(head_floor * ceil(ratio * n))`` tokens, besides its observation window and attention
        sinks, which it always keeps. 0 is the ranking alone, 1 the uniform budgets. Default 0.2,
        Ada-KV's (and ``adakv_alpha``'s); not yet measured on quality here.
    sliding:
        Sliding-window layers of a model that also has full-attention layers (Gemma3;
        docs/method.md#sliding-window-layers): ``"window"`` (default) keeps each one's last
        ``sliding_window - 1`` prompt tokens unscored, whatever ``ratio``; ``"compress"`` scores and
        selects them with the method, keeping ``ceil(ratio * min(n, sliding_window - 1))`` (at least
        the observation window) of the tokens within their window. A model whose layers all slide
        (Mistral, Phi3 with ``sliding_window`` set) is compressed either way, as a full-attention
        model is: ``ceil(ratio * n)`` per layer, at most ``min(n, sliding_window - 1)``.
    keep_special:
        ``True`` (default): in a short prompt row, one whose budget is no more than the observation
        window (``ceil(ratio * n) <= window``, so nothing beyond the window would be kept), the
        positions holding the model's special token ids (``bos`` / ``eos`` / ``pad`` of its
        ``generation_config`` and ``config``: for SmolLM2 the chat template's role markers
        ``<|im_start|>`` and ``<|im_end|>``) are kept too, in every compressed layer and head, on top
        of the budget (docs/method.md#short-prompts). ``False``: the window alone.
    min_tokens:
        A prompt row with fewer real tokens keeps every entry (docs/method.md#short-prompts), per row
        of a left-padded batch; 0: every prompt longer than the window is compressed. ``None``
        (default): :data:`DEFAULT_MIN_TOKENS` (256 since 2026-12-01, measured on chat prompts of
        26-540 tokens; 0 before), so ordinary chat prompts answer as with the full cache.
    spans:
        Keep words whole (docs/method.md#d8-answers-kept-whole): ``"words"``, in every compressed layer
        and KV head, each token ranks as the best token of its whitespace-delimited word (words of up
        to ``max_span`` tokens), so a number, name or code that is kept is kept whole
        rather than some of its digits; ``"none"``: token by token. ``None`` (default): the method's
        own (``Method.default_spans``). Needs the model's vocabulary: the tokenizer given to
        :func:`jacap_attn.patch`, or found in the model's local folder; without one, token by token.
    max_span:
        Longest word, in tokens, that ``spans="words"`` keeps whole (default 64, since 2026-12-01;
        16 before: a UUID is 32-35 tokens on SmolLM2 and Gemma 3, docs/method.md#d8-answers-kept-whole);
        longer words (minified code, base64) rank token by token. An int >= 1.
    queries:
        Which queries score the prompt (docs/method.md#question-agnostic-scoring): ``"window"`` (the
        observation window's, the last ``window`` prompt positions: question-aware when the question
        ends the prompt) or ``"repeat"`` (question-agnostic, KVzip's: after the exact prefill, a
        teacher-forced pass of ``repeat_ids`` plus the prompt itself over the full cache, in chunks of
        ``repeat_chunk`` prompt tokens, whose queries score the prompt; about one more prefill of
        compute, :mod:`jacap_attn.repeat`). Default ``"window"`` for every method (``kvzip`` as the paper
        defines it is ``method="kvzip", queries="repeat"``) until measured. ``"repeat"`` needs a method
        that can score from it (``Method.repeat_stats`` not empty: ``jacap``, ``kvzip``, ``snapkv``,
        ``pyramidkv``, ``adakv``) and a prefill with ``input_ids``. The observation window is kept
        either way, and the kept entries are exactly the prefill's.
    lookahead:
        Tokens the model writes, greedily over the full prompt cache, before the cut; their queries
        score the prompt beside the observation window's, and their K/V are never stored
        (docs/method.md#d11-lookahead-queries, :mod:`jacap_attn.routes.lookahead`): the window finds
        what the question asks about, the written tokens' queries what the answer copies. An int in
        [0, 256]; 0 (default): the window alone (16 measured, docs/method.md#d11-lookahead-queries: it
        did not qualify as Jacap's default). Needs ``queries="window"`` and a method that scores
        from summed statistics (``Method.repeat_stats``: ``jacap``, ``kvzip``, ``snapkv``,
        ``pyramidkv``, ``adakv``). A chunked prefill writes them at its last cut,
        over the entries it holds (a new turn under a running budget at its cut), and question-time
        reselection (``reselect``) after the question, over what the cache holds. No tokens are
        written where the cut can evict nothing.
    lookahead_share:
        With ``lookahead > 0``, the share ``f`` of each scored head's free budget the lookahead fills:
        at the cut, after what is kept by force (window, sinks, consensus), the head keeps first the
        top ``floor((1 - f) * free)`` of its other entries by the observation window's own scores
        (``free`` its budget less the forced entries), then ranks the rest by the window's and the
        written tokens' summed statistics; head budgets, the consensus and the sinks are the
        window's own (:func:`jacap_attn.math.share.share_ranking`,
        docs/method.md#the-rule-for-lookahead_share-written-2026-12-04-sixth-session-before-its-implementation-and-runs).
        A float in (0, 1]; ``None`` (default): the summed statistics rank every entry.
    repeat_ids:
        Token ids of the repeat instruction that precede each replayed chunk (a repeat pass:
        ``queries="repeat"``, ``chunk_scores="repeat"``), e.g.
        :func:`jacap_attn.prompts.repeat_instruction_ids` (KVzip's "Repeat the previous context
        exactly." closing the user turn of the chat template). ``None`` (default): the instruction of
        the tokenizer given to :func:`jacap_attn.patch`, else none (the prompt alone is replayed after
        itself); ``()``: none.
    repeat_chunk:
        Prompt tokens replayed per forward of the repeat pass (default 512): its extra memory is that
        of a ``len(repeat_ids) + repeat_chunk + 8``-token forward over the prompt's cache.
    reselect:
        Select again when the question arrives (docs/method.md#question-time-reselection): a forward of
        several new tokens over a compressed cache (a question, a new turn; ``generate`` over a given
        or loaded cache) scores the entries the cache holds with the last ``window`` new tokens as the
        observation window, and keeps ``ceil(reselect * L)`` of them per compressed layer and KV head
        (``L`` the real tokens seen before the new ones) plus every new token, before decoding.
        A kept fraction in (0, 1], the unit of ``ratio``; ``None`` (default): off, the new tokens are
        appended and nothing is evicted. Needs a method that scores from window queries (not ``h2o``).
    reselect_budget:
        The budget policy of question-time reselection: ``"uniform"`` (default: every compressed layer
        and KV head keeps ``ceil(reselect * L)``) or ``"global"`` (one ranking across layers and KV
        heads sets each head's share of the same total, as ``budget="global"`` at prefill).
    chunk_size:
        Prefill in chunks of this many tokens under a running budget (docs/usage.md#chunked-prefill):
        each chunk's attention reads the compressed cache of the chunks before it plus itself, and after
        each chunk every layer is cut to ``ceil(ratio * seen)`` per KV head (``seen`` the tokens so far; window,
        sinks and newest tokens kept; ``chunk_budget``), so the prefill holds about ``(ratio * n + chunk_size)``
        entries instead of ``n``. Later multi-token forwards over the cache (a new turn) are cut the same way unless
        ``reselect`` is set. ``None`` (default): one exact prefill, one cut. ``generate(prefill_chunk_size=N)`` likewise.
    chunk_scores:
        How a chunk cut ranks the entries earlier chunks kept: ``"rescore"`` (every candidate scored
        again by the new chunk's observation window), ``"carry"`` (the larger of that score and the one
        the entry had at the cut before) or ``"repeat"`` (the cuts before the last scored by a repeat
        pass of each chunk over the held entries, ``repeat_ids`` + the chunk, as ``queries="repeat"``
        scores a whole prompt, scores carried; the last cut by the prompt's end; about one more forward
        per chunk; needs ``input_ids`` and a method that reads the pass). ``None`` (default,
        :attr:`chunk_scoring`): ``"rescore"`` where the prompt is answered in the same call (``compress``,
        ``generate``; lookup ahead keeps what its question will read) unless it repeats itself
        (:func:`jacap_attn.route_settings.prompt_chunking`), ``"repeat"`` in ``Document.compress`` for a method
        that reads the pass (``jacap``, ``snapkv``, ``pyramidkv``, ``adakv``, ``kvzip``): its questions come later.
    chunk_ratio:
        Running budget of a chunked prefill's cuts before its last, a kept fraction in ``[ratio, 1]``:
        each keeps ``ceil(chunk_ratio * seen)`` per layer and KV head, the last (which sees the question
        ending the prompt) ``ceil(ratio * n)``; the prefill holds about ``chunk_ratio * n + chunk_size``
        entries (docs/usage.md#chunked-prefill). ``None`` (default): every cut at ``ratio``.
    chunk_budget:
        What a chunked prefill's cuts before its last keep a fraction of: ``"seen"`` (``ceil(r * seen)`` per layer
        and KV head, ``r`` = ``chunk_ratio`` or ``ratio``) or ``"final"`` (at least ``ceil(ratio * N)``, ``N`` the
        prompt's length). ``None`` (default): ``"final"`` for a prompt's chunks whose first cut is below the slots a
        cut sets aside (chunks of at most 590 tokens at 10%: :func:`~jacap_attn.route_settings.prompt_chunk_budget`),
        else ``"seen"`` (a new turn too). Without ``chunk_ratio`` the held entries, summed over layers and KV heads,
        stay within final budget + chunk + window (docs/usage.md#chunked-prefill).
    chunk_mass:
        ``True``: each entry a chunked prefill's cut before its last evicts hands its attention mass to the
        held entry of its KV head with the nearest key, if their cosine is at least ``mass_cosine`` (default
        ``-1.0``: every one); later chunks raise that entry's logit by ``log(1 + m)`` (``m`` the entries it
        stands for; docs/method.md#carried-mass). ``False``: dropped. ``None`` (default): dropped in a prompt
        (``compress``, ``generate``) but a repetitive one, ``True`` at ``mass_cosine=0.95`` in ``Document.compress``'s repeat-scored
        cuts (:func:`jacap_attn.route_settings.document_chunking`, the rule confirmed 2026-12-07).
    reserve:
        Free slots after the prompt when the expected length is unknown (default 256); it grows when full.
    compile:
        ``True`` (default): on CUDA, ``generate`` compiles the decode step and each method's scoring.
    backend:
        The attention over a compressed cache (docs/architecture.md#decode): ``"sdpa"`` (torch's SDPA
        over every slot of the padded ``[b, h, capacity, d]`` layout, with the validity mask),
        ``"xformers"`` (the ``ragged`` layout, each KV head's entries contiguous, read by xformers'
        fmha with a block-diagonal padded-keys bias: only the held entries are read;
        :mod:`jacap_attn.storage.xformers_backend`; needs CUDA and ``pip install 'jacap-attn[cuda]'``) or
        ``"auto"`` (default): xformers where its kernels run, else stored as ``"sdpa"``. ``"xformers"``
        where it cannot run is a ``ValueError`` when the cache is built (no silent fallback).

    Raises
    ------
    ValueError
        For any value out of range, naming the field and the value.
    """

    ratio: float = 0.1
    method: Method | str = field(default_factory=lambda: methods.Jacap())
    window: int = 32
    budget: str | None = None
    pyramid_beta: float = 20.0
    capacity_alpha: float = 0.5
    global_score: str = "attention"
    head_floor: float = 0.2
    sliding: str = "window"
    keep_special: bool = True
    min_tokens: int | None = None
    spans: str | None = None
    max_span: int = 64
    queries: str = "window"
    lookahead: int = 0
    lookahead_share: float | None = None
    repeat_ids: tuple | None = None
    repeat_chunk: int = 512
    reselect: float | None = None
    reselect_budget: str = "uniform"
    chunk_size: int | None = None
    chunk_scores: str | None = None
    chunk_ratio: float | None = None
    chunk_budget: str | None = None
    chunk_mass: bool | None = None
    mass_cosine: float = -1.0
    reserve: int = 256
    compile: bool = True
    backend: str = "auto"

    def __post_init__(self):
        check_number("ratio", self.ratio)
        if not 0.0 < float(self.ratio) <= 1.0:
            raise ValueError(f"ratio must be a kept fraction in (0, 1], got ratio={self.ratio!r}")
        object.__setattr__(self, "ratio", float(self.ratio))
        method = self.method
        if isinstance(method, str):
            method = methods.get_method(method)()
        if not isinstance(method, Method):
            raise ValueError(f"method must be a registered name or a Method instance, got method={method!r}")
        object.__setattr__(self, "method", method)
        _check_int(self, "window", 1)
        _check_int(self, "reserve", 1)
        if self.min_tokens is None:
            object.__setattr__(self, "min_tokens", DEFAULT_MIN_TOKENS)
        _check_int(self, "min_tokens", 0)
        if self.sliding not in SLIDING:
            raise ValueError(f"sliding must be one of {', '.join(SLIDING)}; got sliding={self.sliding!r}")
        if self.spans is not None and self.spans not in SPANS:
            raise ValueError(f"spans must be one of {', '.join(SPANS)} or None; got spans={self.spans!r}")
        object.__setattr__(self, "spans", self.spans or method.default_spans)
        _check_int(self, "max_span", 1)
        if self.global_score not in GLOBAL_SCORES:
            raise ValueError(f"global_score must be one of {', '.join(GLOBAL_SCORES)}; "
                             f"got global_score={self.global_score!r}")
        for name in ("pyramid_beta", "capacity_alpha", "head_floor", "mass_cosine"):
            check_number(name, getattr(self, name))
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.pyramid_beta <= 1:
            raise ValueError(f"pyramid_beta must be > 1, got pyramid_beta={self.pyramid_beta!r}")
        for name, low, what in (("capacity_alpha", 0.0, "in [0, 1]"), ("head_floor", 0.0, "a fraction in [0, 1]"),
                                ("mass_cosine", -1.0, "a cosine similarity in [-1, 1]")):
            if not low <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be {what}, got {name}={getattr(self, name)!r}")
        for name, unset in (("keep_special", ""), ("compile", ""), ("chunk_mass", " or None")):
            if not isinstance(getattr(self, name), bool) and not (unset and getattr(self, name) is None):
                raise ValueError(f"{name} must be True or False{unset}, got {name}={getattr(self, name)!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got backend={self.backend!r}")
        if self.backend == "auto" and not (xformers_backend.installed() and torch.cuda.is_available()):
            object.__setattr__(self, "backend", "sdpa")  # what "auto" means in this process
        fixed = method.fixed_budget
        if self.budget is not None and self.budget not in BUDGETS:
            raise ValueError(f"budget must be one of {', '.join(BUDGETS)}; got budget={self.budget!r}")
        if fixed is not None and self.budget not in (None, fixed):
            raise ValueError(f"method={method.name!r} fixes budget={fixed!r}; got budget={self.budget!r}")
        object.__setattr__(self, "budget", self.budget or fixed or method.default_budget)
        check_routes(self, method)

    @classmethod
    def from_options(cls, ratio=0.1, method: Method | str = "jacap", **options) -> "JacapConfig":
        """Build a config from ``patch``-style keyword options: the shared settings and the fields of
        the method's dataclass (applied to ``method`` when it is an instance).

        Raises ``ValueError`` for an unknown method or option name, or an option that does not apply
        to the method (for example ``ridge`` with ``method="snapkv"``), naming it.
        """
        if isinstance(method, Method):
            cls_, instance = type(method), method
            if not is_method_class(cls_):
                raise ValueError(f"method={method!r}: a method must be a frozen dataclass registered with "
                                 "jacap_attn.methods.register")
            if not cls_.name or methods.get_method(cls_.name) is not cls_:
                raise ValueError(f"method class {cls_.__qualname__} is not registered: decorate it with "
                                 "@jacap_attn.methods.register(name) (a saved cache names its method)")
        elif isinstance(method, str):
            cls_, instance = methods.get_method(method), None
        else:
            raise ValueError(f"method must be a registered name or a Method instance, got method={method!r}")
        own = [f.name for f in dataclasses.fields(cls_)]
        accepted = [*own, *(COMMON_OPTIONS if cls_.compresses else _FULL_OPTIONS)]
        known = set(COMMON_OPTIONS) | {f.name for f in registered_fields()}
        for name, value in options.items():
            if name not in known and name not in own:
                raise ValueError(f"unknown option {name!r}; options are: {', '.join(sorted(known))}")
            if name not in accepted:
                raise ValueError(f"option {name}={value!r} does not apply to method={cls_.name!r}; "
                                 f"it accepts: {', '.join(sorted(accepted))}")
        own_options = {k: v for k, v in options.items() if k in own}
        method = dataclasses.replace(instance, **own_options) if instance is not None else cls_(**own_options)
        return cls(ratio=ratio, method=method, **{k: v for k, v in options.items() if k not in own})

    @property
    def chunk_scoring(self) -> str:
        """How a chunked prefill of a prompt answered in the same call scores its cuts: :attr:`chunk_scores`
        when set, else ``"rescore"`` (``Document.compress``, and a repetitive prompt's prefill, set ``"repeat"`` for a
        method that reads the repeat pass: :func:`~jacap_attn.route_settings.chunk_scoring`, ``prompt_chunking``)."""
        return chunk_scoring(self.chunk_scores, self.method)

    @property
    def carries_mass(self) -> bool:
        """Whether a chunked prefill carries the evicted mass (``chunk_mass``; ``None``: no)."""
        return bool(self.chunk_mass)

    @property
    def compresses(self) -> bool:
        """Whether prefill evicts anything (``False`` for ``method="full"`` or ``ratio=1``)."""
        return self.method.compresses and self.ratio < 1.0

    def to_dict(self) -> dict:
        """Plain JSON values: the shared settings, ``method`` (its name) and ``options`` (its fields)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["repeat_ids"] = None if self.repeat_ids is None else list(self.repeat_ids)
        out["method"], out["options"] = self.method.name, self.method.options()
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "JacapConfig":
        """Inverse of :meth:`to_dict`; also reads the flat dictionary of cache files of format 1 (every
        option at the top level, ``None`` meaning the method's default). A stored ``backend="xformers"``
        reads back as ``"auto"`` (a cache saved on a GPU loads anywhere; the entries are the same).
        A setting added since the config was written reads as the behaviour before it (``spans="none"``,
        ``max_span=16``, ``chunk_scores="rescore"``, ``chunk_mass=False``, :data:`OPTIONS_BEFORE`), not as today's default. ``ValueError`` if invalid."""
        if not isinstance(data, dict):
            raise ValueError(f"a config must be a dict, got {type(data).__name__}")
        data = dict(data)
        method_cls = methods.get_method(data.pop("method", "jacap"))
        own = {f.name for f in dataclasses.fields(method_cls)}
        shared_names = {f.name for f in dataclasses.fields(cls)} - {"method"}
        if "options" in data:
            options = data.pop("options")
            if not isinstance(options, dict):
                raise ValueError(f"config field 'options' must be a dict, got {options!r}")
            unknown = sorted(set(data) - shared_names)
        else:  # format 1: flat, every method's options at the top level
            options = {k: v for k, v in data.items() if k in own and v is not None}
            # ``None`` meant the method's default of that time: where it changed since, that one.
            options = {**{k: v for k, v in _FORMAT_1_DEFAULTS.get(method_cls.name, {}).items()
                          if k in data and data[k] is None}, **options}
            known = shared_names | {f.name for f in registered_fields()}
            unknown = sorted(set(data) - known)
        if unknown or set(options) - own:
            raise ValueError(f"unknown config field(s) {unknown + sorted(set(options) - own)} for method "
                             f"{method_cls.name!r}")
        shared = {k: v for k, v in data.items() if k in shared_names}
        shared.update({name: before for name, before in SETTINGS_BEFORE.items()  # max_span: only where words are kept
                       if name not in data and (name != "max_span" or data.get("spans") == "words")})
        options = {**OPTIONS_BEFORE.get(method_cls.name, {}), **options}  # written before the options
        if shared.get("backend") == "xformers":  # how the saver attended, not what it kept: read back where it runs
            shared["backend"] = "auto"
        if method_cls.fixed_budget is not None and shared.get("budget") == method_cls.fixed_budget:
            shared.pop("budget")
        if not method_cls.compresses:
            shared = {k: v for k, v in shared.items() if k in ("ratio", *_FULL_OPTIONS)}
        return cls(method=method_cls(**options), **shared)
