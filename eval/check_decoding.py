"""`python -m eval.check_decoding`: the quality harness's fast answers against one-by-one greedy decoding.

For a few samples of each task, every row of the quality config at every kept ratio is answered
twice over the same replayed caches: by :func:`eval.answers.answer_rows` (teacher-forced check
against the full cache's answer, batched greedy decoding of the rest) and by ``generate`` on each
row's cache alone. The table counts the cases whose answer text, and whose score, agree, and times
both (eval/README.md#how-answers-are-decoded).

    python -m eval.check_decoding --models smollm2 --n 4 --threads 1
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch

from eval import answers
from eval import quality as Q


def check_model(model_name: str, cfg: dict, args, log) -> dict:
    from tqdm import tqdm

    from eval import synthetic as T
    from jacap_attn.models import load_model
    from jacap_attn.routes.replay import compress_recorded

    grid = Q.resolve_grid(cfg, args, model_name)
    model, tok = load_model(model_name)
    Q.ensure_patched(model)
    labels = [label for label in (args.methods or cfg["methods"]) if Q.variant(label)[0] not in ("full", "kvpress")]
    totals = {"cases": 0, "same_text": 0, "same_score": 0, "reference": 0, "fast_s": 0.0, "one_by_one_s": 0.0}
    differing = []
    for task in grid.tasks:
        for sample in tqdm(grid.samples(task, tok), desc=f"{model_name} {task}",
                           file=sys.stderr):
            prompt_ids, full_ids = Q.sample_ids(tok, sample, "aware", grid.chat)
            record = Q.record_prefill(model, prompt_ids)
            reference = Q.full_answer(model, tok, record, prompt_ids, full_ids, sample, grid.max_new[task])
            for ratio in grid.ratios:
                caches = [compress_recorded(model, record, Q.make_config(*Q.variant(label), ratio), prompt_ids)
                          for label in labels]
                t0 = time.time()
                fast = answers.answer_rows(model, tok, caches, prompt_ids, full_ids, sample, grid.max_new[task],
                                           reference)
                t1 = time.time()
                slow = [answers.greedy(model, tok, c, full_ids, sample, grid.max_new[task])[0] for c in caches]
                totals["fast_s"] += t1 - t0
                totals["one_by_one_s"] += time.time() - t1
                for label, (tokens, how), one in zip(labels, fast, slow):
                    a, b = tok.decode(tokens, skip_special_tokens=True), tok.decode(one, skip_special_tokens=True)
                    totals["cases"] += 1
                    totals["same_text"] += a == b
                    totals["same_score"] += T.score(sample, a) == T.score(sample, b)
                    totals["reference"] += how == "reference"
                    if a != b:
                        differing.append((task, sample.id, ratio, label, how, a, b))
    log(f"[{model_name}] {totals}")
    return {"model": model_name, **totals, "differing": differing, "labels": labels, "ratios": grid.ratios,
            "tasks": grid.tasks, "n": grid.n}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m eval.check_decoding", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="quality config (default eval/configs/quality.json)")
    p.add_argument("--models", nargs="+")
    p.add_argument("--tasks", nargs="+")
    p.add_argument("--methods", nargs="+")
    p.add_argument("--ratios", nargs="+", type=float)
    p.add_argument("--n", type=int, default=4, help="samples per task")
    p.add_argument("--split", choices=("tuning", "heldout"), default="tuning")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(Q.RESULTS_DIR / "decoding_check.md"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.quick, args.fidelity, args.fidelity_n, args.settings = False, False, 0, ["aware"]
    cfg = Q.load_config(Q.config_path(args))
    command = "python -m eval.check_decoding " + " ".join(shlex.quote(a) for a in argv)
    results = [check_model(m, cfg, args, lambda msg: print(msg, file=sys.stderr, flush=True))
               for m in args.models or list(cfg["models"])]
    out = ["# Fast answers vs one-by-one greedy decoding", "",
           f"Command: `{command}`; question-aware prompts of the {args.split} split; each case (sample, kept ratio, "
           "row) answered over the same replayed cache by `eval.answers.answer_rows` (fast: teacher-forced check, "
           "then batched greedy decoding) and by `generate` on the row's cache alone (one by one).", "",
           *[f"- {r['model']}: tasks {', '.join(r['tasks'])}, {r['n']} samples each; kept ratios "
             f"{', '.join(map(str, r['ratios']))}; rows {', '.join(r['labels'])}." for r in results], "",
           "| model | cases | same answer text | same score | fast by the teacher-forced check | fast (s) | one by one (s) |",
           "|---|---|---|---|---|---|---|"]
    for r in results:
        out.append(f"| {r['model']} | {r['cases']} | {r['same_text']} | {r['same_score']} | {r['reference']} | "
                   f"{r['fast_s']:.0f} | {r['one_by_one_s']:.0f} |")
    diffs = [(r["model"], *d) for r in results for d in r["differing"]]
    out += ["", f"Cases whose text differs: {len(diffs)}.", ""]
    if diffs:
        out += ["| model | task | sample | ratio | row | fast path | fast | one by one |", "|---|---|---|---|---|---|---|---|"]
        out += [f"| {m} | {t} | {s} | {ra} | {lab} | {how} | {a!r} | {b!r} |" for m, t, s, ra, lab, how, a, b in diffs]
    text = "\n".join(out) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
