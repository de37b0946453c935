"""Where a chunked prefill's answer goes wrong, and what carrying the evicted attention mass changes.

A probe (issue 33; not the library's code): on a RULER sample it runs the patched chunked prefill of an
``eval.quality`` row (:func:`eval.chunk_oracle.chunked_run`, which records what every KV head holds after
each cut), then replays it as the masking oracle does (:func:`eval.chunk_oracle.oracle_logits`: the
unpatched model in one forward, each query masked to what its chunk's heads held) with the full cache's
greedy answer teacher-forced after the prompt. Variants of the replay:

* ``honest``: the chunked prefill as it runs (its logits are the patched model's, ``eval.chunk_oracle``);
* ``question exact`` / ``haystack exact``: the queries of the question (the prompt's task tail) / of
  the rest of the prompt see the whole prefix, the others what was held: which hidden states matter;
* ``compensated``: every full-attention KV head carries the evicted entries' attention mass: at each cut
  an evicted entry's mass (1 + what it carried) goes to the held entry of the same head whose key
  (after RoPE) is nearest in cosine, and the queries of the later chunks add ``log(1 + mass)`` to that
  entry's logit (proportional attention, as merged tokens are weighted in ToMe, Bolya et al. 2023); the
  answer's tokens (decode) read the final cut's entries without it. The cuts are the honest run's
  (the library's ``chunk_mass=True``, docs/method.md#carried-mass, scores its cuts from the compensated
  hidden states);
* ``question over one-shot cut`` (``--one-shot``): no chunks; the prompt is prefilled exactly, one-shot
  Jacap cuts it at ``--ratio`` (its question-aware selection), and the question's queries (and the
  answer's) see before the question only what that cut kept: what the question loses by reading a
  tenth of the document however well the tenth is chosen.

``--rows`` may name several chunked rows: the variants above run for each (``honest`` alone for all but
the first).

For each variant: whether the argmax at every answer position is the full cache's token, the first
position where it is not, and the answer's summed log-probability. Dense ``N x N`` masks, one forward
per variant: ~1 min a variant for gemma-3-270m at 4k tokens on one core.

    PYTHONPATH=. python tools/chunk_mass_probe.py --model gemma3-270m --task niah_single_1 --samples 0 3 6
"""

from __future__ import annotations

import argparse
import sys

import torch

from eval.chunk_oracle import carried_bias, held_indices, visible


