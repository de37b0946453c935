"""What Jacap's ridge leverage in bfloat16 would save a reselected question (issue 33; a measurement, not a feature).

The question of ``python -m eval.speed --only-routes`` (SmolLM2, the 1,900-token prose document stored whole,
``reselect=0.1``, a 32-token question, 1 thread, CPU seconds, min of 5) is timed with the library's ridge
leverage and with a prototype that runs its two ``n x d x d`` products (the Gram matrix and the quadratic
form) in bfloat16 inputs with float32 accumulation, alternating so that both see the same machine load.
Prints each one's cost against the same question without rescoring, and how much of each (layer, KV
head)'s reselected set the prototype keeps. The prototype lives in this script only (monkeypatched over
:func:`jacap_attn.math.scoring.ridge_leverage` for its rows).

    PYTHONPATH=. python tools/reselect_bf16_probe.py
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch

import jacap_attn
from jacap_attn.math import scoring
from jacap_attn.models import load_model
from eval.speed import memory_prompt, route_inputs


def bf16_leverage(weights: torch.Tensor, directions: torch.Tensor, ridge: float, *, relative: bool = True):
    """:func:`jacap_attn.math.scoring.ridge_leverage` with its two products in bfloat16 inputs."""
    u = directions.float()
    d = u.shape[-1]
    low = u.bfloat16()
    gram = ((u * weights[..., None]).bfloat16().transpose(-1, -2) @ low).float()
    lam = ridge * gram.diagonal(dim1=-2, dim2=-1).sum(-1) / d if relative else torch.full(gram.shape[:-2], float(ridge))
    inverse = scoring._ridge_inverse(gram, lam)
    return weights * ((low @ inverse.bfloat16()).float() * u).sum(-1)


def main() -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2", dtype=torch.float32, device=torch.device("cpu"), attn_implementation="sdpa")
    document = memory_prompt(tokenizer, torch.zeros(1, 1900, dtype=torch.long), {})
    _, question = route_inputs(tokenizer, document, model.config.vocab_size)
    jacap_attn.patch(model, ratio=1.0, reselect=0.1)
    with torch.no_grad():
        whole = jacap_attn.compress(model, document)

    def timed(**config):
        cache = copy.deepcopy(whole)
        if config:
            cache.config = dataclasses.replace(cache.config, **config)
        start = time.process_time()
        with torch.no_grad():
            model(input_ids=question, cache=cache, use_cache=True, logits_to_keep=1)
        return time.process_time() - start, cache

    exact, kept = scoring.ridge_leverage, {}
    for name, leverage in (("float32", exact), ("bfloat16", bf16_leverage)) * 2:
        scoring.ridge_leverage = leverage
        try:
            for _ in range(2):
                timed(), timed(reselect=None)
            reselected = min(timed()[0] for _ in range(5))
            plain = min(timed(reselect=None)[0] for _ in range(5))
            kept[name] = [layer.positions.masked_fill(~layer.valid, -1)[0] for layer in timed()[1].layers]
        finally:
            scoring.ridge_leverage = exact
        print(f"leverage in {name}: reselected {reselected:.3f} s, not rescored {plain:.3f} s, {reselected / plain:.2f}x")
    shares = []
    for a, b in zip(kept["float32"], kept["bfloat16"]):
        for head in range(a.shape[0]):
            want, got = set(a[head][a[head] >= 0].tolist()), set(b[head][b[head] >= 0].tolist())
            shares.append(len(want & got) / max(len(want), 1))
    print(f"reselected sets kept by the bfloat16 prototype: mean {sum(shares) / len(shares):.4f}, "
          f"lowest {min(shares):.4f} over {len(shares)} (layer, KV head) pairs")


if __name__ == "__main__":
    main()
