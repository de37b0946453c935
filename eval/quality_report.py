"""Tables (Markdown) and plots (matplotlib PNG) of :mod:`eval.quality` results.

``rows`` are the dicts of :func:`eval.quality.aggregate`: ``kind="task"`` rows (accuracy of a
row label at a grid ratio, per task and setting) and ``kind="fidelity"`` rows (mean KL and NLL
increase). Every table and plot states the command, model, tasks, ratios and sample count.
"""

from __future__ import annotations

from eval import stats


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


def markdown_table(rows, command, model, split, tasks, ratios, n, labels, seconds=None) -> str:
    """The Markdown table of a run; rows with per-sample outcomes (``samples``, runs since
    2026-12-01) get intervals and paired tests (:func:`decisive_table`), older rows the table they
    were published with. ``seconds``: the run's wall time, stated when given."""
    if any("samples" in r for r in rows if r["kind"] == "task"):
        return decisive_table(rows, command, model, split, tasks, ratios, n, labels, seconds)
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


# The row the paired tests compare every other row with, the first of these present: the default
# path of the table's setting (the question-agnostic table's is `Document.compress`'s: stored whole,
# reselected at the question), else Jacap's default.
JACAP_LABELS = ("jacap, stored whole, reselected", "jacap (default)", "jacap")
# With the question in the prompt the default path is plain `patch` + `generate`: Jacap's default row.
AWARE_LABELS = ("jacap (default)", "jacap", "jacap, stored whole, reselected")


def reference_row(labels, setting: str) -> str | None:
    """The row a setting's paired tests compare every other row with (:data:`JACAP_LABELS`,
    :data:`AWARE_LABELS` for the question-aware setting), or ``None``."""
    order = AWARE_LABELS if setting == "aware" else JACAP_LABELS
    return next((label for label in order if label in labels), None)


def pooled(task_rows, setting, label, ratio, tasks) -> dict | None:
    """Outcomes of a row at a grid ratio pooled over ``tasks`` (``None`` unless every task has
    per-sample outcomes): ``{"correct", "n", "accuracy", "ci95", "samples": {(task, sample): bool}}``."""
    sel = [r for r in task_rows if r["setting"] == setting and r["label"] == label and r["grid_ratio"] == ratio
           and r["task"] in tasks]
    if sorted(r["task"] for r in sel) != sorted(tasks) or any("samples" not in r for r in sel):
        return None
    return outcome_cell({(r["task"], sid): score >= 1.0 for r in sel for sid, score in r["samples"].items()})


def outcome_cell(samples: dict) -> dict:
    """``{"correct", "n", "accuracy", "ci95", "samples"}`` of per-sample outcomes ``{key: right (bool)}``
    (non-empty), ``ci95`` the 95% Wilson interval."""
    correct, count = sum(samples.values()), len(samples)
    return {"correct": correct, "n": count, "accuracy": correct / count, "ci95": stats.wilson(correct, count),
            "samples": samples}


def span_recall(task_rows, setting, label, ratio, tasks, right_only: bool) -> tuple[float, int] | None:
    """``(mean, n)`` of a row's per-sample span recalls (``span_recall``, sample id -> share of the
    values' prompt tokens kept, :func:`eval.quality.span_recall`) at a grid ratio, pooled over
    ``tasks``; ``right_only``: only the samples the full cache (the reference row of the same task,
    setting and grid ratio) answers right. ``None`` when no such sample has a recall (results cached
    before the metric existed, rows that compress nothing)."""
    reference = _reference_labels(task_rows)
    values = []
    for r in task_rows:
        if (r["setting"], r["label"], r["grid_ratio"]) != (setting, label, ratio) or r["task"] not in tasks:
            continue
        full = next((f["samples"] for f in task_rows if f["label"] in reference and f["task"] == r["task"]
                     and f["setting"] == setting and f["grid_ratio"] == ratio), {})
        values += [v for sid, v in r.get("span_recall", {}).items() if not right_only or full.get(sid, 0) >= 1.0]
    return (sum(values) / len(values), len(values)) if values else None


