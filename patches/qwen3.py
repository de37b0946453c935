"""Qwen3: q/k RMS norms before RoPE (the attention function receives the normed queries, so
scores use them); per-layer ``config.layer_types``."""

from . import Adapter

ADAPTER = Adapter(model_types=("qwen3",), sliding="layer_types")
