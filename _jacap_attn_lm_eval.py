"""Start-up hook that lets the stock ``lm_eval`` command (lm-evaluation-harness 0.4.13) find ``hf-jacap``.

lm-eval 0.4.13 fills its model registry only by importing ``lm_eval.models``; it reads no plug-in
entry points (newer lm-eval reads the ``lm_eval.models`` group that jacap-attn declares).
``jacap_attn_lm_eval.pth``, installed next to this module, imports it at interpreter start-up, which
adds one finder to ``sys.meta_path`` and imports nothing else (no torch, no lm_eval). The first time
a program imports ``lm_eval.models``, the finder lets that import run and then registers jacap-attn's
``lm_eval.models`` entry points as lazy registry entries, as newer lm-eval does: jacap_attn and
torch are imported only when an evaluation asks for ``hf-jacap``. The finder then removes itself.
It never makes an import fail.
"""

import sys

_DISTRIBUTION = "jacap-attn"
_GROUP = "lm_eval.models"


def register_entry_points():
    """Register this distribution's ``lm_eval.models`` entry points that lm-eval does not know yet."""
    try:
        from importlib.metadata import distribution

        from lm_eval.api.registry import model_registry

        for entry_point in distribution(_DISTRIBUTION).entry_points:
            if entry_point.group == _GROUP and entry_point.name not in model_registry:
                model_registry.register(entry_point.name, target=entry_point)
    except Exception:  # another lm-eval layout, or metadata gone: leave lm-eval alone
        pass


class _LmEvalModelsFinder:
    """Meta-path finder that watches for the first import of ``lm_eval.models`` only."""

    def find_spec(self, name, path=None, target=None):
        if name != "lm_eval.models":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_module_then_register(module):
            exec_module(module)
            register_entry_points()

        loader.exec_module = exec_module_then_register
        return spec


def install():
    """Add the finder (once per interpreter)."""
    if not any(isinstance(finder, _LmEvalModelsFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LmEvalModelsFinder())


install()
