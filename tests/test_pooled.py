"""`python -m eval.pooled`: rows of several saved quality tables pooled into one decision table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval import pooled, stats

ROOT = Path(__file__).resolve().parents[1]


def _table(model, outcomes, kl=None, tasks=("t1", "t2"), ratio=0.1):
    """A saved table: ``outcomes`` maps a label to its per-task lists of per-sample scores."""
    rows = []
    for label, per_task in outcomes.items():
        for task, scores in zip(tasks, per_task):
            rows.append({"kind": "task", "model": model, "task": task, "setting": "aware", "label": label,
                         "ratio": ratio, "grid_ratio": ratio,
                         "samples": {f"{task}-{i}": s for i, s in enumerate(scores)}})
        if kl and label in kl:
            rows.append({"kind": "fidelity", "model": model, "label": label, "ratio": ratio, "kl": kl[label]})
    return {"model": model, "tasks": list(tasks), "labels": list(outcomes), "rows": rows}


def test_rows_pool_the_samples_of_every_table_and_test_them_paired():
    a = _table("m1", {"jacap (default)": [[1, 1, 0], [1, 0.5, 1]], "other": [[0, 1, 1], [1, 1, 1]]},
               kl={"jacap (default)": 0.1})
    b = _table("m2", {"jacap (default)": [[1, 1], [0, 0]], "other": [[0, 0], [0, 1]], "only here": [[1, 1], [1, 1]]})
    against, rows = pooled.pooled_rows([a, b])
    assert against == "jacap (default)"
    assert [r["label"] for r in rows] == ["jacap (default)", "other"]  # rows every table has
    ours, other = rows
    # A sample counts as right only with every expected value (score 1): 4 of 6 and 2 of 4.
    assert (ours["correct"], ours["n"]) == (6, 10) and ours["test"] is None
    assert [t["cell"]["correct"] for t in ours["per_table"]] == [4, 2]
    assert [t["kl"] for t in ours["per_table"]] == [{0.1: 0.1}, {0.1: None}]
    assert (other["correct"], other["n"]) == (6, 10)
    # Paired over the pooled samples, told apart by model: the same task and sample id in two
    # models are two samples.
    mine = {("m1", "t1", 0): False, ("m1", "t1", 1): True, ("m1", "t1", 2): True, ("m1", "t2", 0): True,
            ("m1", "t2", 1): True, ("m1", "t2", 2): True, ("m2", "t1", 0): False, ("m2", "t1", 1): False,
            ("m2", "t2", 0): False, ("m2", "t2", 1): True}
    ref = {("m1", "t1", 0): True, ("m1", "t1", 1): True, ("m1", "t1", 2): False, ("m1", "t2", 0): True,
           ("m1", "t2", 1): False, ("m1", "t2", 2): True, ("m2", "t1", 0): True, ("m2", "t1", 1): True,
           ("m2", "t2", 0): False, ("m2", "t2", 1): False}
    expected = stats.mcnemar(mine, ref)
    assert (other["test"].only_a, other["test"].only_b) == (3, 3) == (expected.only_a, expected.only_b)
    assert other["test"].p == expected.p == 1.0
    md = pooled.render(against, rows)
    assert "| other | 0.833 [" in md and "| 6 (0.600) | +0.0 pts (3 vs 3), p = 1 | -2 (m2 t1, 0.1) |" in md
    # The worst cell: m1 t1 2-2, m1 t2 3-2, m2 t1 0-2, m2 t2 1-0 -> m2's t1, two fewer.
    assert other["worst"] == (-2, "m2", "t1", 0.1) and ours["worst"] is None


def test_ratios_and_task_families_pool_into_one_paired_test():
    """Two tables of one model on different tasks (a RULER table beside a look-alike one) and several
    kept ratios pool into one paired test: each (model, ratio, task, sample) is one sample."""
    a = {**_table("m1", {"jacap": [[1, 0], [1, 1]], "new": [[1, 1], [1, 1]]}, kl={"jacap": 0.1, "new": 0.2},
                  ratio=0.25)}
    low = _table("m1", {"jacap": [[0, 0], [1, 0]], "new": [[1, 1], [0, 1]]}, ratio=0.1)
    a["rows"] += low["rows"]
    b = _table("m1", {"jacap": [[1, 1, 1]], "new": [[1, 1, 0]]}, tasks=("t3",), ratio=0.25)
    b["rows"] += _table("m1", {"jacap": [[0, 0, 0]], "new": [[1, 1, 1]]}, tasks=("t3",), ratio=0.1)["rows"]
    against, rows = pooled.pooled_rows([a, b], ratio="all")
    ours, new = rows
    assert (ours["n"], new["n"]) == (14, 14)
    assert (ours["correct"], new["correct"]) == (7, 12)
    assert (new["test"].only_a, new["test"].only_b) == (7, 2)
    # per cell, new minus jacap: t1 +1 / +2, t2 0 / 0, t3 -1 / +3 (at 0.25 / 0.1)
    assert new["worst"] == (-1, "m1", "t3", 0.25)
    assert [t["kl"] for t in new["per_table"]][0] == {0.25: 0.2, 0.1: None}
    assert pooled.pooled_rows([a, b], ratio=[0.1])[1][1]["n"] == 7
    assert "0.200 / –" in pooled.render(against, rows)
    # "all": every ratio of each table, which may differ (a table at one ratio beside one at two).
    one = _table("m1", {"jacap": [[0, 0, 0]], "new": [[1, 1, 1]]}, tasks=("t3",), ratio=0.1)
    _, mixed = pooled.pooled_rows([a, one], ratio="all")
    assert [r["n"] for r in mixed] == [8 + 3, 8 + 3] and mixed[1]["correct"] == 7 + 3
    assert [list(t["kl"]) for t in mixed[1]["per_table"]] == [[0.25, 0.1], [0.1]]
    with pytest.raises(ValueError, match="ratio=0.25 is not a kept ratio"):
        pooled.pooled_rows([a, one], ratio=[0.25])
    with pytest.raises(ValueError, match="repeats a ratio"):
        pooled.pooled_rows([a, b], ratio=[0.1, 0.1])
    with pytest.raises(ValueError, match="ratio=0.5 is not a kept ratio"):
        pooled.pooled_rows([a, b], ratio=[0.1, 0.5])


def test_the_full_cache_counts_each_sample_once_over_several_ratios():
    """``--ratio all``: the full cache answers the same at every kept ratio, so its accuracy and interval count
    each sample once (before: once per ratio, n tripled and the interval too narrow); the tests still pair it with
    the reference at each ratio."""
    t = _table("m1", {"jacap": [[1, 0, 1]], "full": [[1, 1, 0]]}, tasks=("t1",), ratio=0.25)
    for ratio in (0.1, 0.05):
        t["rows"] += _table("m1", {"jacap": [[0, 0, 1]], "full": [[1, 1, 0]]}, tasks=("t1",), ratio=ratio)["rows"]
    for r in t["rows"]:
        r["method"] = "full" if r["label"] == "full" else "jacap"
    against, (jacap, full) = pooled.pooled_rows([t], ratio="all", against="jacap")
    assert (jacap["correct"], jacap["n"]) == (4, 9) and (full["correct"], full["n"]) == (2, 3)
    assert full["per_table"][0]["cell"]["ci95"] == stats.wilson(2, 3)
    assert (full["test"].only_a, full["test"].only_b) == (5, 3)  # paired at each of the three ratios
    assert "| 2 of 3 (0.667) |" in pooled.render(against, [jacap, full])


def test_the_published_ablations_pool_to_their_per_model_counts():
    saved = [json.loads((ROOT / "eval" / "results" / f"ablation_{m}.json").read_text())
             for m in ("smollm2", "gemma3-270m")]
    against, rows = pooled.pooled_rows(saved)
    assert against == "jacap (default)"
    for row in rows:
        assert row["n"] == 144 and row["correct"] == sum(t["cell"]["correct"] for t in row["per_table"])


def test_bad_arguments_are_named(tmp_path, capsys):
    a = _table("m1", {"jacap": [[1], [1]]}, tasks=("t1", "t2"))
    b = _table("m2", {"jacap": [[0], [1]]}, ratio=0.25)
    with pytest.raises(ValueError, match="no saved table"):
        pooled.pooled_rows([])
    with pytest.raises(ValueError, match="share no kept ratio: they cannot be pooled"):
        pooled.pooled_rows([a, b])
    with pytest.raises(ValueError, match="ratio=0.5 is not a kept ratio"):
        pooled.pooled_rows([a], ratio=0.5)
    with pytest.raises(ValueError, match="against='nope' is not a row"):
        pooled.pooled_rows([a], against="nope")
    with pytest.raises(ValueError, match="setting='agnostic'"):
        pooled.pooled_rows([a], setting="agnostic")
    path = tmp_path / "a.json"
    path.write_text(json.dumps(a))
    assert pooled.main([str(path), "--against", "nope"]) == 2
    assert "against='nope'" in capsys.readouterr().err
    assert pooled.main([str(tmp_path / "missing.json")]) == 2
    assert pooled.main([str(path)]) == 0
    assert "| jacap | 1.000 [" in capsys.readouterr().out
    assert pooled.main([str(path), "--ratio", "all"]) == 0 and pooled.main([str(path), "--ratio", "0.1"]) == 0
    capsys.readouterr()
    assert pooled.main([str(path), "--ratio", "low"]) == 2
    assert "--ratio takes kept ratios or 'all', got 'low'" in capsys.readouterr().err


def test_files_of_another_shape_are_refused_with_their_name(tmp_path, capsys):
    """Found by a fresh user: JSON of another shape, non-JSON, the same model twice and tables
    with nothing in common gave tracebacks or advice that could not work."""
    cases = {"list.json": "[1, 2]", "null.json": "null", "rows.json": '{"rows": 5}', "empty.json": "{}",
             "text.json": "not json", "binary.json": b"\xff\xfe\x00"}
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        assert pooled.main([str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path}:") and err.count("\n") == 1, err
    a = _table("m1", {"jacap": [[1], [1]]})
    with pytest.raises(ValueError, match=r"two tables of m1 share the tasks \['t1', 't2'\]"):
        pooled.pooled_rows([a, a])
    with pytest.raises(ValueError, match="the tables share no row"):
        pooled.pooled_rows([a, _table("m2", {"snapkv": [[1], [0]]})])
    agnostic = _table("m2", {"jacap": [[1], [0]]})
    for row in agnostic["rows"]:
        row["setting"] = "agnostic"
    with pytest.raises(ValueError, match="share no setting: they cannot be pooled"):
        pooled.pooled_rows([a, agnostic])
    with pytest.raises(ValueError, match="table 1: the table has no per-task rows"):
        pooled.pooled_rows([{**a, "rows": []}])