def _variant_attention(windows, held, starts, n, total, exact_rows, compensate):
    """An attention function for transformers' ``AttentionInterface``: the oracle's masks
    (:func:`eval.chunk_oracle.visible`, ``exact_rows [total]`` bool queries seeing the whole causal
    prefix), and under ``compensate`` the carried mass (:func:`eval.chunk_oracle.carried_bias`)."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        layer = module.layer_idx
        hq, h = query.shape[1], key.shape[1]
        real = torch.ones(1, total, dtype=torch.bool)
        allowed = visible(held, starts, real, windows[layer], layer, exact_rows)
        bias = carried_bias(held, starts, real, key, layer, n) if compensate and windows[layer] is None \
            else torch.zeros(allowed.shape)
        allowed = allowed.repeat_interleave(hq // h, dim=1)
        logits_bias = torch.where(allowed, bias.repeat_interleave(hq // h, dim=1), torch.tensor(float("-inf")))
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(hq // h, 1), value.repeat_interleave(hq // h, 1),
            attn_mask=logits_bias.to(query.dtype), scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    return attention


def main(argv=None) -> int:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    import jacap_attn
    from eval import quality
    from eval.chunk_oracle import chunked_run, patch_row
    from eval.ruler import tasks as ruler_tasks
    from eval.ruler import task_prompt_parts
    from jacap_attn.models import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--task", default="niah_single_1")
    parser.add_argument("--split", choices=("tuning", "heldout"), default="tuning")
    parser.add_argument("--samples", type=int, nargs="+", default=[0])
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument("--rows", nargs="+", default=["jacap, chunked 1024, repeat"])
    parser.add_argument("--one-shot", action="store_true", help="add the 'question over one-shot cut' variant")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    for row in args.rows:
        if "chunk_size" not in quality.variant(row)[1]:
            parser.error(f"--rows: {row!r} has no chunk_size")
    torch.set_num_threads(args.threads)
    cfg = quality.load_config(quality.CONFIG_DIR / "ruler.json")
    mcfg = cfg["models"][args.model]
    model, tok = load_model(args.model)
    windows = jacap_attn.patches.get_adapter(model.config.model_type).sliding_windows(model.config)
    samples = ruler_tasks.generate(args.task, tok, max(args.samples) + 1, mcfg["context_tokens"],
                                   seed=cfg["splits"][args.split]["seed"])
    for index in args.samples:
        sample = samples[index]
        prompt_ids, full_ids = quality.sample_ids(tok, sample, "aware", mcfg["chat"])
        n = prompt_ids.shape[1]
        quality.ensure_patched(model)
        record = quality.record_prefill(model, prompt_ids)
        reference = quality.full_answer(model, tok, record, prompt_ids, full_ids, sample, 16)
        del record
        question = full_ids.shape[1] - len(tok.encode(task_prompt_parts(sample, tok, chat=mcfg["chat"])[1],
                                                      add_special_tokens=False))
        extra = torch.cat([full_ids[:, n:], torch.tensor([reference[:-1]], dtype=torch.long)], 1)
        ids = torch.cat([prompt_ids, extra], 1)
        total = ids.shape[1]
        rows = torch.arange(total)
        none = rows < 0
        variants = {}  # name -> (held, starts, exact_rows, compensate)
        for k, row in enumerate(args.rows):
            chunk = patch_row(model, tok, row, args.ratio, mcfg["chat"])
            _, held, _ = chunked_run(model, prompt_ids, torch.ones_like(prompt_ids), chunk, extra[:, :1])
            jacap_attn.unpatch(model)
            starts = list(range(0, n, chunk)) + [n]
            tag = "" if len(args.rows) == 1 else f" [{row}]"
            variants[f"honest{tag}"] = (held, starts, none, False)
            if k == 0:
                variants["question exact"] = (held, starts, (rows >= question) & (rows < n), False)
                variants["haystack exact"] = (held, starts, rows < question, False)
                variants["compensated"] = (held, starts, none, True)
        if args.one_shot:
            jacap_attn.patch(model, ratio=args.ratio, tokenizer=tok, compile=False)
            cache = jacap_attn.compress(model, prompt_ids)
            variants["question over one-shot cut"] = ([held_indices(cache, n)], [0, question], none, False)
            jacap_attn.unpatch(model)
            del cache
        target = torch.tensor(reference)
        print(f"{sample.id}: {n} tokens, full cache's answer "
              f"{tok.decode(reference, skip_special_tokens=True)!r}", flush=True)
        original = model.config._attn_implementation
        for name, (held, starts, exact_rows, compensate) in variants.items():
            AttentionInterface.register("jacap_mass_probe", _variant_attention(
                windows, held, starts, n, total, exact_rows, compensate))
            AttentionMaskInterface.register("jacap_mass_probe", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
            model.set_attn_implementation("jacap_mass_probe")
            try:
                with torch.no_grad():
                    logits = model(ids, use_cache=False).logits[0, n:total].float()
            finally:
                model.set_attn_implementation(original)
            predicted = logits.argmax(-1)
            wrong = (predicted != target).nonzero()
            logprob = torch.log_softmax(logits, -1).gather(-1, target[:, None]).sum()
            first = "none" if len(wrong) == 0 else \
                f"token {int(wrong[0])} ({tok.decode([int(predicted[wrong[0]])])!r} for {tok.decode([int(target[wrong[0]])])!r})"
            print(f"  {name:15s} answer's argmax all right: {len(wrong) == 0}; first wrong: {first}; "
                  f"log-prob {float(logprob):.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
