"""Per-architecture adapters, installed as ``jacap_attn.patches``.

An adapter is data: which ``config.model_type`` values it serves, where the decoder layers are,
the name of the attention submodule, and which layers use a sliding window. Everything else
(post-RoPE queries after any q/k norm, the module's ``scaling``, the cache keyword) reaches the
registered attention function the same way in every family. A new family is one small file here
defining ``ADAPTER``; :func:`get_adapter` finds it.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass


@dataclass(frozen=True)
class Adapter:
    """How to find a family's attention modules and sliding-window layers.

    model_types: ``config.model_type`` values served.
    layers_path: dotted path from the ``*ForCausalLM`` model to its ``nn.ModuleList`` of decoder layers.
    attention_attr: attribute of a decoder layer holding its attention module.
    output_attr: attribute of the attention module holding its output projection ``W_O`` (an
        ``nn.Linear`` from the concatenated heads to the hidden size; ``global_score="output"``).
    sliding: ``"none"`` (all layers full attention), ``"all"`` (every layer uses
        ``config.sliding_window`` when it is set: Mistral, Phi3) or ``"layer_types"``
        (``config.layer_types[i] == "sliding_attention"``: Qwen2, Qwen3, Gemma3).
    """

    model_types: tuple[str, ...]
    layers_path: str = "model.layers"
    attention_attr: str = "self_attn"
    output_attr: str = "o_proj"
    sliding: str = "none"

    def base_model(self, model):
        """The decoder stack (the module whose forward runs all layers)."""
        return _resolve(model, self.layers_path.rsplit(".", 1)[0])

    def decoder_layers(self, model):
        return _resolve(model, self.layers_path)

    def attention_modules(self, model) -> list:
        return [getattr(layer, self.attention_attr) for layer in self.decoder_layers(model)]

    def output_projections(self, model) -> list:
        """Per layer, the attention's output projection weight ``[hidden, Hq * d]`` (a tensor-parallel
        rank's local columns: its own query heads)."""
        weights = [getattr(module, self.output_attr).weight for module in self.attention_modules(model)]
        return [w.to_local() if hasattr(w, "to_local") else w for w in weights]

    def sliding_windows(self, config) -> list[int | None]:
        """Per layer, the sliding window (tokens) or ``None`` for full attention."""
        n = config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        if self.sliding == "all":
            return [window] * n
        if self.sliding == "layer_types":
            types = getattr(config, "layer_types", None) or ["full_attention"] * n
            return [window if t == "sliding_attention" else None for t in types[:n]]
        return [None] * n


def _resolve(obj, path: str):
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def _load() -> dict[str, Adapter]:
    registry: dict[str, Adapter] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        adapter = getattr(module, "ADAPTER", None)
        if not isinstance(adapter, Adapter):
            raise TypeError(f"{module.__name__} must define ADAPTER = Adapter(...)")
        for model_type in adapter.model_types:
            registry[model_type] = adapter
    return registry


ADAPTERS: dict[str, Adapter] = _load()


def get_adapter(model_type: str) -> Adapter:
    """The adapter for ``model_type``; ``ValueError`` naming it and listing the supported ones."""
    try:
        return ADAPTERS[model_type]
    except KeyError:
        raise ValueError(
            f"jacap_attn does not support model_type={model_type!r}; supported: {', '.join(sorted(ADAPTERS))}"
        ) from None
