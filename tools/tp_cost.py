"""What the cross-rank agreement costs under tensor parallelism (docs/architecture.md#tensor-parallelism).

    torchrun --standalone --nproc_per_node 2 tools/tp_cost.py [--tokens 2048] [--layers 8] [--json OUT]

A random-weight Llama of a mid size (hidden 512, 8 query and 8 KV heads of 64, ``--layers`` layers) is
saved once to a temporary folder and loaded by every rank with ``tp_plan="auto"`` (gloo on the CPU, one
thread per rank); rank 0 also loads it alone. Timed (median of ``--repeats``): the stock prefill
(``model(ids)``, no cache) and the compressed prefill (:func:`jacap_attn.compress`, Jacap, ``global``
budget, ``--ratio``), each on one process and on the ranks; counted during one compressed prefill: the
calls and payload bytes of jacap_attn's own collectives (the head gathers of the cut, the agreement of
question-time and save decisions) beside the model's own (the row-parallel all-reduces of transformers'
tensor parallelism), and the seconds spent in jacap_attn's. The payload of an all-gather is what a rank
receives (its peers' tensors); of an all-reduce, the tensor. Rank 0 prints one line per row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import jacap_attn
from jacap_attn.storage import distributed as heads

COUNTS: dict = {}
_INSIDE = [False]  # within a jacap_attn collective (HeadGroup, the fingerprint's all-reduce)


def _count(name: str, original):
    def wrapper(*args, **kwargs):
        who = "jacap_attn" if _INSIDE[0] else "model"
        tensor = args[1] if name == "all_gather" else args[0]
        size = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
        received = size * (dist.get_world_size() - 1) if name == "all_gather" else size
        start = time.perf_counter()
        out = original(*args, **kwargs)
        entry = COUNTS.setdefault(who, {"calls": 0, "bytes": 0, "seconds": 0.0})
        entry["calls"] += 1
        entry["bytes"] += received
        entry["seconds"] += time.perf_counter() - start
        return out
    return wrapper


def _ours(method):
    def wrapper(*args, **kwargs):
        outer, _INSIDE[0] = _INSIDE[0], True
        try:
            return method(*args, **kwargs)
        finally:
            _INSIDE[0] = outer
    return wrapper


def instrument() -> None:
    """Count every all-gather, all-reduce and object broadcast; those run by jacap_attn's HeadGroup apart."""
    for name in ("all_gather", "all_reduce", "broadcast_object_list"):
        setattr(dist, name, _count(name, getattr(dist, name)))
    for name in ("gather", "gather_padded", "any", "share"):
        setattr(heads.HeadGroup, name, _ours(getattr(heads.HeadGroup, name)))


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = Path(tempfile.gettempdir()) / f"jacap_tp_cost_{args.layers}"
    if rank == 0 and not (folder / "config.json").exists():
        config = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1536,
                                          num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                                          head_dim=64, max_position_embeddings=args.tokens + 64)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
    dist.barrier()
    tp = transformers.AutoModelForCausalLM.from_pretrained(
        folder, distributed_config=transformers.DistributedConfig(tp_plan="auto"), dtype=torch.float32).eval()
    ids = torch.randint(3, 1000, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    rows = {}
    with torch.no_grad():
        rows["stock prefill, tensor-parallel"] = timed(lambda: tp(ids, use_cache=False, logits_to_keep=1), args.repeats)
        jacap_attn.patch(tp, ratio=args.ratio, min_tokens=0)
        jacap_attn.compress(tp, ids)  # the fingerprint, once
        rows["jacap prefill, tensor-parallel"] = timed(lambda: jacap_attn.compress(tp, ids), args.repeats)
        instrument()
        jacap_attn.compress(tp, ids)
        counted = json.loads(json.dumps(COUNTS))
        if rank == 0:  # one process, while the other rank waits
            sp = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            for name, fn in (("stock prefill, one process", lambda: sp(ids, use_cache=False, logits_to_keep=1)),
                             ("jacap prefill, one process", lambda: jacap_attn.compress(sp, ids))):
                if name.startswith("jacap"):
                    jacap_attn.patch(sp, ratio=args.ratio, min_tokens=0)
                    fn()
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - start)
                rows[name] = statistics.median(times)
        with contextlib.suppress(Exception):
            dist.barrier()
    if rank == 0:
        result = {"world_size": world, "tokens": args.tokens, "layers": args.layers, "ratio": args.ratio,
                  "seconds": rows, "collectives_per_compressed_prefill": counted}
        for name, seconds in rows.items():
            print(f"{name}: {seconds:.3f} s")
        for who, entry in counted.items():
            print(f"{who} collectives in one compressed prefill: {entry['calls']} calls, "
                  f"{entry['bytes'] / 2**20:.2f} MiB received per rank, {entry['seconds']:.4f} s")
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
