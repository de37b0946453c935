"""Do two rows keep the same KV entries on a config's samples? (a check that a changed option leaves a grid's
results as they were, without answering anything)

    PYTHONPATH=. python tools/same_selection.py --config eval/configs/ruler.json --models smollm2 \\
        --split heldout --n 24 --ratios 0.25 0.125 0.1 0.0625 --tasks niah_single_1 niah_single_2 \\
        --rows jacap 'jacap[lookup_free=24]'

For every sample of the grid (:mod:`eval.quality`'s configs, splits and row syntax), one recorded prefill
(:func:`eval.quality.record_prompts`), and per setting and kept ratio both rows' caches built from it as
the harness builds them (:func:`eval.quality.row_cache`: replayed, or a real chunked prefill); a row that
reselects at question time (``store=``, route B) then reads the question's tokens, as its answer does.
Prints, per (model, setting, ratio), how many samples keep the same (layer, KV head) sets in both rows
and, for those that differ, the sample and its first differing layer and head. Equal sets give equal
answers (greedy decoding of the same entries): a grid whose every cell is equal needs no rerun. Exit
status 1 if any cell differs; nothing is written.
"""

from __future__ import annotations

import argparse
import sys

import torch


def kept_sets(cache) -> list[list[frozenset]]:
    """Per layer, per KV head of row 0: the prompt positions ``cache`` holds (a full layer: ``[]``)."""
    out = []
    for layer in cache.layers:
        if getattr(layer, "valid", None) is None or layer.positions is None:
            out.append([])
            continue
        out.append([frozenset(layer.positions[0, h][layer.valid[0, h]].tolist())
                    for h in range(layer.positions.shape[1])])
    return out


def main(argv=None) -> int:
    from eval import quality as Q

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(Q.CONFIG_DIR / "quality.json"))
    p.add_argument("--models", nargs="+", default=["smollm2"])
    p.add_argument("--split", default="heldout", choices=("tuning", "heldout"))
    p.add_argument("--n", type=int)
    p.add_argument("--tasks", nargs="*")
    p.add_argument("--ratios", nargs="+", type=float, required=True)
    p.add_argument("--settings", nargs="+", default=["aware"], choices=("aware", "agnostic"))
    p.add_argument("--rows", nargs=2, required=True, metavar="ROW", help="two row labels (eval.quality's syntax)")
    args = p.parse_args(argv)
    args.fidelity, args.fidelity_n, args.methods = False, None, None
    torch.set_num_threads(1)
    from jacap_attn.models import load_model
    from jacap_attn.prompts import repeat_instruction_ids

    cfg = Q.load_config(args.config)
    rows = [Q.variant(label) for label in args.rows]
    differ = 0
    for model_name in args.models:
        grid = Q.resolve_grid(cfg, args, model_name)
        model, tok = load_model(model_name)
        Q.ensure_patched(model)
        repeat_ids = repeat_instruction_ids(tok, chat=grid.chat) if any(Q.repeats(o) for _, o in rows) else None
        tally: dict = {}
        for task in grid.tasks:
            for index, sample in enumerate(grid.samples(task, tok)):
                ids = {s: Q.sample_ids(tok, sample, s, grid.chat) for s in grid.settings}
                records = Q.record_prompts(model, {s: ids[s][0] for s in grid.settings})
                for setting in grid.settings:
                    prompt_ids, full_ids = ids[setting]
                    for ratio in grid.ratios:
                        sets = []
                        for method, options in rows:
                            cache = Q.row_cache(model, records[setting], prompt_ids, method, options, ratio,
                                                repeat_ids)
                            if cache.config.reselect is not None:  # the question's forward cuts it, as the answer reads it
                                with torch.no_grad():
                                    model(input_ids=full_ids[:, prompt_ids.shape[1]:], cache=cache, use_cache=True,
                                          logits_to_keep=1)
                            sets.append(kept_sets(cache))
                        same, first = True, None
                        for layer, (a, b) in enumerate(zip(*sets)):
                            for head, (x, y) in enumerate(zip(a, b)):
                                if x != y and first is None:
                                    same, first = False, (layer, head, len(x), len(y))
                        cell = tally.setdefault((setting, ratio), [0, 0])
                        cell[0 if same else 1] += 1
                        if not same:
                            differ += 1
                            print(f"{model_name} {setting} {ratio} {task} #{index}: differs first at layer {first[0]} "
                                  f"KV head {first[1]} ({first[2]} vs {first[3]} entries)", flush=True)
        for (setting, ratio), (same, other) in sorted(tally.items()):
            print(f"{model_name} {setting} kept {ratio}: {same} samples with equal kept sets, {other} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
