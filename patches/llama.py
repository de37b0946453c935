"""Llama (and SmolLM2, which is Llama-architecture): every layer full attention."""

from . import Adapter

ADAPTER = Adapter(model_types=("llama",))
