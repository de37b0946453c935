"""Generate with a compressed cache on a model sharded by tensor parallelism, or in one process.

    torchrun --nproc_per_node 2 tools/tp_generate.py FOLDER [--ratio 0.25] [--prompt-file F] [--tokens 24]
    python tools/tp_generate.py FOLDER ...        # the same, in one process (the reference)

FOLDER: a saved model (and its tokenizer) of a family jacap_attn supports. Under ``torchrun`` every
rank loads it with ``tp_plan="auto"`` (NCCL on GPUs, gloo on the CPU), patches it, and generates
greedily from the same prompt; rank 0 prints the new tokens' ids and text. The two commands print the
same lines (tests/test_tensor_parallel.py runs both on a tiny model). docs/usage.md#sharded-and-data-parallel-models.
"""

from __future__ import annotations

import argparse
import os

import torch
import transformers

import jacap_attn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--prompt-file", help="the prompt (default: a fixed sentence repeated to ~400 words)")
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    sharded = int(os.environ.get("WORLD_SIZE", "1")) > 1
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.folder)
    placement = {"distributed_config": transformers.DistributedConfig(tp_plan="auto")} if sharded else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32, **placement).eval()
    jacap_attn.patch(model, ratio=args.ratio, tokenizer=tokenizer)
    text = open(args.prompt_file).read() if args.prompt_file else " ".join(
        f"Note {i}: the weather was mild and nothing happened." for i in range(50))
    ids = tokenizer(text, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=args.tokens, do_sample=False)[0, ids.shape[1]:]
    if int(os.environ.get("RANK", "0")) == 0:
        print("ids:", out.tolist())
        print("text:", tokenizer.decode(out, skip_special_tokens=True))


if __name__ == "__main__":
    main()
