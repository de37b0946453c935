"""jacap_attn: prefill-time KV-cache compression for Hugging Face transformers with Jacap.

    import jacap_attn
    jacap_attn.patch(model, ratio=0.1)      # keep 10% of every prompt's KV entries
    model.generate(input_ids, attention_mask=mask, max_new_tokens=32)

``ratio`` is the kept fraction. See README.md and DESIGN.md for the method.
"""

from .cache import JacapCache, JacapLayer
from .config import METHODS, JacapConfig
from .patching import compress, is_patched, patch, unpatch
from .persist import CacheFileError, load_cache, save_cache

__version__ = "0.1.0"

__all__ = [
    "CacheFileError",
    "compress",
    "load_cache",
    "save_cache",
    "JacapCache",
    "JacapConfig",
    "JacapLayer",
    "METHODS",
    "is_patched",
    "patch",
    "unpatch",
    "__version__",
]
