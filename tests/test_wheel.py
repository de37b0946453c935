"""The wheel: built from a copy of the working tree, installed into a fresh venv, used outside the tree.

``pip wheel`` builds it as a user would (in an isolated build environment: setuptools from the index),
from a copy of the files git tracks or leaves unignored, so that no ``build/`` or ``*.egg-info`` of a
checkout leaks into it. The wheel must hold every ``.py`` of ``jacap_attn/`` and ``patches/`` (as
``jacap_attn.patches``), the lm-eval start-up hook and its ``.pth``, and nothing of ``eval/``,
``tools/`` or ``tests/``. A fresh venv outside the tree gets torch 2.13.0 (the CPU wheel) and then the
wheel with its dependencies; a script run from a scratch folder imports jacap_attn from that venv and
runs patch -> compress -> save_cache -> generate -> load_cache -> generate on a tiny random Llama.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

import jacap_attn
from conftest import COMMON, FAMILIES, child_env, copy_working_tree, library_files

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the CPU wheel on the development machines (as in the Makefile)
# The lm-eval start-up hook and the .pth that imports it: at the wheel's top level, beside jacap_attn/.
HOOK_MODULE, HOOK_PTH = "_jacap_attn_lm_eval.py", "jacap_attn_lm_eval.pth"
OUTSIDE_LIBRARY = ("eval", "tools", "tests")

# Runs in the fresh venv, from a scratch folder. argv: the venv's prefix, the tiny Llama's config (JSON).
SCRIPT = r"""
import sys
hook_at_start_up = "_jacap_attn_lm_eval" in sys.modules  # imported by jacap_attn_lm_eval.pth
import importlib.metadata, json, os
import torch, transformers
import jacap_attn, jacap_attn.patches

venv, config = os.path.realpath(sys.argv[1]) + os.sep, json.loads(sys.argv[2])
for module in (jacap_attn, jacap_attn.patches, jacap_attn.methods):
    assert os.path.realpath(module.__file__).startswith(venv), f"{module.__name__} from {module.__file__}"
assert hook_at_start_up, "jacap_attn_lm_eval.pth did not import _jacap_attn_lm_eval at start-up"
assert jacap_attn.__version__ == importlib.metadata.version("jacap-attn"), jacap_attn.__version__

torch.manual_seed(0)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
jacap_attn.patch(model, ratio=0.25, window=8)
gen = torch.Generator().manual_seed(1)
prompt = torch.randint(3, config["vocab_size"], (1, 80), generator=gen)
ids = torch.cat([prompt, torch.randint(3, config["vocab_size"], (1, 5), generator=gen)], dim=1)

def answer(cache):
    out = model.generate(ids, cache=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    return out[:, ids.shape[1]:]

cache = jacap_attn.compress(model, prompt)
jacap_attn.save_cache(cache, "cache.safetensors", model=model, prompt_ids=prompt)
first = answer(cache)
again = answer(jacap_attn.load_cache("cache.safetensors", model))
assert torch.equal(first, again), (first, again)
assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, ids.shape[1] + 3)
print("WHEEL_OK", jacap_attn.__version__, first.tolist())
"""


def _run(command, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` with :func:`conftest.child_env`, failing the test with the command's output."""
    proc = subprocess.run([str(part) for part in command], env=child_env(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{command} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def test_version_is_one_literal_read_statically():
    """``jacap_attn/version.py`` imports nothing, and setuptools reads ``__version__`` from its syntax
    tree (``StaticModule``, as ``[tool.setuptools.dynamic]`` does first) without running any code."""
    from setuptools.config.expand import StaticModule

    path = ROOT / "jacap_attn" / "version.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    assert not [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    spec = importlib.util.spec_from_file_location("jacap_attn.version", path)
    assert StaticModule("jacap_attn.version", spec).__version__ == jacap_attn.__version__
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" in pyproject["project"]["dynamic"] and "version" not in pyproject["project"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "jacap_attn.version.__version__"}


@pytest.mark.slow  # a wheel, a venv, torch and the dependencies from pip's cache: 56-81 s on 2 shared CPU cores
def test_wheel_installs_and_runs_outside_the_tree(tmp_path):
    assert not tmp_path.resolve().is_relative_to(ROOT)
    started = time.perf_counter()
    tree, dist, venv, work = (tmp_path / name for name in ("tree", "dist", "venv", "work"))
    copy_working_tree(ROOT, tree)
    proc = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--verbose", "--wheel-dir", dist, tree], timeout=600)
    [wheel] = dist.glob("jacap_attn-*.whl")
    # setuptools warns of a data folder importable as a package but left out of `packages`.
    assert "absent from the `packages`" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    built = time.perf_counter()

    names = zipfile.ZipFile(wheel).namelist()
    sources = {name for name in names if name.endswith(".py")}
    expected = {*library_files(tree), HOOK_MODULE}
    assert not expected - sources, f"missing from the wheel (a folder without __init__.py is no package): " \
                                   f"{sorted(expected - sources)}"
    assert not sources - expected, f"in the wheel but not in the tree: {sorted(sources - expected)}"
    assert not [name for name in names if name.split("/")[0] in OUTSIDE_LIBRARY]
    # The lm-eval tasks shipped with the package: their YAMLs and data (package-data in pyproject.toml).
    shipped = {path.relative_to(tree).as_posix() for path in (tree / "jacap_attn" / "tasks").rglob("*")
               if path.is_file() and path.suffix != ".py"}
    assert shipped and not shipped - set(names), f"missing from the wheel: {sorted(shipped - set(names))}"
    top = {name.split("/")[0] for name in names}
    assert top == {"jacap_attn", f"jacap_attn-{jacap_attn.__version__}.dist-info", HOOK_MODULE, HOOK_PTH}

    _run([sys.executable, "-m", "venv", venv], timeout=300)
    python = venv / "bin" / "python"
    _run([python, "-m", "pip", "install", "--quiet", "--no-compile", TORCH], timeout=600)
    _run([python, "-m", "pip", "install", "--quiet", "--no-compile", wheel], timeout=600)
    installed = time.perf_counter()

    work.mkdir()
    proc = _run([python, "-c", SCRIPT, venv, json.dumps({**COMMON, **FAMILIES["llama"][2]})], cwd=work, timeout=600)
    assert "WHEEL_OK" in proc.stdout
    assert "usage" in _run([venv / "bin" / "jacap", "--help"], cwd=work, timeout=300).stdout
    print(f"wheel test: build {built - started:.0f} s, venv + install {installed - built:.0f} s, "
          f"run {time.perf_counter() - installed:.0f} s")
