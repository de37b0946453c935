"""Does the observation window tell the asked key from its look-alikes? (issue 34; docs/method.md#d12-prompt-lookup)

    PYTHONPATH=. python tools/window_key_ranks.py --model gemma3-270m --task lookalike_pycode --n 48 \\
        --samples 1 3 8 9 10 12 16 17

For each look-alike sample (:mod:`eval.synthetic.lookalike`, tuning seed 1000, question in the prompt),
one recorded full-cache prefill, and per layer (Gemma3: its full-attention layers only) and KV head:
the rank among the prompt's tokens before the window of the asked key's best token, and of the best
look-alike key's, by the attention of the window's **last** query (GQA mean) and by the window's
**summed** attention, with the attention mass the last query puts on the asked key and on the
strongest look-alike key. Prints one line per sample; nothing is written.
"""

from __future__ import annotations

import argparse
import sys

import torch

from eval import quality as Q
from eval.ruler import generate_task
from jacap_attn.math import scoring
from jacap_attn.routes.window import window_queries

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from diagnose_lookalike import token_positions  # noqa: E402


def _rank(values: torch.Tensor, positions: list[int]) -> int:
    order = torch.argsort(values, descending=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(values))
    return int(rank[positions].min())


def key_spans(sample) -> list[list[int]]:
    """``[start, end)`` character spans of every fact's key in the sample's document, the asked one first."""
    meta = sample.meta
    return [[start + fact.index(key), start + fact.index(key) + len(key)]
            for (start, _), fact, key in zip(meta["fact_spans"], meta["facts"], meta["keys"])]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--task", default="lookalike_pycode")
    p.add_argument("--n", type=int, default=48)
    p.add_argument("--samples", nargs="*", type=int, help="sample indices to show (default: all)")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--context", type=int, default=1200)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from jacap_attn.models import load_model

    model, tok = load_model(args.model)
    Q.ensure_patched(model)
    chat = bool(Q.load_config(Q.CONFIG_DIR / "lookalike_tuning.json")["models"][args.model]["chat"])
    layer_types = getattr(model.config, "layer_types", None) or []
    for index, sample in enumerate(generate_task(args.task, tok, args.n, args.context, 1000)):
        if args.samples and index not in args.samples:
            continue
        prompt_ids, _ = Q.sample_ids(tok, sample, "aware", chat)
        n = prompt_ids.shape[1]
        keys = token_positions(tok, sample, key_spans(sample), chat)
        w = min(args.window, n)
        cells = []
        for layer, (query, k, _, scaling) in enumerate(Q.record_prefill(model, prompt_ids)):
            if layer < len(layer_types) and layer_types[layer] != "full_attention":
                continue
            h = k.shape[1]
            probs = scoring.window_attention(window_queries(query, h, w), k, scaling,
                                             torch.ones(1, n, dtype=torch.bool))[0].float()  # [h, g, w, n]
            last, summed = probs[:, :, -1, :].mean(1), probs.sum(2).mean(1)  # [h, n]
            for head in range(h):
                before = slice(0, n - w)
                others = keys[1:]
                cells.append(
                    f"L{layer}H{head} last: key {_rank(last[head, before], keys[0])} / look-alike "
                    f"{min(_rank(last[head, before], o) for o in others)}, mass {float(last[head, keys[0]].sum()):.3f} / "
                    f"{max(float(last[head, o].sum()) for o in others):.3f}; summed: key "
                    f"{_rank(summed[head, before], keys[0])} / look-alike {min(_rank(summed[head, before], o) for o in others)}")
        print(sample.id, sample.meta["form"], n, "|", " ; ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
