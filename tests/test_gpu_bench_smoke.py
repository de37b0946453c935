"""``tools/gpu_bench.py --smoke`` from a bare copy of the working tree, on CPU.

The GPU machine gets the repository's files (those git tracks, and untracked ones it does not
ignore), not an installed package. Here the development venv has an editable install whose import
hook (``__editable__*_finder.py``, appended to ``sys.meta_path`` by a ``.pth`` file) would import
``jacap_attn`` (and ``jacap_attn.patches``) from this checkout whenever the copy lacks a module. The
child process therefore removes that hook before running the copied script, and then reports where
``jacap_attn`` came from and which modules of this checkout it imported (none allowed).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env, copy_working_tree

ROOT = Path(__file__).resolve().parents[1]

# argv: original checkout, script (relative to the copy, the current directory), script arguments...
BOOTSTRAP = r"""
import os, runpy, sys
original, script = sys.argv[1], sys.argv[2]
editable = lambda obj: (getattr(obj, "__module__", None) or type(obj).__module__ or "").startswith("__editable__")
sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if not editable(h)]
sys.path_importer_cache.clear()
sys.path[0] = os.path.abspath(os.path.dirname(script))  # as `python tools/gpu_bench.py` sets it
sys.argv = [script, *sys.argv[3:]]
before = set(sys.modules)
try:
    runpy.run_path(script, run_name="__main__")
finally:
    import jacap_attn
    print("JACAP_FILE", jacap_attn.__file__)
    print("PATCHES_FILE", sys.modules["jacap_attn.patches"].__file__)
    venv = os.path.realpath(sys.prefix) + os.sep  # the venv may live inside the checkout (.venv)
    def inside(module):
        path = os.path.realpath(str(getattr(module, "__file__", None) or "/"))
        return path.startswith(original + os.sep) and not path.startswith(venv)
    print("FROM_CHECKOUT", sorted(n for n, m in list(sys.modules.items()) if n not in before and inside(m)))
"""


@pytest.mark.slow  # 100 s on 2 CPU cores (20 s with inductor's cache warm), mostly torch.compile
def test_gpu_bench_smoke_runs_from_a_bare_copy(tmp_path):
    copy = tmp_path / "tree"
    copy_working_tree(ROOT, copy)
    assert (copy / "tools" / "gpu_bench.py").is_file() and not (copy / "jacap_attn" / "patches").exists()
    env = child_env(PYTHONDONTWRITEBYTECODE="1", CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", BOOTSTRAP, str(ROOT), "tools/gpu_bench.py", "--smoke", "--threads", "1",
         "--out", str(out)],
        cwd=copy, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = proc.stdout.splitlines()
    found = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in lines
             if line.startswith(("JACAP_FILE ", "PATCHES_FILE ", "FROM_CHECKOUT "))}
    assert found["JACAP_FILE"] == str(copy / "jacap_attn" / "__init__.py")
    assert found["PATCHES_FILE"] == str(copy / "patches" / "__init__.py")
    assert found["FROM_CHECKOUT"] == "[]"
    # The table printed last: a row per configuration, a column per smoke shape; the xformers rows
    # skipped on the CPU, with the reason; the routes (issue 14) measured on the first shape only.
    header = lines.index("decode ms/step (x floor, x vs stock eager); routes: ms per call")
    assert lines[header + 1].split() == ["config", "256x1", "384x2"]
    rows = {line.split()[0]: line for line in lines[header + 2:] if line and not line.startswith(" ")}
    for name in ("stock-eager", "stock-static-compiled", "jacap-compiled"):
        assert len(rows[name].split()) == 1 + 2 * 3 and "error" not in rows[name], rows[name]  # ms (x, x) twice
    assert rows["jacap-xformers-compiled"].split()[1:] == ["skipped", "skipped"]
    assert any(line.startswith("  jacap-xformers-compiled skipped: the model is on cpu") for line in lines[header:])
    assert "x plain" in rows["question"] and rows["question"].split()[-1] == "-"
    assert "x win" in rows["compress,"] and rows["compress,"].split()[-1] == "-"
    assert not any("error" in line for line in lines[header:]), "\n".join(lines[header:])
    assert any(line.startswith("targets 384x2:") for line in lines[header:])
    assert (out / "speed_table.txt").is_file() and list(out.glob("speed_smoke_cpu_*.json"))
    # The chunked-prefill rows (issue 33): stock, one-shot and chunked prefill of one long prompt.
    table = lines.index(next(line for line in lines if line.startswith("Prefill of 600 tokens, tiny, cpu")))
    kinds = [line.split("|")[1].strip() for line in lines[table:] if line.startswith("| ") and "row" not in line]
    assert kinds == ["stock", "one-shot", "chunked"], lines[table:]
    # its bound counts min_tokens (before: every smoke run said "entries NOT within")
    assert any("entries within, buffers within" in line for line in lines[table:]), lines[table:]
    assert (out / "prefill_memory_smoke_cpu_600.json").is_file() and (out / "prefill_memory_smoke_cpu_600.md").is_file()
    assert not (copy / "eval" / "results").exists() or not list((copy / "eval" / "results").glob("speed_smoke*"))


def test_one_shape_per_call_keeps_each_calls_results(tmp_path, monkeypatch):
    """``tools/gpu_bench.py --shape X`` one shape per call (as its docstring suggests for short calls) named its
    file by device and date alone, so each call overwrote the one before."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import gpu_bench

    monkeypatch.setattr(gpu_bench, "ensure_xformers", lambda wheels: None)
    monkeypatch.setattr(gpu_bench.bench, "run_speed", lambda ns, on_shape=None: {"device": {"type": "cpu"}})
    monkeypatch.setattr(gpu_bench.bench, "format_table", lambda result: "")
    monkeypatch.setattr(gpu_bench, "summary", lambda result: "")
    for shape in ("256x1", "384x2"):
        gpu_bench.main(["--smoke", "--shape", shape, "--prefill-tokens", "none", "--out", str(tmp_path)])
    names = sorted(p.name for p in tmp_path.glob("speed_smoke_cpu_*.json"))
    assert len(names) == 2 and names[0].endswith("_256x1.json") and names[1].endswith("_384x2.json"), names
