#!/usr/bin/env python
"""The speed benchmark on one GPU (an H200): Llama-3.1-8B-shaped random bf16 model, 8k x 1 and
32k x 8 (context x batch), kept ratio 0.1, against stock transformers in the same run.

Runs :mod:`eval.speed` (``python -m eval.speed``, ``make bench``) with these settings on a machine
that has the repository's working tree (not installed) but no package index: run it from the
repository root,

    python tools/gpu_bench.py              # H200: estimated 5-8 min, mostly four torch.compile runs
    python tools/gpu_bench.py --smoke      # tiny config and contexts, any device (CPU here)

Per shape it measures: prefill (stock, patched full, Jacap) and the time spent selecting; decode
ms/step for stock ``DynamicCache`` eager, stock ``StaticCache`` compiled (``reduce-overhead``,
``fullgraph=True``), Jacap eager and Jacap compiled (``--full-jacap`` adds the full-size
``JacapCache`` compiled); peak memory; the bytes/bandwidth floor with the bandwidth measured here;
the cache's physical vs kept bytes under the ``uniform`` and ``global`` budget policies; on the
first shape, the routes' costs (:func:`eval.speed.route_costs`: ``compress`` with the repeat pass vs
the observation window, a question's forward over a cache stored at the kept ratio vs stored whole
with and without question-time reselection, peak memory of each call).
Writes ``speed_h200_<date>.json`` (and the printed table) under ``$OUT`` (default ``/tmp/jacap_bench``)
after every shape, and a copy to ``eval/results/`` (not in ``--smoke``); prints a short table last.
Works with transformers 5.17 (``past_key_values``) to 5.24+ (``cache``) and torch >= 2.10.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the working tree is copied there, not installed

from eval import speed as bench  # noqa: E402

GPU_SHAPES = ("8192x1", "32768x8")
SMOKE_SHAPES = ("256x1", "384x2")


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny config and contexts (checks the script end to end)")
    parser.add_argument("--config", help="model preset or config.json (default llama-8b; tiny with --smoke)")
    parser.add_argument("--shape", action="append", help=f"CONTEXTxBATCH, repeatable (default {' '.join(GPU_SHAPES)})")
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument("--method", default="jacap")
    parser.add_argument("--steps", type=int, help="measured decode steps (default 32; 4 with --smoke)")
    parser.add_argument("--warmup", type=int, help="warm-up decode steps (default 5; 2 with --smoke)")
    parser.add_argument("--prefill-repeats", type=int, default=1)
    parser.add_argument("--full-jacap", action="store_true", help="also the full-size JacapCache, eager and compiled")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--compile-mode", default="auto")
    parser.add_argument("--threads", type=int, help="CPU threads (the --smoke run on a busy CPU: 1)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/jacap_bench", help="details folder ($OUT)")
    return parser.parse_args(argv)


def bench_args(args) -> list[str]:
    """The ``python -m eval.speed`` command line for ``args``."""
    configs = ["stock-eager", "stock-static-compiled", "jacap-eager", "jacap-compiled"]
    if args.full_jacap or args.smoke:
        configs[2:2] = ["jacap-full-eager", "jacap-full-compiled"]
    shapes = args.shape or (SMOKE_SHAPES if args.smoke else GPU_SHAPES)
    argv = ["--config", args.config or ("tiny" if args.smoke else "llama-8b"),
            "--ratio", str(args.ratio), "--method", args.method, "--device", args.device,
            "--dtype", "bfloat16" if not args.smoke else "auto", "--compile-mode", args.compile_mode,
            "--prefill-repeats", str(args.prefill_repeats), "--configs", ",".join(configs),
            # Physical vs kept bytes of two policies only: each costs one more prefill of the shape.
            "--budgets", "uniform,global",
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
    """The short table printed last: one row per shape, decode ms/step per configuration."""
    shapes = [s for s in result["shapes"] if "error" not in s]
    names = [n for n in bench.CONFIGS if any(n in s["decode"] for s in shapes)]
    head = f"{'shape':<10}{'sel.':>9}" + "".join(f"{n:>22}" for n in names) + f"{'floor full->kept':>18}"
    lines = ["decode ms/step (x floor); sel. = time in Jacap scoring + selection / stock prefill time", head]
    for s in result["shapes"]:
        if "error" in s:
            lines.append(f"{s['context']}x{s['batch']}".ljust(10) + f" error: {s['error'][:150]}")
            continue
        fraction = s.get("selection_fraction")
        row = f"{s['context']}x{s['batch']}".ljust(10) + (f"{100 * fraction:>8.1f}%" if fraction is not None else f"{'n/a':>9}")
        for n in names:
            d = s["decode"].get(n, {})
            row += f"{d['ms_per_step']:>13.2f} ({d['x_floor']:>4.1f}x)" if "ms_per_step" in d else \
                f"{'error' if 'error' in d else '-':>22}"
        floors = [s["decode"][n]["floor_ms"] for n in ("stock-eager", "jacap-compiled")
                  if "floor_ms" in s["decode"].get(n, {})]
        row += f"{' -> '.join(f'{f:.2f}' for f in floors):>18}"
        lines.append(row)
    for s in shapes:
        t = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in s["targets"].items()}
        lines.append(f"targets {s['context']}x{s['batch']}: {t}")
    for s in shapes:
        lines += route_summary(s)
    return "\n".join(lines)


def route_summary(shape: dict) -> list[str]:
    """One or two lines of the shape's route costs (:func:`eval.speed.route_costs`), if measured."""
    routes = shape.get("routes")
    if not routes:
        return []
    where = f"routes {shape['context']}x{shape['batch']}"
    if "error" in routes:
        return [f"{where}: error: {routes['error'][:150]}"]
    a, b = routes["route_a"], routes["route_b"]
    peak = [r.get("peak_bytes") for r in (a["window"], a["repeat"], b["stored_whole_reselect"])]
    peaks = "" if None in peak else " | peak GB window/repeat/reselect " + "/".join(f"{p / 2**30:.1f}" for p in peak)
    return [f"{where}: compress s stock prefill {a['stock_prefill']['seconds']:.3f}, "
            f"window {a['window']['seconds']:.3f}, repeat {a['repeat']['seconds']:.3f} "
            f"({a['repeat_over_window']:.2f}x window){peaks}",
            f"{where}: question forward s at ratio {b['stored_at_ratio']['seconds']:.4f}, whole+reselect "
            f"{b['stored_whole_reselect']['seconds']:.4f}, whole {b['stored_whole']['seconds']:.4f}"]


def main(argv=None) -> int:
    args = parse(argv)
    if not args.smoke and args.device == "auto":
        import torch
        if not torch.cuda.is_available():
            print("gpu_bench: no CUDA device; use --smoke for the CPU check", file=sys.stderr)
            return 2
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    speed = bench.add_speed_arguments(argparse.ArgumentParser())
    ns = speed.parse_args(bench_args(args))
    started = time.perf_counter()

    def save(result):
        result["command"] = " ".join([sys.executable, *sys.argv])
        result["wall_seconds"] = time.perf_counter() - started
        name = f"speed_{device_tag(result, args.smoke)}_{datetime.date.today().isoformat()}.json"
        text = json.dumps(result, indent=2) + "\n"
        (out_dir / name).write_text(text)
        (out_dir / "speed_table.txt").write_text(bench.format_table(result) + "\n\n" + summary(result) + "\n")
        if not args.smoke:
            results = ROOT / "eval" / "results"
            results.mkdir(parents=True, exist_ok=True)
            (results / name).write_text(text)
        return out_dir / name

    result = bench.run_speed(ns, on_shape=save)
    path = save(result)
    print(bench.format_table(result))
    print(f"\nwrote {path} ({result['wall_seconds']:.0f} s)\n")
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
