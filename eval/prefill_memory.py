"""`python -m eval.prefill_memory` (part of `make bench`): what a long prompt's prefill costs in memory and
time, stock vs one-shot compression vs chunked compression, side by side in one run
(docs/results.md#prefill-memory-and-time-make-bench).

Each row runs in a process of its own (one CPU thread unless ``--threads``), on the same prompt (the
demo document's prose, :func:`jacap_attn.prompts.demo_document`, of ``--tokens`` tokens):

* ``stock``: the unpatched model's prefill with ``logits_to_keep=1``, as ``generate`` runs it;
* ``one-shot``: :func:`jacap_attn.compress` (an exact prefill of the whole prompt, then one cut);
* ``chunked``: :func:`jacap_attn.compress` with ``chunk_size`` (a cut after every chunk).

Per row: wall and CPU seconds of the prefill; the process's peak resident memory during the prefill
above its resident memory once the model is loaded and warm (a 16-token forward first pages the
mmapped weights in; Linux: the high-water mark ``VmHWM`` reset then through ``/proc/self/clear_refs``,
read from ``/proc/self/status``; elsewhere ``ru_maxrss``, which then includes the loading); the largest K/V buffer bytes the cache held at any
point of the prefill (before each cut, the held entries plus the chunk) beside the final cache's;
and the bound ``(budget + chunk + window) x bytes per token``, with ``budget = ceil(ratio * n)`` (``chunk_ratio``
 instead of ``ratio`` for a row with a running budget, ``--chunk-ratios``), that
the chunked rows' held bytes must stay under. The report prints ratios measured in the same run:
each row's peak and time against the stock row's and the one-shot row of its kept fraction's.

    python -m eval.prefill_memory --model smollm2 --tokens 8000
    python -m eval.prefill_memory --model gemma3-270m --tokens 32000 --chunks 1024
    python -m eval.prefill_memory --model smollm2 --tokens 8000 --chunks 1024 --chunk-ratios 0.3 0.5
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import resource
import subprocess
import sys
import time

from jacap_attn.route_settings import CHUNK_SCORES

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
TARGET_PEAK = 0.5  # chunked peak at most this fraction of one-shot's (issue 33)
TARGET_SPEEDUP = 1.3  # chunked prefill at 10% at least this much faster than stock (issue 33)


def _rss_now() -> int:
    """Resident bytes now (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _reset_peak() -> bool:
    """Reset the process's resident high-water mark (Linux >= 4.0); ``False`` where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    """The process's resident high-water mark in bytes (``VmHWM``, else ``ru_maxrss``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # no /proc (macOS): the getrusage peak below
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load_source(model_name: str | None, config: str | None, device: str, dtype: str):
    """``(model, tokenizer or None)``: an embedded model (``--model``) or random weights of a preset of
    :data:`eval.speed.PRESETS` (``--config``; the 8B shape on a GPU), in eval mode on ``device``."""
    import torch

    torch_dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    if config is not None:
        from eval.speed import random_model

        return random_model(config, torch_dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32),
                            device), None
    from jacap_attn.models import load_model

    return load_model(model_name, device=device, **({"dtype": torch_dtype} if torch_dtype else {}))


def prompt_ids(model, tokenizer, tokens: int, device: str):
    """``[1, tokens]`` ids: the demo document's prose (question at the end) for a real model, random
    ids for random weights (whose attention no text would shape)."""
    import torch

    from jacap_attn import prompts

    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return torch.randint(3, model.config.vocab_size, (1, tokens), generator=generator).to(device)
    doc = prompts.demo_document(tokenizer, context_tokens=tokens, seed=0)
    return tokenizer(doc.prefix + doc.suffixes[0], return_tensors="pt", add_special_tokens=False).input_ids.to(device)


