"""Is a chunked prefill's loss the method's or a bug? Its logits against a masking oracle.

A chunked prefill (``chunk_size``, :mod:`jacap_attn.routes.chunk`) attends, in every chunk, what the
cuts before it kept plus the chunk itself. Its answers can differ from one-shot compression's because
the later chunks' hidden states are computed over a compressed prefix (the cost of honesty), or
because of a bug. The oracle tells them apart: the *unpatched* model over the whole sequence, each
layer's attention masked per KV head so that a query of chunk ``j`` sees before its chunk only what
every head held after the cut of chunk ``j - 1`` (:func:`oracle_logits`). Equal logits mean the
chunked prefill computes exactly what its cuts define; the tests (``tests/test_chunked.py``) check it on
tiny models of every family, this module's command on a real model and task sample:

    python -m eval.chunk_oracle --model gemma3-270m --task niah_single_1 --sample 0 --ratio 0.5 \\
        --row 'snapkv[chunk_size=2048,chunk_scores=rescore]'

prints the largest logit difference over the prompt and the first answer token, and both first answer
tokens. Both runs' logits are held whole: ~9 GB for Gemma-3-270m's 262,144-token vocabulary at 4k tokens
(``--context`` shortens the document). RULER samples of the tuning split (seed 1000) unless ``--split heldout``.
"""

from __future__ import annotations

import argparse
import sys

import torch

__all__ = ["carried_bias", "chunked_run", "held_indices", "oracle_logits", "patch_row", "positions_of", "visible"]


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """``[b, n]`` int64 RoPE positions of a left-padded ``mask [b, n]`` (0 on the padding)."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def held_indices(cache, length: int) -> list[torch.Tensor]:
    """Per layer of ``cache`` (a :class:`~jacap_attn.storage.cache.JacapCache`), ``[b, h, length]`` bool:
    the sequence indices (logical position + left padding) each KV head holds."""
    return [layer.slot_map(length)[1].clone() for layer in cache.layers]


def chunked_run(model, ids: torch.Tensor, mask: torch.Tensor, chunk: int, extra: torch.Tensor | None = None):
    """The patched ``model``'s chunked prefill of ``ids [b, n]`` (``mask [b, n]``, left padding 0) driven
    chunk by chunk of ``chunk`` tokens, as ``compress`` and ``generate`` drive it, then ``extra [b, e]``
    tokens appended, under the model's patch.

    Returns ``(logits [b, n (+ e), vocab] float32, held, cache)``: ``held[j]`` is
    :func:`held_indices` after chunk ``j``'s cut. Raises ``RuntimeError`` when the cache does not end
    its prefill after the last chunk."""
    from jacap_attn.routes.chunk import know_prompt
    from jacap_attn.storage.cache import JacapCache

    b, n = ids.shape
    cache = JacapCache(model)
    cache.prefill_until, cache.prefill_chunk = n, chunk
    know_prompt(cache, ids, mask)  # the whole prompt, as compress and generate give it (lookup ahead)
    pos = positions_of(mask)
    logits, held = [], []
    cache.buffer_trace = []
    with torch.no_grad():
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            out = model(input_ids=ids[:, start:end], attention_mask=mask[:, :end], position_ids=pos[:, start:end],
                        cache=cache, use_cache=True)
            logits.append(out.logits)
            held.append(held_indices(cache, end))
            cache.buffer_trace.append(cache.kv_bytes())
        if extra is not None:
            full = torch.cat([mask, torch.ones_like(extra)], dim=1)
            steps = pos[:, -1:] + 1 + torch.arange(extra.shape[1])
            logits.append(model(input_ids=extra, attention_mask=full, position_ids=steps, cache=cache).logits)
    if cache.prefill_until is not None or cache.prompt_length != n:
        raise RuntimeError(f"the chunked prefill did not end: prefill_until={cache.prefill_until}, "
                           f"prompt_length={cache.prompt_length}, expected {n}")
    return torch.cat(logits, dim=1), held, cache


def visible(held: list, starts: list[int], real: torch.Tensor, window: int | None, layer: int,
            exact_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``[b, h, N, N]`` bool: which keys each query of layer ``layer`` sees in the oracle's one forward
    over ``N`` tokens (``real [b, N]`` bool, False on left padding): causal, within ``window`` (``None``:
    full attention), and a query of chunk ``j`` (``starts[j] <= t < starts[j + 1]``, the last chunk
    running to ``N``) sees before ``starts[j]`` only what each KV head held after the cut of chunk
    ``j - 1`` (``held[j - 1][layer]``, :func:`chunked_run`). ``exact_rows [N]`` bool: queries that see
    the whole causal prefix instead (a probe's counterfactual)."""
    b, total = real.shape
    h = held[0][layer].shape[1]
    rows, cols = torch.arange(total)[:, None], torch.arange(total)[None, :]
    allowed = ((cols <= rows)[None, None] & real[:, None, None, :]).expand(b, h, total, total).clone()
    if window is not None:
        allowed &= (rows - cols < window)[None, None]
    for j, start in enumerate(starts[1:], start=1):
        stop = starts[j + 1] if j + 1 < len(starts) else total
        kept = held[j - 1][layer][:, :, None, :start]  # [b, h, 1, start]: after the cut of the chunk before
        if exact_rows is None:
            allowed[:, :, start:stop, :start] &= kept
        else:
            exact = exact_rows[start:stop][None, None, :, None]
            allowed[:, :, start:stop, :start] &= exact | kept
    return allowed


