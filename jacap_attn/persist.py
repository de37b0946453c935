"""Saved prompt caches: ``save_cache`` / ``load_cache`` in one ``.safetensors`` file (docs/cache.md#saved-file-format).

Tensors, per layer ``i``: ``layers.{i}.keys`` / ``layers.{i}.values`` ``[b, h, K_i, d]`` (the used
slots only), ``layers.{i}.positions`` ``[b, h, K_i]`` int64 logical (RoPE) positions,
``layers.{i}.valid`` ``[b, h, K_i]`` bool (per-head and per-sample validity); ``pads`` ``[b]``
int64 left padding; ``prompt_ids`` ``[b, n]`` int64 (optional). String metadata: format and
library versions, the model fingerprint, the weights fingerprint (``weights_sha256``: which weights
made the cache), the Jacap config, the logical length, the SHA-256 of the prompt ids and of every
tensor's bytes, and a SHA-256 of every other header field (``metadata_sha256``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import warnings

import torch

from .cache import COMPRESSED, JacapCache
from .config import _FULL_OPTIONS, COMMON_OPTIONS, JacapConfig
from .identity import ids_sha256, weights_fingerprint  # ids_sha256: re-exported (it lived here)

FORMAT = "jacap-cache"
# 2: the config nests the method's options; 3: the header is checksummed (`metadata_sha256`).
# Version 1 and 2 files (no header checksum) still load.
FORMAT_VERSION = "3"
READABLE_VERSIONS = ("1", "2", "3")
_UNCHECKED_VERSIONS = ("1", "2")  # written before the header checksum
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


def file_config(path, metadata: dict) -> JacapConfig:
    """The :class:`JacapConfig` a cache file's header records (``jacap_config``, format 1 or 2 layout).
    Raises :class:`CacheFileError` naming ``jacap_config`` when it is missing, malformed or invalid
    (an unknown method, a bad option)."""
    try:
        return JacapConfig.from_dict(json.loads(metadata["jacap_config"]))
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CacheFileError(f"{path}: field 'jacap_config' is not a valid configuration: {err}") from None


def _tensors_sha256(tensors: dict) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(name.encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def metadata_sha256(metadata: dict) -> str:
    """The ``metadata_sha256`` field of a header: a JSON object mapping every other field, in sorted
    order, to the SHA-256 of its UTF-8 value (docs/cache.md#checksums), so that an edited field can
    be named."""
    return json.dumps({name: hashlib.sha256(value.encode()).hexdigest()
                       for name, value in sorted(metadata.items()) if name != "metadata_sha256"}, sort_keys=True)


def _check_metadata(path, metadata: dict) -> None:
    """:class:`CacheFileError` naming the first header field (sorted) that is not what ``metadata_sha256``
    says; files before format 3 may lack that field."""
    if "metadata_sha256" not in metadata:
        if metadata.get("format_version") not in _UNCHECKED_VERSIONS:
            raise CacheFileError(f"{path}: field 'metadata_sha256' is missing (format_version "
                                 f"{metadata.get('format_version')} files checksum their header)")
        return
    try:
        saved = json.loads(metadata["metadata_sha256"])
        if not isinstance(saved, dict):
            raise ValueError("not an object")
    except ValueError:
        raise CacheFileError(f"{path}: field 'metadata_sha256' is malformed (edited file?)") from None
    current = json.loads(metadata_sha256(metadata))
    for name in sorted(set(saved) | set(current)):
        if name not in current:
            raise CacheFileError(f"{path}: field {name!r} was removed from the header after saving "
                                 "(metadata_sha256 covers it)")
        if name not in saved:
            raise CacheFileError(f"{path}: field {name!r} was added to the header after saving "
                                 "(metadata_sha256 does not cover it)")
        if saved[name] != current[name]:
            raise CacheFileError(f"{path}: field {name!r} was edited after saving: its value "
                                 f"{metadata[name][:80]!r} does not match metadata_sha256")


def check_output_path(path) -> str:
    """Check, before any work, that a cache file can be written at ``path`` (a file name, in an
    existing, writable folder; an existing file there would be replaced). Returns ``path`` as a
    string. Raises ``ValueError`` naming ``path``: a directory, a missing folder, a folder where no
    file can be created (probed with a temporary file, removed at once)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"cannot write the cache file {path!r}: it is a directory; give a file name "
                         f"such as {os.path.join(path, 'doc.safetensors')!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write the cache file {path!r}: folder {folder!r} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=".jacap-", suffix=".tmp", dir=folder)
    except OSError as err:
        raise ValueError(f"cannot write the cache file {path!r}: folder {folder!r} is not writable "
                         f"({err.strerror or err})") from None
    os.close(fd)
    os.unlink(probe)
    return path


def save_cache(cache: JacapCache, path, *, model, prompt_ids: torch.Tensor, store_ids: bool = True,
               prompt_format: dict | None = None) -> int:
    """Write a compressed prompt cache to ``path`` atomically; returns the file size in bytes.

    The file is written to a temporary file in the same folder, flushed, fsync'ed and renamed over
    ``path``: a crash leaves any previous file intact and no temporary file behind.

    Parameters: ``cache`` a compressed :class:`JacapCache`; ``model`` the patched model that made it;
    ``prompt_ids`` ``[b, n]`` the prompt it holds (its SHA-256 is always stored, the ids themselves
    when ``store_ids``); ``prompt_format`` optional JSON-able facts about how the prompt was built
    (the CLI stores ``{"chat": bool}`` so a later question is appended the same way).

    Raises ``ValueError`` if ``model`` is not a patched model, the cache is not compressed, ``prompt_ids``
    does not match it, or ``path`` cannot be written (:func:`check_output_path`, checked before any
    work); ``OSError`` naming ``path`` if the write itself fails (the previous file is then intact).
    """
    from safetensors.torch import save

    if getattr(model, "_jacap_state", None) is None:
        raise ValueError(f"save_cache needs model=, the patched model that made the cache; got model="
                         f"{'None' if model is None else 'an unpatched ' + type(model).__name__}")
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
    check_output_path(path)
    tensors = {"pads": cache.layers[0].pads.cpu()}
    for i, layer in enumerate(cache.layers):
        used = int(layer.write_pos)
        for name in ("keys", "values", "positions", "valid"):
            tensors[f"layers.{i}.{name}"] = getattr(layer, name)[:, :, :used].detach().cpu().contiguous()
    if store_ids:
        tensors["prompt_ids"] = prompt_ids.detach().to("cpu", torch.int64).contiguous()
    from . import __version__

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
    metadata["metadata_sha256"] = metadata_sha256(metadata)
    data = save(tensors, metadata=metadata)
    try:
        _write_atomically(path, data)
    except OSError as err:  # name the user's path, not the temporary file
        message = f"cannot write the cache file {os.fspath(path)!r}: {err.strerror or err}"
        raise (OSError(err.errno, message) if err.errno is not None else type(err)(message)) from err
    return len(data)


def _write_atomically(path, data: bytes) -> None:
    """Write ``data`` to a temporary file in ``path``'s folder, flush, fsync, rename it over ``path``,
    fsync the folder; on any error the temporary file is removed and a previous ``path`` is intact."""
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


def read_cache_metadata(path) -> dict:
    """The metadata of a cache file, read from its header alone (the tensors are neither read nor
    checked: :func:`read_cache_file` and :func:`load_cache` do that), format, version and the header's
    checksum (``metadata_sha256``, format 3) verified.

    Raises :class:`CacheFileError` (a ``ValueError``) for an unreadable header, another format, an
    unknown version, or a field edited, added or removed after saving (naming it);
    ``FileNotFoundError`` for a missing file.
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
    _check_metadata(path, metadata)
    return metadata


def read_cache_file(path) -> tuple[dict, dict]:
    """``(metadata, tensors)`` of a cache file on the CPU, with format and checksum verified.

    Raises :class:`CacheFileError` (a ``ValueError``) naming the problem: unreadable, truncated or
    corrupted file, another format, unknown version, a header or tensor checksum mismatch.
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
               reselect: float | bool | None = None) -> JacapCache:
    """Load a cache saved by :func:`save_cache` for ``model``.

    ``device`` (default: each layer's own device) and ``dtype`` (default: the saved dtype, which
    must equal the model's; pass ``dtype=`` to cast). The returned cache continues exactly:
    ``model.generate(torch.cat([prompt_ids, new_ids], 1), cache=loaded)`` gives the tokens the
    saved cache would give. ``copy.deepcopy(loaded)`` answers several prompts from one load
    (:class:`jacap_attn.Document` does that for you).

    Settings (one rule, shared with :meth:`jacap_attn.Document.load`; docs/cache.md#load-checks): the
    loaded cache answers with the settings it was saved with (its stored kept fraction, method and
    options, and its decode budget ``reselect``); the patched model's settings apply to its new
    prefills only. A warning says so when the patched model's method or decode budget (``reselect``,
    else ``ratio``) differs from the file's. ``reselect`` overrides the file's decode budget: a kept
    fraction in (0, 1] (docs/method.md#question-time-reselection), ``False`` for no question-time
    reselection, ``None`` (default) for the file's own.

    An unpatched ``model`` (a fresh process) is patched with the file's settings
    (``jacap_attn.patch(model, ratio=<the file's>, method=<the file's>, ...)``), so later prefills
    compress as the file was compressed; ``jacap_attn.patch`` again to change that.

    Raises :class:`CacheFileError` (a ``ValueError``) naming the field that does not fit: another
    model (model_type, layers, heads, KV heads, head dim, rope parameters, ...), another model of the
    same shape (``weights_sha256``: other weights, e.g. base vs instruct, a merged adapter), another
    dtype, an unknown format version, a truncated or corrupted file, an edited header
    (``metadata_sha256``), tensors whose shapes disagree with the metadata; ``ValueError`` for a bad
    ``reselect`` or a model of an unsupported family. Nothing is changed on the model when it raises
    (a model patched here is unpatched again). A file without ``weights_sha256`` (saved by an older
    version) loads with a warning: which weights made it cannot be checked.
    """
    from .patching import patch, unpatch

    metadata, tensors = read_cache_file(path)
    config = file_config(path, metadata)
    patched_here = getattr(model, "_jacap_state", None) is None
    if patched_here:
        names = COMMON_OPTIONS if config.method.compresses else _FULL_OPTIONS
        patch(model, ratio=config.ratio, method=config.method, **{name: getattr(config, name) for name in names})
    try:
        return _load(path, model, metadata, tensors, config, device=device, dtype=dtype, reselect=reselect,
                     warn=not patched_here)
    except BaseException:
        if patched_here:
            unpatch(model)
        raise