def _recall(cell) -> str:
    return "–" if cell is None else f"{cell[0]:.3f} ({cell[1]})"


def _span_section(task_rows, setting, labels, ratios, tasks, reference) -> list[str]:
    """The span-recall table of a setting (only where some row has span recalls)."""
    if not any(r.get("span_recall") for r in task_rows if r["setting"] == setting):
        return []
    out = ["Span recall: the share of the expected values' prompt tokens a row's cache keeps, averaged over the "
           "layers its method compresses (on Gemma the full-attention ones) and their KV heads; mean over the samples "
           "the full cache answers right (`right`) and over all samples (`all`), their count in parentheses; `–`: no "
           "recall recorded (results cached before the metric):", "",
           "| method | " + " | ".join(f"recall@{r} {w}" for r in ratios for w in ("right", "all")) + " |",
           "|" + "---|" * (2 * len(ratios) + 1)]
    for label in labels:
        if label not in reference:
            out.append("| " + " | ".join([label] + [_recall(span_recall(task_rows, setting, label, r, tasks, right))
                                                    for r in ratios for right in (True, False)]) + " |")
    return out + [""]


def _acc(cell, bold=False) -> str:
    if cell is None:
        return "–"
    text = f"{cell['accuracy']:.3f}"
    return f"{'**' + text + '**' if bold else text} [{cell['ci95'][0]:.2f}, {cell['ci95'][1]:.2f}]"


def _verdict(test: stats.Paired, a: str, b: str) -> str:
    if test.p >= 0.05:
        return "not significant"
    return f"{a} better" if test.only_a > test.only_b else f"{b} better"


