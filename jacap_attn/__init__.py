"""jacap_attn: prefill-time KV-cache compression for Hugging Face transformers with Jacap.

    import jacap_attn
    jacap_attn.patch(model, ratio=0.1)      # keep 10% of every prompt's KV entries
    model.generate(input_ids, attention_mask=mask, max_new_tokens=32)

``ratio`` is the kept fraction. See README.md and docs/ for the method and the architecture.
"""

import importlib.util as _util
import pathlib as _pathlib
import sys as _sys


def _adapters_from_working_tree() -> None:
    """Installed, ``jacap_attn.patches`` is the repository's top-level ``patches/`` folder (mapped by
    pyproject.toml). In a working tree that is not installed (the GPU machine's bare copy), map it
    here, so ``import jacap_attn`` works from the repository root."""
    if _util.find_spec(f"{__name__}.patches") is not None:
        return
    folder = _pathlib.Path(__file__).resolve().parent.parent / "patches"
    spec = _util.spec_from_file_location(f"{__name__}.patches", folder / "__init__.py",
                                         submodule_search_locations=[str(folder)])
    if spec is None:  # pragma: no cover - a broken checkout
        raise ImportError(f"jacap_attn.patches is not installed and {folder} is missing")
    module = _util.module_from_spec(spec)
    _sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    globals()["patches"] = module  # what the import system does for an installed subpackage


_adapters_from_working_tree()

from . import methods  # noqa: E402
from .storage.cache import JacapCache, JacapLayer  # noqa: E402
from .config import JacapConfig  # noqa: E402
from .document import Document  # noqa: E402
from .methods import Method, register  # noqa: E402
from .patching import compress, is_patched, patch, unpatch  # noqa: E402
from .files.persist import CacheFileError, load_cache, save_cache  # noqa: E402
from .version import __version__  # noqa: E402

__all__ = [
    "CacheFileError",
    "compress",
    "Document",
    "load_cache",
    "save_cache",
    "JacapCache",
    "JacapConfig",
    "JacapLayer",
    "Method",
    "methods",
    "register",
    "is_patched",
    "patch",
    "unpatch",
    "__version__",
]
