"""Why a compressed cache loses a look-alike answer (issue 34): per layer and KV head, what it keeps
of the asked fact, the head's budget, and whether the head retrieves.

    PYTHONPATH=. python tools/diagnose_lookalike.py --model smollm2 --tasks lookalike_docstrings lookalike_chat \\
        --n 24 --ratio 0.1 --out eval/results/diagnose_lookalike_smollm2.json

For each sample of the look-alike family (:mod:`eval.synthetic.lookalike`; tuning split by default),
question in the prompt, one recorded prefill (:func:`eval.quality.record_prefill`), then:

* the full cache's greedy answer (the reference) and the row's (``--row``, default ``jacap``) at
  ``--ratio``, replayed as the harness does (:func:`jacap_attn.routes.replay.compress_recorded`);
* the **fact oracle** at the same ratio: every head keeps, under the uniform budget, its window, the
  4 attention sinks and the tokens of the sample's fact sentences (all of them, the asked one and the
  look-alikes), then the latest tokens if room is left (:class:`FactOracle`): is the ratio enough
  in principle?
* per (layer, KV head): the row's budget (kept entries), the share it keeps of the asked key's, the
  asked value's and the asked fact's tokens and of the other facts', and two retrieval measures from
  the full cache: the **question attention** on the asked fact (attention mass of the observation
  window's queries, the question and answer prefix, on the fact's tokens, mean over the window, max
  over the GQA group) and the **copy attention** on the asked value (the same for the queries that
  write the reference answer, teacher-forced: a copy head reads the value while writing it);
* where the row's consensus step (Jacap's, docs/method.md#cross-layer-consensus) ranks the asked
  value's best token among the prompt's tokens.

Writes ``<out>.json`` (per sample and head), ``<out>.md`` (tables) and ``<out>.png`` (per layer and
head: copy attention, the row's budget relative to the uniform one, and the asked value's kept share
on the samples the row loses and the full cache answers).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shlex
import sys
import time

import torch

from eval import answers, quality as Q, spans as E, stats
from eval.ruler import task_prompt_parts
from eval.ruler import generate_task
from eval.synthetic import score
from eval.synthetic.lookalike import SEPARATOR
from jacap_attn.math import scoring
from jacap_attn.math.budget import layer_budget
from jacap_attn.config import JacapConfig
from jacap_attn.methods.base import Method, option, register
from jacap_attn.routes.replay import compress_recorded
from jacap_attn.routes.window import window_queries

SINKS = 4


@register("fact_oracle")
@dataclasses.dataclass(frozen=True)
class FactOracle(Method):
    """Keeps, in every head, the given prompt ``positions`` (the fact sentences' tokens) above every
    other token, the first ``sinks`` real tokens above those; ties (everything else) go to the later
    position. A diagnostic, not a method: it reads the answer's location."""

    positions: tuple = ()
    sinks: int = option(SINKS, low=0)

    @property
    def forced_sinks(self) -> int:
        return self.sinks

    def score(self, inputs):
        b, h, n, _ = inputs.keys.shape
        s = torch.zeros(b, h, n, dtype=torch.float32, device=inputs.keys.device)
        at = torch.tensor([p for p in self.positions if p < n], dtype=torch.long, device=s.device)
        s[..., at] = 1.0
        return scoring.keep_sinks(s, inputs.key_valid, self.sinks)


def token_positions(tok, sample, spans: list, chat: bool) -> list[list[int]]:
    """Prompt token positions (question-aware prompt) of each ``[start, end)`` character span of the
    sample's document."""
    head, tail = task_prompt_parts(sample, tok, chat=chat)
    start = len(head) - len(SEPARATOR) - len(sample.context)
    shifted = E.prompt_spans(head + tail, sample.context, [[list(s)] for s in spans], start=start)
    return E.value_token_positions(tok, head + tail, shifted, add_special_tokens=not chat)


def attention_on(record_layer, positions: list[int], last: int) -> torch.Tensor:
    """``[h]``: attention mass of the last ``last`` queries of a recorded layer on ``positions``, mean
    over those queries, max over the GQA group (full cache, causal)."""
    query, keys, _, scaling = record_layer
    h = keys.shape[1]
    probs = scoring.window_attention(window_queries(query, h, last), keys, scaling,
                                     torch.ones(1, keys.shape[2], dtype=torch.bool))  # [1, h, g, w, n]
    return probs[0][..., positions].sum(-1).mean(-1).amax(-1)


def kept_share(cache, positions: list[int]) -> torch.Tensor:
    """``[L, h]``: share of ``positions`` each layer and KV head of a compressed cache holds."""
    wanted = torch.tensor(sorted(set(positions)))
    rows = []
    for layer in cache.layers:
        _, _, held, valid = layer.export()
        rows.append((torch.isin(held[0], wanted) & valid[0].bool()).sum(-1).double() / len(wanted))
    return torch.stack(rows)


def diagnose_sample(model, tok, sample, chat: bool, row: tuple, ratio: float, max_new: int) -> dict:
    """Every measure of the module docstring for one sample."""
    prompt_ids, full_ids = Q.sample_ids(tok, sample, "aware", chat)
    n = prompt_ids.shape[1]
    facts = token_positions(tok, sample, sample.meta["fact_spans"], chat)
    key_pos = token_positions(tok, sample, sample.meta["key_spans"], chat)[0]
    value_pos = token_positions(tok, sample, sample.meta["value_spans"][0], chat)[0]
    record = Q.record_prefill(model, prompt_ids)
    reference = Q.full_answer(model, tok, record, prompt_ids, full_ids, sample, max_new)
    full_text = tok.decode(reference, skip_special_tokens=True)

    parts: dict = {}
    cfg = Q.make_config(row[0], row[1], ratio)
    cache = compress_recorded(model, record, cfg, prompt_ids, parts=parts)
    budgets = torch.stack([layer.kept_counts()[0] for layer in cache.layers]).double()  # [L, h]
    uniform = float(layer_budget(torch.tensor([n]), ratio, cfg.window)[0])
    shares = {name: kept_share(cache, pos) for name, pos in
              (("key", key_pos), ("value", value_pos), ("fact", facts[0]),
               ("others", sorted({p for f in facts[1:] for p in f})))}
    row_text = tok.decode(answers.greedy(model, tok, cache, full_ids, sample, max_new)[0], skip_special_tokens=True)

    consensus_rank = key_rank = None
    if row[0] == "jacap" and all("leverage" in p for p in parts.values()):
        key_valid = torch.ones(1, n, dtype=torch.bool)
        cons = scoring.consensus_scores([parts[i]["leverage"] for i in sorted(parts)], key_valid)[0]
        cons[:SINKS] = 0.0  # as Jacap.across_layers: the sinks take no consensus, then forward pooling
        cons[n - min(cfg.window, n):] = 0.0  # the window is kept anyway

        def rank_of(values, positions):
            order = torch.argsort(values, descending=True)
            rank = torch.empty_like(order)
            rank[order] = torch.arange(n)
            return int(rank[positions].min())

        key_rank = rank_of(cons, key_pos)  # among single tokens, before the forward pooling
        cons = scoring.pool_scores(cons[None, None], "forward", cfg.method.consensus_kernel)[0, 0]
        consensus_rank = rank_of(cons, value_pos)

    oracle = JacapConfig(ratio=ratio, method=FactOracle(positions=tuple(sorted({p for f in facts for p in f}))),
                         budget="uniform", spans="none", compile=False)
    oracle_cache = compress_recorded(model, record, oracle, prompt_ids)
    oracle_text = tok.decode(answers.greedy(model, tok, oracle_cache, full_ids, sample, max_new)[0],
                             skip_special_tokens=True)

    window = min(cfg.window, n)
    question = torch.stack([attention_on(r, facts[0], window) for r in record])  # [L, h]
    copy_ids = torch.cat([full_ids, torch.tensor([reference[:-1]], dtype=torch.long)], 1) \
        if len(reference) > 1 else full_ids
    copy_record = Q.record_prefill(model, copy_ids)
    copy = torch.stack([attention_on(r, value_pos, len(reference)) for r in copy_record])  # [L, h]
    return {"id": sample.id, "form": sample.meta["form"], "n": n, "answers": sample.answers, "full": full_text,
            "row": row_text, "oracle": oracle_text, "full_ok": score(sample, full_text) >= 1,
            "row_ok": score(sample, row_text) >= 1, "oracle_ok": score(sample, oracle_text) >= 1,
            "uniform_budget": uniform, "fact_tokens": sum(len(f) for f in facts), "value_tokens": len(value_pos),
            "consensus_rank": consensus_rank, "key_consensus_rank": key_rank, "budget": budgets.tolist(), "question_attention": question.tolist(),
            "copy_attention": copy.tolist(), **{f"kept_{k}": v.tolist() for k, v in shares.items()}}


def _acc(k: int, n: int) -> str:
    low, high = stats.wilson(k, n)
    return f"{k}/{n} [{low:.2f}, {high:.2f}]"


def _mean(results: list[dict], name: str) -> torch.Tensor:
    return torch.tensor([r[name] for r in results], dtype=torch.float64).mean(0)


def report(results: list[dict], command: str, model: str, row: str, ratio: float, top: int) -> str:
    """Markdown tables of a diagnosis (see the module docstring)."""
    n = len(results)
    lost = [r for r in results if r["full_ok"] and not r["row_ok"]]
    count = lambda key, rs: sum(r[key] for r in rs)  # noqa: E731
    lines = [f"# Look-alike diagnosis: {model}, `{row}` at {ratio:g} kept", "", f"Command: `{command}`", "",
             f"{n} samples (question in the prompt). Answered: full cache {_acc(count('full_ok', results), n)}, "
             f"`{row}` {_acc(count('row_ok', results), n)}, fact oracle {_acc(count('oracle_ok', results), n)} "
             f"(95% Wilson intervals). Lost by `{row}` where the full cache answers: {len(lost)}; of those, the "
             f"oracle answers {count('oracle_ok', lost)}.", ""]
    if not lost:
        return "\n".join(lines)
    copy = _mean(results, "copy_attention")  # [L, h]: over every sample (a property of the model)
    question = _mean(results, "question_attention")
    rel = torch.stack([torch.tensor(r["budget"]) / r["uniform_budget"] for r in lost]).mean(0)
    kept = {k: _mean(lost, f"kept_{k}") for k in ("key", "value", "fact", "others")}
    whole = torch.tensor([[[float(v >= 1.0) for v in row_] for row_ in r["kept_fact"]] for r in lost]).mean(0)
    key_all = torch.tensor([r["kept_key"] for r in lost], dtype=torch.float64)
    value_all = torch.tensor([r["kept_value"] for r in lost], dtype=torch.float64)
    with_key = key_all >= 1.0
    lines += [f"On the {len(lost)} lost samples, averaged over all {copy.numel()} (layer, KV head) pairs: asked key "
              f"kept {float(kept['key'].mean()):.2f}, asked value {float(kept['value'].mean()):.2f}, asked fact "
              f"{float(kept['fact'].mean()):.2f} (whole in {float(whole.mean()):.0%} of the pairs), the look-alike facts "
              f"{float(kept['others'].mean()):.2f}. Consensus rank of the asked value's best token (of ~"
              f"{results[0]['n']} prompt tokens; Jacap's default forces the top "
              f"{int(0.5 * (results[0]['uniform_budget'] - 32 - SINKS))} into a head of the uniform budget): "
              f"{sorted(r['consensus_rank'] for r in lost if r['consensus_rank'] is not None)}; rank of the asked key's "
              f"best token among single tokens, before the pooling: "
              f"{sorted(r['key_consensus_rank'] for r in lost if r.get('key_consensus_rank') is not None)}. Where a head keeps "
              f"the whole asked key ({float(with_key.double().mean()):.0%} of the pairs), it keeps "
              f"{float(value_all[with_key].mean()):.2f} of the value; where it does not, "
              f"{float(value_all[~with_key].mean()):.2f}.", ""]
    order = torch.argsort(copy.flatten(), descending=True)[:top]
    lines += [f"Top {top} copy heads (copy attention on the asked value, mean over all samples), on the lost samples:",
              "", "| layer | KV head | copy attention | question attention on the fact | budget / uniform | "
              "key kept | value kept | fact kept | fact whole |", "|---|---|---|---|---|---|---|---|---|"]
    h = copy.shape[1]
    for flat in order.tolist():
        layer, head = divmod(flat, h)
        lines.append(f"| {layer} | {head} | {copy[layer, head]:.3f} | {question[layer, head]:.3f} | {rel[layer, head]:.2f} "
                     f"| {kept['key'][layer, head]:.2f} | {kept['value'][layer, head]:.2f} | {kept['fact'][layer, head]:.2f} "
                     f"| {whole[layer, head]:.2f} |")
    rest = torch.ones_like(copy, dtype=torch.bool).flatten()
    rest[order] = False
    rest = rest.view_as(copy)
    lines += ["", f"All other heads: budget / uniform {float(rel[rest].mean()):.2f}, value kept "
              f"{float(kept['value'][rest].mean()):.2f}, fact whole {float(whole[rest].mean()):.2f}.", "",
              "Lost samples:", "", "| sample | form | expected | full cache | row | oracle | value rank in consensus |",
              "|---|---|---|---|---|---|---|"]
    for r in lost:
        lines.append(f"| {r['id']} | {r['form']} | {r['answers'][0]} | {r['full'].strip()[:30]!r} | "
                     f"{r['row'].strip()[:30]!r} | {r['oracle'].strip()[:30]!r} | {r['consensus_rank']} |")
    return "\n".join(lines) + "\n"


def figure(results: list[dict], path: str, row: str, ratio: float) -> None:
    """Three heatmaps (layer x KV head): copy attention; on the lost samples, the row's budget over
    the uniform one and the asked value's kept share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lost = [r for r in results if r["full_ok"] and not r["row_ok"]] or results
    panels = [("copy attention on the asked value", _mean(results, "copy_attention")),
              (f"{row} budget / uniform ({ratio:g} kept)",
               torch.stack([torch.tensor(r["budget"]) / r["uniform_budget"] for r in lost]).mean(0)),
              ("asked value kept (lost samples)", _mean(lost, "kept_value"))]
    fig, axes = plt.subplots(1, 3, figsize=(12, 6))
    for ax, (title, data) in zip(axes, panels):
        im = ax.imshow(data.numpy(), aspect="auto", cmap="viridis")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("KV head")
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tasks", nargs="+", default=["lookalike_docstrings", "lookalike_chat"])
    p.add_argument("--split", default="tuning", choices=("tuning", "heldout"))
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--ratio", type=float, default=0.1)
    p.add_argument("--row", default="jacap", help="a harness row label (eval.quality.variant)")
    p.add_argument("--context", type=int, default=1200)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True,
                   help="output stem: <out>.json, <out>.md, <out>.png (a .json suffix is dropped)")
    p.add_argument("--report-only", action="store_true", help="re-render <out>.md and <out>.png from <out>.json")
    args = p.parse_args(argv)
    args.out = args.out.removesuffix(".json")
    if args.report_only:
        saved = json.loads(pathlib.Path(f"{args.out}.json").read_text())
        md = report(saved["results"], saved["command"], saved["model"], saved["row"], saved["ratio"], args.top)
        pathlib.Path(f"{args.out}.md").write_text(md)
        figure(saved["results"], f"{args.out}.png", saved["row"], saved["ratio"])
        print(md)
        return 0
    torch.set_num_threads(args.threads)
    from jacap_attn.models import load_model

    model, tok = load_model(args.model)
    Q.ensure_patched(model)
    chat = bool(Q.load_config(Q.CONFIG_DIR / "lookalike_tuning.json")["models"][args.model]["chat"])
    seed = {"tuning": 1000, "heldout": 5000}[args.split]
    results, t0 = [], time.time()
    for task in args.tasks:
        for sample in generate_task(task, tok, args.n, args.context, seed):
            results.append(diagnose_sample(model, tok, sample, chat, Q.variant(args.row), args.ratio, 32))
            r = results[-1]
            print(f"{sample.id} full {r['full_ok']} row {r['row_ok']} oracle {r['oracle_ok']} "
                  f"({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    command = "PYTHONPATH=. python tools/diagnose_lookalike.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(f"{args.out}.json").write_text(json.dumps({"command": command, "model": args.model, "row": args.row,
                                                            "ratio": args.ratio, "results": results}))
    pathlib.Path(f"{args.out}.md").write_text(report(results, command, args.model, args.row, args.ratio, args.top))
    figure(results, f"{args.out}.png", args.row, args.ratio)
    print(pathlib.Path(f"{args.out}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
