"""Routes: where the queries that score a cache come from, and when the cut happens
(docs/architecture.md#routes).

A route is an object with three hooks, called for the forwards it handles:

* :meth:`Route.layer`, by the registered attention function right after a layer's attention
  (exact over the prompt at prefill; over the held entries plus the new tokens at question time);
* :meth:`Route.attend`, by the attention function of a pending layer instead of the stock
  attention (``None``: the stock attention; the repeat pass computes a chunk's attention from the
  probabilities it scores from);
* :meth:`Route.update`, by :meth:`jacap_attn.storage.cache.JacapCache.update` before a layer stores new
  K/V (``None``: store as usual; a route running forwards of its own can return the K/V to attend
  without storing them);
* :meth:`Route.finish`, by the decoder stack's post-hook after the forward's last layer, with
  ``forward``, a callable that runs the patched decoder stack over the cache
  (``forward(input_ids=..., attention_mask=..., position_ids=...)``): a route that needs extra
  forwards (the repeat pass) calls it, and never imports :mod:`jacap_attn.patching`.

Routes are chosen from one map, :data:`ROUTES`, by name: a prefill runs the route named by the
config's ``queries`` (``"window"``, ``"repeat"``, or one registered with :func:`register_route`); a
forward of several tokens over a compressed cache runs the first append route (``prefill = False``)
whose :meth:`Route.applies` says yes (``"reselect"``). A new route is one file and one
``@register_route`` (a test registers a toy route from a test file). This module is a leaf: it
imports nothing from the library, so the config can validate ``queries`` against the map.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

ROUTES: dict[str, type["Route"]] = {}


class Route:
    """Base class of a route; one instance handles one prefill, or one forward over a compressed cache,
    and may keep that work's scratch state on itself.

    Class attributes: ``name`` (set by :func:`register_route`); ``prefill`` (``True``: selected by the
    config's ``queries`` for a prefill; ``False``: an append route, for new tokens over a compressed
    cache, selected by :meth:`applies`); ``attends_held`` (``True``: :meth:`attend` is asked for the
    layers already compressed too, not only pending ones, with the keyword ``weights`` (``True`` when
    the eager implementation must return its softmax weights): the repeat pass over a chunked
    prefill's held entries, :class:`jacap_attn.routes.repeat.HeldRepeatPass`, and question-time
    reselection, :class:`jacap_attn.routes.reselect.ReselectRoute`)."""

    name: ClassVar[str] = ""
    prefill: ClassVar[bool] = True
    attends_held: ClassVar[bool] = False

    @classmethod
    def applies(cls, cache: Any, new_tokens: int) -> bool:
        """Whether this append route handles a forward of ``new_tokens`` tokens over ``cache``."""
        return False

    def layer(self, cache: Any, index: int, query, keys, values, scaling: float) -> None:
        """After layer ``index``'s attention: ``query [b, Hq, q, d]`` post-RoPE, ``keys/values`` what the
        attention read, ``scaling`` the module's scale. Default: nothing."""

    def attend(self, cache: Any, index: int, query, keys, values, scaling: float, **kwargs):
        """Instead of the stock attention of pending layer ``index`` (``query [b, Hq, q, d]``
        post-RoPE, ``keys/values [b, h, k, d]`` what :meth:`update` returned, ``kwargs`` the attention
        module's extras: ``dropout``, ``softcap``, ``sliding_window``, ...): ``(out [b, q, Hq, d], None)``
        computed by the route, equal to the stock attention within float32 rounding, or ``None`` (the
        stock attention runs). :meth:`layer` is called after either. Default: ``None``."""
        return None

    def update(self, layer: Any, key_states, value_states):
        """Before ``layer`` stores ``key_states/value_states [b, h, q, d]``: ``None`` to store them as
        usual, or the ``(keys, values)`` the attention must read instead (nothing stored)."""
        return None

    def finish(self, cache: Any, forward: Callable[..., Any]) -> None:
        """After the forward's last layer; ``forward(**kwargs)`` runs the decoder stack over ``cache``.
        The route that handled the outermost forward ends it with ``cache.route = None``."""
        cache.route = None


def register_route(name: str):
    """Class decorator: add a :class:`Route` subclass to :data:`ROUTES` under ``name``.

    Raises ``TypeError`` for a class that is not a ``Route`` subclass, ``ValueError`` for a name that
    is not an identifier or is taken by another class."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a route name must be an identifier, got {name!r}")

    def decorate(cls):
        if not (isinstance(cls, type) and issubclass(cls, Route)):
            raise TypeError(f"@register_route({name!r}) needs a Route subclass, got {cls!r}")
        old = ROUTES.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"route name {name!r} is already registered by {old.__module__}.{old.__qualname__}")
        cls.name = name
        ROUTES[name] = cls
        return cls

    return decorate


def unregister_route(name: str) -> None:
    """Remove ``name`` from :data:`ROUTES`; ``ValueError`` if it is not registered."""
    if ROUTES.pop(name, None) is None:
        raise ValueError(f"unknown route {name!r}; registered routes: {', '.join(ROUTES)}")


def prefill_routes() -> tuple[str, ...]:
    """Names of the registered prefill routes (the accepted values of ``queries``)."""
    return tuple(name for name, cls in ROUTES.items() if cls.prefill)


def get_route(name: str) -> type[Route]:
    """The registered route class ``name``; ``ValueError`` naming it and the registered names."""
    try:
        return ROUTES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown route {name!r}; registered routes: {', '.join(ROUTES)}") from None


def prefill_route(config: Any) -> type[Route]:
    """The route class of a prefill under ``config``: the one named by ``config.queries``, except that
    ``queries="window"`` with ``config.lookahead > 0`` runs ``"lookahead"`` (the window's queries plus
    the written tokens', :mod:`jacap_attn.routes.lookahead`)."""
    if config.queries == "window" and getattr(config, "lookahead", 0):
        return get_route("lookahead")
    return get_route(config.queries)


def route_for(cache: Any, prefill: bool, new_tokens: int) -> Route | None:
    """A new instance of the route of a forward over ``cache``: for a prefill (``prefill`` True) the
    route named by ``cache.config.queries``; otherwise the first append route that applies to
    ``new_tokens`` new tokens, or ``None`` (the tokens are appended, nothing is rescored)."""
    if prefill:
        return prefill_route(cache.config)()
    for cls in ROUTES.values():
        if not cls.prefill and cls.applies(cache, new_tokens):
            return cls()
    return None
