"""Start-up hook that lets the stock ``lm_eval`` command (lm-evaluation-harness 0.4.13) find ``hf-jacap``
and the tasks shipped with jacap_attn (``jacap_attn/tasks``: ``jacap_single_needle``).

lm-eval 0.4.13 fills its model registry only by importing ``lm_eval.models``; it reads no plug-in
entry points (newer lm-eval reads the ``lm_eval.models`` group that jacap-attn declares).
``jacap_attn_lm_eval.pth``, installed next to this module, imports it at interpreter start-up, which
adds one finder to ``sys.meta_path`` and imports nothing else (no torch, no lm_eval). The first time
a program imports ``lm_eval.models``, the finder lets that import run and then registers jacap-attn's
``lm_eval.models`` entry points as lazy registry entries, as newer lm-eval does: jacap_attn and
torch are imported only when an evaluation asks for ``hf-jacap``. The first time a program imports
``lm_eval.tasks.manager``, it makes ``TaskManager`` index the shipped tasks' folder too (found by
path, without importing jacap_attn), after lm-eval's own tasks and before any ``--include_path``, so
``lm_eval --tasks jacap_single_needle`` works from any folder with no ``--include_path``. Once both
were seen the finder removes itself. It never makes an import fail.
"""

import sys

_DISTRIBUTION = "jacap-attn"
_GROUP = "lm_eval.models"


def register_entry_points(module=None):
    """Register this distribution's ``lm_eval.models`` entry points that lm-eval does not know yet
    (``module``, the imported ``lm_eval.models``, is not read)."""
    try:
        from importlib.metadata import distribution

        from lm_eval.api.registry import model_registry

        for entry_point in distribution(_DISTRIBUTION).entry_points:
            if entry_point.group == _GROUP and entry_point.name not in model_registry:
                model_registry.register(entry_point.name, target=entry_point)
    except Exception:  # another lm-eval layout, or metadata gone: leave lm-eval alone
        pass


def tasks_path():
    """The folder of the lm-eval tasks shipped with jacap_attn (``jacap_attn/tasks``), found without
    importing jacap_attn (no torch at start-up); ``None`` when it is not there."""
    try:
        import importlib.util
        import os

        spec = importlib.util.find_spec("jacap_attn")
        for location in (spec.submodule_search_locations or []) if spec else []:
            folder = os.path.join(location, "tasks")
            if os.path.isfile(os.path.join(folder, "__init__.py")):
                return folder
    except Exception:  # a broken install: lm-eval runs without our tasks
        pass
    return None


def register_tasks(manager_module):
    """Make every ``TaskManager`` of ``manager_module`` (``lm_eval.tasks.manager``) built with lm-eval's
    default tasks also index :func:`tasks_path`, after the defaults and before any ``include_path``
    (whose tasks of the same name then win, as lm-eval's later paths do). Once per class."""
    try:
        import functools
        import inspect

        cls = manager_module.TaskManager
        original = cls.__init__
        folder = tasks_path()
        if folder is None or getattr(original, "_jacap_tasks", False):
            return
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            if bound.arguments.get("include_defaults", True):
                given = bound.arguments.get("include_path")
                given = list(given) if isinstance(given, (list, tuple)) else [given] if given else []
                bound.arguments["include_path"] = [folder, *given]
            original(*bound.args, **bound.kwargs)

        __init__._jacap_tasks = True
        cls.__init__ = __init__
    except Exception:  # another lm-eval layout: leave lm-eval alone
        pass


_WATCHED = {"lm_eval.models": register_entry_points, "lm_eval.tasks.manager": register_tasks}


class _LmEvalModelsFinder:
    """Meta-path finder that watches for the first import of ``lm_eval.models`` (then registers
    ``hf-jacap``) and of ``lm_eval.tasks.manager`` (then adds the shipped tasks), and leaves once both
    were seen."""

    def __init__(self):
        self.pending = set(_WATCHED)

    def find_spec(self, name, path=None, target=None):
        if name not in self.pending:
            return None
        self.pending.discard(name)
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_module_then_register(module):
            exec_module(module)
            _WATCHED[name](module)

        loader.exec_module = exec_module_then_register
        return spec


def install():
    """Add the finder (once per interpreter)."""
    if not any(isinstance(finder, _LmEvalModelsFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LmEvalModelsFinder())


install()
