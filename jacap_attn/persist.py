"""Saved prompt caches: ``save_cache`` / ``load_cache`` in one ``.safetensors`` file (docs/cache.md#saved-file-format).

Tensors, per layer ``i``: ``layers.{i}.keys`` / ``layers.{i}.values`` ``[b, h, K_i, d]`` (the used
slots only), ``layers.{i}.positions`` ``[b, h, K_i]`` int64 logical (RoPE) positions,
``layers.{i}.valid`` ``[b, h, K_i]`` bool (per-head and per-sample validity); ``pads`` ``[b]``
int64 left padding; ``prompt_ids`` ``[b, n]`` int64 (optional). String metadata: format and
library versions, the model fingerprint, the weights fingerprint (``weights_sha256``: which weights
made the cache), the Jacap config, the logical length, the SHA-256 of the prompt ids and of every
tensor's bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import warnings

import torch

from .cache import COMPRESSED, JacapCache, weights_fingerprint
from .config import JacapConfig

FORMAT = "jacap-cache"
FORMAT_VERSION = "2"  # 2: the config nests the method's options; version 1 files still load
READABLE_VERSIONS = ("1", "2")
_FINGERPRINT_FIELDS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                       "head_dim", "hidden_size", "vocab_size", "rope_parameters", "sliding_windows")


class CacheFileError(ValueError):
    """A cache file that cannot be used with this model; the message names the field."""


def model_fingerprint(model) -> dict:
    """The architecture facts a saved cache depends on (JSON-serialisable)."""
    config = model.config
    state = model._jacap_state
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        rope = {k: v for k, v in vars(rope).items()} if hasattr(rope, "__dict__") else {"value": str(rope)}
    if "rope_theta" not in rope and hasattr(config, "rope_theta"):
        rope = {**rope, "rope_theta": config.rope_theta}
    fp = {
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", config.num_attention_heads),
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "rope_parameters": json.loads(json.dumps(rope, sort_keys=True, default=str)),
        "sliding_windows": list(state.sliding_windows),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }
    fp["config_sha256"] = hashlib.sha256(json.dumps({k: fp[k] for k in _FINGERPRINT_FIELDS}, sort_keys=True).encode()).hexdigest()
    return fp


def selection_route(config: JacapConfig) -> str:
    """Which route selected a cache's entries (docs/method.md#question-agnostic-scoring): ``"window"``
    (the observation window's queries: question-aware when the prompt ends with the question),
    ``"repeat"`` (the repeat pass's queries: question-agnostic), or ``"whole"`` (nothing evicted:
    ``ratio=1`` or ``full``, e.g. a document stored whole for question-time ``reselect``)."""
    if not config.compresses:
        return "whole"
    return config.queries


def file_route(metadata: dict) -> str:
    """The ``selection_route`` of a file's metadata; files written before it was recorded were
    selected by the observation window (or stored whole)."""
    if "selection_route" in metadata:
        return metadata["selection_route"]
    try:
        return selection_route(JacapConfig.from_dict(json.loads(metadata["jacap_config"])))
    except (KeyError, TypeError, ValueError):
        return "window"


def ids_sha256(ids: torch.Tensor) -> str:
    """SHA-256 of token ids ``[b, n]`` (shape and int64 little-endian values)."""
    ids = ids.detach().to("cpu", torch.int64).contiguous()
    digest = hashlib.sha256(json.dumps(list(ids.shape)).encode())
    digest.update(ids.numpy().astype("<i8").tobytes())
    return digest.hexdigest()


def _tensors_sha256(tensors: dict) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(name.encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def save_cache(cache: JacapCache, path, *, model, prompt_ids: torch.Tensor, store_ids: bool = True,
               prompt_format: dict | None = None) -> int:
    """Write a compressed prompt cache to ``path`` atomically; returns the file size in bytes.

    The file is written to a temporary file in the same folder, flushed, fsync'ed and renamed over
    ``path``: a crash leaves any previous file intact and no temporary file behind.

    Parameters: ``cache`` a compressed :class:`JacapCache`; ``model`` the patched model that made it;
    ``prompt_ids`` ``[b, n]`` the prompt it holds (its SHA-256 is always stored, the ids themselves
    when ``store_ids``); ``prompt_format`` optional JSON-able facts about how the prompt was built
    (the CLI stores ``{"chat": bool}`` so a later question is appended the same way).

    Raises ``ValueError`` if the cache is not compressed or ``prompt_ids`` does not match its length.
    """
    from safetensors.torch import save

    if not isinstance(cache, JacapCache) or cache.state != COMPRESSED:
        raise ValueError("save_cache needs a compressed JacapCache (run jacap_attn.compress first)")
    logical = cache.get_seq_length()
    batch = cache.layers[0].keys.shape[0]
    if not isinstance(prompt_ids, torch.Tensor) or tuple(prompt_ids.shape) != (batch, logical):
        raise ValueError(f"prompt_ids has shape {tuple(getattr(prompt_ids, 'shape', ()))}; the cache holds "
                         f"{batch} row(s) of {logical} tokens")
    if cache._matches_prompt(prompt_ids.to(torch.int64)) is False:
        raise ValueError("prompt_ids are not the prompt this cache was built from (ids or prompt_sha256 differ)")
    cache.check_model(model)  # the file records this model's fingerprint: it must be the cache's own
    tensors = {"pads": cache.layers[0].pads.cpu()}
    for i, layer in enumerate(cache.layers):
        used = int(layer.write_pos)
        for name in ("keys", "values", "positions", "valid"):
            tensors[f"layers.{i}.{name}"] = getattr(layer, name)[:, :, :used].detach().cpu().contiguous()
    if store_ids:
        tensors["prompt_ids"] = prompt_ids.detach().to("cpu", torch.int64).contiguous()
    from .version import __version__

    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "model": json.dumps(model_fingerprint(model), sort_keys=True),
        "weights_sha256": weights_fingerprint(model),
        "jacap_config": json.dumps(cache.config.to_dict(), sort_keys=True),
        "logical_length": str(logical),
        "batch_size": str(prompt_ids.shape[0]),
        "prompt_sha256": ids_sha256(prompt_ids),
        "tensors_sha256": _tensors_sha256(tensors),
        "selection_route": selection_route(cache.config),
    }
    if prompt_format is not None:
        metadata["prompt_format"] = json.dumps(prompt_format, sort_keys=True)
    data = save(tensors, metadata=metadata)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".jacap-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return len(data)


def read_cache_metadata(path) -> dict:
    """The metadata of a cache file, read from its header alone (the tensors are neither read nor
    checked: :func:`read_cache_file` and :func:`load_cache` do that), format and version verified.

    Raises :class:`CacheFileError` (a ``ValueError``) for an unreadable header, another format or an
    unknown version; ``FileNotFoundError`` for a missing file.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as handle:
            metadata = handle.metadata() or {}
    except FileNotFoundError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CacheFileError(f"{path}: not a readable cache file (truncated or corrupted?): {err}") from None
    if metadata.get("format") != FORMAT:
        raise CacheFileError(f"{path}: field 'format' is {metadata.get('format')!r}, expected {FORMAT!r}")
    if metadata.get("format_version") not in READABLE_VERSIONS:
        raise CacheFileError(f"{path}: unknown format_version {metadata.get('format_version')!r} "
                             f"(this library reads {', '.join(READABLE_VERSIONS)})")
    return metadata


def read_cache_file(path) -> tuple[dict, dict]:
    """``(metadata, tensors)`` of a cache file on the CPU, with format and checksum verified.

    Raises :class:`CacheFileError` (a ``ValueError``) naming the problem: unreadable, truncated or
    corrupted file, another format, unknown version, checksum mismatch.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        with open(path, "rb") as handle:
            raw = handle.read()
        tensors = load(raw)
    except FileNotFoundError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CacheFileError(f"{path}: not a readable cache file (truncated or corrupted?): {err}") from None
    metadata = read_cache_metadata(path)
    if _tensors_sha256(tensors) != metadata.get("tensors_sha256"):
        raise CacheFileError(f"{path}: field 'tensors_sha256' does not match the tensor data (corrupted file)")
    return metadata, tensors


def load_cache(path, model, *, device=None, dtype: torch.dtype | None = None,
               reselect: float | None = None) -> JacapCache:
    """Load a cache saved by :func:`save_cache` for the patched ``model``.

    ``device`` (default: each layer's own device) and ``dtype`` (default: the saved dtype, which
    must equal the model's; pass ``dtype=`` to cast). The returned cache continues exactly:
    ``model.generate(torch.cat([prompt_ids, new_ids], 1), cache=loaded)`` gives the tokens the
    saved cache would give. ``copy.deepcopy(loaded)`` answers several prompts from one load
    (:class:`jacap_attn.Document` does that for you).

    ``reselect``: question-time reselection of the loaded cache (docs/method.md#question-time-reselection),
    a kept fraction in (0, 1]; ``None`` (default): the patched model's own ``reselect`` setting (the
    one that answers decides), not the file's. Every other setting is the file's.

    Raises :class:`CacheFileError` (a ``ValueError``) naming the field that does not fit: another
    model (model_type, layers, heads, KV heads, head dim, rope parameters, ...), another model of the
    same shape (``weights_sha256``: other weights, e.g. base vs instruct), another dtype, an unknown
    format version, a truncated or corrupted file, tensors whose shapes disagree with the metadata.
    Nothing is changed on the model when it raises. A file without ``weights_sha256`` (saved by an
    older version) loads with a warning: which weights made it cannot be checked.
    """
    if getattr(model, "_jacap_state", None) is None:
        raise ValueError("load_cache needs a patched model: call jacap_attn.patch(model, ...) first")
    metadata, tensors = read_cache_file(path)
    try:
        saved = json.loads(metadata["model"])
        logical, batch = int(metadata["logical_length"]), int(metadata["batch_size"])
        jacap_config = json.loads(metadata["jacap_config"])
    except (KeyError, ValueError) as err:
        raise CacheFileError(f"{path}: metadata field missing or malformed: {err}") from None
    current = model_fingerprint(model)
    for name in _FINGERPRINT_FIELDS:
        if saved.get(name) != current[name]:
            raise CacheFileError(f"{path}: cache is for another model: field {name!r} is {saved.get(name)!r}, "
                                 f"this model has {current[name]!r}")
    saved_weights, current_weights = metadata.get("weights_sha256"), weights_fingerprint(model)
    if saved_weights is None:
        warnings.warn(f"{path}: no 'weights_sha256' in the file (saved by an older jacap_attn): cannot check that "
                      "this model's weights made the cache", UserWarning, stacklevel=2)
    elif saved_weights != current_weights:
        raise CacheFileError(f"{path}: cache is for another model: field 'weights_sha256' is {saved_weights[:16]}..., "
                             f"this model's weights give {current_weights[:16]}... (same shape, other weights?)")
    if dtype is None and saved.get("dtype") != current["dtype"]:
        raise CacheFileError(f"{path}: field 'dtype' is {saved.get('dtype')!r} but the model is {current['dtype']!r}; "
                             "pass dtype= to cast")
    layers = []
    kv_heads, head_dim = current["num_key_value_heads"], current["head_dim"]
    for i in range(current["num_hidden_layers"]):
        try:
            keys, values = tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]
            positions, valid = tensors[f"layers.{i}.positions"], tensors[f"layers.{i}.valid"]
        except KeyError as err:
            raise CacheFileError(f"{path}: tensor {err.args[0]!r} is missing") from None
        k = keys.shape[2] if keys.dim() == 4 else -1
        expected = {"keys": (batch, kv_heads, k, head_dim), "values": (batch, kv_heads, k, head_dim),
                    "positions": (batch, kv_heads, k), "valid": (batch, kv_heads, k)}
        for name, tensor in (("keys", keys), ("values", values), ("positions", positions), ("valid", valid)):
            if tuple(tensor.shape) != expected[name]:
                raise CacheFileError(f"{path}: tensor 'layers.{i}.{name}' has shape {tuple(tensor.shape)}, "
                                     f"metadata says {expected[name]}")
        if bool((positions[valid] >= logical).any()):
            raise CacheFileError(f"{path}: tensor 'layers.{i}.positions' holds positions beyond logical_length={logical}")
        layers.append((keys, values, positions, valid))
    pads = tensors.get("pads")
    if pads is None or tuple(pads.shape) != (batch,):
        raise CacheFileError(f"{path}: tensor 'pads' is missing or has the wrong shape")
    prompt_ids = tensors.get("prompt_ids")
    if prompt_ids is not None and (tuple(prompt_ids.shape) != (batch, logical) or ids_sha256(prompt_ids) != metadata.get("prompt_sha256")):
        raise CacheFileError(f"{path}: field 'prompt_sha256' does not match tensor 'prompt_ids'")

    try:
        config = JacapConfig.from_dict(jacap_config)
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise CacheFileError(f"{path}: field 'jacap_config' is not a valid configuration: {err}") from None
    if reselect is None:
        reselect = model._jacap_state.config.reselect
    config = dataclasses.replace(config, reselect=reselect)  # validated (ValueError naming a bad value)
    attention = model._jacap_state.adapter.attention_modules(model)
    placed = []
    for (keys, values, positions, valid), module in zip(layers, attention):
        target = device if device is not None else next(module.parameters()).device
        cast = dtype if dtype is not None else keys.dtype
        placed.append((keys.to(target, cast), values.to(target, cast), positions.to(target), valid.to(target)))
    cache = JacapCache.from_kept(model, placed, logical=logical, pads=pads, config=config, prompt_ids=prompt_ids)
    cache.prompt_sha256 = metadata.get("prompt_sha256")
    return cache
