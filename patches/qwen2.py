"""Qwen2: per-layer ``config.layer_types`` (sliding layers only with ``use_sliding_window``)."""

from . import Adapter

ADAPTER = Adapter(model_types=("qwen2",), sliding="layer_types")
