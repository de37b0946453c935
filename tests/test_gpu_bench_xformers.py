"""``tools/gpu_bench.py`` makes xformers importable on a machine without a package index: from a
wheel in ``wheels/`` (``pip install --no-deps --no-index --target`` a temporary folder, this process
only), or says why not. Here with a stand-in wheel (a pure-Python ``xformers`` package), offline."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def gpu_bench():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("gpu_bench_under_test", ROOT / "tools" / "gpu_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stand_in_wheel(folder: Path) -> Path:
    """``xformers-0.0.35-py3-none-any.whl`` holding ``xformers/__init__.py`` (``STAND_IN = True``)."""
    files = {"xformers/__init__.py": b"STAND_IN = True\n",
             "xformers-0.0.35.dist-info/METADATA": b"Metadata-Version: 2.1\nName: xformers\nVersion: 0.0.35\n",
             "xformers-0.0.35.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                b"Tag: py3-none-any\n"}
    record = ""
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{name},sha256={digest},{len(data)}\n"
    record += "xformers-0.0.35.dist-info/RECORD,,\n"
    path = folder / "xformers-0.0.35-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr("xformers-0.0.35.dist-info/RECORD", record)
    return path


def test_ensure_xformers_installs_a_carried_wheel_for_this_run_only(tmp_path, monkeypatch):
    bench = gpu_bench()
    original = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "xformers" else original(name, *a))  # "not installed"
    monkeypatch.setattr(sys, "path", list(sys.path))
    empty = tmp_path / "none"
    empty.mkdir()
    assert bench.ensure_xformers(str(empty)) == f"not installed, no wheel in {empty}"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    stand_in_wheel(wheels)
    assert bench.ensure_xformers(str(wheels)) == "from xformers-0.0.35-py3-none-any.whl"
    target = Path(sys.path[0])
    assert target.name.startswith("jacap_xformers_") and (target / "xformers" / "__init__.py").is_file()
    monkeypatch.setattr(importlib.util, "find_spec", original)
    if "xformers" not in sys.modules:
        try:
            import xformers
            assert getattr(xformers, "STAND_IN", False)
        finally:  # the stand-in must not stay importable for the tests after this one
            for name in [n for n in sys.modules if n == "xformers" or n.startswith("xformers.")]:
                del sys.modules[name]


def test_summary_lists_skipped_and_failed_rows_with_their_reasons():
    bench = gpu_bench()
    row = {"ms_per_step": 5.0, "x_floor": 1.25, "speedup_vs_stock": 3.0}
    shape = {"context": 8192, "batch": 1, "selection_fraction": 0.02, "targets": {},
             "decode": {"stock-eager": dict(row, speedup_vs_stock=1.0), "jacap-compiled": row,
                        "jacap-xformers-compiled": {"skipped": "no CUDA"}},
             "budget_memory": {"global": {"read_bytes": 3e6, "xformers_read_bytes": 1e6, "kept_bytes": 1e6}}}
    failed = {"context": 32768, "batch": 8, "error": "OutOfMemoryError: boom"}
    lines = bench.summary({"shapes": [shape, failed]}).splitlines()
    assert lines[1].split() == ["config", "8192x1", "32768x8"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:] if not line.startswith(" ")}
    assert rows["jacap-compiled"] == ["5.00", "(1.2x,", "3.00x)", "error"]
    assert rows["jacap-xformers-compiled"] == ["skipped", "error"]
    assert rows["KV"][-2:] == ["3.0|1.0|1.0", "-"]
    assert "  jacap-xformers-compiled skipped: no CUDA" in lines
    assert any(line.startswith("  jacap-compiled error: OutOfMemoryError: boom") for line in lines)
