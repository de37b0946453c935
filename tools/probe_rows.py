"""A quick tuning-side probe: how many of a task's samples each harness row answers, from one recorded
prefill per sample (the harness's replay, :func:`jacap_attn.routes.replay.compress_recorded`), question
in the prompt, greedy, as :mod:`eval.quality` scores them.

    PYTHONPATH=. python tools/probe_rows.py --task niah_single_1 --n 12 --ratio 0.1 \\
        --rows jacap 'jacap[head_floor=0.5]' 'jacap[budget=uniform]'

A lead, not a result: a handful of samples, no intervals, no cache, no results file. A default changes
only through a rule written before an :mod:`eval.quality` run (docs/method.md). Prints one line per
sample (1: right) and the counts.
"""

from __future__ import annotations

import argparse
import sys

import torch

from eval import answers, quality as Q
from eval.ruler import generate_task
from eval.synthetic import score
from jacap_attn.models import load_model
from jacap_attn.routes.replay import compress_recorded


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--task", required=True, help="a RULER, synthetic or look-alike task name")
    p.add_argument("--split", default="tuning", choices=("tuning", "heldout"))
    p.add_argument("--n", type=int, default=12)
    p.add_argument("--ratio", type=float, default=0.1)
    p.add_argument("--context", type=int, default=2000, help="document tokens (default 2000)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--rows", nargs="+", default=["jacap"], help="harness row labels (eval.quality.variant)")
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    rows = {label: Q.variant(label) for label in args.rows}  # a bad label fails before the model loads
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    Q.ensure_patched(model)
    seed = {"tuning": 1000, "heldout": 5000}[args.split]
    right, full_right, total = dict.fromkeys(rows, 0), 0, 0
    for sample in generate_task(args.task, tok, args.n, args.context, seed):
        prompt_ids, full_ids = Q.sample_ids(tok, sample, "aware", args.chat)
        record = Q.record_prefill(model, prompt_ids)
        reference = Q.full_answer(model, tok, record, prompt_ids, full_ids, sample, args.max_new)
        full_right += score(sample, tok.decode(reference, skip_special_tokens=True)) == 1.0
        total += 1
        marks = []
        for label, (method, options) in rows.items():
            cache = compress_recorded(model, record, Q.make_config(method, options, args.ratio), prompt_ids)
            text = tok.decode(answers.greedy(model, tok, cache, full_ids, sample, args.max_new)[0],
                              skip_special_tokens=True)
            ok = score(sample, text) == 1.0
            right[label] += ok
            marks.append(f"{label}: {int(ok)}")
        print(sample.id, " | ".join(marks), flush=True)
    print(f"{args.task}, {args.split}, {args.model}, kept {args.ratio}: full {full_right}/{total}; "
          + "; ".join(f"{label} {count}/{total}" for label, count in right.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
