"""The registered attention function: the stock attention at prefill, the layer's own attention over
its held entries afterwards, and the route's hook after either (docs/architecture.md#attention).

``jacap_attention`` is registered with transformers' ``AttentionInterface`` under
``jacap_sdpa`` / ``jacap_eager`` (see :mod:`jacap_attn.patching`); the patched attention-module
forward passes the :class:`~jacap_attn.storage.cache.JacapCache` as ``jacap_cache`` and the layer index as
``jacap_index``. Three cases:

* no Jacap cache (no cache, or another cache type): the stock attention, unchanged;
* a pending layer (the prefill, or a forward of the repeat pass): the stock attention over what
  the layer returned (the full prompt: exact outputs), unless the route computes it itself
  (:meth:`jacap_attn.routes.Route.attend`: the repeat pass, from the probabilities it scores from);
  a sliding-window layer's prompt runs in query blocks over the keys each can reach
  (:func:`jacap_attn.windowed.windowed_prefill`, exact up to summation order);
* a compressed layer: :meth:`jacap_attn.storage.layer.JacapLayer.attend` over the held entries (with
  ``jacap_eager``, its softmax weights too, over the slots held, as eager attention returns them for
  ``output_attentions``).

Then the cache's route of this forward, if any (:mod:`jacap_attn.routes`), sees the layer
(:meth:`jacap_attn.routes.Route.layer`): the prefill routes score it, question-time reselection
rescores the held entries. The attention function knows no route by name.
"""

from __future__ import annotations

import sys

import torch

from .storage.layer import PENDING
from .windowed import windowed_prefill


def stock_attention(impl: str):
    """The original attention function for ``impl`` (``"sdpa"`` or ``"eager"``)."""
    if impl == "eager":
        def eager(module, *args, **kwargs):
            return sys.modules[type(module).__module__].eager_attention_forward(module, *args, **kwargs)
        return eager
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return ALL_ATTENTION_FUNCTIONS[impl]


def make_attention_function(impl: str):
    """Build the function registered as ``jacap_<impl>``."""
    stock = stock_attention(impl)

    def jacap_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        jacap_cache=None, jacap_index=None, **kwargs):
        if jacap_cache is None:
            return stock(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        layer = jacap_cache.layers[jacap_index]
        if layer.state == PENDING:
            out = None if jacap_cache.route is None else \
                jacap_cache.route.attend(jacap_cache, jacap_index, query, key, value, scaling, dropout=dropout, **kwargs)
            if out is None and impl == "sdpa":  # a sliding layer's prompt in query blocks (exact)
                out = windowed_prefill(stock, module, query, key, value, attention_mask,
                                       kwargs.get("sliding_window") or layer.sliding_window,
                                       dropout=dropout, scaling=scaling, **kwargs)
            if out is None:
                out = stock(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        else:  # the eager implementation returns its weights, as the stock one does (output_attentions)
            out = None if jacap_cache.route is None or not jacap_cache.route.attends_held else \
                (_route_attend_outside if torch.compiler.is_compiling() else _route_attend)(
                    jacap_cache, jacap_index, query, key, value, scaling, dropout=dropout, weights=impl == "eager",
                    **kwargs)
            if out is None:
                out = layer.attend(query, scaling, weights=impl == "eager")
        if jacap_cache.route is not None:  # under torch.compile: eagerly, outside the graph
            (_route_layer_outside if torch.compiler.is_compiling() else _route_layer)(
                jacap_cache, jacap_index, query, key, value, scaling)
        return out

    jacap_attention.__name__ = f"jacap_{impl}_attention"
    return jacap_attention


def _route_layer(cache, index: int, query, key, value, scaling: float) -> None:
    """The route's per-layer hook (:meth:`jacap_attn.routes.Route.layer`)."""
    cache.route.layer(cache, index, query, key, value, scaling)


def _route_attend(cache, index: int, query, key, value, scaling: float, **kwargs):
    """The route's own attention of a compressed layer, or ``None`` (:meth:`jacap_attn.routes.Route.attend`;
    a repeat pass over a chunked prefill's held entries computes its own)."""
    return cache.route.attend(cache, index, query, key, value, scaling, **kwargs)


# In a compiled forward (a prefill, a question over a compressed cache) the route's scoring runs
# eagerly, outside the graph, as in an eager forward; a decode step has no route and stays traced.
_route_layer_outside = torch._dynamo.disable(_route_layer)
_route_attend_outside = torch._dynamo.disable(_route_attend)
