"""`python -m eval.document_routes`: what each route of a saved document costs and scores (issue 24).

A saved document (``Document.compress`` then ``save``; README "Documents: compress once, ask later")
can be stored in several ways. For each route of :data:`ROUTES` and each decode budget, on one model
and one document, this measures in one process and on the same ids:

* ``compress_s``: ``Document.compress`` of the document (wall seconds, one call);
* ``file_bytes``: the saved ``.safetensors`` file; ``kept_bytes``: the stored cache's kept K/V
  entries in the model's dtype; ``full_bytes``: the whole uncompressed cache of the document (what
  a stock cache holds, :meth:`jacap_attn.storage.cache.JacapCache.full_bytes`), so ``file / full`` and
  ``file / kept`` (at most 1.15 for a file at a kept fraction, the packed format);
* ``load_s``: ``Document.load`` of the file (min over ``--repeats``);
* ``question_s``: one question answered from the loaded file, ``Document.generate`` of the demo
  question with exactly ``--new-tokens`` greedy tokens (the question's forward, its reselection
  where the route reselects, and the decode; min over ``--repeats``), with the held entries the
  decode read afterwards (``decode_kept_bytes``);
* the answer to the demo question, untimed, up to ``--answer-tokens`` greedy tokens (one sample: a
  sanity check, not an accuracy).

Accuracy comes from the harness, not from here: ``--accuracy`` names the saved quality table
(`python -m eval.quality`'s ``<stem>.json``, question-agnostic setting) whose rows are the routes'
``row`` labels; each cell then carries the pooled accuracy over that table's tasks with its 95%
Wilson interval and sample count (``None`` when the table lacks the row). The table is written to
``eval/results/document_routes_<model>.{json,md}`` atomically, after the last measurement (a
failed run leaves the previous files).

    python -m eval.document_routes --model smollm2 --threads 1 \\
        --accuracy eval/results/quality_smollm2_heldout_agnostic_routes.json
    python -m eval.document_routes combine eval/results/document_routes_smollm2.json \\
        eval/results/document_routes_gemma3-270m.json      # one table of both (README)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import sys
import tempfile
import time

import torch

from .quality_report import pooled

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class DocumentRoute:
    """One way of storing a document: ``patch`` options, ``Document.compress``'s ``store`` and
    ``Document.save``'s ``quantize``; ``row`` is the harness row that measures its accuracy
    (eval/quality.py's named rows)."""

    name: str
    row: str
    options: dict
    store: float | None
    quantize: str | None


ROUTES = (
    DocumentRoute("window scoring, stored at the budget", "jacap", {}, None, None),
    DocumentRoute("A: repeat pass, stored at the budget", "jacap (repeat)", {"queries": "repeat"}, None, None),
    DocumentRoute("A + B: repeat pass, stored 0.5, reselected", "jacap (repeat), stored 0.5, reselected",
                  {"queries": "repeat"}, 0.5, None),
    DocumentRoute("B: stored whole, reselected, exact file", "jacap, stored whole, reselected", {}, 1.0, None),
    DocumentRoute("B: stored whole, reselected, 8-bit file (default)", "jacap, stored whole, reselected, int8",
                  {}, 1.0, "int8"),
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eval.document_routes", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="model name (jacap_attn.models) or folder (default smollm2)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.1],
                        help="decode budgets (kept fractions, each in (0, 1); default 0.25 0.1)")
    parser.add_argument("--context", type=int, default=1400, help="document tokens (the demo document; default 1400)")
    parser.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per timed question (default 16)")
    parser.add_argument("--answer-tokens", type=int, default=48,
                        help="greedy tokens of the untimed demo answer (default 48)")
    parser.add_argument("--repeats", type=int, default=2, help="timed loads and questions per cell, min taken (default 2)")
    parser.add_argument("--routes", nargs="+", help=f"route names (default all: {[r.name for r in ROUTES]})")
    parser.add_argument("--accuracy", help="saved quality table (<stem>.json, question-agnostic) holding the routes' rows")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's default)")
    parser.add_argument("--out", help="output stem (default eval/results/document_routes_<model>)")
    args = parser.parse_args(argv)
    bad = [b for b in args.budgets if not 0.0 < b < 1.0]
    if bad:
        parser.error(f"--budgets must be kept fractions in (0, 1), got {bad}")
    for name in ("context", "new_tokens", "answer_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    known = {r.name for r in ROUTES}
    unknown = [r for r in args.routes or [] if r not in known]
    if unknown:
        parser.error(f"unknown --routes {unknown}; known: {sorted(known)}")
    if args.accuracy and not pathlib.Path(args.accuracy).is_file():
        parser.error(f"--accuracy: no such file {args.accuracy!r}")
    return args


def accuracy_cells(path: str | None) -> dict:
    """``{(row label, grid ratio): cell}`` of the question-agnostic setting of a saved quality table
    (cells as :func:`eval.quality_report.pooled`, without their per-sample outcomes); ``{}`` without
    a table. Raises ``ValueError`` for a file that is not a saved quality table."""
    if not path:
        return {}
    table = json.loads(pathlib.Path(path).read_text())
    if not isinstance(table, dict) or not isinstance(table.get("rows"), list):
        raise ValueError(f"{path}: not a saved quality table (python -m eval.quality's <stem>.json)")
    rows = [r for r in table["rows"] if isinstance(r, dict) and r.get("kind") == "task"]
    cells = {}
    for label in table.get("labels", []):
        for ratio in {r["grid_ratio"] for r in rows}:
            cell = pooled(rows, "agnostic", label, ratio, table["tasks"])
            if cell is not None:
                cells[(label, ratio)] = {k: v for k, v in cell.items() if k != "samples"} | {
                    "source": str(path), "tasks": table["tasks"]}
    return cells


def measure_route(model, tokenizer, route: DocumentRoute, budget: float, doc_ids, question_ids, answer: str,
                  args, folder: pathlib.Path, repeat_ids=None) -> dict:
    """One cell: compress, save, load and answer under ``route`` at decode budget ``budget``
    (``doc_ids [1, n]``, ``question_ids [q]``; ``repeat_ids`` the repeat instruction of the routes that
    run the repeat pass, as the harness gives it; ``args`` needs ``chat``, ``repeats``, ``new_tokens``, ``answer_tokens``)."""
    import jacap_attn

    from .speed import _timed_calls  # min wall seconds over the repeats, as `make bench` times its calls

    device = next(model.parameters()).device
    options = dict(route.options)
    if options.get("queries") == "repeat":
        options["repeat_ids"] = repeat_ids
    jacap_attn.patch(model, ratio=budget, tokenizer=tokenizer, **options)
    try:
        with torch.no_grad():
            start = time.perf_counter()
            doc = jacap_attn.Document.compress(model, doc_ids, prompt_format={"chat": args.chat}, store=route.store)
            compress_s = time.perf_counter() - start
            path = folder / "doc.safetensors"
            file_bytes = doc.save(path, quantize=route.quantize)
            kept_bytes, full_bytes = doc.cache.prompt_kept_bytes(), doc.cache.full_bytes()
            load, loaded = _timed_calls(device, args.repeats, lambda _: jacap_attn.Document.load(path, model))

            def ask():
                cache = loaded.fresh_cache()
                ids, mask = loaded.inputs(question_ids)
                out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=args.new_tokens,
                                     min_new_tokens=args.new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)
                return out[0, ids.shape[1]:], cache

            question, (_, cache) = _timed_calls(device, args.repeats, lambda _: ask())
            # The sanity answer, untimed: up to `answer_tokens` (the timed questions stop at new_tokens).
            ids, mask = loaded.inputs(question_ids)
            new = model.generate(ids, attention_mask=mask, cache=loaded.fresh_cache(), do_sample=False,
                                 max_new_tokens=args.answer_tokens, pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:]
    finally:
        jacap_attn.unpatch(model)
    text = tokenizer.decode(new, skip_special_tokens=True).strip()
    return {"route": route.name, "row": route.row, "budget": budget, "store": route.store, "quantize": route.quantize,
            "options": route.options, "compress_s": compress_s, "file_bytes": file_bytes, "kept_bytes": kept_bytes,
            "full_bytes": full_bytes, "file_over_full": file_bytes / full_bytes, "file_over_kept": file_bytes / kept_bytes,
            "load_s": load["seconds"], "question_s": question["seconds"], "decode_kept_bytes": cache.kept_bytes(),
            "answer": text, "demo_answer_right": answer in text}


