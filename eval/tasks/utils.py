"""lm-evaluation-harness hooks for the jacap synthetic tasks (referenced by the YAMLs beside it).

lm-eval loads this file by path (``!function utils.<name>``), not as part of a package; the scorer
comes from the repository's ``eval.synthetic``, importable once the repository root (derived from
this file's path) is on ``sys.path``, so nothing relies on the current directory.

Where the data comes from
-------------------------
``load_task`` is the tasks' ``custom_dataset``. lm-eval 0.4.13 calls it with the task's
``metadata`` (the YAML's plus whatever ``--metadata '{...}'`` / ``TaskManager(metadata=...)``
adds) and ``dataset_kwargs`` as keyword arguments. The JSONL file ``<data_dir>/<task>.jsonl`` is
read from, in order of precedence:

1. ``data_dir`` from ``--metadata '{"data_dir": "..."}'``,
2. the ``JACAP_TASKS_DATA`` environment variable,
3. ``data/`` beside this file (``eval/tasks/data``, the default ``--out`` of
   ``python -m eval.make_tasks``).

A relative ``data_dir`` from 1 or 2 is taken relative to the current directory (it was typed
there); the default 3 does not depend on the current directory.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parents[1]


def _tasks_module():
    """``eval.synthetic`` of this repository (the task generators and their scorer).

    The repository root is put on ``sys.path`` first if needed: lm-eval runs from any directory.
    (With the package not installed, ``jacap_attn`` is then imported from the same working tree.)
    """
    if str(_REPO) not in sys.path:
        sys.path.insert(0, str(_REPO))
    from eval import synthetic

    return synthetic


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The folder holding ``<task>.jsonl`` (see the module docstring for the precedence).

    Parameters
    ----------
    data_dir:
        Explicit folder (from lm-eval metadata); ``None`` for the environment/default.

    Returns
    -------
    Path
        The absolute folder path.
    """
    chosen = data_dir or os.environ.get("JACAP_TASKS_DATA")
    return Path(chosen).expanduser().resolve() if chosen else _HERE / "data"


def read_rows(task: str, data_dir: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """Rows of ``<data_dir>/<task>.jsonl`` as dicts.

    Parameters
    ----------
    task:
        Task name in ``eval.synthetic.TASKS`` (e.g. ``"single_needle"``).
    data_dir:
        Folder override (see :func:`resolve_data_dir`).

    Returns
    -------
    list[dict]
        One dict per line.

    Raises
    ------
    FileNotFoundError
        With the command that generates the file.
    """
    path = resolve_data_dir(data_dir) / f"{task}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: generate it with "
            f"`python -m eval.make_tasks --tokenizer <model folder> --out {path.parent}` "
            "or point --metadata '{\"data_dir\": ...}' / JACAP_TASKS_DATA at the data"
        )
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_task(task: str, data_dir: str | None = None, **metadata: Any) -> dict[str, Any]:
    """``custom_dataset`` hook: the task's rows as a ``{"test": datasets.Dataset}`` dict.

    Parameters
    ----------
    task:
        Task name, from the YAML's ``dataset_kwargs``.
    data_dir:
        Data folder, from ``--metadata`` (optional).
    **metadata:
        The rest of lm-eval's metadata (``version``, ``config_source``, ...); ignored.

    Returns
    -------
    dict
        ``{"test": Dataset}``; the ``meta`` column is a JSON string (its keys differ between
        tasks, which Arrow would otherwise have to reconcile).
    """
    import datasets  # an lm-eval dependency

    rows = read_rows(task, data_dir)
    for row in rows:
        row["meta"] = json.dumps(row.get("meta", {}), sort_keys=True)
    return {"test": datasets.Dataset.from_list(rows)}


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """``process_results`` hook for the generation tasks.

    Parameters
    ----------
    doc:
        The dataset row (has ``answers``).
    results:
        lm-eval's outputs for the doc; the first is the generated text.

    Returns
    -------
    dict
        ``{"score": fraction of answers found}`` (``eval.synthetic.score``).
    """
    return {"score": _tasks_module().score(doc, results[0])}
