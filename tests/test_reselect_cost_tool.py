"""``tools/reselect_cost.py`` (issue 33's bound on a reselected question, and its floor) end to end on the tiny
preset: every leverage variant timed against the same question not rescored, the cut's steps timed, the
bfloat16 prototype's agreement, the JSON written; bad arguments refused by name before any model loads."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import reselect_cost  # noqa: E402


def test_every_variant_is_timed_beside_the_plain_question_and_written(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert reselect_cost.main(["--config", "tiny", "--context", "300", "--repeats", "1", "--rounds", "1", "--steps",
                               "--leverage", "float32", "bfloat16", "none", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == "tiny (4 layers, random weights)" and result["context"] == 300
    assert result["question_tokens"] == 32 and result["reselect"] == 0.1
    for name in ("float32", "bfloat16", "none"):
        (row,) = result["rows"][name]
        assert row["reselected_s"] > 0 and row["plain_s"] > 0
        assert row["ratio"] == pytest.approx(row["reselected_s"] / row["plain_s"])
    assert set(result["rows"]["float32"][0]["steps_ms"]) >= {"gather", "assign_layer_budgets"}
    assert result["rows"]["none"][0]["steps_ms"] == {}  # the steps are timed under the library's leverage only
    agreement = result["agreement"]["bfloat16"]
    assert 0 < agreement["lowest"] <= agreement["mean"] <= 1 and agreement["pairs"] == 4 * 2
    assert "leverage none:" in capsys.readouterr().out


@pytest.mark.parametrize("argv,name", [(["--context", "0"], "--context"), (["--repeats", "0"], "--repeats"),
                                       (["--layers", "2"], "--layers 2 keeps layers"),
                                       (["--config", "tiny", "--layers", "0"], "--layers must be at least 1"),
                                       (["--reselect", "1.5"], "--reselect"), (["--leverage", "float16"], "--leverage"),
                                       (["--config", "nosuch"], "--config 'nosuch' is neither a preset"),
                                       (["--config", "tiny", "--context", "9000"], "past the tiny preset's 8192"),
                                       (["--out", "/"], "--out '/'"), (["--out", "/no/such/x.json"], "--out")])
def test_bad_arguments_are_refused_by_name_before_any_model_loads(argv, name, capsys):
    """Before: an unknown preset went to the hub (about 27 s, then an OSError), a bad --out failed after all the
    timing, and --layers without --config read "needs --config and a positive count, got 2"."""
    with pytest.raises(SystemExit):
        reselect_cost.parse(argv)
    assert name in capsys.readouterr().err


def test_a_variant_named_twice_runs_once_per_round():
    assert reselect_cost.parse(["--leverage", "float32", "float32", "none"]).leverage == ["float32", "none"]
