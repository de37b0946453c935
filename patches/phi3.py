"""Phi-3: fused qkv projection and partial rotary (both before the attention function, so nothing
differs for us); every layer uses ``config.sliding_window`` when it is set."""

from . import Adapter

ADAPTER = Adapter(model_types=("phi3",), sliding="all")
