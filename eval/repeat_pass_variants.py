"""The repeat pass's cost in stock prefills, variants side by side in one process (issue 24 item 4).

Variants: the reference path (the stock attention, then the chunk's probabilities materialised and
every statistic the method lists: the code before the blocked statistics), the default path, the
blocked statistics behind the stock attention (``RepeatRoute.shares_attention = False``), Jacap with
``beta=1`` (``sq_dist`` computed), ``repeat_chunk`` 256 and 1024. SmolLM2, the 1,900-token prose
prompt of ``make bench``'s route section, one thread; wall and CPU seconds (the process's, which
other jobs on a shared machine inflate less), min over ``REPEATS`` rounds, each round the stock
prefill then every variant; and whether each variant keeps what the reference path keeps.

    python eval/repeat_pass_variants.py REPEATS OUT.json
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def main(repeats: int, out_path: str) -> dict:
    import jacap_attn
    from jacap_attn.math import attention_stats
    from jacap_attn.models import load_model
    from jacap_attn.prompts import repeat_instruction_ids
    from jacap_attn.routes import repeat
    from transformers.cache_utils import DynamicCache

    from eval.speed import memory_prompt

    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2", attn_implementation="sdpa")
    ids = memory_prompt(tokenizer, torch.zeros(1, 1900, dtype=torch.long), {})
    repeat_ids = repeat_instruction_ids(tokenizer)
    fused, names_of = attention_stats.chunk_statistics, repeat.repeat_statistics
    every_listed = lambda cfg: tuple(sorted(set(cfg.method.repeat_stats) | set(names_of(cfg))))  # noqa: E731
    variants = {  # name: (statistics function, shares_attention, repeat_statistics, patch options)
        "before (reference path)": (attention_stats.reference_chunk_statistics, False, every_listed, {}),
        "after": (fused, True, names_of, {}),
        "after, stock attention + blocked statistics": (fused, False, names_of, {}),
        "after, beta=1 (sq_dist)": (fused, True, names_of, {"beta": 1.0}),
        "after, repeat_chunk=256": (fused, True, names_of, {"repeat_chunk": 256}),
        "after, repeat_chunk=1024": (fused, True, names_of, {"repeat_chunk": 1024}),
    }
    spent, times, kept = {}, {}, {}
    run_pass = repeat.RepeatRoute.run_pass

    def timed_pass(self, cache, forward):
        wall, cpu = time.perf_counter(), time.process_time()
        run_pass(self, cache, forward)
        spent["pass"] = (time.perf_counter() - wall, time.process_time() - cpu)

    repeat.RepeatRoute.run_pass = timed_pass
    try:
        with torch.no_grad():
            model(input_ids=ids[:, :256], use_cache=True, logits_to_keep=1, cache=DynamicCache(config=model.config))
            for _ in range(repeats):
                wall, cpu = time.perf_counter(), time.process_time()
                model(input_ids=ids, use_cache=True, logits_to_keep=1, cache=DynamicCache(config=model.config))
                times.setdefault("stock prefill", []).append((time.perf_counter() - wall, time.process_time() - cpu))
                for name, (function, share, names, options) in variants.items():
                    attention_stats.chunk_statistics, repeat.repeat_statistics = function, names
                    repeat.RepeatRoute.shares_attention = share
                    jacap_attn.patch(model, ratio=0.1, queries="repeat", repeat_ids=repeat_ids, **options)
                    cache = jacap_attn.compress(model, ids)
                    kept[name] = [layer.positions[layer.valid].tolist() for layer in cache.layers]
                    times.setdefault(name, []).append(spent["pass"])
                jacap_attn.unpatch(model)
    finally:
        repeat.RepeatRoute.run_pass = run_pass
        attention_stats.chunk_statistics, repeat.repeat_statistics = fused, names_of
        repeat.RepeatRoute.shares_attention = True
    stock_wall, stock_cpu = (min(t[i] for t in times["stock prefill"]) for i in (0, 1))
    out = {"command": " ".join(["python", *sys.argv]), "model": "smollm2", "context": ids.shape[1], "threads": 1,
           "repeat_instruction_tokens": len(repeat_ids), "load_average_1m_end": os.getloadavg()[0], "rows": {}}
    for name, rows in times.items():
        wall, cpu = min(t[0] for t in rows), min(t[1] for t in rows)
        out["rows"][name] = {"wall_seconds": wall, "cpu_seconds": cpu, "all_wall_cpu_seconds": rows,
                             "over_stock_prefill_wall": wall / stock_wall, "over_stock_prefill_cpu": cpu / stock_cpu,
                             # the same kept sets as the reference path, for the variants of its config
                             "kept_equal_reference": (kept[name] == kept["before (reference path)"]
                                                      if name in kept and not variants[name][3] else None)}
        row = out["rows"][name]
        print(f"{name:46s} wall {wall:7.2f} s  cpu {cpu:7.2f} s  x stock prefill: wall {row['over_stock_prefill_wall']:5.2f}"
              f"  cpu {row['over_stock_prefill_cpu']:5.2f}  kept as before: {row['kept_equal_reference']}")
    pathlib.Path(out_path).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
