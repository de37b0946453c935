"""The saved file's format: header fields, checksums, the packed tensors and their reading
(docs/cache.md#saved-file-format). :mod:`jacap_attn.files.persist` writes and loads caches with it.

Format 3 (written since 2026-12-01) is *packed*: per layer ``i``, ``layers.{i}.keys`` /
``layers.{i}.values`` ``[E_i, d]`` hold only the entries the layer holds, row by row and KV head by
KV head, each head's in slot order (its kept prompt positions ascending, then the tokens appended
before saving); ``layers.{i}.positions`` ``[E_i]`` int32 their logical (RoPE) positions and
``layers.{i}.counts`` ``[b, h]`` int64 how many entries each (row, KV head) holds, so the file
holds the kept bytes and a small header, not ``[b, h, K_i, d]`` padded to a layer's largest head.
Formats 1 and 2 stored the padded layout (``keys``/``values`` ``[b, h, K_i, d]``, ``positions``
``[b, h, K_i]`` int64, ``valid`` ``[b, h, K_i]`` bool) and still load.
"""

from __future__ import annotations

import hashlib
import json

import torch

from . import quantize as quantization
from ..config import JacapConfig
from ..math.budget import stock_entries
from .paths import (write_atomically, canonical_header, check_input_file, check_output_path, missing_file,  # noqa: F401
                    parse_header, read_header)  # (re-exported)
from ..types import dtype_name

FORMAT = "jacap-cache"
# 2: the config nests the method's options; 3: packed entries, the header checksummed
# (`metadata_sha256`). Version 1 and 2 files (padded, no header checksum) still load.
FORMAT_VERSION = "3"
READABLE_VERSIONS = ("1", "2", "3")
_UNCHECKED_VERSIONS = ("1", "2")  # written before the header checksum
_FINGERPRINT_FIELDS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                       "head_dim", "hidden_size", "vocab_size", "rope_parameters", "sliding_windows")
PACKED_VERSIONS = ("3",)


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
        "dtype": dtype_name(next(model.parameters()).dtype),
    }
    fp["config_sha256"] = hashlib.sha256(json.dumps({k: fp[k] for k in _FINGERPRINT_FIELDS}, sort_keys=True).encode()).hexdigest()
    return fp


def selection_route(config: JacapConfig, evicted: bool = True, chunked: bool = False) -> str:
    """Which route selected a cache's entries (docs/method.md#question-agnostic-scoring): ``"window"``
    (the observation window's queries: question-aware when the prompt ends with the question),
    ``"lookahead"`` (the window's queries and those of the tokens the model writes next,
    ``lookahead > 0``: question-aware as the window), ``"repeat"`` (the repeat pass's queries:
    question-agnostic), ``"chunked"`` / ``"chunked-repeat"`` (a prefill of more than one chunk,
    ``chunked``: the cuts before the last scored by each chunk's window, or by a repeat pass,
    ``chunk_scores="repeat"``; the last by the prompt's end), or ``"whole"`` (nothing evicted:
    ``ratio=1`` or ``full``, e.g. a document stored whole for question-time ``reselect``, or
    ``evicted=False``: a prompt the cut kept whole, shorter than ``min_tokens`` or its window)."""
    if not config.compresses or not evicted:
        return "whole"
    if chunked:
        return "chunked-repeat" if config.chunk_scoring == "repeat" else "chunked"
    if config.queries == "window" and config.lookahead:
        return "lookahead"
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


def read_cache_metadata(path) -> dict:
    """The checked metadata of a cache file from its header alone: :func:`read_cache_header`'s first half."""
    return read_cache_header(path)[0]


def read_cache_header(path) -> tuple[dict, frozenset]:
    """``(metadata, tensor names)`` of a cache file from one read of its header alone (the tensors are neither read
    nor checked: :func:`read_cache_file` and :func:`load_cache` do that), format, version and the header's checksum
    (``metadata_sha256``, format 3) verified. Raises :class:`CacheFileError` (a ``ValueError``) for an unreadable
    header, another format, an unknown version, or a field edited, added or removed after saving (naming it);
    ``FileNotFoundError`` for a missing file, ``IsADirectoryError`` for a folder."""
    check_input_file(path)
    try:
        metadata, names = read_header(path)  # one open file: a file replaced meanwhile is read as one version
    except FileNotFoundError:
        raise missing_file(path) from None
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
        raise CacheFileError(f"{path}: not a readable cache file (truncated or corrupted?): {err}") from None
    return _checked_metadata(path, metadata), names


