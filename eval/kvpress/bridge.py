"""kvpress side by side: export our exact prompts for kvpress, then score its answers with our scorer.

Runs in the project's venv; the presses themselves run in kvpress's venv
(:mod:`eval.kvpress.run_presses`), because kvpress 0.5.5 pins ``transformers<5.3``.

    python -m eval.kvpress.bridge export  REQUESTS.json <python -m eval.quality arguments>
    .venv-kvpress/bin/python eval/kvpress/run_presses.py REQUESTS.json RESULTS.jsonl
    python -m eval.kvpress.bridge merge   REQUESTS.json RESULTS.jsonl

``export`` walks the same grid as ``python -m eval.quality`` with the same arguments (model, split,
tasks, ``n``, ratios, settings, fidelity) and writes, for every ``kvpress:*`` row of ``--methods``
(all of :data:`eval.quality.KVPRESS` if none is given) that is not yet in the result cache, the
token ids our harness would compress and decode. ``merge`` scores the returned texts with
:func:`eval.synthetic.score` and stores them in the harness's result cache under the same keys, so
``python -m eval.quality --methods ... kvpress:snapkv ...`` puts them in the same table as our rows.
``make bench-kvpress`` runs the three steps.
"""

from __future__ import annotations

import json
import sys

from eval import quality as Q


def export(path: str, argv: list[str]) -> int:
    from eval.make_tasks import load_tokenizer, resolve_model

    args = Q.build_parser().parse_args(argv)
    cfg = Q.load_config(Q.config_path(args))
    args.split = args.split or cfg.get("default_split", "heldout")
    labels = [label for label in (args.methods or Q.KVPRESS) if label.startswith("kvpress:")]
    unknown = [label for label in labels if label not in Q.KVPRESS]
    if unknown or not labels:
        raise SystemExit(f"kvpress rows {unknown or 'none'} among --methods; known: {', '.join(Q.KVPRESS)}")
    model_names = args.models or list(cfg["models"])
    if len(model_names) != 1:
        raise SystemExit("export one model at a time (--models NAME)")
    grid = Q.resolve_grid(cfg, args, model_names[0])
    model_dir = resolve_model(grid.model)
    tok = load_tokenizer(model_dir)  # token ids only: the model itself runs in kvpress's venv
    store = Q.ResultCache(args.cache_dir)
    requests, meta = [], {}

    def add(kind: str, key: str, label: str, ratio: float, **fields) -> bool:
        """Request ``key`` unless its result is cached; whether it was requested."""
        if store.get(key) is not None:
            return False
        press, kwargs = Q.KVPRESS[label]
        requests.append({"kind": kind, "key": key, "press": press, "kwargs": kwargs, "ratio": ratio, **fields})
        return True

    # The same walk as `python -m eval.quality`: each sample encoded once, then every (ratio, row).
    for setting in grid.settings:
        for task in grid.tasks:
            for sample in grid.samples(task, tok):
                prompt_ids, full_ids = Q.sample_ids(tok, sample, setting, grid.chat)
                for ratio in grid.ratios:
                    for label in labels:
                        key = Q.task_key(grid.model, task, sample.id, setting, "kvpress", {"press": label},
                                         ratio, grid.max_new[task], grid.ctx, grid.chat)
                        if add("task", key, label, ratio, prompt_ids=prompt_ids[0].tolist(),
                               full_ids=full_ids[0].tolist(), max_new=grid.max_new[task]):
                            meta[key] = {"answers": list(sample.answers)}
    for i in range(grid.n_prose):
        prefix, cont = Q.prose_ids(tok, i, args.split, grid.prose_ctx, grid.prose_tokens)
        for ratio in grid.ratios:
            for label in labels:
                key = Q.fidelity_key(grid.model, i, args.split, "kvpress", {"press": label}, ratio,
                                     grid.prose_ctx, grid.prose_tokens)
                add("fidelity", key, label, ratio, index=i, prefix_ids=prefix[0].tolist(),
                    cont_ids=cont[0].tolist())
    with open(path, "w") as f:
        json.dump({"model": grid.model, "model_dir": str(model_dir), "threads": args.threads,
                   "requests": requests, "answers": meta}, f)
    print(f"{path}: {len(requests)} kvpress requests ({grid.model}, {args.split})", file=sys.stderr)
    return 0


def read_results(path: str) -> list[dict]:
    """The JSON lines of a results file; blank lines are skipped, and so is a truncated *last* line
    (an interrupted run), with a warning. Any other bad line raises ``ValueError`` naming file and line."""
    with open(path) as f:
        lines = f.read().split("\n")
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as err:
            if all(not rest.strip() for rest in lines[number:]):
                print(f"{path}:{number}: skipping a truncated last line ({err.msg})", file=sys.stderr)
                continue
            raise ValueError(f"{path}:{number}: not a JSON line ({err.msg})") from None
    return out


def merge(requests_path: str, results_path: str, cache_dir=Q.CACHE_DIR) -> int:
    """Score and store the results of ``results_path`` for the requests of ``requests_path``.
    Returns 0 when every request has a result, else 1. Raises ``ValueError`` for a malformed file."""
    from eval.synthetic import score

    try:
        with open(requests_path) as f:
            spec = json.load(f)
        kinds = {r["key"]: r["kind"] for r in spec["requests"]}
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{requests_path}: not a requests file written by `bridge export` ({err!r})") from None
    need = {"task": ("text",), "fidelity": ("kl", "nll_increase")}
    store = Q.ResultCache(cache_dir)
    merged = set()
    for result in read_results(results_path):
        key = result.pop("key", None)
        if key not in kinds:
            continue
        missing = [field for field in need[kinds[key]] if field not in result]
        if missing:
            raise ValueError(f"{results_path}: result {key} has no {', '.join(missing)}")
        if kinds[key] == "task":
            result["score"] = score(spec["answers"][key], result["text"])
        store.put(key, {**result, "source": "kvpress"})
        merged.add(key)
    print(f"merged {len(merged)} of {len(kinds)} kvpress results into {store.root}", file=sys.stderr)
    return 0 if len(merged) == len(kinds) else 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "export":
        return export(argv[1], argv[2:])
    if len(argv) == 3 and argv[0] == "merge":
        return merge(argv[1], argv[2])
    raise SystemExit(__doc__)


if __name__ == "__main__":
    sys.exit(main())
