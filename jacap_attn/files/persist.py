"""Saved prompt caches: ``save_cache`` / ``load_cache`` in one ``.safetensors`` file (docs/cache.md#saved-file-format).

Tensors, per layer ``i``, packed (format 3, :mod:`jacap_attn.files.cache_file`): ``layers.{i}.keys`` /
``layers.{i}.values`` ``[E_i, d]`` the held entries only, ``layers.{i}.positions`` ``[E_i]`` int32
their logical (RoPE) positions, ``layers.{i}.counts`` ``[b, h]`` int64 the entries of each row and KV
head (with ``quantize="int8"``, keys and values uint8 and their ranges, :mod:`jacap_attn.files.quantize`);
``pads`` ``[b]`` int64 left padding; ``prompt_ids`` ``[b, n]`` int64 (optional). String metadata: format and
library versions, the model fingerprint, the weights fingerprint (``weights_sha256``: which weights
made the cache), the Jacap config, the logical length, the SHA-256 of the prompt ids and of every
tensor's bytes, and a SHA-256 of every other header field (``metadata_sha256``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import torch

from ..storage.cache import COMPRESSED, JacapCache
from ..storage.distributed import head_group
from .cache_file import (FORMAT, FORMAT_VERSION, PACKED_LAYER_TENSORS, PACKED_VERSIONS, PADDED_LAYER_TENSORS,
                         READABLE_VERSIONS, CacheFileError, _FINGERPRINT_FIELDS, _check_entry_dtypes, _tensors_sha256,
                         write_atomically, canonical_header, check_output_path, check_positions, file_config,
                         file_route, metadata_sha256, model_fingerprint, pack_layer, quantize_layer, read_cache_file,
                         read_cache_header, read_cache_metadata, selection_route, unpack_layer)
from ..config import _FULL_OPTIONS, COMMON_OPTIONS, JacapConfig
from ..storage.identity import ids_sha256, legacy_weights_fingerprint, weights_fingerprint  # ids_sha256: re-exported
from .quantize import check as check_quantize
from ..types import dtype_name




def prompt_format_json(prompt_format: dict | None) -> str | None:
    """``prompt_format`` as the JSON a cache file's header stores (keys sorted), ``None`` for ``None``.
    ``ValueError`` naming the value unless it is a dict of JSON-able values (str, number, bool, None, list, dict)."""
    if prompt_format is None:
        return None
    if not isinstance(prompt_format, dict):
        raise ValueError(f"prompt_format must be a dict (e.g. {{'chat': True}}) or None, got {prompt_format!r}")
    try:
        return json.dumps(prompt_format, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise ValueError(f"prompt_format must be JSON-able (str, number, bool, None, list, dict values): {err}") from None


def save_cache(cache: JacapCache, path, *, model, prompt_ids: torch.Tensor, store_ids: bool = True,
               prompt_format: dict | None = None, quantize: str | None = None) -> int:
    """Write a compressed prompt cache to ``path`` atomically; returns the file size in bytes.

    The file is written to a temporary file in the same folder, flushed, fsync'ed and renamed over
    ``path``: a crash leaves any previous file intact and no temporary file behind.

    Parameters: ``cache`` a compressed :class:`JacapCache`; ``model`` the patched model that made it;
    ``prompt_ids`` ``[b, n]`` every token it has seen (its SHA-256 is always stored, the ids themselves
    when ``store_ids``): the prompt it was built from (checked), then any tokens appended since (taken as
    given: the cache does not keep their ids); ``prompt_format`` optional JSON-able facts about how the prompt was built
    (the CLI stores ``{"chat": bool}`` so a later question is appended the same way); ``quantize``
    ``None`` (entries in the cache's dtype) or ``"int8"`` (keys per channel, values per token, KIVI's
    layout: about 0.27 of the float32 bytes; dequantized on load; docs/cache.md#quantized-files).

    Raises ``ValueError`` for a ``quantize`` other than those, a ``prompt_format`` that is not a JSON-able dict, if
    ``model`` is not a patched model, the cache is not compressed, ``prompt_ids``
    does not match it, or ``path`` cannot be written (:func:`check_output_path`, checked before any
    work); ``ValueError`` (nothing written) when the cache holds what :func:`load_cache` would refuse
    (positions outside ``[0, logical length)`` or out of order, bad paddings: the reader's own
    checks, :func:`jacap_attn.files.cache_file.check_positions` and :func:`check_pads`); ``OSError`` naming
    ``path`` if the write itself fails (the previous file is then intact).
    """
    from safetensors.torch import save

    quantize = check_quantize(quantize)
    format_json = prompt_format_json(prompt_format)  # the readers take it as a JSON object: refused here, not there
    if getattr(model, "_jacap_state", None) is None:
        raise ValueError(f"save_cache needs model=, the patched model that made the cache; got model="
                         f"{'None' if model is None else 'an unpatched ' + type(model).__name__}")
    if not isinstance(cache, JacapCache) or cache.state != COMPRESSED:
        raise ValueError("save_cache needs a compressed JacapCache (run jacap_attn.compress first)")
    logical = cache.get_seq_length()
    batch = cache.batch_size
    if not isinstance(prompt_ids, torch.Tensor) or tuple(prompt_ids.shape) != (batch, logical):
        raise ValueError(f"prompt_ids has shape {tuple(getattr(prompt_ids, 'shape', ()))}; the cache holds "
                         f"{batch} row(s) of {logical} tokens")
    if cache.starts_with_prompt(prompt_ids.to(torch.int64))[1] is False:  # then the tokens appended since
        raise ValueError("prompt_ids do not start with the prompt this cache was built from (ids or prompt_sha256 "
                         "differ)")
    cache.check_model(model)  # the file records this model's fingerprint: it must be the cache's own
    group = cache.heads  # a tensor-parallel model's ranks write one file together, from rank 0
    on_writer(group, check_output_path, path)
    tensors = {"pads": cache.pads.cpu()}
    try:  # the reader's own checks of what it reads (never write a file that load_cache refuses)
        check_pads("the cache", tensors["pads"], batch, logical)
        for i, layer in enumerate(cache.layers):  # the held entries only, packed (cache_file.pack_layer)
            packed = pack_layer(*every_head(group, layer))
            check_positions("the cache", i, packed["positions"], packed["counts"], logical)
            try:
                packed = quantize_layer(packed, quantize)
            except ValueError as err:  # a non-finite entry under quantize="int8": nothing written
                raise ValueError(f"layer {i}: {err}") from None
            tensors.update({f"layers.{i}.{name}": t for name, t in packed.items()})
    except CacheFileError as err:
        raise ValueError(f"save_cache refuses to write {os.fspath(path)!r}, which load_cache would reject: "
                         f"{err}") from None
    if store_ids:
        tensors["prompt_ids"] = prompt_ids.detach().to("cpu", torch.int64).contiguous()
    from ..version import __version__

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
        "selection_route": selection_route(cache.config, prefill_evicted(cache), chunked_prefill(cache)),
    }
    if format_json is not None:
        metadata["prompt_format"] = format_json
    if quantize is not None:
        metadata["quantization"] = quantize
    metadata["metadata_sha256"] = metadata_sha256(metadata)
    data = canonical_header(save(tensors, metadata=metadata))  # the same cache, the same bytes
    on_writer(group, _write, path, data)
    return len(data)


def _write(path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically; ``OSError`` naming ``path``."""
    try:
        write_atomically(path, data)
    except OSError as err:  # name the user's path, not the temporary file
        message = f"cannot write the cache file {os.fspath(path)!r}: {err.strerror or err}"
        raise (OSError(err.errno, message) if err.errno is not None else type(err)(message)) from err


def every_head(group, layer) -> tuple:
    """``layer.export()`` of every KV head: on a rank of a tensor-parallel model whose heads are split
    (:class:`~jacap_attn.storage.distributed.HeadGroup`), each rank's ``[b, h, K_r(, d)]`` gathered to
    ``[b, H, max K_r(, d)]`` (a collective: every rank calls it), what one process holding every head
    exports; else the layer's own export."""
    return tuple(group.gather_padded(list(layer.export())))


def on_writer(group, action, *args):
    """Run ``action(*args)`` on the writing rank of ``group`` (rank 0 of a tensor-parallel model; the
    process itself without one) and raise its exception, if any, on every rank: the ranks of a sharded
    model write one file and fail together (docs/cache.md#tensor-parallel-models)."""
    if not group.distributed:
        return action(*args)
    error = None
    if group.is_writer():
        try:
            action(*args)
        except Exception as err:  # shared with the other ranks, raised on all
            error = err
    error = group.share(error)
    if error is not None:
        raise error


def load_cache(path, model, *, device=None, dtype: torch.dtype | None = None,
               reselect: float | bool | None = None, tokenizer=None) -> JacapCache:
    """Load a cache saved by :func:`save_cache` for ``model``.

    ``device`` (default: each layer's own device) and ``dtype`` (default: the saved dtype, which
    must equal the model's; pass ``dtype=`` the model's dtype to cast a file saved in another; any
    other ``dtype`` is a ``ValueError``, raised before the entries are built). The returned cache continues exactly:
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
    (``jacap_attn.patch(model, ratio=<the file's>, method=<the file's>, ..., tokenizer=tokenizer)``), so later
    prefills compress as the file was compressed; ``jacap_attn.patch`` again to change that. ``tokenizer``
    gives that patch the vocabulary for word spans (and the repeat instruction) where the model's folder has
    none, e.g. a model built in memory; a patched model keeps its own.

    Raises :class:`CacheFileError` (a ``ValueError``) naming the field that does not fit: another
    model (model_type, layers, heads, KV heads, head dim, rope parameters, ...), another model of the
    same shape (``weights_sha256``: other weights, e.g. base vs instruct, a merged adapter), another
    dtype, an unknown format version, a truncated or corrupted file, an edited header
    (``metadata_sha256``), tensors whose shapes disagree with the metadata; ``ValueError`` for a bad
    ``reselect`` or a model of an unsupported family. Nothing is changed on the model when it raises
    (a model patched here is unpatched again). A file without ``weights_sha256`` (saved by an older
    version) loads with a warning: which weights made it cannot be checked. On a tensor-parallel model every
    rank reads ``path``: a rank that cannot read it raises its error on every rank, and ranks that read
    different files are a ``ValueError`` on every rank (before: a hang in the first collective).
    """
    return load_cache_and_metadata(path, model, device=device, dtype=dtype, reselect=reselect, tokenizer=tokenizer)[0]


def load_cache_and_metadata(path, model, *, device=None, dtype: torch.dtype | None = None,
                            reselect: float | bool | None = None, tokenizer=None) -> tuple[JacapCache, dict]:
    """:func:`load_cache`, and the file's checked header metadata (:func:`read_cache_metadata`'s dict) from the
    same read as its tensors: a file replaced meanwhile (an atomic save) is one version, never the header of
    one and the entries of another (:meth:`jacap_attn.Document.load` reads its ``prompt_format`` from it)."""
    from ..patching import patch, unpatch

    if dtype is not None and not isinstance(dtype, torch.dtype):  # e.g. "float32": checked before any read
        raise ValueError(f"dtype must be a torch.dtype (e.g. torch.{dtype} for {dtype!r}) or None, got dtype={dtype!r}")
    group = head_group(model)  # a tensor-parallel model's ranks read one file: they fail, or load it, together
    try:
        metadata, tensors = read_cache_file(path)
        config, error = file_config(path, metadata), None
    except (OSError, ValueError) as err:  # e.g. a file missing on one rank's disk
        error = err
    group.raise_any(error)
    group.agree((metadata["tensors_sha256"], metadata.get("metadata_sha256")), f"the cache file {os.fspath(path)!r} "
                "(its tensors_sha256 and metadata_sha256: every rank must read the same file)")
    patched_here = getattr(model, "_jacap_state", None) is None
    deferred = []  # the temporary patch's warnings: said only once the file is known to fit the model
    if patched_here:
        names = COMMON_OPTIONS if config.method.compresses else _FULL_OPTIONS
        with warnings.catch_warnings(record=True) as deferred:
            warnings.simplefilter("always")
            patch(model, ratio=config.ratio, method=config.method, tokenizer=tokenizer,
                  **{name: getattr(config, name) for name in names})
    try:
        cache = _load(path, model, metadata, tensors, config, device=device, dtype=dtype, reselect=reselect,
                      warn=not patched_here)
    except BaseException:
        if patched_here:
            unpatch(model)
        raise
    for caught in deferred:
        warnings.warn(caught.message, caught.category, stacklevel=3)
    return cache, metadata


def decode_budget(config: JacapConfig) -> float:
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
    # Files of formats 1 and 2 hold the fingerprint of their time (slices of the weights).
    if metadata.get("format_version") in PACKED_VERSIONS:
        current_weights = weights_fingerprint(model)
    else:
        current_weights = legacy_weights_fingerprint(model, model._jacap_state.adapter.decoder_layers(model))
    saved_weights = metadata.get("weights_sha256")
    if saved_weights is None:
        warnings.warn(f"{path}: no 'weights_sha256' in the file (saved by an older jacap_attn): cannot check that "
                      "this model's weights made the cache", UserWarning, stacklevel=4)
    elif saved_weights != current_weights:
        # A copy of the same weights in another dtype can fingerprint differently (float16 rounds other bits):
        # name the dtype that wrote the file rather than suggest other weights.
        cast = saved.get("dtype") != current["dtype"]
        hint = (f"the file was written by a {saved.get('dtype')} model and this one is {current['dtype']}, whose "
                f"copy of the weights can fingerprint differently: load the model in {saved.get('dtype')} (or "
                "float32) to use this file") if cast else "same shape, other weights?"
        raise CacheFileError(f"{path}: cache is for another model: field 'weights_sha256' is {saved_weights[:16]}..., "
                             f"this model's weights give {current_weights[:16]}... ({hint})")
    if dtype is None and saved.get("dtype") != current["dtype"]:
        raise CacheFileError(f"{path}: field 'dtype' is {saved.get('dtype')!r} but the model is {current['dtype']!r}; "
                             "pass dtype= to cast")
    if dtype is not None and dtype_name(dtype) != current["dtype"]:
        # The attention reads the cache's keys with the model's queries: one dtype for both.
        raise ValueError(f"dtype={dtype} is not the model's dtype ({current['dtype']}): a cache is cast to the dtype "
                         "of the model that continues it; cast the model, or pass its dtype")
    layers = []
    kv_heads, head_dim = current["num_key_value_heads"], current["head_dim"]
    packed = metadata.get("format_version") in PACKED_VERSIONS
    file_dtype = getattr(torch, str(saved.get("dtype")), None)
    file_dtype = file_dtype if isinstance(file_dtype, torch.dtype) else None
    layer_names = PACKED_LAYER_TENSORS if packed else PADDED_LAYER_TENSORS
    known = {"pads", "prompt_ids"} | {f"layers.{i}.{name}" for i in range(current["num_hidden_layers"])
                                      for name in layer_names}
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise CacheFileError(f"{path}: unexpected tensor {unknown[0]!r} (this file holds tensors its header does not "
                             "describe)")
    for i in range(current["num_hidden_layers"]):
        layers.append(unpack_layer(path, i, tensors, batch, kv_heads, head_dim, logical, file_dtype) if packed
                      else _padded_layer(path, i, tensors, batch, kv_heads, head_dim, logical, file_dtype))
    pads = tensors.get("pads")
    check_pads(path, pads, batch, logical)
    prompt_ids = tensors.get("prompt_ids")
    if prompt_ids is not None and prompt_ids.dtype != torch.int64:
        raise CacheFileError(f"{path}: tensor 'prompt_ids' has dtype {prompt_ids.dtype}: token ids are int64")
    if prompt_ids is not None and (tuple(prompt_ids.shape) != (batch, logical) or ids_sha256(prompt_ids) != metadata.get("prompt_sha256")):
        raise CacheFileError(f"{path}: field 'prompt_sha256' does not match tensor 'prompt_ids'")

    if reselect is not None:  # validated by JacapConfig (ValueError naming a bad value)
        config = dataclasses.replace(config, reselect=None if reselect is False else reselect)
    patched = model._jacap_state.config
    if warn and reselect is None and (patched.method.name, decode_budget(patched)) != \
            (config.method.name, decode_budget(config)):
        warnings.warn(f"{path}: the loaded cache answers with the file's settings (method {config.method.name!r}, "
                      f"decode budget {decode_budget(config)}), not the patched model's (method "
                      f"{patched.method.name!r}, decode budget {decode_budget(patched)}), which apply to new "
                      "prefills only; pass reselect= to choose the decode budget", UserWarning, stacklevel=4)
    attention = model._jacap_state.adapter.attention_modules(model)
    group = model._jacap_state.heads  # a tensor-parallel rank keeps its own KV heads of the file's
    placed = []
    for (keys, values, positions, valid), module in zip(layers, attention):
        target = device if device is not None else next(module.parameters()).device
        cast = dtype if dtype is not None else keys.dtype
        keys, values, positions, valid = (group.local(t) for t in (keys, values, positions, valid))
        placed.append((keys.to(target, cast), values.to(target, cast), positions.to(target), valid.to(target)))
    cache = JacapCache.from_kept(model, placed, logical=logical, pads=pads, config=config, prompt_ids=prompt_ids)
    cache.prompt_sha256 = metadata.get("prompt_sha256")
    return cache


def check_pads(path, pads: torch.Tensor | None, batch: int, logical: int) -> None:
    """``pads`` is ``[batch]`` int64 left paddings in ``[0, logical)``; else a :class:`CacheFileError`
    naming the tensor. Run by the reader (:func:`load_cache`) and the writer (:func:`save_cache`, before
    writing), with :func:`jacap_attn.files.cache_file.check_positions`."""
    if pads is None or tuple(pads.shape) != (batch,):
        raise CacheFileError(f"{path}: tensor 'pads' is missing or has the wrong shape")
    if pads.dtype != torch.int64 or bool(((pads < 0) | (pads >= logical)).any()):
        raise CacheFileError(f"{path}: tensor 'pads' must hold int64 left paddings in [0, logical_length={logical}), "
                             f"got {pads.tolist()} ({pads.dtype})")


def _padded_layer(path, index: int, tensors: dict, batch: int, kv_heads: int, head_dim: int, logical: int,
                  dtype: torch.dtype | None = None):
    """``(keys, values, positions, valid)`` of layer ``index`` of a format 1 or 2 file (padded
    ``[b, h, K(, d)]``), checked against the header (keys and values in ``dtype`` when given);
    :class:`CacheFileError` naming the tensor."""
    try:
        keys, values, positions, valid = (tensors[f"layers.{index}.{name}"] for name in PADDED_LAYER_TENSORS)
    except KeyError as err:
        raise CacheFileError(f"{path}: tensor {err.args[0]!r} is missing") from None
    k = keys.shape[2] if keys.dim() == 4 else -1
    expected = {"keys": (batch, kv_heads, k, head_dim), "values": (batch, kv_heads, k, head_dim),
                "positions": (batch, kv_heads, k), "valid": (batch, kv_heads, k)}
    for name, tensor in (("keys", keys), ("values", values), ("positions", positions), ("valid", valid)):
        if tuple(tensor.shape) != expected[name]:
            raise CacheFileError(f"{path}: tensor 'layers.{index}.{name}' has shape {tuple(tensor.shape)}, "
                                 f"metadata says {expected[name]}")
    _check_entry_dtypes(path, index, keys, values, positions, dtype)
    if valid.dtype != torch.bool:
        raise CacheFileError(f"{path}: tensor 'layers.{index}.valid' has dtype {valid.dtype}, not bool")
    if bool((positions[valid] >= logical).any()):
        raise CacheFileError(f"{path}: tensor 'layers.{index}.positions' holds positions beyond logical_length={logical}")
    return keys, values, positions, valid


def chunked_prefill(cache) -> bool:
    """Whether the cache's prompt was prefilled in more than one chunk (``chunk_size`` or ``prefill_chunk_size``)."""
    chunk = cache.chunk_in_force
    return chunk is not None and (cache.prompt_length or 0) > chunk


def prefill_evicted(cache) -> bool:
    """Whether the prefill's cut dropped a prompt entry that a stock cache would hold: some layer and
    KV head kept fewer than the row's real tokens (a sliding-window layer: fewer than its window
    reaches). ``True`` when the cache does not record what its prefill kept."""
    if cache.prompt_kept is None or cache.prompt_length is None:
        return True
    for layer, kept in zip(cache.layers, cache.prompt_kept):
        if kept.numel() == 0:
            continue
        seen = cache.prompt_length - layer.pads.cpu()[:, None]  # [b, 1]
        reach = seen.clamp(max=layer.sliding_window - 1) if layer.is_sliding else seen
        if bool((kept.cpu() < reach).any()):
            return True
    return False