def _checked_metadata(path, metadata: dict) -> dict:
    """``metadata`` (a cache file's header fields) after its format, version and checksum checks
    (:func:`read_cache_metadata`'s errors)."""
    if metadata.get("format") != FORMAT and not any(key.startswith("jacap") for key in metadata):
        held = f"header fields {', '.join(map(repr, sorted(metadata)))}" if metadata else "no header fields"
        raise CacheFileError(f"{path}: not a jacap cache file (a safetensors file with {held}; a cache file is "
                             "what jacap compress, Document.save or save_cache writes)")
    if metadata.get("format") != FORMAT:
        raise CacheFileError(f"{path}: field 'format' is {metadata.get('format')!r}, expected {FORMAT!r}")
    if "format_version" not in metadata:
        raise CacheFileError(f"{path}: field 'format_version' is missing (a corrupted or edited header)")
    if metadata.get("format_version") not in READABLE_VERSIONS:
        raise CacheFileError(f"{path}: unknown format_version {metadata.get('format_version')!r} "
                             f"(this library reads {', '.join(READABLE_VERSIONS)})")
    _check_metadata(path, metadata)
    _check_fields(path, metadata)
    return metadata


def _check_fields(path, metadata: dict) -> None:
    """:class:`CacheFileError` naming a field the readers parse that is malformed (an edited file whose checksum
    was recomputed): ``model``, ``jacap_config`` and ``prompt_format`` JSON objects, the model's layer and head
    counts and ``batch_size`` positive integers, ``logical_length`` a non-negative one."""
    def number(text, lowest, name):
        if not (isinstance(text, (str, int)) and str(text).isdigit() and int(text) >= lowest):
            raise CacheFileError(f"{path}: field {name} is {text!r}, not an integer of at least {lowest}")
    parsed = {}
    for name in ("model", "jacap_config", "prompt_format"):
        try:
            parsed[name] = json.loads(metadata[name]) if name in metadata else {}
        except (TypeError, ValueError):
            parsed[name] = None
        if not isinstance(parsed[name], dict):
            raise CacheFileError(f"{path}: field {name!r} is not a JSON object (edited file?): {str(metadata[name])[:80]!r}")
    for key in ("num_hidden_layers", "num_key_value_heads", "head_dim"):
        number(parsed["model"].get(key), 1, f"'model'.{key}")
    number(metadata.get("batch_size"), 1, "'batch_size'")
    number(metadata.get("logical_length"), 0, "'logical_length'")


