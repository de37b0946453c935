"""What a cache knows of the model it was built for: its shape and a cheap weight fingerprint
(docs/cache.md#misuse-errors)."""

from __future__ import annotations

import hashlib

import torch


def model_shape(model) -> dict:
    """The architecture facts a cache's buffers depend on (type, layers, KV heads, head dim)."""
    config = model.config
    return {
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": getattr(config, "num_key_value_heads", config.num_attention_heads),
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
    }


def weights_fingerprint(model) -> str:
    """SHA-256 of a few fixed small slices of ``model``'s weights: 16 rows (256 columns) from the
    middle of the input embedding, and the first 4096 entries of every 1-D parameter (norms, biases)
    outside the middle decoder layers, i.e. of the first and last layers and the final norm.

    Two checkpoints of the same architecture (base and instruct, two seeds) differ there. Values are
    rounded to bfloat16 before hashing, so a float32 model and its bfloat16 copy agree. Only the slices
    are moved to the CPU (a few tens of KB even for an 8B model). Memoised on the patch state: computed
    once per patched model (weights changed in place afterwards are not noticed).
    """
    state = getattr(model, "_jacap_state", None)
    if getattr(state, "weights_sha256", None) is not None:
        return state.weights_sha256
    if state is not None:
        adapter = state.adapter
    else:
        from .patches import get_adapter

        adapter = get_adapter(model.config.model_type)
    layers = list(adapter.decoder_layers(model))
    middle = {id(p) for layer in layers[1:-1] for p in layer.parameters()}
    embed = model.get_input_embeddings().weight
    row = embed.shape[0] // 2
    parts = [("embed", embed[row:row + 16, :256])]
    parts += [(name, p[:4096]) for name, p in model.named_parameters() if p.dim() == 1 and id(p) not in middle]
    digest = hashlib.sha256()
    for name, tensor in parts:
        tensor = tensor.detach()
        digest.update(f"{name}:{tuple(tensor.shape)};".encode())
        if tensor.device.type == "meta":
            continue
        if tensor.is_floating_point():
            data = tensor.to(torch.bfloat16).cpu().float().numpy().astype("<f4")
        else:
            data = tensor.cpu().to(torch.int64).numpy().astype("<i8")
        digest.update(data.tobytes())
    value = digest.hexdigest()
    if state is not None:
        state.weights_sha256 = value
    return value
