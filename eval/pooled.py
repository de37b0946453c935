"""`python -m eval.pooled`: rows of several saved quality tables (one per model, or one per task
family) pooled into one decision table.

A decision about a default rests on both models (docs/method.md#consensus-share-re-tuned-2026-12-01)
and often on several task families and kept ratios at once (docs/method.md#the-rule-for-head_floor-written-2026-12-03-before-its-tuning-run):
this reads the ``<stem>.json`` files that `python -m eval.quality` saves, takes the rows every file
has (by label) at the chosen kept ratios and one setting, and prints, per row, each file's accuracy
with its 95% Wilson interval and its fidelity KL, the correct count over every file's samples and
ratios together, an exact McNemar test against a reference row over those pooled, paired samples
(`eval/stats.py`), and the row's worst (task, ratio) cell against the reference.

    python -m eval.pooled eval/results/ablation_smollm2.json eval/results/ablation_gemma3-270m.json
    python -m eval.pooled A.json B.json --against consensus=0.75 --ratio 0.1
    python -m eval.pooled RULER.json LOOKALIKE.json --ratio all   # one model, two task families, every ratio
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from . import stats
from .quality_report import outcome_cell, pooled, reference_row


def _check_table(table, where: str) -> list[dict]:
    """The per-task rows of one saved table, after checking its shape (``ValueError`` naming
    ``where`` and what is wrong)."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: not a saved quality table (a JSON object), got {type(table).__name__}")
    for key, kind in (("model", str), ("tasks", list), ("labels", list), ("rows", list)):
        if not isinstance(table.get(key), kind):
            raise ValueError(f"{where}: not a saved quality table (python -m eval.quality's <stem>.json): "
                             f"needs {key!r} ({kind.__name__})")
    rows = [r for r in table["rows"] if isinstance(r, dict) and r.get("kind") == "task"]
    for r in rows:
        missing = [key for key in ("task", "setting", "label", "grid_ratio") if key not in r]
        if missing:
            raise ValueError(f"{where}: a task row lacks {missing}")
        if not isinstance(r.get("samples", {}), dict):
            raise ValueError(f"{where}: row {r['label']!r}: 'samples' must map sample ids to scores")
    if not rows:
        raise ValueError(f"{where}: the table has no per-task rows")
    return rows


def _pick(name: str, given, shared: set, what: str):
    """``given`` if every table has it, else the one value the tables share (``ValueError`` naming it)."""
    if given is None:
        if not shared:
            raise ValueError(f"the tables share no {what}: they cannot be pooled")
        if len(shared) != 1:
            raise ValueError(f"the tables share the {what}s {sorted(shared)}: pass --{name}")
        return next(iter(shared))
    if given not in shared:
        raise ValueError(f"{name}={given!r} is not a {what} of every table (shared: {sorted(shared)})")
    return given


def _pick_ratios(given, per_table: list[set]) -> list[list[float]]:
    """Each table's kept ratios to pool, largest first: ``"all"`` (every ratio of each table, which may
    differ between tables: a RULER table at 0.25 / 0.1 beside a look-alike one at four ratios), a ratio
    or a list of them (each in every table), or by default the only ratio the tables share
    (``ValueError`` naming what is wrong)."""
    if given == "all":
        return [sorted(r, reverse=True) for r in per_table]
    shared = set.intersection(*per_table)
    if isinstance(given, (list, tuple)):
        if not given:
            raise ValueError("ratio: an empty list")
        if len(set(given)) != len(given):
            raise ValueError(f"ratio: {list(given)} repeats a ratio")
        chosen = [_pick("ratio", r, shared, "kept ratio") for r in given]
    else:
        chosen = [_pick("ratio", given, shared, "kept ratio")]
    return [chosen for _ in per_table]


