"""kvpress side by side: export our exact prompts for kvpress, then score its answers with our scorer.

Runs in the project's venv; the presses themselves run in kvpress's venv
(:mod:`eval.kvpress.run_presses`), because kvpress 0.5.5 pins ``transformers<5.3``.

    python -m eval.kvpress.bridge export  REQUESTS.json <jacap bench quality arguments>
    .venv-kvpress/bin/python eval/kvpress/run_presses.py REQUESTS.json RESULTS.jsonl
    python -m eval.kvpress.bridge merge   REQUESTS.json RESULTS.jsonl

``export`` walks the same grid as ``jacap bench quality`` with the same arguments (model, split,
tasks, ``n``, ratios, settings, fidelity) and writes, for every ``kvpress:*`` row of ``--methods``
(all of :data:`jacap_attn.quality.KVPRESS` if none is given) that is not yet in the result cache, the
token ids our harness would compress and decode. ``merge`` scores the returned texts with
:func:`jacap_attn.tasks.score` and stores them in the harness's result cache under the same keys, so
``jacap bench quality --methods ... kvpress:snapkv ...`` puts them in the same table as our rows.
``make bench-kvpress`` runs the three steps.
"""

from __future__ import annotations

import json
import sys

from jacap_attn import quality as Q


def export(path: str, argv: list[str]) -> int:
    from jacap_attn import tasks as T
    from jacap_attn.models import ensure_model, load_model

    args = Q.build_parser().parse_args(argv)
    cfg = Q.load_config(args.config or Q.CONFIG_DIR / ("quality_quick.json" if args.quick else "quality_full.json"))
    args.split = args.split or cfg.get("default_split", "heldout")
    labels = [label for label in (args.methods or Q.KVPRESS) if label.startswith("kvpress:")]
    unknown = [label for label in labels if label not in Q.KVPRESS]
    if unknown or not labels:
        raise SystemExit(f"kvpress rows {unknown or 'none'} among --methods; known: {', '.join(Q.KVPRESS)}")
    store = Q.ResultCache(args.cache_dir)
    requests, meta = [], {}
    model_names = args.models or list(cfg["models"])
    if len(model_names) != 1:
        raise SystemExit("export one model at a time (--models NAME)")
    model_name = model_names[0]
    mcfg = cfg["models"][model_name]
    _, tok = load_model(model_name)
    chat, ctx = bool(mcfg.get("chat", False)), int(mcfg["context_tokens"])
    n = args.n if args.n is not None else int(cfg.get("n", 4))
    for ratio in args.ratios or cfg["ratios"]:
        for setting in args.settings or cfg.get("settings", ["aware"]):
            for task in args.tasks or mcfg.get("tasks", cfg["tasks"]):
                max_new = int(cfg.get("max_new_tokens", {}).get(task, Q.DEFAULT_MAX_NEW.get(task, 32)))
                for sample in T.generate(task, tok, n, ctx, seed=cfg["splits"][args.split]["seed"]):
                    prompt_ids, full_ids = Q.sample_ids(tok, sample, setting, chat)
                    for label in labels:
                        key = Q.task_key(model_name, task, sample.id, setting, "kvpress", {"press": label},
                                         ratio, max_new, ctx, chat)
                        if store.get(key) is None:
                            press, kwargs = Q.KVPRESS[label]
                            requests.append({"kind": "task", "key": key, "press": press, "kwargs": kwargs,
                                             "ratio": ratio, "prompt_ids": prompt_ids[0].tolist(),
                                             "full_ids": full_ids[0].tolist(), "max_new": max_new})
                            meta[key] = {"answers": list(sample.answers)}
        fcfg = cfg.get("fidelity", {})
        n_prose = int(args.fidelity_n if args.fidelity_n is not None else fcfg.get("n", 4)) if args.fidelity else 0
        fctx, m = int(fcfg.get("context_tokens", ctx)), int(fcfg.get("tokens", 64))
        for i in range(n_prose):
            prefix, cont = Q.prose_ids(tok, i, args.split, fctx, m)
            for label in labels:
                key = Q.fidelity_key(model_name, i, args.split, "kvpress", {"press": label}, ratio, fctx, m)
                if store.get(key) is None:
                    press, kwargs = Q.KVPRESS[label]
                    requests.append({"kind": "fidelity", "key": key, "press": press, "kwargs": kwargs,
                                     "ratio": ratio, "index": i, "prefix_ids": prefix[0].tolist(),
                                     "cont_ids": cont[0].tolist()})
    with open(path, "w") as f:
        json.dump({"model": model_name, "model_dir": str(ensure_model(model_name)), "threads": args.threads,
                   "requests": requests, "answers": meta}, f)
    print(f"{path}: {len(requests)} kvpress requests ({model_name}, {args.split})", file=sys.stderr)
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
    from jacap_attn.tasks import score

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
