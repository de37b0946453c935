"""The method interface: a frozen dataclass of options, a ``score`` over :class:`PrefillInputs`, and
the registry (docs/architecture.md#methods).

A method answers one question per compressed layer: how much is each prompt token worth to each KV
head? Everything else (budgets, the observation window, top-k, gathering, the cache) is shared and
lives in :mod:`jacap_attn.selection` and :mod:`jacap_attn.selection.scorer`; the data a method reads
(:class:`~jacap_attn.types.PrefillInputs`) is defined in the leaf module :mod:`jacap_attn.types`.
Options are the dataclass's fields; :func:`option` attaches their bounds, which every instance
checks on construction.
"""

from __future__ import annotations

import dataclasses
import keyword
import math
import numbers
from typing import Any, ClassVar

import torch

from ..types import LayerPlan, PrefillInputs


INT_MAX = 2**31 - 1  # token counts and seeds; larger values overflow the int64 index arithmetic
_REGISTRY: dict[str, type["Method"]] = {}


def option(default: Any, *, low: float | None = None, high: float | None = None, above: float | None = None,
           odd: bool = False, choices: tuple | None = None):
    """A method option: its default and bounds (``low <= x <= high``, ``x > above``, odd, one of
    ``choices``), checked by :meth:`Method.__post_init__` with an error naming the field."""
    meta = {"low": low, "high": high, "above": above, "odd": odd, "choices": choices}
    return dataclasses.field(default=default, metadata=meta)


class Method:
    """Base class of a compression method; subclasses are frozen dataclasses registered with
    :func:`register`.

    Class attributes (not options): ``needs_window_attention`` (fill ``inputs.probs``),
    ``needs_all_queries`` (fill ``inputs.all_queries``), ``fixed_budget`` (a budget policy that is
    part of the method, e.g. PyramidKV's ``"pyramid"``), ``default_spans`` (``"words"`` or ``"none"``:
    whether the selection keeps words whole when the config does not say), ``default_budget`` (the policy when the config
    gives none; ``"uniform"`` unless measured otherwise), ``compresses`` (False for ``full``),
    ``repeat_stats`` (the statistics of :func:`jacap_attn.math.attention_stats.attention_statistics` the method
    scores from under ``queries="repeat"``, summed or maximised over the repeat pass's query chunks;
    empty: the method cannot use that route).

    Override :meth:`score`; optionally :meth:`score_parts` (extra per-layer tensors for the hooks),
    :meth:`head_budgets` (per-head budgets, Ada-KV) and :meth:`across_layers` (a step over all
    layers after scoring, e.g. Jacap's consensus and sinks).
    """

    name: ClassVar[str] = ""
    needs_window_attention: ClassVar[bool] = False
    needs_all_queries: ClassVar[bool] = False
    fixed_budget: ClassVar[str | None] = None
    default_budget: ClassVar[str] = "uniform"
    default_spans: ClassVar[str] = "none"
    compresses: ClassVar[bool] = True
    repeat_stats: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = _checked(f, getattr(self, f.name))
            object.__setattr__(self, f.name, value)

    def reads_repeat_stats(self) -> tuple[str, ...]:
        """The statistics of ``repeat_stats`` this instance reads under its options (default: all of
        them); the repeat pass computes only these, plus its budget policy's."""
        return self.repeat_stats

    @property
    def compilable(self) -> bool:
        """Whether :meth:`score_parts` may run under ``torch.compile`` (no data-dependent loops)."""
        return True

    @property
    def reads_budget(self) -> bool:
        """Whether :meth:`score_parts` reads ``inputs.budget`` (its scores then differ per kept
        ratio); when it does not, scores computed once serve every ratio
        (:func:`jacap_attn.routes.replay.compress_recorded`'s ``parts``)."""
        return False

    @property
    def forced_sinks(self) -> int:
        """How many first real tokens (attention sinks) the method keeps in every head; the ``global``
        budget policy counts them inside each head's budget (docs/method.md#global-budget). 0 unless
        the method keeps sinks."""
        return 0

    @property
    def lookup_slots(self) -> int:
        """Free slots a head's budget must leave (beyond its window and sinks) for the method's prompt lookup
        to force a run there (docs/method.md#d12-prompt-lookup); 0 for a method without prompt lookup."""
        return 0

    def options(self) -> dict:
        """The options as plain JSON-serialisable values."""
        return dataclasses.asdict(self)

    def score(self, inputs: PrefillInputs) -> torch.Tensor:
        """``[b, h, n]`` float32 worth of every prompt token to every KV head (higher = keep)."""
        raise NotImplementedError(f"{type(self).__name__} must define score(inputs)")

    def score_parts(self, inputs: PrefillInputs) -> dict[str, torch.Tensor]:
        """``{"scores": [b, h, n]}`` plus any tensors the hooks read (e.g. ``"weights"`` ``[b, h, n]``,
        the per-token demand the ``capacity`` budget policy reads)."""
        return {"scores": self.score(inputs)}

    def head_budgets(self, scores: torch.Tensor, budget: torch.Tensor, key_valid: torch.Tensor,
                     window: int) -> torch.Tensor | None:
        """``[b, h]`` int64 per-head budgets summing to ``h * budget`` per row, or ``None`` (every
        head keeps ``budget [b]``)."""
        return None

    def across_layers(self, plans: list["LayerPlan"], key_valid: torch.Tensor, window: int) -> None:
        """Adjust ``plan.scores`` of the compressed layers after all are scored (default: nothing)."""

    def global_scores(self, plan: "LayerPlan", scores: torch.Tensor) -> torch.Tensor:
        """What the ``global`` budget ranks in ``plan``'s layer, ``[b, h, n]``, from the policy's own
        ``scores`` (the observation attention or the normalised shares); default: those scores."""
        return scores


