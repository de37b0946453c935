"""Hash every look-alike sample behind the committed configs, to see which samples a generator change moves.

For each ``eval/configs/lookalike*.json``, each model of it (its converted tokenizer in
:func:`jacap_attn.models.model_dir`, made by :func:`jacap_attn.models.load_model`), each task, each
split, n = the config's ``n`` and 48: sha256 (16 hex digits) of the sample's context, question, answers
and answer prefix, written as JSON ``{"<config>/<model>/<task>/<split>/<n>/<i>": hash}``.

    PYTHONPATH=. python tools/lookalike_hashes.py before.json   # on the old code (a git worktree)
    PYTHONPATH=. python tools/lookalike_hashes.py after.json
    python -c "import json,sys; a,b=(json.load(open(f)) for f in sys.argv[1:]); print([k for k in a if a[k]!=b.get(k)])" before.json after.json

About 1 minute on one core (2,496 samples).
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from eval.ruler import generate_task
from jacap_attn.models import model_dir


def main(out: str) -> None:
    tokenizers = {}
    hashes = {}
    for path in sorted(Path("eval/configs").glob("lookalike*.json")):
        cfg = json.loads(path.read_text())
        for model, mcfg in cfg["models"].items():
            if model not in tokenizers:
                tokenizers[model] = AutoTokenizer.from_pretrained(str(model_dir(model)), local_files_only=True)
            for task in mcfg["tasks"]:
                options = dict(cfg.get("task_variants", {}).get(task, {}))
                base = options.pop("task", task)
                for split, spec in cfg["splits"].items():
                    for n in sorted({cfg["n"], 48}):
                        samples = generate_task(base, tokenizers[model], n, int(mcfg["context_tokens"]),
                                                spec["seed"], **options)
                        for i, s in enumerate(samples):
                            text = json.dumps([s.context, s.question, s.answers, s.answer_prefix])
                            hashes[f"{path.stem}/{model}/{task}/{split}/{n}/{i}"] = \
                                hashlib.sha256(text.encode()).hexdigest()[:16]
    Path(out).write_text(json.dumps(hashes, indent=0, sort_keys=True))
    print(f"{len(hashes)} samples hashed into {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: PYTHONPATH=. python tools/lookalike_hashes.py OUT.json")
    main(sys.argv[1])