def measure_row(model, ids, kind: str, ratio: float | None, chunk: int | None, tokenizer=None,
                chunk_ratio: float | None = None, chunk_scores: str | None = None, chunk_budget: str | None = None,
                chunk_mass: bool = False) -> dict:
    """One row on ``model`` (unpatched on entry and exit) and ``ids [1, n]``; see the module docstring.
    ``chunk_ratio``: a chunked row's running budget before its last cut (``JacapConfig.chunk_ratio``);
    ``chunk_budget``: what its cuts before the last take their fraction of (``JacapConfig.chunk_budget``;
    ``None``: the library's default for a prompt, by the chunk size; the row records the one it ran);
    ``chunk_mass``: whether its cuts carry the evicted entries' attention mass (``JacapConfig.chunk_mass``);
    ``chunk_scores``: how its cuts are scored (``JacapConfig.chunk_scores``; ``None``: the library's
    default for a prompt, ``"rescore"``; with ``"repeat"``, a document's default for Jacap, the repeat
    instruction is the tokenizer's, which
    ``patch(tokenizer=...)`` gives it, as the quality harness does).
    On CUDA the peak is ``torch.cuda.max_memory_allocated`` above the allocation before the row; on the
    CPU the process's resident high-water mark above its resident memory before it (run each row in a
    fresh process: :func:`run_all`)."""
    import torch

    import jacap_attn
    from jacap_attn import selection
    from jacap_attn.route_settings import prompt_chunk_budget
    from jacap_attn.selection import steps

    device = ids.device
    n = ids.shape[1]
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * next(model.parameters()).element_size()
    held = {"peak": 0, "entries": 0}
    original = selection.cut

    def spy(cache, plans, request):  # just before each cut: the held entries plus the chunk, and their buffers
        held["peak"] = max(held["peak"], cache.kv_bytes())
        held["entries"] = max(held["entries"], sum(layer.valid_bytes() for layer in cache.layers))
        return original(cache, plans, request)

    with torch.no_grad():  # page the weights in (a loaded model is mmapped) and warm the kernels up
        model(ids[:, :16], use_cache=False, logits_to_keep=1)
    if kind != "stock":
        scores = jacap_attn.JacapConfig.from_options(ratio=ratio, chunk_scores=chunk_scores).chunk_scoring
        jacap_attn.patch(model, ratio=ratio, tokenizer=tokenizer, compile=False,  # the tokenizer's repeat instruction
                         chunk_ratio=chunk_ratio if kind == "chunked" else None, chunk_scores=chunk_scores,
                         chunk_budget=chunk_budget if kind == "chunked" else None, chunk_mass=chunk_mass)
        selection.cut = steps.cut = spy  # the routes call the package's name, finalize_prefill its module's
    cuda = device.type == "cuda"
    try:
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            baseline, exact_peak = torch.cuda.memory_allocated(device), True
        else:
            baseline, exact_peak = _rss_now(), _reset_peak()
        start_cpu, start = time.process_time(), time.perf_counter()
        with torch.no_grad():
            if kind == "stock":
                cache = model(ids, use_cache=True, logits_to_keep=1).past_key_values
                final = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
                held["peak"] = held["entries"] = final
            else:
                cache = jacap_attn.compress(model, ids, chunk_size=chunk if kind == "chunked" else None)
                final = cache.kv_bytes()
        if cuda:
            torch.cuda.synchronize(device)
        wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        peak = (torch.cuda.max_memory_allocated(device) if cuda else _peak_rss()) - (baseline if exact_peak else 0)
        cfg = model._jacap_state.config if kind != "stock" else None
        window, min_tokens = (cfg.window, cfg.min_tokens) if cfg is not None else (None, 0)
        budget_used = prompt_chunk_budget(cfg, chunk) if kind == "chunked" else None
    finally:
        selection.cut = steps.cut = original
        jacap_attn.unpatch(model)
    del cache
    row = {"kind": kind, "ratio": ratio, "chunk": chunk, "chunk_ratio": chunk_ratio if kind == "chunked" else None,
           "chunk_scores": scores if kind == "chunked" else None,
           "chunk_budget": budget_used,
           "chunk_mass": bool(chunk_mass) if kind == "chunked" else None,
           "tokens": n, "prefill_s": round(wall, 3),
           "prefill_cpu_s": round(cpu, 2), "peak_mb": round(peak / 2**20, 1), "peak_exact": exact_peak,
           "peak_kind": "cuda max_memory_allocated" if cuda else "process resident (VmHWM)",
           "held_kv_peak_mb": round(held["peak"] / 2**20, 2), "held_entries_peak_mb": round(held["entries"] / 2**20, 2),
           "final_kv_mb": round(final / 2**20, 2),
           "full_kv_mb": round(n * token_bytes / 2**20, 2), "bytes_per_token": token_bytes}
    if kind == "chunked":
        # no cut before `min_tokens` tokens are seen: until then a chunk joins up to min_tokens - 1 held entries
        bound = (max(math.ceil((chunk_ratio or ratio) * n), min_tokens - 1) + chunk + window) * token_bytes
        row["held_bound_mb"] = round(bound / 2**20, 2)
        row["within_bound"] = held["entries"] <= bound  # the entries held; the buffers' padding is reported beside
        row["buffers_within_bound"] = held["peak"] <= bound
    return row


