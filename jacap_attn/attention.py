"""The registered attention function: exact prefill plus scoring, then decode over the kept slots.

``jacap_attention`` is registered with transformers' ``AttentionInterface`` under
``jacap_sdpa`` / ``jacap_eager`` (see :mod:`jacap_attn.patching`); the patched attention-module
forward passes the :class:`~jacap_attn.cache.JacapCache` as ``jacap_cache`` and the layer index as
``jacap_index``. Three cases (docs/architecture.md#attention):

* no Jacap cache (no cache, or another cache type): the stock attention, unchanged;
* a pending layer (the prefill): the stock attention over the full prompt (exact outputs), then the
  layer's scores (:func:`jacap_attn.selection.score_layer`); in a chunk of the repeat pass
  (``queries="repeat"``), the stock attention over the prompt and the chunk, then the chunk's
  statistics (:func:`jacap_attn.repeat.observe_repeat`);
* a compressed layer: :func:`decode_attention` over the static buffers with the layer's own mask;
  then, for several new tokens under ``reselect``, the layer's question-time reselection
  (:func:`jacap_attn.reselect.score_layer`, cut at the forward's end).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from . import reselect
from .layer import PENDING
from .repeat import observe_repeat
from .selection import score_layer


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
            out = stock(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
            if jacap_cache.prefill.replay_valid is not None:  # a chunk of the repeat pass
                observe_repeat(jacap_cache, jacap_index, query, key, scaling)
            else:
                score_layer(jacap_cache, jacap_index, query, key, value, scaling)
            return out
        out = decode_attention(query, key, value, layer.attention_mask(query.shape[-2]), scaling)
        if reselect.applies(jacap_cache, jacap_index, query.shape[-2]):  # a question over a compressed cache
            reselect.score_layer(jacap_cache, jacap_index, query, scaling)
        return out, None

    jacap_attention.__name__ = f"jacap_{impl}_attention"
    return jacap_attention


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """SDPA of ``query [b, Hq, q, d]`` over the static buffers ``keys/values [b, h, C, d]`` with the
    per-KV-head mask ``[b, h, q, C]``. The GQA group is folded into the query axis, so K/V are never
    repeated to query heads. Returns ``[b, q, Hq, d]`` (the layout transformers expects)."""
    b, hq, q, d = query.shape
    h, c = keys.shape[1], keys.shape[2]
    g = hq // h
    folded = query.reshape(b, h, g * q, d)
    mask = mask[:, :, None].expand(b, h, g, q, c).reshape(b, h, g * q, c)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, q, values.shape[-1]).transpose(1, 2).contiguous()
