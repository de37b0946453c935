"""What a repetitive prompt's chunked prefill costs now that it is cut as a document (issue 33; docs/results.md,
"Repetitive prompts cut as documents"): RULER ``niah_single_1`` (held-out sample 0, question in the prompt) on each
model, 10% kept, chunks of 1,024, the default (repeat-scored cuts carrying near-duplicates' mass on this prompt)
against window-scored cuts (``chunk_scores="rescore"``) and a stock prefill (``logits_to_keep=1``), 1 thread, CPU
seconds, min of 3.

    PYTHONPATH=. python tools/repetitive_speed.py
"""

from __future__ import annotations

import sys
import time
import warnings

import torch


def main() -> int:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    import jacap_attn
    from eval import quality
    from eval.ruler import tasks as ruler_tasks
    from jacap_attn.models import load_model

    cfg = quality.load_config(quality.CONFIG_DIR / "ruler.json")
    for name in ("smollm2", "gemma3-270m"):
        mcfg = cfg["models"][name]
        model, tok = load_model(name)
        sample = ruler_tasks.generate("niah_single_1", tok, 1, mcfg["context_tokens"], seed=cfg["splits"]["heldout"]["seed"])[0]
        ids, _ = quality.sample_ids(tok, sample, "aware", mcfg["chat"])
        times = {}
        for label, opts in (("default (repetitive: repeat-scored, mass)", {}), ("window-scored (chunk_scores=rescore)", {"chunk_scores": "rescore"})):
            jacap_attn.patch(model, ratio=0.1, chunk_size=1024, tokenizer=tok, **opts)
            best = float("inf")
            for _ in range(3):
                start = time.process_time()
                with torch.no_grad():
                    jacap_attn.compress(model, ids)
                best = min(best, time.process_time() - start)
            jacap_attn.unpatch(model)
            times[label] = best
        stock = float("inf")
        for _ in range(3):
            start = time.process_time()
            with torch.no_grad():
                model(input_ids=ids, logits_to_keep=1)
            stock = min(stock, time.process_time() - start)
        print(f"{name}, RULER niah_single_1 held-out sample 0, {ids.shape[1]} tokens, 10% kept, chunks of 1,024, 1 thread, "
              f"CPU seconds, min of 3: " + ", ".join(f"{k} {v:.2f} s" for k, v in times.items()) + f", stock prefill {stock:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
