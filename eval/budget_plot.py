"""Per-layer budgets of the budget policies (issue 15): how many prompt entries each layer and KV
head keeps, on the quality harness's own prompts.

    python -m eval.budget_plot --models smollm2 gemma3-270m

For each model, the first ``--n`` held-out samples of every task of ``eval/configs/quality.json``
(question in the prompt) are prefilled once (:func:`eval.quality.record_prefill`) and compressed by
Jacap under every policy of ``--labels`` at every kept ratio of the config
(:func:`jacap_attn.routes.replay.compress_recorded`: the very selection a patched prefill makes). A
layer's kept fraction is its kept entries per KV head (``JacapCache.prompt_kept``) over the prompt's
length: the line is the mean over samples and KV heads, the band the range over KV heads (mean over
samples). Writes ``eval/results/budgets_<model>.png`` (one picture per model, one panel per policy)
and ``budgets_<model>.json`` (the numbers and the command).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys
import time

import torch

from eval import quality

POLICIES = ["jacap+uniform", "jacap+pyramid", "jacap+capacity", "jacap+global", "jacap+global (normalized)"]


def layer_fractions(model, tok, grid, labels: list[str], n: int) -> dict:
    """``{label: {ratio: [L, h] mean kept fraction over the samples}}`` for the first ``n`` samples of
    every task of ``grid`` (question-aware prompts)."""
    from jacap_attn.routes.replay import compress_recorded

    sums: dict = {label: {r: None for r in grid.ratios} for label in labels}
    count = 0
    for task in grid.tasks:
        for sample in grid.samples(task, tok)[:n]:
            prompt_ids, _ = quality.sample_ids(tok, sample, "aware", grid.chat)
            record = quality.record_prefill(model, prompt_ids)
            length = prompt_ids.shape[1]
            for label in labels:
                method, options = quality.variant(label)
                for ratio in grid.ratios:
                    cache = compress_recorded(model, record, quality.make_config(method, options, ratio), prompt_ids)
                    kept = torch.stack([k[0].float() for k in cache.prompt_kept]) / length  # [L, h]
                    sums[label][ratio] = kept if sums[label][ratio] is None else sums[label][ratio] + kept
            count += 1
    return {label: {r: (t / count).tolist() for r, t in by_ratio.items()} for label, by_ratio in sums.items()}


def plot(fractions: dict, model_name: str, caption: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(fractions)
    fig, axes = plt.subplots(1, len(labels), figsize=(3.6 * len(labels), 3.8), sharey=True, squeeze=False)
    for ax, label in zip(axes[0], labels):
        for ratio, rows in fractions[label].items():
            t = torch.tensor(rows)  # [L, h]
            xs = range(t.shape[0])
            line, = ax.plot(xs, t.mean(-1), marker=".", label=f"kept {ratio}")
            ax.fill_between(xs, t.amin(-1), t.amax(-1), color=line.get_color(), alpha=0.2)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("layer")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("kept fraction per KV head")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{model_name}: per-layer budgets (line: mean over KV heads; band: range over KV heads)",
                 fontsize=10)
    fig.text(0.01, 0.005, caption, fontsize=6, wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    from jacap_attn.models import load_model

    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m eval.budget_plot", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    p.add_argument("--labels", nargs="+", default=POLICIES, help="quality-harness row labels (Jacap variants)")
    p.add_argument("--n", type=int, default=4, help="samples per task")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-dir", default=str(quality.RESULTS_DIR))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    pathlib.Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    command = "python -m eval.budget_plot " + " ".join(shlex.quote(a) for a in argv)
    cfg = quality.load_config(quality.CONFIG_DIR / "quality.json")
    grid_args = quality.build_parser().parse_args(["--split", "heldout"])
    for model_name in args.models:
        t0 = time.time()
        grid = quality.resolve_grid(cfg, grid_args, model_name)
        model, tok = load_model(model_name)
        quality.ensure_patched(model)
        fractions = layer_fractions(model, tok, grid, args.labels, args.n)
        caption = (f"`{command}`; model {model_name}; held-out samples, question in the prompt; first {args.n} "
                   f"samples of each task ({', '.join(grid.tasks)}), {grid.ctx}-token prompts")
        stem = f"{args.out_dir}/budgets_{model_name}"
        plot(fractions, model_name, caption, f"{stem}.png")
        with open(f"{stem}.json", "w") as f:
            json.dump({"command": command, "model": model_name, "tasks": grid.tasks, "n_per_task": args.n,
                       "ratios": grid.ratios, "fractions": fractions}, f, indent=1)
        print(f"wrote {stem}.png, {stem}.json ({time.time() - t0:.0f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