def _library_default(value: str | None) -> str | None:
    """``JacapConfig.chunk_scores`` or ``chunk_budget`` of a ``--chunk-scores`` / ``--chunk-budgets`` value
    (``"default"``: ``None``, the library's)."""
    return None if value == "default" else value


def rows_for(ratios, chunks, chunk_ratios=(), chunk_scores=(None,), chunk_budgets=(None,),
             chunk_masses=("off",)) -> list[tuple]:
    """``(kind, ratio, chunk, chunk_ratio, chunk_scores, chunk_budget, chunk_mass)`` of every row: stock,
    then per kept fraction one-shot and each chunk size, each also with every running budget of
    ``chunk_ratios`` above the fraction, each of those with every way of scoring the cuts in
    ``chunk_scores`` (``None``: the library's default), every ``chunk_budgets`` value and every
    ``chunk_masses`` value (``"off"``/``"on"``)."""
    chunk_scores = [_library_default(scores) for scores in chunk_scores]
    chunk_budgets = [_library_default(budget) for budget in chunk_budgets]
    out = [("stock", None, None, None, None, None, None)]
    for ratio in ratios:
        out.append(("one-shot", ratio, None, None, None, None, None))
        for chunk in chunks:
            out.extend(("chunked", ratio, chunk, running, scores, budget, mass) for running in [None, *chunk_ratios]
                       if running is None or running > ratio for scores in chunk_scores for budget in chunk_budgets
                       for mass in chunk_masses)
    return out


def _source_args(args) -> list[str]:
    out = ["--device", args.device, "--dtype", args.dtype]
    return out + (["--config", args.config] if args.config else ["--model", args.model])


