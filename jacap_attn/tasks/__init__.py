"""lm-evaluation-harness tasks shipped with jacap_attn, with their data: what the README's ``lm_eval``
line runs from any folder once ``pip install ".[eval]"`` is done (docs/usage.md#lm-evaluation-harness).

* ``jacap_single_needle`` (``jacap_single_needle.yaml``): passkey retrieval, one 7-digit "special magic
  number" hidden in ~1,500 tokens of Python's own documentation; ``score`` is the fraction of the
  expected answers found in the generated text (case-insensitive). 20 samples in ``data/``, made
  offline by the repository's ``python -m eval.make_tasks`` (the command, tokenizer and corpus are in
  ``data/manifest.json``): the prompts are already in SmolLM2-135M-Instruct's chat layout (the
  embedded default model), so do not pass ``--apply_chat_template``; for another model, generate its
  own data from a checkout and point ``--metadata '{"data_dir": ...}'`` at it.

lm-eval finds this folder by itself: the start-up hook installed with the package
(``_jacap_attn_lm_eval``) adds :func:`path` to every ``TaskManager`` built with lm-eval's default
tasks, before any ``--include_path`` (whose tasks of the same name win, with lm-eval's warning).
The YAMLs name :func:`load_task` and :func:`process_results` by their import path. Nothing here
imports lm-eval or torch at import time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
TASKS = {"jacap_single_needle": "single_needle"}
"""lm-eval task name -> data file stem (``data/<stem>.jsonl``) of the shipped tasks."""
METRICS = ("all", "part")
"""String-match metrics, RULER's: ``all`` (the fraction of the answers found), ``part`` (1 if any is)."""


def path() -> str:
    """The folder holding the shipped task YAMLs (for ``lm_eval --include_path``, which the start-up
    hook makes unnecessary)."""
    return str(_HERE)


def data_path(stem: str, data_dir: str | None = None) -> Path:
    """``<data_dir>/<stem>.jsonl``; ``data_dir`` ``None``: the shipped ``data/`` folder. Raises
    ``FileNotFoundError`` naming the file when it is not there."""
    folder = Path(data_dir).expanduser().resolve() if data_dir else _HERE / "data"
    file = folder / f"{stem}.jsonl"
    if not file.is_file():
        raise FileNotFoundError(f"no task data at {str(file)!r}: the shipped data is in {str(_HERE / 'data')!r}; "
                                "generate another set with `python -m eval.make_tasks` from a checkout")
    return file


def read_rows(stem: str, data_dir: str | None = None) -> list[dict[str, Any]]:
    """The rows of ``<stem>.jsonl`` (:func:`data_path`) as dicts."""
    with data_path(stem, data_dir).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def load_task(task: str, data_dir: str | None = None, **metadata: Any) -> dict:
    """lm-eval's ``custom_dataset`` hook: ``{"test": datasets.Dataset}`` of the task's rows
    (``task``: the data file stem, from the YAML's ``dataset_kwargs``; ``data_dir`` from ``--metadata``,
    optional; the rest of lm-eval's metadata is ignored). ``meta`` becomes a JSON string."""
    import datasets  # an lm-eval dependency

    rows = read_rows(task, data_dir)
    for row in rows:
        row["meta"] = json.dumps(row.get("meta", {}), sort_keys=True)
    return {"test": datasets.Dataset.from_list(rows)}


def score_answers(answers, output_text: str | None, metric: str = "all") -> float:
    """The score of ``output_text`` against the expected ``answers`` (strings), as RULER scores:
    case-insensitive substring match; ``metric`` ``"all"`` the fraction found, ``"part"`` 1.0 when any
    is. Raises ``ValueError`` for no answers or an unknown metric."""
    answers = list(answers)
    if not answers:
        raise ValueError("sample has no answers")
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; known: {', '.join(METRICS)}")
    text = (output_text or "").lower()
    found = [str(answer).lower() in text for answer in answers]
    return float(any(found)) if metric == "part" else sum(found) / len(answers)


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lm-eval's ``process_results`` hook of the generation tasks: ``{"score": ...}`` of the first
    generated text (:func:`score_answers`, the row's ``meta["metric"]``, default ``"all"``)."""
    meta = doc.get("meta") or {}
    meta = json.loads(meta) if isinstance(meta, str) else meta
    return {"score": score_answers(doc["answers"], results[0], meta.get("metric", "all"))}
