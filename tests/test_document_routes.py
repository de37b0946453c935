"""`python -m eval.document_routes` (issue 24: the routes' bytes, latency and accuracy side by side)."""

from __future__ import annotations

import argparse
import json

import pytest

from conftest import random_ids, tiny_model
from eval import document_routes
from test_spans import WordTokenizer


class DigitTokenizer(WordTokenizer):
    """What the tool reads of a tokenizer: the vocabulary (word spans), ``decode`` and ``pad_token_id``."""

    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


def _args(**kw):
    return argparse.Namespace(chat=False, repeats=1, new_tokens=3, answer_tokens=5, **kw)


def test_every_route_measured_with_its_bytes(tmp_path):
    """Each route at a 25% decode budget: the file holds what the route stores (a quarter, a half or the
    whole document), within 1.15x its kept bytes unless quantized; the default 8-bit file is under
    0.4 of the full cache at this head dim; the question reselects the whole document to the budget."""
    model = tiny_model("llama")
    doc_ids, question = random_ids(1, 400), random_ids(1, 6, seed=2)[0]
    cells = {route.name: document_routes.measure_route(model, DigitTokenizer(), route, 0.25, doc_ids, question,
                                                       "12", _args(), tmp_path, repeat_ids=[5, 6, 7])
             for route in document_routes.ROUTES}
    stored = {"window scoring, stored at the budget": 0.25, "A: repeat pass, stored at the budget": 0.25,
              "A + B: repeat pass, stored 0.5, reselected": 0.5, "B: stored whole, reselected, exact file": 1.0}
    full = cells["B: stored whole, reselected, exact file"]["full_bytes"]
    for name, fraction in stored.items():
        c = cells[name]
        assert c["kept_bytes"] == pytest.approx(fraction * full, rel=0.05), name
        assert c["file_over_kept"] <= 1.15, name
        assert len(c["answer"].split()) <= 5  # the untimed answer: up to answer_tokens
    default = cells["B: stored whole, reselected, 8-bit file (default)"]
    # 8 bits a value plus the scales: 0.27 of float32 at the embedded models' head dims (64, 256), more
    # at this tiny model's 16 (a value's per-token scale weighs more).
    assert default["file_over_full"] < 0.4
    assert default["file_bytes"] < 0.4 * cells["B: stored whole, reselected, exact file"]["file_bytes"]
    # The question reselected the whole document to the budget before decoding.
    assert default["decode_kept_bytes"] < 0.3 * full
    assert cells["B: stored whole, reselected, exact file"]["decode_kept_bytes"] < 0.3 * full


def test_accuracy_joined_from_a_saved_table(tmp_path):
    rows = [{"kind": "task", "task": t, "setting": "agnostic", "label": "jacap", "grid_ratio": 0.25,
             "samples": {f"{t}-{i}": float(i < 3) for i in range(4)}} for t in ("a", "b")]
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"model": "m", "tasks": ["a", "b"], "labels": ["jacap"], "rows": rows}))
    cell = document_routes.accuracy_cells(str(path))[("jacap", 0.25)]
    assert (cell["correct"], cell["n"]) == (6, 8)
    assert cell["ci95"][0] < 0.75 < cell["ci95"][1]
    assert "samples" not in cell
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError, match="not a saved quality table"):
        document_routes.accuracy_cells(str(tmp_path / "bad.json"))


@pytest.mark.parametrize("argv, message", [
    (["--budgets", "1.0"], "--budgets must be kept fractions"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--routes", "nope"], "unknown --routes"),
    (["--accuracy", "/nonexistent.json"], "no such file"),
])
def test_bad_arguments_refused_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        document_routes.parse_args(argv)
    assert message in capsys.readouterr().err


def test_table_lists_each_cell():
    cell = {"route": "r", "budget": 0.1, "file_bytes": 2_000_000, "file_over_full": 0.27, "file_over_kept": 0.27,
            "compress_s": 1.0, "load_s": 0.01, "question_s": 0.5, "demo_answer_right": True, "full_bytes": 7_400_000,
            "accuracy": {"accuracy": 0.9, "ci95": [0.8, 0.95], "n": 72}}
    text = document_routes.format_table({"model": "m", "command": "c", "document_tokens": 100, "question_tokens": 9,
                                         "new_tokens": 16, "dtype": "float32", "threads": 1, "repeats": 2,
                                         "load_average": 1.0, "cells": [cell, {**cell, "accuracy": None}]})
    assert "| r | 0.1 | 2.0 | 0.27 | 0.27 | 1.00 | 0.010 | 0.50 | 0.900 [0.80, 0.95] (n=72) | right |" in text
    assert "| – | right |" in text
    assert "Full cache of the document: 7.4 MB." in text


def test_combined_table_one_line_per_route_and_the_full_cache():
    cell = {"route": "r", "file_over_full": 0.27, "question_s": 1.5, "accuracy": {"accuracy": 0.861}}
    results = [{"model": m, "cells": [cell, {**cell, "accuracy": None}], "full_accuracy": [{"accuracy": 0.9}, None]}
               for m in ("a", "b")]
    text = document_routes.combined_table(results)
    assert "| r | 0.27 / 0.27 | 1.50 / 1.50 | 0.861 / – | 0.27 / 0.27 | 1.50 / 1.50 | 0.861 / – |" in text
    assert "| full cache (reference) | 1.00 | – | 0.900 / – | 1.00 | – | 0.900 / – |" in text
    assert document_routes.main(["combine", "/nonexistent.json"]) == 2
