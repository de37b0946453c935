"""Where a chunked prefill loses the asked value: its kept share after every cut, layer by layer.

A chunked prefill (``chunk_size``) cuts the cache after every chunk (:mod:`jacap_attn.routes.chunk`).
When it answers worse than one-shot compression, the question is at which cut and in which layer the
asked value's entries went. :func:`trace_cuts` runs one compression with a hook around
:func:`jacap_attn.selection.cut` (every cut of a prefill, chunked or not, goes through it; a prefill's
own cut calls it as ``selection.steps.cut``) and records, after each cut, the share of the value's
prompt positions seen so far that each layer keeps (:func:`eval.spans.kept_share`, averaged over the
layer's KV heads).

    python -m eval.chunk_trace --model gemma3-270m --task niah_single_2 --n 4 --ratio 0.25 \\
        --row 'jacap, chunked 1024, repeat' --row 'jacap[chunk_size=1024,chunk_scores=repeat,budget=uniform]'

prints one line per sample and row: the answer's score, then per cut the shares of the layers the
method selects in (:func:`eval.quality.selected_layers`; on Gemma the full-attention ones). RULER
samples of the tuning split (seed 1000) unless ``--split heldout``.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from unittest import mock

import torch

__all__ = ["trace_cuts"]


@contextmanager
def _cuts_traced(positions, layers: list[int], log: list):
    """Within: after every :func:`jacap_attn.selection.cut`, append to ``log`` the kept share of the
    ``positions`` the cache has seen, per layer of ``layers`` (``None`` where none was seen yet). An
    empty ``layers`` is filled at the first cut with the cache's selected layers."""
    from jacap_attn import selection
    from jacap_attn.selection import steps

    from eval import quality, spans

    cut = steps.cut

    def traced(cache, plans, request):
        out = cut(cache, plans, request)
        if not layers:
            layers.extend(quality.selected_layers(cache))
        seen = int(cache.layers[layers[0]].next_positions().max())
        here = [p for p in positions if p < seen]
        log.append([spans.kept_share(cache, here, [i]) if here else None for i in layers])
        return out

    # The routes call `selection.cut`; a prefill's own cut (`finalize_prefill`) calls `steps.cut`.
    with mock.patch.object(selection, "cut", traced), mock.patch.object(steps, "cut", traced):
        yield


def trace_cuts(model, prompt_ids: torch.Tensor, config, positions: list[int]):
    """Compress ``prompt_ids [1, n]`` with the patched ``model`` under ``config`` (a
    :class:`~jacap_attn.config.JacapConfig`; chunked or not) and return ``(cache, layers, shares)``:
    ``layers`` the layers the method selects in (:func:`eval.quality.selected_layers`), ``shares[c][j]``
    the share of ``positions`` (prompt token positions, e.g. a value's) that layer ``layers[j]`` keeps
    after cut ``c``, among the positions seen by then (``None`` before any is seen), averaged over its
    KV heads. Raises ``ValueError`` for empty ``positions``."""
    import jacap_attn

    if not positions:
        raise ValueError("trace_cuts needs positions (the value's prompt token positions), got none")
    layers: list = []
    log: list = []
    with torch.no_grad(), _cuts_traced(positions, layers, log):
        cache = jacap_attn.compress(model, prompt_ids, config=config)
    return cache, layers, log


def main(argv=None) -> int:
    from eval import answers, quality
    from eval import synthetic as T
    from eval.ruler import tasks as ruler_tasks

    from jacap_attn.models import load_model
    from jacap_attn.prompts import repeat_instruction_ids

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--task", default="niah_single_2", help="a RULER NIAH task (eval/ruler)")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--context", type=int, default=None, help="document tokens (default: eval/configs/ruler.json's)")
    parser.add_argument("--split", choices=("tuning", "heldout"), default="tuning")
    parser.add_argument("--row", action="append", required=True,
                        help="a row label of eval.quality (e.g. 'jacap, chunked 1024, repeat' or 'jacap[chunk_size=512]')")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if not 0.0 < args.ratio <= 1.0:
        parser.error(f"--ratio must be in (0, 1], got {args.ratio}")
    rows = [(label, *quality.variant(label)) for label in args.row]  # ValueError for an unknown row, before loading
    torch.set_num_threads(args.threads)
    cfg = quality.load_config(quality.CONFIG_DIR / "ruler.json")
    ctx = args.context or cfg["models"][args.model]["context_tokens"]
    chat = cfg["models"][args.model]["chat"]
    seed = cfg["splits"][args.split]["seed"]
    model, tok = load_model(args.model)
    quality.ensure_patched(model)
    repeat_ids = repeat_instruction_ids(tok, chat=chat)
    for sample in ruler_tasks.generate(args.task, tok, args.n, ctx, seed=seed):
        prompt_ids, full_ids = quality.sample_ids(tok, sample, "aware", chat)
        positions = quality.value_positions(tok, sample, "aware", chat)
        parts = []
        for label, method, options in rows:
            config = quality.make_config(method, options, args.ratio, repeat_ids)
            cache, layers, shares = trace_cuts(model, prompt_ids, config, positions)
            text = tok.decode(answers.greedy(model, tok, cache, full_ids, sample, 32)[0], skip_special_tokens=True)
            cuts = " ".join("[" + ",".join("-" if s is None else f"{s:.2f}" for s in cut) + "]" for cut in shares)
            parts.append(f"{label}: score {T.score(sample, text):.0f}, cuts {cuts}")
        print(f"{sample.id} ({prompt_ids.shape[1]} tokens, value at {positions[0]}) layers {layers}: "
              + " | ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
