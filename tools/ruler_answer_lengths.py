"""How many new tokens a right answer needs, per task, from a run's result cache.

The measurement behind the RULER config's answer lengths (eval/ruler/README.md#answer-lengths): a
harness run stores every answer's tokens, cut where the harness's stop rule stopped it (every
expected value in the text, or EOS); a right answer's token count is what it needed. This reads
them back for the run's grid (the same arguments as its ``python -m eval.quality`` command) and
prints, per task, the count of right answers and the most tokens any of them needed, beside the
answer length the run had.

    python tools/ruler_answer_lengths.py --config eval/configs/ruler.json --split tuning \\
        --models smollm2 --n 3 --methods full jacap --cache-dir /tmp/ruler-len/cache --lengths ruler

``--lengths ruler``: the run used RULER's tokens to generate (:func:`eval.ruler.max_new_tokens`),
the config's before it set its own; ``config``: the config's ``max_new_tokens``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `eval` is a top-level folder of the repository
    sys.path.insert(0, str(ROOT))

from eval import quality  # noqa: E402


def answer_lengths(argv: list[str]) -> dict:
    """Per ``(model, task)``: ``{"max_new", "right": [token counts of right answers], "all": [token counts],
    "missing": results not in the cache}`` over the grid ``argv`` selects (``eval.quality``'s
    arguments plus ``--lengths ruler|config``), every setting, ratio and row."""
    from eval.ruler import max_new_tokens

    lengths = "ruler"
    if "--lengths" in argv:
        at = argv.index("--lengths")
        lengths = argv[at + 1]
        argv = argv[:at] + argv[at + 2:]
    args = quality.build_parser().parse_args(argv)
    cfg = quality.load_config(quality.config_path(args))
    args.split = args.split or cfg.get("default_split", "heldout")
    variants = quality.resolve_variants(args, cfg)
    store = quality.ResultCache(args.cache_dir)
    out, seen = {}, set()  # the full row's key is the same at every ratio: counted once
    for model in args.models or list(cfg["models"]):
        grid = quality.resolve_grid(cfg, args, model)
        for task in grid.tasks:
            max_new = max_new_tokens(task) if lengths == "ruler" else grid.max_new[task]
            entry = out.setdefault((model, task), {"max_new": max_new, "right": [], "all": [], "missing": 0})
            for setting in grid.settings:
                for index in range(grid.n):
                    for ratio in grid.ratios:
                        for label, (method, opts) in variants.items():
                            key = quality.task_key(model, task, grid.sample_id(task, index), setting, method, opts,
                                                   1.0 if method == "full" else ratio, max_new, grid.ctx, grid.chat)
                            if key in seen:
                                continue
                            seen.add(key)
                            hit = store.get(key)
                            if hit is None:
                                entry["missing"] += 1
                                continue
                            entry["all"].append(len(hit["tokens"]))
                            if hit["score"] >= 1.0:
                                entry["right"].append(len(hit["tokens"]))
    return out


def main(argv=None) -> int:
    """Print the table of :func:`answer_lengths` (Markdown)."""
    table = answer_lengths(list(sys.argv[1:] if argv is None else argv))
    print("| model | task | answer length of the run | answers | right | most tokens a right answer needed "
          "| answers at the length |")
    print("|---|---|---|---|---|---|---|")
    for (model, task), e in table.items():
        most = max(e["right"]) if e["right"] else "–"
        at_cap = sum(1 for n in e["all"] if n >= e["max_new"])
        missing = f" ({e['missing']} not cached)" if e["missing"] else ""
        print(f"| {model} | {task} | {e['max_new']} | {len(e['all'])}{missing} | {len(e['right'])} | {most} | {at_cap} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