def carried_bias(held: list, starts: list[int], real: torch.Tensor, key: torch.Tensor, layer: int,
                 prompt: int, min_cosine: float = -1.0) -> torch.Tensor:
    """``[b, h, N, N]`` float32: the logit bias ``chunk_mass`` adds (docs/method.md#carried-mass), worked
    out here from the cuts alone (``held``, :func:`chunked_run`) and the layer's keys ``key [b, h, N, d]``
    (after RoPE): at the cut after chunk ``j - 1`` each real index of that chunk or held before it that the
    head does not keep hands ``1 +`` its carried count to the kept index of the head with the nearest key
    in cosine if that cosine is at least ``min_cosine`` (``mass_cosine``; else the count is dropped), and
    the queries of prompt chunk ``j`` (``starts[j] < prompt``) add ``log(1 + count)`` to the keys before
    ``starts[j]``; the tokens after the prompt read no bias."""
    b, h, total = key.shape[0], key.shape[1], real.shape[1]
    bias = torch.zeros(b, h, total, total)
    count = torch.zeros(b, h, total)
    unit = torch.nn.functional.normalize(key.float(), dim=-1)
    for j, start in enumerate(starts[1:], start=1):
        kept = held[j - 1][layer][:, :, :start]
        candidates = real[:, None, :start].expand(b, h, start).clone()
        if j >= 2:
            candidates[..., :starts[j - 1]] &= held[j - 2][layer][:, :, :starts[j - 1]]
        for r in range(b):
            for head in range(h):
                gone = (candidates[r, head] & ~kept[r, head]).nonzero()[:, 0]
                stay = kept[r, head].nonzero()[:, 0]
                if len(gone) and len(stay):
                    best, at = (unit[r, head, gone] @ unit[r, head, stay].T).max(-1)
                    handed = (1 + count[r, head, gone]) * (best >= min_cosine)
                    count[r, head].index_add_(0, stay[at], handed)
                    count[r, head, gone] = 0
        if start < prompt:
            stop = starts[j + 1] if j + 1 < len(starts) else total
            bias[:, :, start:stop, :start] = torch.log1p(count[:, :, None, :start])
    return bias