def pooled_rows(saved: list[dict], ratio=None, setting: str | None = None,
                against: str | None = None, names: list[str] | None = None) -> tuple[str, list[dict]]:
    """The rows present in every saved table, pooled over the tables' samples and kept ratios.

    ``saved``: the tables' JSON (`python -m eval.quality`'s ``<stem>.json``): one per model, or several of
    one model on different tasks (a task family beside another); ``ratio``: a grid ratio or a list of them
    (in every table), or ``"all"`` (every ratio of each table; default: the only ratio the tables
    share): each (ratio, sample) is one paired sample; ``setting`` (default: the only one they share) and ``against`` (default:
    Jacap's default row of the setting, :func:`eval.quality_report.reference_row`) pick the column and the
    reference row; ``names`` (default ``table 1``, ``table 2``, ...) name the tables in errors. Returns
    ``(against, rows)``; each row is a dict with ``label``, ``per_table`` (a list of ``{"model", "cell",
    "kl"}``, ``cell`` as :func:`quality_report.pooled` returns it, pooled over the ratios, ``kl`` a dict
    ratio -> fidelity KL, ``None`` where the table has none), ``correct``, ``n``, ``test``
    (:class:`stats.Paired` of the row against ``against``; ``None`` for ``against`` itself) and ``worst``
    (``(difference, model, task, ratio)``: the (table, task, ratio) cell where the row answers fewest
    samples more than ``against``, a negative difference where it answers fewer; ``None`` for ``against``).

    Raises ``ValueError`` naming what is wrong: no table, a table of another shape, two tables of one
    model sharing a task (the same samples twice), no shared row, no shared or no single ratio or
    setting, a reference row not in every table, a row without per-sample outcomes.
    """
    if not saved:
        raise ValueError("no saved table given")
    names = names or [f"table {i + 1}" for i in range(len(saved))]
    task_rows = [_check_table(s, name) for s, name in zip(saved, names)]
    seen: dict[str, set] = {}
    for s in saved:
        twice = seen.setdefault(s["model"], set()) & set(s["tasks"])
        if twice:
            raise ValueError(f"two tables of {s['model']} share the tasks {sorted(twice)}: "
                             "their samples would count twice")
        seen[s["model"]] |= set(s["tasks"])
    per_table = _pick_ratios(ratio, [{r["grid_ratio"] for r in rows} for rows in task_rows])
    settings = set.intersection(*({r["setting"] for r in rows} for rows in task_rows))
    setting = _pick("setting", setting, settings, "setting")
    labels = [label for label in saved[0]["labels"] if all(label in s["labels"] for s in saved[1:])]
    if not labels:
        raise ValueError("the tables share no row: they cannot be pooled")
    if against is None:
        against = reference_row(labels, setting)
        if against is None:
            raise ValueError("no Jacap default row in every table: pass --against")
    elif against not in labels:
        raise ValueError(f"against={against!r} is not a row of every table (shared: {labels})")

    # Each table's fidelity KL by row and ratio.
    kls = [{(r.get("label"), r.get("ratio")): r.get("kl") for r in s["rows"]
            if isinstance(r, dict) and r.get("kind") == "fidelity"} for s in saved]

    def outcomes_of(label, s, rows, x):
        cell = pooled(rows, setting, label, x, s["tasks"])
        if cell is None:
            raise ValueError(f"row {label!r} of {s['model']} lacks per-sample outcomes at ratio={x}")
        return {(x, *key): ok for key, ok in cell["samples"].items()}

    def paired(label):  # every (table, ratio, task, sample) outcome: the pairs of the tests
        return [{key: ok for x in ratios for key, ok in outcomes_of(label, s, rows, x).items()}
                for s, rows, ratios in zip(saved, task_rows, per_table)]

    def cells(label, samples):
        out = []
        for s, rows, kl, ratios, mine in zip(saved, task_rows, kls, per_table, samples):
            methods = {r.get("method") for r in rows if r["label"] == label}
            if methods == {"full"}:
                # the full cache answers the same at every kept ratio: each sample counts once in its interval
                mine = {key[1:]: ok for key, ok in mine.items() if key[0] == ratios[0]}
            out.append({"model": s["model"], "cell": outcome_cell(mine), "kl": {x: kl.get((label, x)) for x in ratios}})
        return out

    pairs = {label: paired(label) for label in labels}
    per_label = {label: cells(label, pairs[label]) for label in labels}
    # The tables' samples, told apart by model and kept ratio.
    outcomes = {label: {(s["model"], *key): ok for s, mine in zip(saved, tables) for key, ok in mine.items()}
                for label, tables in pairs.items()}

    def worst(mine: dict, ref: dict):
        diff: dict = {}
        for (model, x, task, _), ok in mine.items():
            diff[(model, task, x)] = diff.get((model, task, x), 0) + int(ok)
        for (model, x, task, _), ok in ref.items():
            diff[(model, task, x)] -= int(ok)
        key = min(diff, key=lambda k: (diff[k], k[0], k[1], -k[2]))
        return (diff[key], *key)

    rows = []
    for label, mine in outcomes.items():
        reference = label == against
        counted = [t["cell"] for t in per_label[label]]  # the full row's samples once
        rows.append({"label": label, "per_table": per_label[label], "correct": sum(c["correct"] for c in counted),
                     "n": sum(c["n"] for c in counted),
                     "test": None if reference else stats.mcnemar(mine, outcomes[against]),
                     "worst": None if reference else worst(mine, outcomes[against])})
    return against, rows


