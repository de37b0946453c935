"""Gemma3 text model (``Gemma3ForCausalLM``): 5 sliding-window layers per full-attention layer.
Only the full-attention layers are compressed; sliding layers keep their window. Scaling is
``query_pre_attn_scalar ** -0.5``, passed to the attention function by the module."""

from . import Adapter

ADAPTER = Adapter(model_types=("gemma3_text",), sliding="layer_types")