def run(args) -> dict:
    from tqdm.auto import tqdm

    from jacap_attn.models import load_model
    from jacap_attn.prompts import demo_document, repeat_instruction_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    accuracy = accuracy_cells(args.accuracy)  # checked before the model is loaded
    model, tokenizer = load_model(args.model)
    demo = demo_document(tokenizer, args.context)
    args.chat = demo.chat
    doc_ids = torch.tensor([tokenizer(demo.prefix, add_special_tokens=False).input_ids])
    question_ids = torch.tensor(tokenizer(demo.suffixes[0], add_special_tokens=False).input_ids)
    repeat_ids = repeat_instruction_ids(tokenizer, chat=demo.chat)
    routes = [r for r in ROUTES if not args.routes or r.name in args.routes]
    cells = []
    with tempfile.TemporaryDirectory() as folder:
        for route in tqdm(routes, desc=f"{args.model} routes"):
            for budget in args.budgets:
                cell = measure_route(model, tokenizer, route, budget, doc_ids, question_ids, demo.answers[0],
                                     args, pathlib.Path(folder), repeat_ids)
                cell["accuracy"] = accuracy.get((route.row, budget))
                cells.append(cell)
    return {"command": "python -m eval.document_routes " + " ".join(sys.argv[1:]), "model": args.model,
            "document_tokens": doc_ids.shape[1], "question_tokens": len(question_ids), "new_tokens": args.new_tokens,
            "repeats": args.repeats, "threads": torch.get_num_threads(), "dtype": str(next(model.parameters()).dtype),
            "machine": platform.processor() or platform.machine(), "load_average": os.getloadavg()[0],
            "full_accuracy": [accuracy.get(("full", budget)) for budget in args.budgets], "cells": cells}