def read_cache_file(path) -> tuple[dict, dict]:
    """``(metadata, tensors)`` of a cache file on the CPU, with format and checksum verified.

    Raises :class:`CacheFileError` (a ``ValueError``) naming the problem: unreadable, truncated or
    corrupted file, another format, unknown version, a header or tensor checksum mismatch;
    ``FileNotFoundError`` for a missing file, ``IsADirectoryError`` for a folder.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    check_input_file(path)
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
        tensors = load(raw)
        header = parse_header(raw)  # of the same bytes, not a second read that a concurrent save could replace
    except FileNotFoundError:
        raise missing_file(path) from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CacheFileError(f"{path}: not a readable cache file (truncated or corrupted?): {err}") from None
    metadata = _checked_metadata(path, header.get("__metadata__") or {})
    if _tensors_sha256(tensors) != metadata.get("tensors_sha256"):
        raise CacheFileError(f"{path}: field 'tensors_sha256' does not match the tensor data (corrupted file)")
    return metadata, dequantized(path, metadata, tensors)


def quantize_layer(packed: dict, quantize: str | None) -> dict:
    """One layer's :func:`pack_layer` tensors, their keys and values in 8 bits when ``quantize`` is
    ``"int8"`` (:func:`jacap_attn.files.quantize.encode`: ``keys``/``values`` uint8 plus their ranges),
    unchanged for ``None``."""
    if quantize is None:
        return packed
    return {**packed, **quantization.encode(packed["keys"], packed["values"], packed["counts"])}


def dequantized(path, metadata: dict, tensors: dict) -> dict:
    """A file's tensors with 8-bit entries (header field ``quantization``, docs/cache.md#quantized-files)
    decoded to the file's dtype, the ranges dropped: what a file without quantization holds. Raises
    :class:`CacheFileError` for an unknown ``quantization`` or a tensor that disagrees with its counts."""
    kind = metadata.get("quantization")
    if kind is None:
        return tensors
    if kind not in quantization.QUANTIZATIONS:
        raise CacheFileError(f"{path}: field 'quantization' is {kind!r}; this library reads "
                             f"{', '.join(quantization.QUANTIZATIONS)}")
    model = json.loads(metadata["model"])
    dtype = getattr(torch, model.get("dtype", "float32"))
    names = ("keys", "values", "keys_min", "keys_scale", "values_min", "values_scale")
    out = dict(tensors)
    for i in range(int(model["num_hidden_layers"])):
        prefix = f"layers.{i}."
        try:
            parts = {n: out.pop(prefix + n) for n in names}
            counts = out[prefix + "counts"]
        except KeyError as err:
            raise CacheFileError(f"{path}: tensor {err.args[0]!r} is missing") from None
        try:
            out[prefix + "keys"], out[prefix + "values"] = quantization.decode(parts, counts, dtype)
        except ValueError as err:
            raise CacheFileError(f"{path}: layer {i}: {err}") from None
    return out


# The tensors of one layer in a file, ``layers.{i}.<name>``: packed (format 3) and padded (formats 1, 2).
PACKED_LAYER_TENSORS = ("keys", "values", "positions", "counts")
PADDED_LAYER_TENSORS = ("keys", "values", "positions", "valid")


def pack_layer(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> dict:
    """One layer's held entries packed: ``keys``/``values`` ``[b, h, K, d]``, ``positions``/``valid``
    ``[b, h, K]`` (:meth:`jacap_attn.storage.layer.JacapLayer.export`) to ``{"keys": [E, d], "values": [E, d],
    "positions": [E] int32, "counts": [b, h] int64}`` on the CPU, ``E`` the held entries, in row, head,
    slot order."""
    valid = valid.detach().cpu()
    return {"keys": keys.detach().cpu()[valid].contiguous(), "values": values.detach().cpu()[valid].contiguous(),
            "positions": positions.detach().cpu()[valid].to(torch.int32).contiguous(),
            "counts": valid.sum(-1).to(torch.int64)}


def unpack_layer(path, index: int, tensors: dict, batch: int, kv_heads: int, head_dim: int, logical: int,
                 dtype: torch.dtype | None = None):
    """``(keys, values, positions, valid)`` ``[b, h, K(, d)]`` of layer ``index`` from a packed file's
    tensors: each (row, KV head)'s entries in its first slots, ``K`` the largest count. Raises
    :class:`CacheFileError` naming the tensor whose shape, dtype (keys and values in ``dtype``, the
    header's, when given; integer positions) or contents (positions within ``logical`` and strictly
    increasing within each row and KV head, as a cache holds them) disagree with the header."""
    try:
        keys, values, positions, counts = (tensors[f"layers.{index}.{n}"] for n in PACKED_LAYER_TENSORS)
    except KeyError as err:
        raise CacheFileError(f"{path}: tensor {err.args[0]!r} is missing") from None
    if tuple(counts.shape) != (batch, kv_heads) or counts.dtype != torch.int64 or bool((counts < 0).any()):
        raise CacheFileError(f"{path}: tensor 'layers.{index}.counts' has shape {tuple(counts.shape)}, "
                             f"metadata says ({batch}, {kv_heads}) non-negative int64 counts")
    total = int(counts.sum())
    for name, tensor, shape in (("keys", keys, (total, head_dim)), ("values", values, (total, head_dim)),
                                ("positions", positions, (total,))):
        if tuple(tensor.shape) != shape:
            raise CacheFileError(f"{path}: tensor 'layers.{index}.{name}' has shape {tuple(tensor.shape)}, "
                                 f"its counts say {shape}")
    _check_entry_dtypes(path, index, keys, values, positions, dtype)
    check_positions(path, index, positions, counts, logical)
    width = int(counts.max()) if counts.numel() else 0
    valid = torch.arange(width)[None, None, :] < counts[..., None]  # [b, h, K]: each head's first slots
    out_keys = keys.new_zeros(batch, kv_heads, width, head_dim)
    out_values = values.new_zeros(batch, kv_heads, width, head_dim)
    out_positions = torch.zeros(batch, kv_heads, width, dtype=torch.int64)
    out_keys[valid], out_values[valid], out_positions[valid] = keys, values, positions.to(torch.int64)
    return out_keys, out_values, out_positions, valid


def check_positions(path, index: int, positions: torch.Tensor, counts: torch.Tensor, logical: int) -> None:
    """Layer ``index``'s packed ``positions [E]`` (``counts [b, h]`` entries per row and KV head) lie in
    ``[0, logical)`` and increase strictly within each row and KV head, as a cache holds them; else a
    :class:`CacheFileError` naming the tensor. The one check of a file's positions: :func:`unpack_layer`
    (the reader) and :func:`jacap_attn.files.persist.save_cache` (the writer, before writing) run it."""
    low, high = (int(positions.min()), int(positions.max())) if positions.numel() else (0, 0)
    if low < 0 or high >= logical:
        raise CacheFileError(f"{path}: tensor 'layers.{index}.positions' holds positions from {low} to {high}, "
                             f"outside [0, logical_length={logical})")
    same_head = (lambda segment: segment[1:] == segment[:-1])(quantization.segments(counts))
    if bool((same_head & (positions[1:] <= positions[:-1])).any()):
        raise CacheFileError(f"{path}: tensor 'layers.{index}.positions' is not strictly increasing within a "
                             "row and KV head (a cache holds each position once, in order)")


def _check_entry_dtypes(path, index: int, keys, values, positions, dtype: torch.dtype | None) -> None:
    """:class:`CacheFileError` unless a layer's keys and values are floats of ``dtype`` (any float
    dtype when ``None``) and its positions integers."""
    for name, tensor in (("keys", keys), ("values", values)):
        if not tensor.is_floating_point() or (dtype is not None and tensor.dtype != dtype):
            want = dtype_name(dtype) if dtype is not None else "a float dtype"
            raise CacheFileError(f"{path}: tensor 'layers.{index}.{name}' has dtype "
                                 f"{dtype_name(tensor.dtype)}, field 'dtype' says {want}")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise CacheFileError(f"{path}: tensor 'layers.{index}.positions' has dtype {positions.dtype}: "
                             "positions are integers")


_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def summary(metadata: dict, tensors: dict) -> dict:
    """What a user reads about a saved cache, from its header and tensors: ``kept_per_layer`` (per layer,
    ``[b][h]`` entries held), ``kept_bytes`` (the K/V bytes of those entries), ``full_bytes`` (the K/V
    bytes of the whole uncompressed cache of the same prompt: every position in a full-attention layer,
    ``min(n, sliding_window - 1)`` in a sliding one, what a stock cache holds, in the saved dtype),
    ``stored_ratio`` (the kept fraction the file was stored at: the configured ``ratio``), ``held_fraction`` (the entries held over those of
    the whole uncompressed cache, ``kept_bytes / full_bytes``, left padding counted in the full cache as
    a stock cache holds it: above ``stored_ratio`` where sliding-window layers keep their window, a
    prompt under ``min_tokens`` is kept whole or words are kept whole, below it in a left-padded batch;
    1.0 for an empty prompt), ``decode_budget`` (what a question decodes over: ``reselect``, else the stored
    fraction) and ``route``."""
    model = json.loads(metadata["model"])
    config = json.loads(metadata["jacap_config"])
    logical, batch = int(metadata["logical_length"]), int(metadata["batch_size"])
    packed = metadata.get("format_version") in PACKED_VERSIONS
    layers = range(int(model["num_hidden_layers"]))
    kept = [(tensors[f"layers.{i}.counts"] if packed else tensors[f"layers.{i}.valid"].sum(-1)).tolist() for i in layers]
    slot = 2 * int(model["head_dim"]) * _ELEMENT_BYTES.get(model.get("dtype"), 4)
    windows = model.get("sliding_windows") or [None] * len(kept)
    full = sum(batch * int(model["num_key_value_heads"]) * stock_entries(logical, w) * slot for w in windows)
    stored = float(config.get("ratio", 1.0))
    if config.get("method") == "full":
        stored = 1.0
    reselect = config.get("reselect")
    kept_bytes = sum(sum(map(sum, k)) for k in kept) * slot
    return {"kept_per_layer": kept, "kept_bytes": kept_bytes, "full_bytes": full,
            "stored_ratio": stored, "held_fraction": kept_bytes / full if full else 1.0,
            "decode_budget": stored if reselect is None else float(reselect),
            "route": file_route(metadata)}


def padded_tensors(metadata: dict, tensors: dict) -> tuple[dict, dict]:
    """A packed (format 3) file's ``(metadata, tensors)`` in the padded layout of formats 1 and 2:
    per layer ``keys``/``values`` ``[b, h, K, d]``, ``positions`` ``[b, h, K]`` int64, ``valid``; the
    metadata's ``tensors_sha256`` recomputed (its header checksum and version left to the caller).
    What an older library wrote, for tests of old files and for tools that want the padded form."""
    model = json.loads(metadata["model"])
    batch, logical = int(metadata["batch_size"]), int(metadata["logical_length"])
    out = {k: v for k, v in tensors.items() if not k.startswith("layers.")}
    for i in range(int(model["num_hidden_layers"])):
        keys, values, positions, valid = unpack_layer("(packed)", i, tensors, batch, int(model["num_key_value_heads"]),
                                                      int(model["head_dim"]), logical)
        out.update({f"layers.{i}.keys": keys, f"layers.{i}.values": values, f"layers.{i}.positions": positions,
                    f"layers.{i}.valid": valid})
    return {**metadata, "tensors_sha256": _tensors_sha256(out)}, out
