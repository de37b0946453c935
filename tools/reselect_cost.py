"""What a reselected question costs, and where its floor lies (issue 33; a measurement, not a feature).

A document is stored whole (``patch(ratio=1, reselect=R)``, :func:`jacap_attn.compress`), then a
32-token question (:data:`eval.speed.QUESTION_TOKENS`) is forwarded over a fresh copy of it (``logits_to_keep=1``, as
``generate``'s first step) with question-time reselection and without it (``reselect=None``: the same
forward over every stored entry, nothing rescored). The two take turns ``--repeats`` times after two
warm-up rounds; CPU seconds, min of each. That is the ratio that ``python -m eval.speed --only-routes``
reports and issue 33 bounds (1.25x).

Each ``--leverage`` variant replaces Jacap's ridge leverage (:func:`jacap_attn.math.scoring.ridge_leverage`)
for its rows, monkeypatched in this script only:

- ``float32``: the library's own (the shipped method);
- ``bfloat16``: its two ``n x d x d`` products (Gram matrix, quadratic form) in bfloat16 inputs with float32
  accumulation (a prototype; it changes selections: the share of each (layer, KV head)'s reselected set it
  keeps is printed);
- ``none``: no leverage at all (the importance weights stand in, at no cost). Not a method: the cost of
  every other step of a reselected question, i.e. the ratio no cheaper leverage can go below.

The variants run in turns (``--rounds`` times each), so all see the same machine load. ``--steps`` also
times the cut's steps (:mod:`jacap_attn.selection.steps`) in place, ms per question.

    PYTHONPATH=. python tools/reselect_cost.py                        # SmolLM2, 1,900-token prose document
    PYTHONPATH=. python tools/reselect_cost.py --leverage float32 bfloat16
    PYTHONPATH=. python tools/reselect_cost.py --config llama-8b --layers 4   # the 8B shape, 4 of its layers, random weights

Random weights (``--config``, a preset of :data:`eval.speed.PRESETS` or a config.json; ``--layers`` keeps
that many layers, since the ratio is per layer) read random token ids: the cost does not depend on the
weights. ``--out`` writes the figures as JSON (atomically).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jacap_attn  # noqa: E402
from jacap_attn.files.paths import write_atomically  # noqa: E402
from jacap_attn.math import scoring  # noqa: E402
from jacap_attn.selection import steps as cut_steps  # noqa: E402
from eval.speed import (PRESETS, QUESTION_TOKENS, _alternated_calls, cpu_name, memory_prompt,  # noqa: E402
                        random_model, route_inputs)

VARIANTS = ("float32", "bfloat16", "none")
STEPS = ("assign_layer_budgets", "assign_head_budgets", "keep_special_tokens", "close_spans", "gather")


def bf16_leverage(weights: torch.Tensor, directions: torch.Tensor, ridge: float, *, relative: bool = True):
    """:func:`jacap_attn.math.scoring.ridge_leverage` with its two products in bfloat16 inputs."""
    u = directions.float()
    d = u.shape[-1]
    low = u.bfloat16()
    gram = ((u * weights[..., None]).bfloat16().transpose(-1, -2) @ low).float()
    lam = ridge * gram.diagonal(dim1=-2, dim2=-1).sum(-1) / d if relative else torch.full(gram.shape[:-2], float(ridge))
    inverse = scoring._ridge_inverse(gram, lam)
    return weights * ((low @ inverse.bfloat16()).float() * u).sum(-1)


def no_leverage(weights: torch.Tensor, directions: torch.Tensor, ridge: float, *, relative: bool = True):
    """No leverage: the weights themselves, ``[b, h, n]`` (a cost floor, not a method)."""
    return weights.clone()


LEVERAGE = {"float32": scoring.ridge_leverage, "bfloat16": bf16_leverage, "none": no_leverage}


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default="smollm2", help="model name (jacap_attn.models; default smollm2)")
    source.add_argument("--config", help=f"random weights instead: {', '.join(PRESETS)} or a config.json path")
    parser.add_argument("--layers", type=int, help="with --config: keep this many layers")
    parser.add_argument("--context", type=int, default=1900, help="document tokens (default 1900)")
    parser.add_argument("--reselect", type=float, default=0.1, help="kept fraction at question time (default 0.1)")
    parser.add_argument("--leverage", nargs="+", choices=VARIANTS, default=["float32", "none"])
    parser.add_argument("--repeats", type=int, default=5, help="timed turns per variant and round (min taken)")
    parser.add_argument("--rounds", type=int, default=2, help="times each variant runs, in turns (default 2)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", action="store_true", help="also time the cut's steps in place")
    parser.add_argument("--out", help="JSON path for the figures")
    args = parser.parse_args(argv)
    args.leverage = list(dict.fromkeys(args.leverage))  # each variant once per round
    for name in ("context", "repeats", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.layers is not None and args.config is None:
        parser.error(f"--layers {args.layers} keeps layers of a random-weight model: it needs --config")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be at least 1, got {args.layers}")
    if args.config is not None and args.config not in PRESETS and not pathlib.Path(args.config).expanduser().is_file():
        parser.error(f"--config {args.config!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
    if args.config in PRESETS and args.context > PRESETS[args.config].get("max_position_embeddings", args.context):
        parser.error(f"--context {args.context} is past the {args.config} preset's "
                     f"{PRESETS[args.config]['max_position_embeddings']} positions")
    if args.out is not None:
        out = pathlib.Path(args.out).expanduser()
        if out.is_dir() or not out.parent.is_dir():
            parser.error(f"--out {args.out!r}: not a file path in an existing folder")
    if not 0 < args.reselect < 1:
        parser.error(f"--reselect must be in (0, 1), got {args.reselect}")
    return args


def load(args):
    """``(model, document [1, n], question [1, q], label)``."""
    if args.config is None:
        from jacap_attn.models import load_model

        model, tokenizer = load_model(args.model, dtype=torch.float32, device=torch.device("cpu"))
        document = memory_prompt(tokenizer, torch.zeros(1, args.context, dtype=torch.long), {})
        return model, document, route_inputs(tokenizer, document, model.config.vocab_size)[1], args.model
    model = random_model(args.config, torch.float32, "cpu", layers=args.layers)
    config = model.config
    document = torch.randint(3, config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    label = f"{args.config} ({config.num_hidden_layers} layers, random weights)"
    return model, document, route_inputs(None, document, config.vocab_size)[1], label


@dataclasses.dataclass
class StepTimer:
    """CPU seconds spent in each of :data:`STEPS` while :attr:`on` (the functions wrapped in place)."""

    on: bool = False
    spent: dict = dataclasses.field(default_factory=dict)

    def install(self):
        for name in STEPS:
            original = getattr(cut_steps, name)

            @functools.wraps(original)
            def timed(*a, _original=original, _name=name, **k):
                start = time.process_time()
                try:
                    return _original(*a, **k)
                finally:
                    if self.on:
                        self.spent[_name] = self.spent.get(_name, 0.0) + time.process_time() - start
            setattr(cut_steps, name, timed)


def main(argv=None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    model, document, question, label = load(args)
    question = question[:, :QUESTION_TOKENS]
    jacap_attn.patch(model, ratio=1.0, reselect=args.reselect)
    with torch.no_grad():
        whole = jacap_attn.compress(model, document)
    timer = StepTimer()
    if args.steps:
        timer.install()

    def ask(cache):
        with torch.no_grad():
            model(input_ids=question, cache=cache, use_cache=True, logits_to_keep=1)
        return cache

    def stored(reselect: bool):  # a fresh copy of the stored document, made before the clock starts
        def copy_of_whole():
            cache = copy.deepcopy(whole)
            if not reselect:
                cache.config = dataclasses.replace(cache.config, reselect=None)
            return cache
        return copy_of_whole

    calls = {"reselected": (ask, stored(True)), "plain": (ask, stored(False))}  # taking turns: a b a b ...
    cpu = torch.device("cpu")
    rows, kept = {name: [] for name in args.leverage}, {}
    exact = scoring.ridge_leverage
    print(f"{label}: document {document.shape[1]} tokens stored whole, a {question.shape[1]}-token question, "
          f"reselect={args.reselect}, {args.threads} thread(s), CPU seconds, min of {args.repeats}", flush=True)
    for _ in range(args.rounds):
        for name in args.leverage:
            scoring.ridge_leverage = LEVERAGE[name]
            try:
                _alternated_calls(cpu, 2, calls)  # warm-up
                timer.on, timer.spent = name == "float32", {}  # only the reselected question cuts
                records, results = _alternated_calls(cpu, args.repeats, calls)
                timer.on = False
                kept.setdefault(name, [layer.positions.masked_fill(~layer.valid, -1)[0]
                                       for layer in results["reselected"].layers])
            finally:
                scoring.ridge_leverage = exact
            reselected, plain = records["reselected"]["cpu_seconds"], records["plain"]["cpu_seconds"]
            rows[name].append({"reselected_s": reselected, "plain_s": plain, "ratio": reselected / plain,
                               "steps_ms": {k: 1e3 * v / args.repeats for k, v in timer.spent.items()}})
            print(f"leverage {name}: reselected {reselected:.3f} s, not rescored {plain:.3f} s, "
                  f"{reselected / plain:.2f}x", flush=True)
            if timer.spent:
                print("  cut steps, ms per question: " + ", ".join(
                    f"{k} {1e3 * v / args.repeats:.1f}" for k, v in timer.spent.items()), flush=True)
    agreement = {}
    if "float32" in kept:
        for name in set(kept) - {"float32", "none"}:
            shares = []
            for a, b in zip(kept["float32"], kept[name]):
                for head in range(a.shape[0]):
                    want, got = set(a[head][a[head] >= 0].tolist()), set(b[head][b[head] >= 0].tolist())
                    shares.append(len(want & got) / max(len(want), 1))
            agreement[name] = {"mean": sum(shares) / len(shares), "lowest": min(shares), "pairs": len(shares)}
            print(f"reselected sets the {name} leverage keeps of float32's: mean {agreement[name]['mean']:.4f}, "
                  f"lowest {agreement[name]['lowest']:.4f} over {len(shares)} (layer, KV head) pairs")
    if args.out:
        result = {"command": "python tools/reselect_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  "model": label, "context": int(document.shape[1]), "question_tokens": int(question.shape[1]),
                  "reselect": args.reselect, "threads": args.threads, "repeats": args.repeats,
                  "cpu": cpu_name(), "rows": rows, "agreement": agreement}
        write_atomically(args.out, (json.dumps(result, indent=2) + "\n").encode())
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
