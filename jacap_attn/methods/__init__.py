"""Compression methods, one frozen dataclass each, registered by name (docs/architecture.md#methods).

    from dataclasses import dataclass
    from jacap_attn.methods import Method, register

    @register("neg_knorm")
    @dataclass(frozen=True)
    class NegKNorm(Method):
        def score(self, inputs):             # inputs.keys: [b, h, n, d]
            return inputs.keys.float().norm(dim=-1)

    jacap_attn.patch(model, ratio=0.1, method="neg_knorm")
"""

from .base import Method, PrefillInputs, get_method, names, option, register, unregister
from .jacap import Jacap  # noqa: I001 - registration order: jacap first, then the baselines
from .full import Full
from .streaming_llm import StreamingLLM
from .random import Random
from .knorm import KNorm
from .snapkv import SnapKV
from .pyramidkv import PyramidKV
from .h2o import H2O
from .tova import TOVA
from .keydiff import KeyDiff
from .capkv import CapKV
from .adakv import AdaKV
from .kvzip import KVzip

__all__ = ["Method", "PrefillInputs", "get_method", "names", "option", "register", "unregister", "Jacap", "SnapKV",
           "PyramidKV", "AdaKV", "Full", "StreamingLLM", "Random", "KNorm", "KeyDiff", "H2O", "TOVA", "CapKV", "KVzip"]