def oracle_logits(model, ids: torch.Tensor, mask: torch.Tensor, chunk: int, held: list,
                  extra: torch.Tensor | None = None, mass: bool = False, mass_cosine: float = -1.0) -> torch.Tensor:
    """``[b, n (+ e), vocab]``: the model *unpatched* (``jacap_attn.unpatch``; it stays unpatched) over
    ``ids [b, n]`` (then ``extra [b, e]``) in one forward, each layer's attention masked per KV head: a
    query of chunk ``j`` (or of ``extra``) sees, before its chunk, only what that head held after the
    cut of chunk ``j - 1`` (``held`` from :func:`chunked_run`), within its chunk everything causal, and
    a sliding-window layer only its window; with ``mass`` a full-attention layer adds :func:`carried_bias`
    (the chunked prefill ran ``chunk_mass=True``, with ``mass_cosine``). Dense ``[b, h, N, N]`` masks: for
    checks, not for speed."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    import jacap_attn

    windows = jacap_attn.patches.get_adapter(model.config.model_type).sliding_windows(model.config)
    n = ids.shape[1]
    if extra is not None:
        ids = torch.cat([ids, extra], dim=1)
        mask = torch.cat([mask, torch.ones_like(extra)], dim=1)
    starts = list(range(0, n, chunk)) + ([n] if extra is not None else [])
    real = mask.bool()

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        hq, h = query.shape[1], key.shape[1]
        allowed = visible(held, starts, real, windows[module.layer_idx], module.layer_idx)
        allowed = allowed.repeat_interleave(hq // h, dim=1)
        allowed |= ~allowed.any(-1, keepdim=True)  # padding rows: anything (their logits are not compared)
        if mass and windows[module.layer_idx] is None:
            bias = carried_bias(held, starts, real, key, module.layer_idx, n, mass_cosine)
            bias = bias.repeat_interleave(hq // h, dim=1)
            allowed = torch.where(allowed, bias.to(query.dtype), torch.tensor(float("-inf"), dtype=query.dtype))
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(hq // h, 1), value.repeat_interleave(hq // h, 1), attn_mask=allowed,
            scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("jacap_chunk_oracle", attention)
    AttentionMaskInterface.register("jacap_chunk_oracle", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    jacap_attn.unpatch(model)
    original = model.config._attn_implementation
    model.set_attn_implementation("jacap_chunk_oracle")
    try:
        with torch.no_grad():
            return model(ids, attention_mask=mask, position_ids=positions_of(mask), use_cache=False).logits
    finally:
        model.set_attn_implementation(original)


def patch_row(model, tok, label: str, ratio: float, chat: bool) -> int:
    """Patch ``model`` with the chunked ``eval.quality`` row ``label`` at grid kept ratio ``ratio`` (as
    :func:`eval.quality.make_config` configures it: the repeat instruction for ``chat`` or not, from
    ``tok``); returns its ``chunk_size``. Raises ``ValueError`` for an unknown row or one without
    ``chunk_size``."""
    import jacap_attn
    from eval import quality
    from jacap_attn.prompts import repeat_instruction_ids

    method, options = quality.variant(label)
    if "chunk_size" not in options:
        raise ValueError(f"row {label!r} has no chunk_size: not a chunked prefill")
    opts, ratio = quality.row_options(options, ratio)
    if quality.repeats(opts):
        opts["repeat_ids"] = tuple(repeat_instruction_ids(tok, chat=chat))
    jacap_attn.patch(model, ratio=ratio, method=method, tokenizer=tok, compile=False, **opts)
    return int(opts["chunk_size"])


def main(argv=None) -> int:
    from eval import quality
    from eval.ruler import tasks as ruler_tasks

    from jacap_attn.models import load_model

    parser = argparse.ArgumentParser(prog="python -m eval.chunk_oracle", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--task", default="niah_single_1", help="a RULER NIAH task (eval/ruler)")
    parser.add_argument("--sample", type=int, default=0, help="the sample's index in its split")
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument("--context", type=int, default=None, help="document tokens (default: eval/configs/ruler.json's)")
    parser.add_argument("--split", choices=("tuning", "heldout"), default="tuning")
    parser.add_argument("--row", default="jacap, chunked 1024, repeat",
                        help="a chunked row label of eval.quality (e.g. 'jacap[chunk_size=512]')")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if not 0.0 < args.ratio <= 1.0:
        parser.error(f"--ratio must be in (0, 1], got {args.ratio}")
    if args.sample < 0:
        parser.error(f"--sample must be >= 0, got {args.sample}")
    if args.context is not None and args.context < 1:
        parser.error(f"--context must be >= 1, got {args.context}")
    if "chunk_size" not in quality.variant(args.row)[1]:  # ValueError for an unknown row, before loading
        parser.error(f"--row {args.row!r} has no chunk_size: the oracle checks a chunked prefill")
    torch.set_num_threads(args.threads)
    cfg = quality.load_config(quality.CONFIG_DIR / "ruler.json")
    mcfg = cfg["models"][args.model]
    model, tok = load_model(args.model)
    sample = ruler_tasks.generate(args.task, tok, args.sample + 1, args.context or mcfg["context_tokens"],
                                  seed=cfg["splits"][args.split]["seed"])[args.sample]
    prompt_ids, full_ids = quality.sample_ids(tok, sample, "aware", mcfg["chat"])
    chunk = patch_row(model, tok, args.row, args.ratio, mcfg["chat"])
    row = model._jacap_state.config  # the row's own settings: a row carrying the evicted mass is replayed with it
    extra = full_ids[:, prompt_ids.shape[1]:prompt_ids.shape[1] + 1]  # the prompt's last token: the first answer
    mask = torch.ones_like(prompt_ids)
    got, held, _ = chunked_run(model, prompt_ids, mask, chunk, extra)
    evicted = sum(int((~h).sum()) for h in held[-1])
    want = oracle_logits(model, prompt_ids, mask, chunk, held, extra, mass=row.carries_mass, mass_cosine=row.mass_cosine)
    first = [tok.decode([int(x[0, -1].argmax())]) for x in (got, want)]
    diff = max(float((g - w).abs().max()) for g, w in zip(got.split(256, 1), want.split(256, 1)))  # no third copy
    print(f"{sample.id} ({prompt_ids.shape[1]} tokens, chunks of {chunk}, {evicted} entries evicted "
          f"at the last cut): max |logit difference| {diff:.2e}; first answer token "
          f"chunked {first[0]!r}, oracle {first[1]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