def register(name: str):
    """Class decorator: make a :class:`Method` dataclass available as ``patch(model, method=name)``.

    Raises ``TypeError`` for a class that is not a frozen dataclass subclassing :class:`Method`,
    ``ValueError`` for a name already taken by another class.
    """
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"a method name must be an identifier (not a Python keyword), got {name!r}")

    def decorate(cls):
        if not is_method_class(cls):
            raise TypeError(f"@register({name!r}) needs a frozen dataclass subclassing Method, got {cls!r}")
        if cls.__dict__.get("name") and cls.__dict__["name"] != name and _REGISTRY.get(cls.__dict__["name"]) is cls:
            raise ValueError(f"{cls.__qualname__} is already registered as {cls.__dict__['name']!r}; "
                             "one class, one name (a saved cache names its method)")
        old = _REGISTRY.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"method name {name!r} is already registered by {old.__module__}.{old.__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def is_method_class(cls) -> bool:
    """Whether ``cls`` can be a method: a frozen dataclass subclassing :class:`Method`."""
    return (isinstance(cls, type) and issubclass(cls, Method) and dataclasses.is_dataclass(cls)
            and cls.__dataclass_params__.frozen)


def registered_fields() -> list[dataclasses.Field]:
    """The option fields of every registered method (repeated names included)."""
    return [f for cls in _REGISTRY.values() for f in dataclasses.fields(cls)]


def unregister(name: str) -> None:
    """Remove ``name`` from the registry (a notebook redefining a method, a test cleaning up);
    ``ValueError`` for a name that is not registered."""
    if _REGISTRY.pop(name, None) is None:
        raise ValueError(f"unknown method={name!r}; registered methods: {', '.join(names())}")


def get_method(name: str) -> type[Method]:
    """The registered class of ``name``; ``ValueError`` naming it and the registered names."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown method={name!r}; registered methods: {', '.join(names())}") from None


def names() -> tuple[str, ...]:
    """Names of the registered methods, in registration order (built-ins first)."""
    return tuple(_REGISTRY)


def _checked(f: dataclasses.Field, value):
    """``value`` of option ``f`` validated against its annotation and :func:`option` bounds, as a
    plain Python number (NumPy scalars, Fractions...: the config is saved as JSON)."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    kind = kind.split("|")[0].strip()
    meta, name = f.metadata, f.name
    if meta.get("choices") is not None:
        if value not in meta["choices"]:
            raise ValueError(f"{name} must be one of {', '.join(map(str, meta['choices']))}; got {name}={value!r}")
        return value
    if kind == "int":
        low = meta.get("low", None)
        low = -INT_MAX if low is None else low
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= INT_MAX:
            raise ValueError(f"{name} must be an integer in [{low}, {INT_MAX}], got {name}={value!r}")
        if meta.get("odd") and value % 2 == 0:
            raise ValueError(f"{name} must be odd, got {name}={value!r}")
        return int(value)
    if kind == "float":
        check_number(name, value)
        low, high, above = meta.get("low"), meta.get("high"), meta.get("above")
        if (low is not None and value < low) or (high is not None and value > high) \
                or (above is not None and not value > above):
            bound = [f"> {above}" if above is not None else "", f">= {low}" if low is not None else "",
                     f"<= {high}" if high is not None else ""]
            raise ValueError(f"{name} must be {' and '.join(b for b in bound if b)}, got {name}={value!r}")
        return float(value)
    if kind == "bool" and not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {name}={value!r}")
    return value


def check_number(name: str, value) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is a finite real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite real number, got {name}={value!r}")