def _decode_budget(config: JacapConfig) -> float:
    """The kept fraction a cache with these settings decodes over after a question."""
    if config.reselect is not None:
        return config.reselect
    return config.ratio if config.method.compresses else 1.0


def _load(path, model, metadata, tensors, config, *, device, dtype, reselect, warn):
    """:func:`load_cache`'s checks and build, on a patched ``model``, from a file read and checksummed
    (``config``: its settings; ``warn``: say when the patched settings differ)."""
    try:
        saved = json.loads(metadata["model"])
        logical, batch = int(metadata["logical_length"]), int(metadata["batch_size"])
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
                      "this model's weights made the cache", UserWarning, stacklevel=3)
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

    if reselect is not None:  # validated by JacapConfig (ValueError naming a bad value)
        config = dataclasses.replace(config, reselect=None if reselect is False else reselect)
    patched = model._jacap_state.config
    if warn and reselect is None and (patched.method.name, _decode_budget(patched)) != \
            (config.method.name, _decode_budget(config)):
        warnings.warn(f"{path}: the loaded cache answers with the file's settings (method {config.method.name!r}, "
                      f"decode budget {_decode_budget(config)}), not the patched model's (method "
                      f"{patched.method.name!r}, decode budget {_decode_budget(patched)}), which apply to new "
                      "prefills only; pass reselect= to choose the decode budget", UserWarning, stacklevel=3)
    attention = model._jacap_state.adapter.attention_modules(model)
    placed = []
    for (keys, values, positions, valid), module in zip(layers, attention):
        target = device if device is not None else next(module.parameters()).device
        cast = dtype if dtype is not None else keys.dtype
        placed.append((keys.to(target, cast), values.to(target, cast), positions.to(target), valid.to(target)))
    cache = JacapCache.from_kept(model, placed, logical=logical, pads=pads, config=config, prompt_ids=prompt_ids)
    cache.prompt_sha256 = metadata.get("prompt_sha256")
    return cache
