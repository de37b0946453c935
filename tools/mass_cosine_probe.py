"""How similar an evicted entry is to the held entry its mass goes to (``chunk_mass``; issue 33).

A probe, not the library's code: on RULER samples it runs the library's chunked prefill with
``chunk_mass=True`` (every evicted entry handed on, ``mass_cosine=-1``; window-scored cuts, chunks of
``--chunk``, ``--ratio`` kept) and records, at every cut before the last, the cosine between each evicted
entry's key (after RoPE) and the nearest held key of its layer, row and KV head: the quantity
``mass_cosine`` gates (docs/method.md#carried-mass). Prints per sample the cosine's quantiles and the share of
evicted entries at or above each threshold. Run it on the tuning split only.

    PYTHONPATH=. python tools/mass_cosine_probe.py --model gemma3-270m --task niah_single_1 --samples 3
"""

from __future__ import annotations

import argparse
import sys

import torch

THRESHOLDS = (0.5, 0.7, 0.8, 0.9, 0.95)


def main(argv=None) -> int:
    import jacap_attn
    from eval import quality
    from eval.chunk_oracle import chunked_run, patch_row
    from eval.ruler import tasks as ruler_tasks
    from jacap_attn.models import load_model
    from jacap_attn.selection import mass

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--task", default="niah_single_1")
    parser.add_argument("--split", choices=("tuning", "heldout"), default="tuning")
    parser.add_argument("--samples", type=int, default=3, help="the first N samples of the split")
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk-scores", choices=("rescore", "repeat"), default="rescore",
                        help="how the cuts are scored: window-scored (a prompt's default) or by a repeat pass")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = quality.load_config(quality.CONFIG_DIR / "ruler.json")
    mcfg = cfg["models"][args.model]
    model, tok = load_model(args.model)
    samples = ruler_tasks.generate(args.task, tok, args.samples, mcfg["context_tokens"],
                                   seed=cfg["splits"][args.split]["seed"])
    seen: list[torch.Tensor] = []
    library = mass.carried

    def recording(plan, indices, kept, slots, min_cosine=-1.0):
        _, handed_over = mass.handovers(plan, indices, kept, slots)
        if handed_over is not None:
            _, real, cosine, _ = handed_over
            seen.append(cosine[real])
        return library(plan, indices, kept, slots, min_cosine)

    mass.carried = recording
    try:
        for index, sample in enumerate(samples):
            prompt_ids, _ = quality.sample_ids(tok, sample, "aware", mcfg["chat"])
            chunk = patch_row(model, tok, f"jacap[chunk_size={args.chunk},chunk_scores={args.chunk_scores},chunk_mass=True]",
                              args.ratio, mcfg["chat"])
            seen.clear()
            chunked_run(model, prompt_ids, torch.ones_like(prompt_ids), chunk)
            jacap_attn.unpatch(model)
            cosine = torch.cat(seen) if seen else torch.zeros(0)
            if not len(cosine):
                print(f"{args.model} {args.task} sample {index}: nothing evicted before the last cut", flush=True)
                continue
            quantiles = torch.quantile(cosine, torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9])).tolist()
            shares = [float((cosine >= t).float().mean()) for t in THRESHOLDS]
            print(f"{args.model} {args.task} sample {index}: {len(cosine)} evicted entries; cosine quantiles "
                  f"(10/25/50/75/90%) {' '.join(f'{q:.3f}' for q in quantiles)}; share at or above "
                  + ", ".join(f"{t}: {s:.3f}" for t, s in zip(THRESHOLDS, shares)), flush=True)
    finally:
        mass.carried = library
    return 0


if __name__ == "__main__":
    sys.exit(main())