def run_all(args, on_row=None) -> dict:
    """Every row: on the CPU each in a fresh process of this interpreter (so each peak is its own), on
    CUDA in this process (the allocator's peak is reset per row)."""
    from tqdm import tqdm

    results = []
    rows = rows_for(args.ratios, args.chunks, args.chunk_ratios, args.chunk_scores, args.chunk_budgets, args.chunk_masses)
    bar = tqdm(rows, desc=f"prefill rows ({args.config or args.model}, {args.tokens} tokens)", disable=args.no_progress)
    if args.device.startswith("cuda") or args.in_process:
        import torch

        model, tokenizer = load_source(args.model, args.config, args.device, args.dtype)
        ids = prompt_ids(model, tokenizer, args.tokens, args.device)
        for kind, ratio, chunk, running, scores, budget, mass in bar:
            results.append(measure_row(model, ids, kind, ratio, chunk, tokenizer, running, scores, budget, mass == "on"))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if on_row:
                on_row(results)
    else:
        for kind, ratio, chunk, running, scores, budget, mass in bar:
            command = [sys.executable, "-m", "eval.prefill_memory", "--row", kind, *_source_args(args),
                       "--tokens", str(args.tokens), "--threads", str(args.threads)]
            command += ["--ratios", str(ratio)] if ratio is not None else []
            command += ["--chunks", str(chunk)] if chunk is not None else []
            command += ["--chunk-ratios", str(running)] if running is not None else []
            command += ["--chunk-scores", scores] if scores is not None else []
            command += ["--chunk-budgets", budget] if budget is not None else []
            command += ["--chunk-masses", mass] if mass is not None else []
            done = subprocess.run(command, capture_output=True, text=True, cwd=pathlib.Path(__file__).resolve().parents[1])
            if done.returncode != 0:
                raise RuntimeError(f"row {kind} {ratio} {chunk} failed:\n{done.stderr[-3000:]}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            if on_row:
                on_row(results)
    return {"command": "python -m " + " ".join(["eval.prefill_memory", *sys.argv[1:]]),
            "model": args.config or args.model, "tokens": args.tokens, "threads": args.threads, "device": args.device,
            "date": datetime.date.today().isoformat(), "rows": results}


def report(result: dict) -> str:
    """The markdown table: each row beside the stock row and the one-shot row of its kept fraction."""
    rows = result["rows"]
    stock = next(r for r in rows if r["kind"] == "stock")
    unit = rows[0].get("peak_kind", "process resident")
    one_shot = {r["ratio"]: r for r in rows if r["kind"] == "one-shot"}
    lines = [f"Prefill of {stock['tokens']} tokens, {result['model']}, {result.get('device', 'cpu')}, "
             f"{result['threads']} thread(s), {result['date']}: `{result['command']}`; peak: {unit}, above the "
             "loaded, warm model", "",
             "| row | kept | chunk | prefill s (CPU s) | faster than stock (CPU) | peak MB | vs stock | vs one-shot "
             "| held K/V peak MB: entries / buffers | bound MB | final KV MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = one_shot.get(r["ratio"])
        speed = stock["prefill_s"] / r["prefill_s"] if r["prefill_s"] else float("nan")
        cpu_speed = stock["prefill_cpu_s"] / r["prefill_cpu_s"] if r["prefill_cpu_s"] else float("nan")
        vs_stock = r["peak_mb"] / stock["peak_mb"] if stock["peak_mb"] else float("nan")
        vs_one = (f"{r['peak_mb'] / base['peak_mb']:.2f}x" if base and r["kind"] == "chunked"
                  and base["peak_mb"] else "–")
        bound = f"{r['held_bound_mb']}" + ("" if r.get("within_bound") else " (over)") if "held_bound_mb" in r else "–"
        held_mb = f"{r.get('held_entries_peak_mb', '?')} / {r['held_kv_peak_mb']}"
        lines.append(f"| {r['kind']} | {r['ratio'] or 1} | {_chunk_label(r)} | {r['prefill_s']} ({r['prefill_cpu_s']}) "
                     f"| {speed:.2f}x ({cpu_speed:.2f}x) "
                     f"| {r['peak_mb']} | {vs_stock:.2f}x | {vs_one} | {held_mb} | {bound} "
                     f"| {r['final_kv_mb']} |")
    verdicts = []
    for r in rows:
        if r["kind"] != "chunked":
            continue
        base = one_shot.get(r["ratio"])
        if base and base["peak_mb"]:
            ok = r["peak_mb"] <= TARGET_PEAK * base["peak_mb"]
            verdicts.append(f"chunk {_chunk_label(r)} at {r['ratio']}: peak {r['peak_mb'] / base['peak_mb']:.2f}x "
                            f"one-shot's (target <= {TARGET_PEAK}): {'met' if ok else 'NOT met'}")
        elif base:  # --in-process on the CPU: the rows share the process's one high-water mark
            verdicts.append(f"chunk {_chunk_label(r)} at {r['ratio']}: peak against one-shot's not measured "
                            f"(one-shot's peak reads {base['peak_mb']} MB: rows in one process on the CPU)")
        if r["ratio"] == 0.1:
            speed = stock["prefill_s"] / r["prefill_s"]
            cpu = stock["prefill_cpu_s"] / r["prefill_cpu_s"] if r["prefill_cpu_s"] else float("nan")
            # judged in CPU seconds on the CPU (wall seconds there carry the other jobs of a shared machine)
            on_cpu = not str(r.get("peak_kind", "")).startswith("cuda")
            judged = cpu if on_cpu else speed
            verdicts.append(f"chunk {_chunk_label(r)} at 0.1: {speed:.2f}x faster than stock in wall seconds, {cpu:.2f}x in "
                            f"CPU seconds (target >= {TARGET_SPEEDUP}, judged in {'CPU' if on_cpu else 'wall'} "
                            f"seconds): {'met' if judged >= TARGET_SPEEDUP else 'NOT met'}")
        if "within_bound" in r:
            entries = r.get("held_entries_peak_mb", r["held_kv_peak_mb"])
            verdicts.append(f"chunk {_chunk_label(r)} at {r['ratio']}: held K/V entries at most {entries} MB, their buffers "
                            f"{r['held_kv_peak_mb']} MB (free slots included), bound (budget + chunk + "
                            f"window) x bytes per token {r['held_bound_mb']} MB: entries "
                            f"{'within' if r['within_bound'] else 'NOT within'}, buffers "
                            f"{'within' if r.get('buffers_within_bound', r['within_bound']) else 'NOT within'}")
    return "\n".join(lines + [""] + [f"- {v}" for v in verdicts])


def _chunk_label(row: dict) -> str:
    """A row's chunk column: its size, and its running budget (``chunk_ratio``) where it has one."""
    if not row["chunk"]:
        return "–"
    notes = ([f"running {row['chunk_ratio']}"] if row.get("chunk_ratio") else []) + \
        (["final budget from the first cut"] if row.get("chunk_budget") == "final" else []) + \
        ([f"{row['chunk_scores']} scores"] if row.get("chunk_scores") not in (None, "rescore") else []) + \
        (["carried mass"] if row.get("chunk_mass") else [])
    return f"{row['chunk']}" + (f" ({', '.join(notes)})" if notes else "")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.prefill_memory", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default="smollm2", help="embedded model name or folder (default smollm2)")
    source.add_argument("--config", help="random weights of an eval.speed preset instead (llama-8b, tiny, ...)")
    parser.add_argument("--tokens", type=int, default=8000, help="prompt tokens (default 8000)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.25], help="kept fractions (default 0.1 0.25)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 1024, 2048], help="chunk sizes (default 512 1024 2048)")
    parser.add_argument("--chunk-ratios", type=float, nargs="*", default=[],
                        help="chunked rows also with these running budgets before the last cut (chunk_ratio; "
                             "default none)")
    parser.add_argument("--chunk-scores", nargs="+", default=["default"], choices=("default", *CHUNK_SCORES),
                        help="chunked rows with each of these ways of scoring their cuts (chunk_scores; default: "
                             "the library's for a prompt, rescore; repeat is a document's for jacap)")
    parser.add_argument("--chunk-budgets", nargs="+", default=["default"], choices=("default", "seen", "final"),
                        help="chunked rows with each of these running budgets' bases (chunk_budget; default: the "
                             "library's for a prompt, final where a first cut is below what a cut sets aside)")
    parser.add_argument("--chunk-masses", nargs="+", default=["off"], choices=("off", "on"),
                        help="chunked rows with the evicted mass carried (on) or not (chunk_mass; default off)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="weights dtype (auto: the model's float32 on the CPU, bfloat16 random weights on CUDA)")
    parser.add_argument("--in-process", action="store_true",
                        help="on the CPU too, every row in this process (a smoke check: each row's resident peak then "
                             "sits on what the rows before it left allocated)")
    parser.add_argument("--row", choices=("stock", "one-shot", "chunked"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help="results path without extension (default eval/results/prefill_memory_<model>_<tokens>; "
                                      "'-': print only)")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def write(result: dict, text: str, out: pathlib.Path) -> None:
    """``<out>.json`` and ``<out>.md``, each written atomically."""
    from jacap_attn.files.paths import write_atomically

    for suffix, body in ((".json", json.dumps(result, indent=1)), (".md", text + "\n")):
        write_atomically(pathlib.Path(f"{out}{suffix}"), body.encode())  # `out` may hold a dot (`_ratio0.25`)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tokens < 17 or args.threads < 1 or any(not 0 < r <= 1 for r in args.ratios) or any(c < 1 for c in args.chunks) \
            or any(not 0 < r <= 1 for r in args.chunk_ratios):
        parser.error(f"--tokens must be > 16, --threads and --chunks >= 1, --ratios and --chunk-ratios in (0, 1]; got "
                     f"tokens={args.tokens} threads={args.threads} chunks={args.chunks} ratios={args.ratios} "
                     f"chunk_ratios={args.chunk_ratios}")
    if args.out not in (None, "-") and not pathlib.Path(args.out).parent.is_dir():  # before the rows, not after
        parser.error(f"--out {args.out}: folder {str(pathlib.Path(args.out).parent)!r} does not exist")
    import torch

    torch.set_num_threads(args.threads)
    if args.row:
        model, tokenizer = load_source(args.model, args.config, args.device, args.dtype)
        ids = prompt_ids(model, tokenizer, args.tokens, args.device)
        print(json.dumps(measure_row(model, ids, args.row, args.ratios[0] if args.row != "stock" else None,
                                     args.chunks[0] if args.row == "chunked" else None, tokenizer,
                                     args.chunk_ratios[0] if args.chunk_ratios and args.row == "chunked" else None,
                                     _library_default(args.chunk_scores[0]) if args.row == "chunked" else None,
                                     _library_default(args.chunk_budgets[0]), args.chunk_masses[0] == "on")))
        return 0
    result = run_all(args)
    text = report(result)
    print(text)
    if args.out != "-":
        write(result, text, pathlib.Path(args.out or RESULTS_DIR / f"prefill_memory_{args.config or args.model}_{args.tokens}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
