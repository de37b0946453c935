"""Where the repeat pass's attention goes (issue 24: why ``queries="repeat"`` fails on Gemma).

    python tools/repeat_copy.py gemma3-270m [--task multikey_needle] [--seed 1000] [--chunk 512]

One tuning-split document of ``eval.synthetic`` (1,000 tokens on SmolLM2, 1,024 on Gemma), the repeat
instruction of ``queries="repeat"`` (:func:`jacap_attn.prompts.repeat_instruction_ids`) and the
document's first ``--chunk`` tokens replayed after it, teacher-forced, in one eager forward (the
repeat route's first chunk). Prints how well the model copies (greedy accuracy and NLL of the
replayed tokens, against the NLL of their first reading) and, per full-attention layer, how the
copy queries' attention spreads over the replayed document tokens: the median and 10th percentile
over those tokens of their peak attention (max over query heads and copy queries, the ``peak``
statistic the route's ``global`` budget ranks), the share of tokens whose peak exceeds 0.3, and how
often a copy query's most attended key is its own token's original or the next one (induction).
A layer whose copy reads nearly every token strongly ranks nothing above anything else: its
repeat-pass scores select close to a random subset. Needs ``eval`` on the path (run it from the
repository root: ``PYTHONPATH=. python tools/repeat_copy.py ...``).
"""

from __future__ import annotations

import argparse

import torch

from jacap_attn import prompts
from jacap_attn.models import load_model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=("smollm2", "gemma3-270m"))
    parser.add_argument("--task", default="multikey_needle")
    parser.add_argument("--seed", type=int, default=1000, help="1000: the tuning split's seed")
    parser.add_argument("--chunk", type=int, default=512, help="replayed document tokens (the route's repeat_chunk)")
    args = parser.parse_args(argv)
    if args.chunk < 2:
        parser.error(f"--chunk must be at least 2, got {args.chunk}")
    from eval.synthetic import generate  # the repository's task generators (not installed)

    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    model.set_attn_implementation("eager")
    model.eval()
    chat = args.model == "smollm2"
    sample = generate(args.task, tok, 1, 1000 if chat else 1024, seed=args.seed)[0]
    doc = tok(sample.context, add_special_tokens=False).input_ids
    bos = [] if chat or tok.bos_token_id is None else [tok.bos_token_id]
    ids, rep, chunk = bos + doc, prompts.repeat_instruction_ids(tok, chat=chat), doc[: args.chunk]
    n, q0 = len(ids), len(ids) + len(rep)
    with torch.no_grad():
        out = model(torch.tensor([ids + rep + chunk]), output_attentions=True)
    copy_logits = out.logits[0, q0 - 1: q0 + len(chunk) - 1].float()
    target = torch.tensor(chunk)
    first = torch.nn.functional.cross_entropy(out.logits[0, len(bos): len(bos) + len(chunk) - 1].float(),
                                              target[1:]).item()
    print(f"{args.model}, {args.task} seed {args.seed}: {n} prompt tokens; replaying {len(chunk)}: greedy "
          f"accuracy {(copy_logits.argmax(-1) == target).float().mean():.3f}, NLL "
          f"{torch.nn.functional.cross_entropy(copy_logits, target):.3f} (first reading {first:.3f})")
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    j = torch.arange(len(chunk))
    for index, attn in enumerate(out.attentions):
        if types[index] != "full_attention":
            continue
        p = attn[0, :, q0:, :n].float()  # [heads, copy queries, prompt keys]
        peak = p.amax(dim=(0, 1))[len(bos): len(bos) + len(chunk)]
        top = p.amax(0).argmax(-1) - len(bos)
        induction = ((top == j) | (top == j + 1)).float().mean()
        print(f"  layer {index:2d}: peak median {peak.median():.3f}, 10th pct {peak.quantile(0.1):.3f}, "
              f"share > 0.3 {(peak > 0.3).float().mean():.2f}; top key own/next token {induction:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
