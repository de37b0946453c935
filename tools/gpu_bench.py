#!/usr/bin/env python
"""The speed benchmark on one GPU (an H200): Llama-3.1-8B-shaped random bf16 model, 8k x 1 and
32k x 8 (context x batch), kept ratio 0.1, against stock transformers in the same run.

Runs :mod:`eval.speed` (``python -m eval.speed``, ``make bench``) with these settings on a machine
that has the repository's working tree (not installed) but no package index: run it from the
repository root,

    python tools/gpu_bench.py              # H200: estimated 6-9 min, mostly six torch.compile runs
    python tools/gpu_bench.py --shape 8192x1 --prefill-tokens none   # one shape per call, if a call must stay short
    python tools/gpu_bench.py --smoke      # tiny config and contexts, any device (CPU here)
    python tools/gpu_bench.py --only-prefill   # the chunked-prefill rows alone (estimated 3-5 min on an H200)

xformers (the ``jacap-xformers-*`` rows, ``backend="xformers"``): used if importable; else, if
``wheels/`` (``--wheels``) holds an xformers wheel, it is installed for this run only into a
temporary folder (``pip install --no-deps --target``; nothing else on the machine changes). Put
it there beforehand on a machine with an index: ``pip download xformers==0.0.35 --no-deps -d
wheels/`` (``wheels/`` is git-ignored: carry it with the tree). Without xformers or CUDA the two
rows read ``skipped`` with the reason. The other Jacap rows and the budget policies' bytes run
``backend="sdpa"`` (the padded layout); the routes run the default ``backend="auto"`` (xformers
where it runs).

Per shape it measures: prefill (stock, patched full, Jacap) and the time spent selecting; decode
ms/step for stock ``DynamicCache`` eager, stock ``StaticCache`` compiled (``reduce-overhead``,
``fullgraph=True``), Jacap eager and compiled (padded layout, SDPA) and Jacap eager and compiled
with the xformers backend (ragged layout; one more prefill) (``--full-jacap`` adds the full-size
``JacapCache`` compiled); peak memory; the bytes/bandwidth floor with the bandwidth measured here;
the cache's physical vs kept bytes, and the bytes a decode step reads (padded + SDPA vs ragged +
xformers), under the ``uniform``, ``pyramid``, ``capacity`` and ``global`` budget policies (one
prefill each); on the first shape, the routes' costs (:func:`eval.speed.route_costs`: ``compress`` with the repeat pass vs
the observation window, a question's forward over a cache stored at the kept ratio vs stored whole
with and without question-time reselection, peak memory of each call).
Then a long prompt's prefill on the same shape, stock vs one-shot vs chunked compression (chunks of
4,096 tokens) at 32k and 128k tokens (:mod:`eval.prefill_memory`, issue 33): prefill seconds, peak
device memory above the loaded model, and the K/V bytes the cache held at most.
Writes ``speed_h200_<date>.json`` (and the printed table) under ``$OUT`` (default ``/tmp/jacap_bench``)
after every shape, and a copy to ``eval/results/`` (not in ``--smoke``); prints last one table
(:func:`summary`): per configuration and shape, ms per step, x its bytes/bandwidth floor and the
speed-up over stock eager; question-time reselection and the repeat pass as ms per call.
Works with transformers 5.17 (``past_key_values``) to 5.24+ (``cache``) and torch >= 2.10.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the working tree is copied there, not installed

from eval import speed as bench  # noqa: E402

GPU_SHAPES = ("8192x1", "32768x8")
# The chunked-prefill rows (issue 33): prompt lengths and chunk sizes on the GPU.
PREFILL_TOKENS = "32768,131072"
PREFILL_CHUNKS = ("4096",)
SMOKE_SHAPES = ("256x1", "384x2")
GPU_BUDGETS = "uniform,pyramid,capacity,global"
# The decode rows of the table, in order (eval.speed.CONFIGS names).
ROWS = ("stock-eager", "stock-static-compiled", "jacap-full-compiled", "jacap-eager", "jacap-compiled",
        "jacap-xformers-eager", "jacap-xformers-compiled")


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny config and contexts (checks the script end to end)")
    parser.add_argument("--config", help="model preset or config.json (default llama-8b; tiny with --smoke)")
    parser.add_argument("--shape", action="append", type=bench._shape, help=f"CONTEXTxBATCH, repeatable (default {' '.join(GPU_SHAPES)})")
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument("--method", default="jacap")
    parser.add_argument("--steps", type=int, help="measured decode steps (default 32; 4 with --smoke)")
    parser.add_argument("--warmup", type=int, help="warm-up decode steps (default 5; 2 with --smoke)")
    parser.add_argument("--prefill-repeats", type=int, default=1)
    parser.add_argument("--full-jacap", action="store_true", help="also the full-size JacapCache, eager and compiled")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--compile-mode", default="auto")
    parser.add_argument("--threads", type=int, help="CPU threads (the --smoke run on a busy CPU: 1)")
    parser.add_argument("--only-prefill", action="store_true", help="the chunked-prefill rows alone (no decode rows)")
    parser.add_argument("--prefill-tokens", help=f"prompt lengths of the chunked-prefill rows, comma-separated "
                                                 f"(default {PREFILL_TOKENS}; 600 with --smoke; 'none': skip them)")
    parser.add_argument("--budgets", help=f"budget policies whose bytes are reported (default {GPU_BUDGETS}; "
                                          "uniform,global with --smoke)")
    parser.add_argument("--wheels", default=str(ROOT / "wheels"),
                        help="folder holding an xformers wheel to install for this run if xformers is missing")
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/jacap_bench", help="details folder ($OUT)")
    return parser.parse_args(argv)


def bench_args(args) -> list[str]:
    """The ``python -m eval.speed`` command line for ``args``."""
    configs = ["stock-eager", "stock-static-compiled", "jacap-eager", "jacap-compiled", "jacap-xformers-eager",
               "jacap-xformers-compiled"]
    if args.full_jacap or args.smoke:
        configs[2:2] = ["jacap-full-eager", "jacap-full-compiled"]
    shapes = args.shape or (SMOKE_SHAPES if args.smoke else GPU_SHAPES)
    argv = ["--config", args.config or ("tiny" if args.smoke else "llama-8b"),
            "--ratio", str(args.ratio), "--method", args.method, "--device", args.device,
            "--dtype", "bfloat16" if not args.smoke else "auto", "--compile-mode", args.compile_mode,
            "--prefill-repeats", str(args.prefill_repeats), "--configs", ",".join(configs),
            # Each policy costs one more prefill of the shape.
            "--budgets", args.budgets or ("uniform,global" if args.smoke else GPU_BUDGETS),
            "--steps", str(args.steps or (4 if args.smoke else 32)),
            "--warmup", str(args.warmup if args.warmup is not None else (2 if args.smoke else 5))]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    for shape in shapes:
        argv += ["--shape", shape]
    return argv


def device_tag(result: dict, smoke: bool) -> str:
    if smoke:
        return f"smoke_{result['device']['type']}"
    name = result["device"].get("name", "gpu")
    match = re.search(r"\b([A-Z]\d{2,4}[A-Za-z]*)\b", name)  # "NVIDIA H200" -> h200
    return (match.group(1) if match else re.sub(r"\W+", "_", name)).lower()


def summary(result: dict) -> str:
    """The table printed last: one row per configuration, one column per shape, each cell
    ``ms (x floor, x vs stock)`` (decode ms/step, over its bytes/bandwidth floor, speed-up over
    stock eager), ``skipped``/``error`` with the reason below the table; then question-time
    reselection and the repeat pass (ms per call, where measured: the first shape), the selection
    time, the KV bytes a step reads, and the targets."""
    shapes = result["shapes"]
    labels = [f"{s['context']}x{s['batch']}" for s in shapes]
    width = 28
    lines = ["decode ms/step (x floor, x vs stock eager); routes: ms per call",
             f"{'config':<30}" + "".join(f"{label:>{width}}" for label in labels)]
    notes = {}

    def cell(text):
        return f"{text:>{width}}"

    names = [n for n in ROWS if any(n in s.get("decode", {}) for s in shapes)]
    for name in names:
        row = f"{name:<30}"
        for shape in shapes:
            d = shape.get("decode", {}).get(name) if "error" not in shape else {"error": shape["error"]}
            if not d:
                row += cell("-")
            elif "ms_per_step" in d:
                speed = f"{d['speedup_vs_stock']:.2f}x" if d.get("speedup_vs_stock") else "-"
                row += cell(f"{d['ms_per_step']:.2f} ({d['x_floor']:.1f}x, {speed})")
            else:
                what = "skipped" if "skipped" in d else "error"
                notes.setdefault(f"{name} {what}", d[what][:200])
                row += cell(what)
        lines.append(row)
    lines += route_rows(shapes, cell)
    lines.append(f"{'selection, % of stock prefill':<30}" + "".join(
        cell(f"{100 * s['selection_fraction']:.1f}%" if s.get("selection_fraction") is not None else "-")
        for s in shapes))
    lines.append(f"{'KV MB read/step sdpa|xf|kept':<30}" + "".join(cell(read_cell(s)) for s in shapes))
    lines += [f"  {key}: {text}" for key, text in notes.items()]
    for label, s in zip(labels, shapes):
        if "targets" in s:
            t = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in s["targets"].items()}
            lines.append(f"targets {label}: {t}")
    return "\n".join(lines)


def read_cell(shape: dict) -> str:
    """``sdpa | xformers | kept`` MB a decode step reads from the Jacap cache (the ``global`` policy's
    row of :func:`eval.speed.cache_memory`, else the first measured)."""
    memory = {k: v for k, v in (shape.get("budget_memory") or {}).items() if "error" not in v}
    if not memory:
        return "-"
    row = memory.get("global") or next(iter(memory.values()))
    return "|".join(f"{row[k] / 1e6:.1f}" for k in ("read_bytes", "xformers_read_bytes", "kept_bytes"))


def route_rows(shapes: list[dict], cell) -> list[str]:
    """The routes' rows (:func:`eval.speed.route_costs`, measured on the first shape): the question's
    forward over a cache stored whole and reselected (x the forward over a cache stored at the kept
    ratio), and ``compress`` with the repeat pass (x ``compress`` with the observation window, x the
    stock prefill); ``cell(text)`` pads a column."""
    rows = {"question + reselection": [], "compress, repeat pass": []}
    for shape in shapes:
        routes = shape.get("routes")
        if not routes or "error" in routes:
            text = "error" if routes else "-"
            rows["question + reselection"].append(text)
            rows["compress, repeat pass"].append(text)
            continue
        a, b = routes["route_a"], routes["route_b"]
        rows["question + reselection"].append(
            f"{1e3 * b['stored_whole_reselect']['seconds']:.1f} ({b['reselect_over_plain']:.2f}x plain)")
        rows["compress, repeat pass"].append(
            f"{1e3 * a['repeat']['seconds']:.0f} ({a['repeat_over_window']:.2f}x win, "
            f"{a['repeat_over_stock_prefill']:.1f}x pf)")
    return [f"{name:<30}" + "".join(map(cell, texts)) for name, texts in rows.items()]


def ensure_xformers(wheels: str) -> str:
    """Make xformers importable for this run: ``"installed"`` if it already is; else, if ``wheels``
    holds an ``xformers-*.whl``, install it with ``pip install --no-deps --target`` into a temporary
    folder put first on ``sys.path`` (this process only) and return ``"from <wheel>"``; else a
    sentence saying why not (the xformers rows are then skipped)."""
    if importlib.util.find_spec("xformers") is not None:
        return "installed"
    found = sorted(pathlib.Path(wheels).glob("xformers-*.whl"))
    if not found:
        return f"not installed, no wheel in {wheels}"
    target = tempfile.mkdtemp(prefix="jacap_xformers_")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                           "--target", target, str(found[-1])], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"pip could not install {found[-1].name}: {proc.stderr.strip()[-300:]}"
    sys.path.insert(0, target)
    importlib.invalidate_caches()
    return f"from {found[-1].name}"


def main(argv=None) -> int:
    args = parse(argv)
    if not args.smoke and args.device == "auto":
        import torch
        if not torch.cuda.is_available():
            print("gpu_bench: no CUDA device; use --smoke for the CPU check", file=sys.stderr)
            return 2
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    xformers = ensure_xformers(args.wheels)
    speed = bench.add_speed_arguments(argparse.ArgumentParser())
    ns = speed.parse_args(bench_args(args))
    started = time.perf_counter()

    def save(result):
        result["command"] = " ".join([sys.executable, *sys.argv])
        result["xformers"] = xformers
        result["wall_seconds"] = time.perf_counter() - started
        # one file per set of shapes: a call per shape (--shape) does not overwrite the call before
        shapes = "_" + "_".join(args.shape) if args.shape else ""
        name = f"speed_{device_tag(result, args.smoke)}_{datetime.date.today().isoformat()}{shapes}.json"
        text = json.dumps(result, indent=2) + "\n"
        (out_dir / name).write_text(text)
        (out_dir / "speed_table.txt").write_text(bench.format_table(result) + "\n\n" + summary(result) + "\n")
        if not args.smoke:
            results = ROOT / "eval" / "results"
            results.mkdir(parents=True, exist_ok=True)
            (results / name).write_text(text)
        return out_dir / name

    if not args.only_prefill:
        result = bench.run_speed(ns, on_shape=save)
        path = save(result)
        print(bench.format_table(result))
        print(f"\nwrote {path} ({result['wall_seconds']:.0f} s)\n")
        print(summary(result))
    if args.prefill_tokens != "none":
        prefill_rows(args, out_dir)
    return 0


def prefill_rows(args, out_dir: pathlib.Path) -> None:
    """A long prompt's prefill, stock vs one-shot vs chunked compression (:mod:`eval.prefill_memory`):
    peak device memory, prefill seconds, the K/V bytes the cache held; one table per prompt length
    (``--prefill-tokens``; the 8B shape at 32k and 128k tokens on the GPU, the tiny one with ``--smoke``)."""
    from eval import prefill_memory

    lengths = [int(t) for t in (args.prefill_tokens or ("600" if args.smoke else PREFILL_TOKENS)).split(",")]
    for tokens in lengths:
        argv = ["--config", args.config or ("tiny" if args.smoke else "llama-8b"), "--tokens", str(tokens),
                "--device", "cpu" if args.smoke and args.device == "auto" else ("cuda" if args.device == "auto"
                                                                                else args.device),
                "--ratios", str(args.ratio), "--chunks", *(["128"] if args.smoke else PREFILL_CHUNKS),
                "--threads", str(args.threads or 1), "--in-process", "--no-progress"]
        ns = prefill_memory.build_parser().parse_args(argv)
        result = prefill_memory.run_all(ns)
        result["command"] = " ".join(["python", "tools/gpu_bench.py", *sys.argv[1:]])
        text = prefill_memory.report(result)
        print("\n" + text)
        import torch

        device = {"type": ns.device.split(":")[0]}
        if device["type"] == "cuda":
            device["name"] = torch.cuda.get_device_name(ns.device)
        name = f"prefill_memory_{device_tag({'device': device}, args.smoke)}_{tokens}"
        prefill_memory.write(result, text, out_dir / name)
        if not args.smoke:
            prefill_memory.write(result, text, ROOT / "eval" / "results" / name)


if __name__ == "__main__":
    sys.exit(main())
