"""Mistral: every layer uses ``config.sliding_window`` when it is set (v0.1), none otherwise."""

from . import Adapter

ADAPTER = Adapter(model_types=("mistral",), sliding="all")