def decisive_table(rows, command, model, split, tasks, ratios, n, labels, seconds=None) -> str:
    """Accuracy pooled over tasks with 95% Wilson intervals, the best non-reference row per column
    in bold, exact McNemar tests of Jacap's row against every other row (and a summary against the
    best other row per column), the full cache's accuracy per task, fidelity, and per-task rows."""
    task_rows = [r for r in rows if r["kind"] == "task"]
    reference = _reference_labels(rows)
    fid = {(r["label"], r["ratio"]): r for r in rows if r["kind"] == "fidelity"}
    per_cell = n * len(tasks) if isinstance(n, int) else None
    when = f"; wall time {seconds / 60:.0f} min" if seconds else ""
    out = [f"# Quality: {model}, {split} split", "",
           _caption(command, model, tasks, ratios, n,
                    f"{f' ({per_cell} per cell)' if per_cell else ''}; accuracy = fraction of samples whose "
                    "answer contains every expected value (substring match), pooled over the tasks, with its "
                    "95% Wilson interval in brackets; bold = the highest compressed row of a column (a point "
                    "estimate: the paired tests below say which differences are significant); KL = mean "
                    "KL(p_full || p_compressed) over 64 teacher-forced prose tokens (lower is better)" + when), ""]
    for setting in sorted({r["setting"] for r in task_rows}) or ["aware"]:
        ours = reference_row(labels, setting)
        cells = {(label, ratio): pooled(task_rows, setting, label, ratio, tasks) for label in labels for ratio in ratios}
        header = ["method"] + [f"acc@{r}" for r in ratios] + ([f"KL@{r}" for r in ratios] if fid else [])
        out += [f"## Setting: question-{setting}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        best, best_kl = {}, {}
        for ratio in ratios:
            vals = [(cells[(l, ratio)]["accuracy"], l) for l in labels
                    if cells[(l, ratio)] is not None and l not in reference]
            best[ratio] = max(vals, key=lambda v: v[0]) if vals and max(vals)[0] > 0 else None
            kls = [fid[(l, ratio)]["kl"] for l in labels if (l, ratio) in fid]
            best_kl[ratio] = min(kls) if kls else None
        for label in labels:
            line = [label] + [_acc(cells[(label, r)], best[r] is not None and label not in reference
                                   and cells[(label, r)] is not None
                                   and cells[(label, r)]["accuracy"] == best[r][0]) for r in ratios]
            if fid:
                line += [_cell(fid.get((label, r), {}).get("kl"), best_kl[r]) for r in ratios]
            out.append("| " + " | ".join(line) + " |")
        out.append("")
        if ours is not None:
            out += _paired_sections(cells, labels, ratios, reference, ours)
        full = [l for l in labels if l in reference]
        if full:
            out += ["Full cache per task (can the model do the task at all):", "",
                    "| task | n | full-cache accuracy |", "|---|---|---|"]
            for task in tasks:
                cell = pooled(task_rows, setting, full[0], ratios[0], [task])
                out.append(f"| {task} | {cell['n'] if cell else '–'} | {_acc(cell)} |")
            out.append("")
        out += _span_section(task_rows, setting, labels, ratios, tasks, reference)
    if fid:
        out += ["## Fidelity: NLL increase over the full cache (nats/token)", "",
                "| method | " + " | ".join(f"ΔNLL@{r}" for r in ratios) + " |", "|" + "---|" * (len(ratios) + 1)]
        for label in labels:
            if label not in reference:
                out.append("| " + label + " | " + " | ".join(
                    f"{fid[(label, r)]['nll_increase']:.3f}" if (label, r) in fid else "–" for r in ratios) + " |")
        out.append("")
    spans = any(r.get("span_recall") for r in task_rows)  # the span-recall columns, where recorded
    out += ["Per task:", "", "| setting | task | method | ratio | n | accuracy [95% CI] | mean fraction of answers |"
            + (" span recall right | span recall all |" if spans else ""), "|---|---|---|---|---|---|---|"
            + ("---|---|" if spans else "")]
    for r in task_rows:
        ci = r.get("ci95")
        acc = f"{r['accuracy']:.3f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
        line = (f"| {r['setting']} | {r['task']} | {r['label']} | {r['grid_ratio']} | {r['n']} | {acc} | "
                f"{r.get('mean_score', r['accuracy']):.3f} |")
        if spans:
            cells = [span_recall(task_rows, r["setting"], r["label"], r["grid_ratio"], [r["task"]], right)
                     for right in (True, False)]
            line += "".join(f" {_recall(cell)} |" for cell in cells)
        out.append(line)
    return "\n".join(out) + "\n"


def _paired_sections(cells, labels, ratios, reference, ours) -> list[str]:
    """Jacap's row against the best other row per column, then against every row."""
    out = [f"Paired comparison, `{ours}` against the best other compressed row of each column (exact McNemar "
           "test over the same samples; significant at p < 0.05):", "",
           "| kept | " + ours + " | best other | difference | only " + ours + " right | only other right | p | verdict |",
           "|---|---|---|---|---|---|---|---|"]
    others = [l for l in labels if l not in reference and l != ours]
    for ratio in ratios:
        mine = cells[(ours, ratio)]
        rivals = [(cells[(l, ratio)]["accuracy"], l) for l in others if cells[(l, ratio)] is not None]
        if mine is None or not rivals:
            continue
        top = max(r[0] for r in rivals)
        name = next(l for acc, l in rivals if acc == top)
        test = stats.mcnemar(mine["samples"], cells[(name, ratio)]["samples"])
        out.append(f"| {ratio} | {mine['accuracy']:.3f} | {name} {top:.3f} | {100 * test.difference:+.1f} pts | "
                   f"{test.only_a} | {test.only_b} | {test.p:.3g} | {_verdict(test, ours, name)} |")
    out += ["", f"Every row against `{ours}`: accuracy difference (row minus `{ours}`, points) and McNemar p:", "",
            "| method | " + " | ".join(f"Δ@{r} (p)" for r in ratios) + " |", "|" + "---|" * (len(ratios) + 1)]
    for label in labels:
        if label == ours:
            continue
        line = [label]
        for ratio in ratios:
            a, b = cells[(label, ratio)], cells[(ours, ratio)]
            if a is None or b is None:
                line.append("–")
                continue
            test = stats.mcnemar(a["samples"], b["samples"])
            line.append(f"{100 * test.difference:+.1f} ({test.p:.2g})" + (" *" if test.p < 0.05 else ""))
        out.append("| " + " | ".join(line) + " |")
    out += ["", "`*`: significant at p < 0.05.", ""]
    return out


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
