"""Tables (Markdown) and plots (matplotlib PNG) of :mod:`eval.quality` results.

``rows`` are the dicts of :func:`eval.quality.aggregate`: ``kind="task"`` rows (accuracy of a
row label at a grid ratio, per task and setting) and ``kind="fidelity"`` rows (mean KL and NLL
increase). Every table and plot states the command, model, tasks, ratios and sample count.
"""

from __future__ import annotations


def _reference_labels(rows) -> set[str]:
    """Labels of the uncompressed reference rows (method ``full``): shown, never marked best."""
    return {"full"} | {r["label"] for r in rows if r["method"] == "full"}


def _caption(command, model, tasks, ratios, n, extra=""):
    return (f"Command: `{command}`; model: {model}; tasks: {', '.join(tasks)}; kept ratios: "
            f"{', '.join(str(r) for r in ratios)}; n = {n} samples per task{extra}.")



def _cell(value, best) -> str:
    """A table cell: ``–`` when missing, bold when it equals the column's best."""
    if value is None:
        return "–"
    text = f"{value:.3f}"
    return f"**{text}**" if best is not None and value == best else text


def markdown_table(rows, command, model, split, tasks, ratios, n, labels) -> str:
    out = [f"# Quality: {model}, {split} split", "",
           _caption(command, model, tasks, ratios, n,
                    "; accuracy averaged over tasks (substring match); KL = mean KL(p_full || p_compressed) "
                    "over 64 teacher-forced prose tokens (lower is better)"), ""]
    task_rows = [r for r in rows if r["kind"] == "task"]
    reference = _reference_labels(rows)
    fid = {(r["label"], r["ratio"]): r for r in rows if r["kind"] == "fidelity"}
    settings = sorted({r["setting"] for r in task_rows}) or ["aware"]
    for setting in settings:
        acc = {}
        for label in labels:
            for ratio in ratios:
                sel = [r["accuracy"] for r in task_rows
                       if r["setting"] == setting and r["label"] == label and r["grid_ratio"] == ratio]
                if len(sel) == len({r["task"] for r in task_rows if r["setting"] == setting}) and sel:
                    acc[(label, ratio)] = sum(sel) / len(sel)
        header = ["method"] + [f"acc@{r}" for r in ratios] + ([f"KL@{r}" for r in ratios] if fid else [])
        out += [f"## Setting: question-{setting}", "", "| " + " | ".join(header) + " |",
                "|" + "---|" * len(header)]
        best = {}
        for ratio in ratios:
            vals = [acc[(l, ratio)] for l in labels if (l, ratio) in acc and l not in reference]
            best[("acc", ratio)] = max(vals) if vals and max(vals) > 0 else None  # no bold for all-zero
            kls = [fid[(l, ratio)]["kl"] for l in labels if (l, ratio) in fid]
            best[("kl", ratio)] = min(kls) if kls else None
        for label in labels:
            cells = [label]
            cells += [_cell(acc.get((label, r)), None if label in reference else best[("acc", r)]) for r in ratios]
            if fid:
                cells += [_cell(fid.get((label, r), {}).get("kl"), best[("kl", r)]) for r in ratios]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    if fid:
        out += ["## Fidelity: NLL increase over the full cache (nats/token)", "",
                "| method | " + " | ".join(f"ΔNLL@{r}" for r in ratios) + " |", "|" + "---|" * (len(ratios) + 1)]
        for label in labels:
            if label in reference:
                continue
            out.append("| " + label + " | " + " | ".join(
                f"{fid[(label, r)]['nll_increase']:.3f}" if (label, r) in fid else "–" for r in ratios) + " |")
        out.append("")
    out += ["Per task:", "", "| setting | task | method | ratio | n | accuracy |", "|---|---|---|---|---|---|"]
    for r in task_rows:
        out.append(f"| {r['setting']} | {r['task']} | {r['label']} | {r['grid_ratio']} | {r['n']} | {r['accuracy']:.3f} |")
    return "\n".join(out) + "\n"


def plots(rows, command, model, split, tasks, ratios, n, labels, stem) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    task_rows = [r for r in rows if r["kind"] == "task"]
    reference = _reference_labels(rows)
    cap = _caption(command, model, tasks, ratios, n)
    for setting in sorted({r["setting"] for r in task_rows}):
        fig, ax = plt.subplots(figsize=(8, 5.5))
        for label in labels:
            xs, ys = [], []
            for ratio in ratios:
                sel = [r["accuracy"] for r in task_rows if r["setting"] == setting and r["label"] == label
                       and r["grid_ratio"] == ratio]
                if sel:
                    xs.append(ratio)
                    ys.append(sum(sel) / len(sel))
            if not xs:
                continue
            if label in reference:
                ax.axhline(ys[0], color="k", ls="--", label="full")
            else:
                ax.plot(xs, ys, marker="o", label=label, lw=2.2 if label.startswith("jacap") else 1.2)
        ax.set_xscale("log")
        ax.set_xlabel("kept ratio")
        ax.set_ylabel("accuracy (mean over tasks)")
        ax.set_title(f"{model} ({split}), question-{setting}")
        ax.legend(fontsize=7, ncol=2)
        fig.text(0.01, 0.005, cap, fontsize=6, wrap=True)
        fig.subplots_adjust(bottom=0.2)
        path = f"{stem}_{setting}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    fid = [r for r in rows if r["kind"] == "fidelity"]
    if fid:
        fig, ax = plt.subplots(figsize=(8, 5.5))
        for label in labels:
            pts = sorted((r["ratio"], r["kl"]) for r in fid if r["label"] == label)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label, lw=2.2 if label.startswith("jacap") else 1.2)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("kept ratio")
        ax.set_ylabel("mean KL(p_full || p_compressed), 64 prose tokens")
        ax.set_title(f"{model} ({split}): fidelity")
        ax.legend(fontsize=7, ncol=2)
        fig.text(0.01, 0.005, _caption(command, model, ["held-out prose"], ratios, fid[0]["n"]), fontsize=6, wrap=True)
        fig.subplots_adjust(bottom=0.2)
        path = f"{stem}_kl.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
