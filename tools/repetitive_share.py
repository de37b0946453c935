"""Which RULER prompts the repetitive-prompt rule flags (issue 33; docs/method.md, "Repetitive prompts").

For each task's prompts, generated as ``eval.quality`` generates them (question in the prompt), prints the range
of :func:`jacap_attn.route_settings.repeated_share` and how many reach
:data:`~jacap_attn.route_settings.REPETITIVE_SHARE`. Tokenization only: no model runs.

    PYTHONPATH=. python tools/repetitive_share.py > eval/results/repetitive_prompts_share.txt
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    import transformers

    from eval import quality
    from eval.ruler import tasks as ruler_tasks
    from jacap_attn.models import model_dir
    from jacap_attn.route_settings import REPETITIVE_SHARE, repeated_share

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    parser.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_single_2", "niah_single_3",
                                                         "niah_multikey_1"])
    parser.add_argument("--n", nargs=2, type=int, default=[24, 36], metavar=("TUNING", "HELDOUT"))
    args = parser.parse_args(argv)
    cfg = quality.load_config(quality.CONFIG_DIR / "ruler.json")
    print(f"# route_settings.repeated_share of RULER prompts (question in the prompt); repetitive at >= {REPETITIVE_SHARE}")
    for name in args.models:
        mcfg = cfg["models"][name]
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir(name)))
        for split, n in zip(("tuning", "heldout"), args.n):
            for task in args.tasks:
                samples = ruler_tasks.generate(task, tokenizer, n, mcfg["context_tokens"],
                                               seed=cfg["splits"][split]["seed"])
                shares = torch.cat([repeated_share(quality.sample_ids(tokenizer, s, "aware", mcfg["chat"])[0])
                                    for s in samples])
                print(f"{name} {split} {task} n={n}: repeated share {shares.min():.3f}-{shares.max():.3f}, "
                      f"repetitive {int((shares >= REPETITIVE_SHARE).sum())} of {n}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
