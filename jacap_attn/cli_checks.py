"""The ``jacap`` command's checks of what a user gives (:mod:`jacap_attn.cli`): each a ``ValueError`` naming the
flag or file, run before the model loads (counts, ``--model``, questions, the prompt file, the output path and
what it would replace, a cache file's settings), or, for a prompt's length against the model's context, once it
has loaded and before any prefill."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def _check_count(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


DEMO_MIN_TOKENS = 64  # the shortest demo document `jacap run --context-tokens` builds, checked before the model loads


def _check_demo_length(tokens: int) -> None:
    """``ValueError`` for a ``jacap run --context-tokens`` below :data:`DEMO_MIN_TOKENS` (the demo's two needles alone
    take about 30 tokens, 27 with SmolLM2's tokenizer; shorter is refused only once the tokenizer loads)."""
    if tokens < DEMO_MIN_TOKENS:
        raise ValueError(f"--context-tokens must be at least {DEMO_MIN_TOKENS} (the demo document's two needles and "
                         f"some text around them), got {tokens}")


def _check_model_name(name: str) -> None:
    """``ValueError`` naming ``--model`` unless it is an embedded model name, a model folder or a
    ``.gguf`` file (:func:`jacap_attn.models.check_model_path`)."""
    from .models import check_model_path

    try:
        check_model_path(name)
    except ValueError as err:
        raise ValueError(f"--model {err}") from None


def _check_questions(questions) -> None:
    for question in questions:
        if not question.strip():
            raise ValueError(f"--question {question!r} is empty: ask something")


def _read_document(path) -> str:
    """The text of ``--prompt-file``; ``ValueError`` naming it when it is empty or whitespace only (nothing
    to compress: no cache is written) or not UTF-8 text."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError, PermissionError) as err:
        raise ValueError(f"--prompt-file {path!r}: {err.strerror.lower() if err.strerror else err}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"--prompt-file {path!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    if not text.strip():
        raise ValueError(f"--prompt-file {path!r} is empty{' (whitespace only)' if text else ''}: nothing to "
                         "compress, no cache file written")
    return text


def _document_source(model: str, *, text: str | None = None, raw: bool = False, demo: dict | None = None) -> str:
    """SHA-256 naming what a saved document is made of, known before anything loads: ``--model`` as
    given and the prompt file's text with its layout (``--raw``), or the demo document's settings.
    ``jacap compress`` and ``jacap run`` store it in the file's ``prompt_format`` (``"source"``), so a
    later run tells, before the model loads, whether ``--out`` holds the same document."""
    key = {"model": model, "text": text, "raw": bool(raw), "demo": demo}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _check_out(path, force: bool, option: str, source: str, inputs: dict | None = None) -> None:
    """Check ``path`` (``--out`` / ``--cache-out``) before any work, the model's loading included: a
    file that can be written (the user's path named otherwise), and, unless ``force``, not a file
    that holds anything but the cache of the same document (``source``, :func:`_document_source`): a
    cache of another document, one not written by ``jacap`` from the same source, or a file that is no
    cache at all is replaced only with ``--force``; the same document is recompressed in place.
    ``inputs`` (``{flag: path}``, e.g. ``--prompt-file``, ``--model``) are never replaced, even with
    ``--force``: ``path`` the same file as one of them, or an existing file inside a ``--model`` folder
    that is not a jacap cache, is a ``ValueError`` naming both."""
    from .files.persist import CacheFileError, check_output_path, read_cache_metadata

    try:
        check_output_path(path)
    except ValueError as err:
        raise ValueError(f"{option}: {err}") from None
    if not os.path.exists(path):
        return
    try:  # the header alone, read once for both checks below
        metadata = read_cache_metadata(path)
    except CacheFileError:
        metadata = None
    _check_not_an_input(path, option, inputs or {}, is_cache=metadata is not None)
    if force:
        return
    if metadata is None:
        raise ValueError(f"{option} {os.fspath(path)!r} exists and is not a jacap cache file; pass --force to "
                         "replace it")
    try:
        same = json.loads(metadata.get("prompt_format", "{}")).get("source") == source
    except (ValueError, AttributeError):
        same = False
    if not same:
        raise ValueError(f"{option} {os.fspath(path)!r} holds the cache of another document (or one not written by "
                         "jacap from this document and --model); pass --force to replace it, or choose another file")


def _check_not_an_input(path, option: str, inputs: dict, *, is_cache: bool) -> None:
    """``ValueError`` if the existing file ``path`` is one of ``inputs`` (``{flag: path}``) or, unless
    ``is_cache`` (a jacap cache saved beside the model's files may be replaced), a file inside a folder
    given as ``--model`` (its weights, config or tokenizer; an embedded model's converted folder too)."""
    from .models import MODELS, model_dir

    for flag, given in inputs.items():
        given = str(model_dir(given)) if flag == "--model" and given in MODELS else given
        if given is None or not os.path.exists(given):
            continue
        inside = os.path.isdir(given) and Path(path).resolve().is_relative_to(Path(given).resolve())
        if (inside and not is_cache) or (not inside and os.path.samefile(path, given)):
            raise ValueError(f"{option} {os.fspath(path)!r} is {'a file of' if inside else 'the same file as'} "
                             f"{flag} {os.fspath(given)!r}: it would be overwritten by the cache; choose another "
                             "file (--force does not replace a command's own input)")


def _check_context(model, tokens: int, what: str) -> None:
    """``ValueError`` naming ``what`` if ``tokens`` (a prompt and its answer's room) exceed the model's context
    (:func:`jacap_attn.models.context_limit`): after the model loads, before a too-long prompt's prefill."""
    from .models import context_limit

    limit = context_limit(model)
    if limit and tokens > limit:
        raise ValueError(f"{what}: {tokens:,} tokens, beyond the model's context of {limit:,} "
                         "(config.max_position_embeddings); shorten it")


def _check_file_settings(path, reselect, model: str | None = None) -> dict:
    """The header of the cache file ``path`` (format and header checksum verified; the tensors are
    checked when it loads) and, before the model loads (or is fetched), that ``--reselect`` is valid for
    its method, that ``--model`` (an embedded one, or a folder by its config.json) is of the file's
    ``model_type`` and that the file holds its prompt's ids (which a question is appended to)."""
    import dataclasses

    from .files.persist import file_config, read_cache_header
    from .models import MODELS

    metadata, tensor_names = read_cache_header(path)  # one read: the header's fields and its tensors' names
    config = file_config(path, metadata)
    try:
        recorded = json.loads(metadata["model"]).get("model_type")
    except (KeyError, TypeError, ValueError, AttributeError):
        recorded = None  # the model check of load_cache names what is wrong
    given = MODELS[model].model_type if model in MODELS else _folder_model_type(model)
    if given is not None and recorded is not None and recorded != given:
        raise ValueError(f"{path}: cache is for another model: field 'model_type' is {recorded!r}, --model {model} "
                         f"is {given!r}")
    if reselect is not None:
        try:
            dataclasses.replace(config, reselect=reselect)
        except ValueError as err:
            raise ValueError(f"--reselect: {err}") from None
    if "prompt_ids" not in tensor_names:
        raise ValueError(f"{path} was saved without its prompt ids (store_ids=False), which a question is appended "
                         "to: from Python, Document.load(path, model, prompt_ids=<the prompt's ids>)")
    return metadata


def _folder_model_type(model) -> str | None:
    """The ``model_type`` in a ``--model`` folder's ``config.json`` (read before the model loads), else ``None``."""
    try:
        config = json.loads((Path(model).expanduser() / "config.json").read_text())
    except (OSError, TypeError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None