def render(against: str, rows: list[dict]) -> str:
    """The markdown table of :func:`pooled_rows`' rows (a table's KL column lists its ratios' KLs,
    largest ratio first)."""
    models = [t["model"] for t in rows[0]["per_table"]]
    n = max(row["n"] for row in rows)  # a row counted over fewer samples (the full cache's, once each) says so
    head = "| row | " + " | ".join(f"{m} accuracy | {m} KL" for m in models) + \
        f" | all ({n}) | against `{against}`, exact McNemar | worst cell (model task, kept) |"
    out = [head, "|" + "---|" * (2 * len(models) + 4)]
    for row in rows:
        parts = []
        for t in row["per_table"]:
            c = t["cell"]
            parts.append(f"{c['accuracy']:.3f} [{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]")
            parts.append(" / ".join("–" if kl is None else f"{kl:.3f}" for kl in t["kl"].values()))
        test = row["test"]
        versus = "–" if test is None else (f"{100 * test.difference:+.1f} pts ({test.only_a} vs {test.only_b}), "
                                           f"p = {test.p:.2g}{' *' if test.p < 0.05 else ''}")
        worst = "–" if row["worst"] is None else f"{row['worst'][0]:+d} ({row['worst'][1]} {row['worst'][2]}, {row['worst'][3]:g})"
        out.append(f"| {row['label']} | " + " | ".join(parts) +
                   f" | {row['correct']}{'' if row['n'] == n else ' of ' + str(row['n'])} ({row['correct'] / row['n']:.3f})"
                   f" | {versus} | {worst} |")
    out.append("")
    out.append("`*`: significant at p < 0.05; (a vs b): samples only this row got right vs only the reference; "
               "worst cell: the fewest right answers more than the reference in one task at one kept ratio. Over "
               "several kept ratios each (ratio, sample) is one pair of the test, though a sample recurs at every "
               "ratio (so p is optimistic); the full cache's accuracy counts each sample once.")
    return "\n".join(out) + "\n"


def _ratio_argument(values: list[str] | None):
    """``--ratio``'s words as :func:`pooled_rows` takes them (``ValueError`` naming a bad word)."""
    if values is None:
        return None
    if values == ["all"]:
        return "all"
    try:
        return [float(v) for v in values]
    except ValueError:
        raise ValueError(f"--ratio takes kept ratios or 'all', got {' '.join(values)!r}") from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.pooled", description=__doc__.splitlines()[0])
    parser.add_argument("tables", nargs="+", type=pathlib.Path, help="saved <stem>.json files, one per model")
    parser.add_argument("--ratio", nargs="+", help="kept ratios pooled, each (ratio, sample) one paired sample, or "
                        "'all' (every ratio of each table; default: the only one they share)")
    parser.add_argument("--setting", help="aware or agnostic (default: the only one the tables share)")
    parser.add_argument("--against", help="the reference row (default: Jacap's default row)")
    args = parser.parse_args(argv)
    try:
        saved = []
        for path in args.tables:
            try:
                saved.append(json.loads(path.read_text()))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise ValueError(f"{path}: not JSON ({error})") from None
        ratio = _ratio_argument(args.ratio)
        against, rows = pooled_rows(saved, ratio, args.setting, args.against,
                                    names=[str(path) for path in args.tables])
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(render(against, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
