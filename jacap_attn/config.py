"""`JacapConfig`: every knob of the method (DESIGN.md §3/§4), validated, with its default."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

# method -> options that apply to it (besides `ratio`, `window`, `budget` and `reserve`,
# which apply to every compressing method). Anything else passed to `patch` is an error.
_COMMON = frozenset({"window", "budget", "pyramid_beta", "capacity_alpha", "reserve", "compile"})
METHOD_OPTIONS: dict[str, frozenset[str]] = {
    "jacap": _COMMON | {"ridge", "beta", "pooling", "kernel", "selector", "consensus", "consensus_kernel", "mass",
                        "sinks"},
    "full": frozenset({"reserve", "compile"}),
    "streaming_llm": _COMMON | {"sinks"},
    "random": _COMMON | {"seed"},
    "knorm": _COMMON,
    "snapkv": _COMMON | {"pooling", "kernel"},
    "pyramidkv": _COMMON | {"pooling", "kernel"},
    "h2o": _COMMON,
    "tova": _COMMON,
    "keydiff": _COMMON,
    "capkv": _COMMON | {"ridge", "temperature", "sinks"},
    "adakv": _COMMON | {"pooling", "kernel", "adakv_alpha"},
}
METHODS = tuple(METHOD_OPTIONS)
BUDGETS = ("uniform", "pyramid", "capacity")
POOLINGS = ("avg", "max", "forward", "none")
SELECTORS = ("leverage", "greedy")
_INT_MAX = 2**31 - 1  # token counts and seeds; larger values overflow the int64 index arithmetic
# Methods whose budget schedule is part of their definition.
_FIXED_BUDGET = {"pyramidkv": "pyramid"}


@dataclass(frozen=True)
class JacapConfig:
    """Settings of one compression method; passed to :func:`jacap_attn.patch` as keyword options.

    Parameters
    ----------
    ratio:
        Kept fraction of each prompt's tokens, in (0, 1] (0.1 keeps about 10% of the KV entries of
        every compressed layer). The removed fraction is ``1 - ratio``.
    method:
        Scoring method: ``"jacap"`` (default, DESIGN.md §3) or a baseline from :data:`METHODS`.
    window:
        Observation window ``w``: the last ``w`` prompt positions, whose queries score the prompt and
        which are always kept (default 32, clipped to the prompt length).
    budget:
        Per-layer budget policy: ``"uniform"`` (default: every compressed layer keeps
        ``ceil(ratio * n)`` tokens), ``"pyramid"`` (PyramidKV schedule) or ``"capacity"`` (adaptive,
        see :func:`jacap_attn.budget.capacity_budgets`). The global budget is ``ratio * n * layers``
        for all three.
    ridge:
        Ridge factor ``rho``: ``lambda = rho * tr(Phi^T Phi) / d`` (default 0.1). For ``capkv`` the
        absolute ridge of CapPress (default 1.0).
    beta:
        Weight of the first-order softmax-sensitivity term in the importance weight ``omega``
        (default 1.0; 0 keeps the zeroth-order ``sum_t p^2`` only).
    pooling, kernel:
        Local smoothing of the per-token weights along the sequence, ``"avg"`` (default),
        ``"max"`` or ``"none"``, with an odd kernel (default 7 for Jacap, 5 for SnapKV-style methods).
    selector:
        ``"leverage"`` (default): keep the largest ridge-leverage scores. ``"greedy"``: exact greedy
        log-det maximisation (:func:`jacap_attn.scoring.greedy_logdet_scores`), one rank-one update
        per kept token; slower, and run eagerly (its loop over picks is not compiled).
    consensus:
        Fraction (in [0, 1]) of each head's budget beyond the window given to the tokens with the
        highest cross-layer consensus score (:func:`jacap_attn.scoring.consensus_scores`); default
        0.25; 0 is purely per-head selection (DESIGN.md §3 as written). Our addition, measured:
        see README "What we changed after measuring".
    consensus_kernel:
        Odd max-pooling kernel applied to the consensus score (default 15), so that the span around
        a consensus token (a key phrase and the value that follows it) is kept together.
    mass:
        Jacap only: weight ``gamma >= 0`` of the attention-mass term in the per-head ranking
        ``(l_i / sum_j l_j + gamma * a_i / sum_j a_j) / (1 + gamma)``, ``a_i`` the window's
        attention to token ``i`` (:func:`jacap_attn.scoring.add_attention_mass`); ``None`` (default)
        means 2.0; 0 ranks by leverage alone (DESIGN.md §3 as written). Our addition, measured: see
        README "What we changed after measuring".
    sinks:
        Attention-sink tokens (the first real positions) kept in every head by ``jacap``,
        ``streaming_llm`` and ``capkv`` (default 4; 0 keeps none by force), after the window and
        before everything else, the earliest first (:func:`jacap_attn.scoring.keep_sinks`).
    temperature:
        CapPress's ``tau`` in ``w_i = exp(tau * cos(k_i, mean query))`` (default 5.0).
    seed:
        Seed of the ``random`` baseline (default 0).
    pyramid_beta:
        PyramidKV's ``beta`` (default 20): the last layer gets ``(B - w) / beta`` tokens above the window.
    capacity_alpha:
        Uniform floor of the ``capacity`` policy: each layer gets ``alpha * B`` tokens plus its share
        of the remaining ``(1 - alpha) * B * layers`` (default 0.5).
    adakv_alpha:
        Ada-KV's uniform fraction per head (default 0.2).
    reserve:
        Cache slots kept free for new tokens after the prompt when the expected length is unknown
        (a user-built cache used outside ``generate``); default 256. The cache grows when full.
    compile:
        ``True`` (default): on CUDA, ``generate`` compiles the decode step over the static cache.

    Raises
    ------
    ValueError
        For any value out of range, naming the field and the value.
    """

    ratio: float = 0.1
    method: str = "jacap"
    window: int = 32
    budget: str = "uniform"
    ridge: float | None = None
    beta: float = 1.0
    pooling: str = "avg"
    kernel: int | None = None
    selector: str = "leverage"
    consensus: float = 0.25
    consensus_kernel: int = 15
    mass: float | None = None
    sinks: int = 4
    temperature: float = 5.0
    seed: int = 0
    pyramid_beta: float = 20.0
    capacity_alpha: float = 0.5
    adakv_alpha: float = 0.2
    reserve: int = 256
    compile: bool = True
    explicit: frozenset = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self):
        _check_number("ratio", self.ratio)
        if not 0.0 < float(self.ratio) <= 1.0:
            raise ValueError(f"ratio must be a kept fraction in (0, 1], got ratio={self.ratio!r}")
        object.__setattr__(self, "ratio", float(self.ratio))
        if self.method not in METHOD_OPTIONS:
            raise ValueError(f"unknown method={self.method!r}; supported methods: {', '.join(METHODS)}")
        _check_int("window", self.window, minimum=1)
        _check_choice("budget", self.budget, BUDGETS)
        _check_choice("pooling", self.pooling, POOLINGS)
        _check_choice("selector", self.selector, SELECTORS)
        if self.ridge is not None:
            _check_number("ridge", self.ridge)
            if not self.ridge > 0:
                raise ValueError(f"ridge must be > 0, got ridge={self.ridge!r}")
        for name in ("beta", "temperature", "pyramid_beta"):
            _check_number(name, getattr(self, name))
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got temperature={self.temperature!r}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got beta={self.beta!r}")
        if self.pyramid_beta <= 1:
            raise ValueError(f"pyramid_beta must be > 1, got pyramid_beta={self.pyramid_beta!r}")
        if self.mass is not None:
            _check_number("mass", self.mass)
            if self.mass < 0:
                raise ValueError(f"mass must be >= 0, got mass={self.mass!r}")
        for name in ("capacity_alpha", "adakv_alpha", "consensus"):
            _check_number(name, getattr(self, name))
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {name}={getattr(self, name)!r}")
        if self.kernel is not None:
            _check_int("kernel", self.kernel, minimum=1)
            if self.kernel % 2 == 0:
                raise ValueError(f"kernel must be odd, got kernel={self.kernel!r}")
        _check_int("consensus_kernel", self.consensus_kernel, minimum=1)
        if self.consensus_kernel % 2 == 0:
            raise ValueError(f"consensus_kernel must be odd, got consensus_kernel={self.consensus_kernel!r}")
        _check_int("sinks", self.sinks, minimum=0)
        _check_int("seed", self.seed, minimum=0)
        _check_int("reserve", self.reserve, minimum=1)
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got compile={self.compile!r}")
        # Plain Python numbers from here on (NumPy scalars, Fractions...): the config is saved as JSON.
        for name, cast in _NUMBER_FIELDS.items():
            if getattr(self, name) is not None:
                object.__setattr__(self, name, cast(getattr(self, name)))
        fixed = _FIXED_BUDGET.get(self.method)
        if fixed is not None:
            if "budget" in self.explicit and self.budget != fixed:
                raise ValueError(f"method={self.method!r} fixes budget={fixed!r}; got budget={self.budget!r}")
            object.__setattr__(self, "budget", fixed)

    @classmethod
    def from_options(cls, ratio=0.1, method="jacap", **options) -> "JacapConfig":
        """Build a config from ``patch``-style keyword options.

        Raises ``ValueError`` for an unknown option name, or an option that does not apply to
        ``method`` (for example ``ridge`` with ``method="snapkv"``), naming it.
        """
        if not isinstance(method, str) or method not in METHOD_OPTIONS:
            raise ValueError(f"unknown method={method!r}; supported methods: {', '.join(METHODS)}")
        known = {f.name for f in dataclasses.fields(cls)} - {"ratio", "method", "explicit"}
        for name in options:
            if name not in known:
                raise ValueError(f"unknown option {name!r}; options are: {', '.join(sorted(known))}")
            if name not in METHOD_OPTIONS[method]:
                raise ValueError(
                    f"option {name}={options[name]!r} does not apply to method={method!r}; "
                    f"it accepts: {', '.join(sorted(METHOD_OPTIONS[method])) or 'none'}"
                )
        return cls(ratio=ratio, method=method, explicit=frozenset(options), **options)

    @property
    def compresses(self) -> bool:
        """Whether prefill evicts anything (``False`` for ``method="full"`` or ``ratio=1``)."""
        return self.method != "full" and self.ratio < 1.0

    def resolved_kernel(self) -> int:
        """Pooling kernel: the explicit value, else 7 for Jacap and 5 for SnapKV-style scores."""
        if self.kernel is not None:
            return self.kernel
        return 7 if self.method == "jacap" else 5

    def resolved_ridge(self) -> float:
        """Ridge factor: the explicit value, else 0.1 (Jacap, relative) or 1.0 (CapKV, absolute)."""
        if self.ridge is not None:
            return float(self.ridge)
        return 1.0 if self.method == "capkv" else 0.1

    def resolved_mass(self) -> float:
        """Weight of Jacap's attention-mass term: the explicit value, else 2.0."""
        return 2.0 if self.mass is None else float(self.mass)

    def to_dict(self) -> dict:
        """The settings as plain JSON-serialisable values (without bookkeeping fields)."""
        out = dataclasses.asdict(self)
        out.pop("explicit")
        return out


# The numeric fields and their Python type, read from the annotations ("int", "float | None", ...).
_NUMBER_FIELDS = {f.name: {"int": int, "float": float}[kind] for f in dataclasses.fields(JacapConfig)
                  if (kind := str(f.type).split("|")[0].strip()) in ("int", "float")}


def _check_number(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite real number, got {name}={value!r}")


def _check_int(name, value, *, minimum, maximum=_INT_MAX):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an integer in [{minimum}, {maximum}], got {name}={value!r}")


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {name}={value!r}")