def _mb(x: int) -> str:
    return f"{x / 1e6:.1f}"


def format_table(result: dict) -> str:
    """Markdown: one line per route and decode budget."""
    lines = [f"# Saved-document routes: {result['model']}", "",
             f"Command: `{result['command']}`; document: the demo document, {result['document_tokens']} tokens; "
             f"question: its {result['question_tokens']}-token magic-number question, {result['new_tokens']} greedy "
             f"tokens; {result['dtype']}, {result['threads']} thread(s), min of {result['repeats']}; load average "
             f"{result['load_average']:.1f} at the end. Bytes are exact; seconds are wall seconds of this run. "
             "Accuracy: the harness's question-agnostic held-out table (pooled over its tasks, 95% Wilson interval, "
             "samples) for the route's row at that decode budget; `–`: not measured.", "",
             "| route | decode budget | file MB | file / full cache | file / kept | compress s | load s "
             "| question s | accuracy | demo answer |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["cells"]:
        acc = c["accuracy"]
        acc_text = "–" if acc is None else f"{acc['accuracy']:.3f} [{acc['ci95'][0]:.2f}, {acc['ci95'][1]:.2f}] (n={acc['n']})"
        lines.append(f"| {c['route']} | {c['budget']} | {_mb(c['file_bytes'])} | {c['file_over_full']:.2f} "
                     f"| {c['file_over_kept']:.2f} | {c['compress_s']:.2f} | {c['load_s']:.3f} | {c['question_s']:.2f} "
                     f"| {acc_text} | {'right' if c['demo_answer_right'] else 'wrong'} |")
    full = result["cells"][0]["full_bytes"] if result["cells"] else 0
    lines += ["", f"Full cache of the document: {_mb(full)} MB."]
    return "\n".join(lines) + "\n"


def combined_table(results: list[dict]) -> str:
    """Markdown: one line per route, each model's file / full cache, question seconds and accuracy
    at every decode budget (``a / b`` in the order measured), from saved results of several models."""
    models = [r["model"] for r in results]
    head = "| route | " + " | ".join(f"{m}: file / full | {m}: question s | {m}: accuracy" for m in models) + " |"
    lines = [head, "|---|" + "---|---|---|" * len(models)]
    for name in dict.fromkeys(c["route"] for r in results for c in r["cells"]):
        row = [name]
        for r in results:
            cells = [c for c in r["cells"] if c["route"] == name]
            acc = ["–" if c["accuracy"] is None else f"{c['accuracy']['accuracy']:.3f}" for c in cells]
            row += [" / ".join(f"{c['file_over_full']:.2f}" for c in cells),
                    " / ".join(f"{c['question_s']:.2f}" for c in cells), " / ".join(acc)]
        lines.append("| " + " | ".join(row) + " |")
    row = ["full cache (reference)"]
    for r in results:
        acc = ["–" if c is None else f"{c['accuracy']:.3f}" for c in r.get("full_accuracy", [])]
        row += ["1.00", "–", " / ".join(acc) or "–"]
    lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["combine"]:  # python -m eval.document_routes combine A.json B.json: the README's table
        try:
            print(combined_table([json.loads(pathlib.Path(path).read_text()) for path in argv[1:]]), end="")
        except (OSError, ValueError, KeyError) as error:
            print(f"error: combine needs saved document_routes_<model>.json files: {error}", file=sys.stderr)
            return 2
        return 0
    args = parse_args(argv)
    try:
        result = run(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    table = format_table(result)
    print(table)
    from jacap_attn.files.cache_file import write_atomically  # temporary file, fsync, rename

    stem = pathlib.Path(args.out) if args.out else RESULTS_DIR / f"document_routes_{args.model}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(stem.with_suffix(".json"), (json.dumps(result, indent=1) + "\n").encode())
    write_atomically(stem.with_suffix(".md"), table.encode())
    print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
