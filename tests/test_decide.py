"""The quality harness's decisive parts: fast answers (eval/answers.py) equal one-by-one greedy
decoding, scores shared across ratios equal fresh scoring, intervals and paired tests
(eval/stats.py) and the table that prints them (eval/quality_report.py)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from conftest import random_ids, tiny_model
from jacap_attn.patching import compress, unpatch
from jacap_attn.routes.replay import compress_recorded

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from eval import answers, quality, quality_report, stats  # noqa: E402


class _Tok:
    """A tokenizer stand-in for a random-weight model: token ids written as words."""

    eos_token_id = 0
    pad_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{int(i)}" for i in ids if not (skip_special_tokens and int(i) == self.eos_token_id))

    def batch_decode(self, rows, skip_special_tokens=True):
        return [self.decode(r, skip_special_tokens) for r in rows]


class _Sample:
    def __init__(self, answers):
        self.answers = answers


def _setup(family="llama", n=64, q=5, seed=0):
    model = tiny_model(family)
    model.generation_config.eos_token_id = 0
    ids = random_ids(1, n + q, seed=seed)
    prompt = ids[:, :n]
    return model, prompt, ids, quality.record_prefill(model, prompt)


ROWS = ["full", "jacap", "snapkv", "streaming_llm", "h2o", "adakv", "jacap+pyramid"]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_fast_answers_equal_one_by_one_greedy(family):
    model, prompt, ids, record = _setup(family)
    tok = _Tok()
    full = quality.replay_cache(model, record, quality.make_config("full", {}, 1.0), prompt)
    reference = answers.greedy(model, tok, full, ids, _Sample(["never"]), 12)[0]
    assert len(reference) == 12  # no answer, no EOS: max_new tokens
    # The 3rd reference token as the answer: greedy stops right after it, rows that differ go on.
    sample = _Sample([f"t{reference[2]}"])
    reference = answers.greedy(model, tok, quality.replay_cache(model, record, quality.make_config("full", {}, 1.0),
                                                               prompt), ids, sample, 12)[0]
    hows = set()
    for ratio in (1.0, 0.3, 0.1):
        caches = [compress_recorded(model, record, quality.make_config(*quality.variant(label), ratio), prompt)
                  for label in ROWS]
        fast = answers.answer_rows(model, tok, caches, prompt, ids, sample, 12, reference)
        for label, cache, (tokens, how) in zip(ROWS, caches, fast):
            one = answers.greedy(model, tok, cache, ids, sample, 12)[0]  # the caches were left unchanged
            assert tokens == one, (label, ratio, how)
            hows.add(how)
    assert hows == {"reference", "decoded"}  # both paths ran
    unpatch(model)


def test_answers_stop_like_generate_alone():
    """A batch goes on until its last row stops; each row's answer ends where it would alone."""
    model, prompt, ids, record = _setup(seed=2)
    tok = _Tok()
    caches = [compress_recorded(model, record, quality.make_config(m, {}, 0.3), prompt)
              for m in ("jacap", "streaming_llm", "random", "knorm")]
    alone = [answers.greedy(model, tok, copy.deepcopy(c), ids, _Sample(["never"]), 10)[0] for c in caches]
    sample = _Sample([f"t{alone[0][1]}"])  # row 0 stops after 2 tokens
    batch = answers.greedy(model, tok, answers.stack_caches(model, caches, prompt), ids, sample, 10)
    for cache, tokens in zip(caches, batch):
        assert tokens == answers.greedy(model, tok, cache, ids, sample, 10)[0]
    assert len(batch[0]) == 2
    unpatch(model)


@pytest.mark.parametrize("label", sorted(quality.VARIANTS))
def test_scores_shared_across_ratios_select_what_fresh_scores_select(label):
    method, opts = quality.VARIANTS[label]
    model, prompt, _, record = _setup()
    shared: dict = {}
    for ratio in (0.5, 0.1, 0.3):
        config = quality.make_config(method, opts, ratio)
        fresh = compress_recorded(model, record, config, prompt)
        if config.method.reads_budget:
            with pytest.raises(ValueError, match="reads the budget"):
                compress_recorded(model, record, config, prompt, parts=shared)
            continue
        if config.chunk_size is not None and prompt.shape[1] > config.chunk_size:  # every chunk's cut scores afresh
            with pytest.raises(ValueError, match="chunked replay"):
                compress_recorded(model, record, config, prompt, parts=shared)
            continue
        reused = compress_recorded(model, record, config, prompt, parts=shared)
        assert shared or not config.method.compresses or config.ratio == 1.0  # a whole stored cache is not scored
        for a, b in zip(fresh.layers, reused.layers):
            assert torch.equal(a.positions, b.positions) and torch.equal(a.valid, b.valid), (label, ratio)
    unpatch(model)


def test_greedy_selector_reads_the_budget():
    assert quality.make_config("jacap", {"selector": "greedy"}, 0.1).method.reads_budget
    assert not quality.make_config("jacap", {}, 0.1).method.reads_budget


def test_wilson_interval_and_exact_mcnemar():
    # Wilson 95% of 0/10: (0, 0.2775); of 7/10: (0.3968, 0.8922) (Brown, Cai & DasGupta 2001, Table 5 style).
    assert stats.wilson(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-4)
    assert stats.wilson(7, 10) == pytest.approx((0.39677, 0.89222), abs=1e-4)
    with pytest.raises(ValueError, match="correct=11"):
        stats.wilson(11, 10)
    # 10 samples right for a only, 2 for b only: two-sided exact p = 2 * P(X <= 2), X ~ Bin(12, 1/2) = 0.0386.
    a = {i: i < 10 or i >= 14 for i in range(20)}
    b = {i: i >= 10 for i in range(20)}
    test = stats.mcnemar(a, b)
    assert (test.only_a, test.only_b, test.n) == (10, 4, 20)
    assert stats.mcnemar({i: i < 10 for i in range(12)}, {i: i >= 10 for i in range(12)}).p == pytest.approx(0.03857, abs=1e-4)
    assert stats.mcnemar(a, a).p == 1.0
    with pytest.raises(ValueError, match="no sample"):
        stats.mcnemar({1: True}, {2: True})


def _rows(outcomes: dict) -> list[dict]:
    """Table rows as the harness aggregates them, from ``{(label, ratio, task): [0/1 per sample]}``."""
    raw = [(task, "aware", label, ratio, f"{task}-{i}", float(bit))
           for (label, ratio, task), bits in outcomes.items() for i, bit in enumerate(bits)]
    return quality.aggregate(raw, [], "tiny", type("Args", (), {"split": "heldout"}))


def test_decisive_table_prints_intervals_and_paired_tests():
    n = 24
    outcomes = {}
    for task in ("t1", "t2"):
        outcomes[("full", 0.1, task)] = [1] * 20 + [0] * 4
        outcomes[("jacap", 0.1, task)] = [1] * 18 + [0] * 6
        outcomes[("snapkv", 0.1, task)] = [1] * 5 + [0] * 19
        outcomes[("tova", 0.1, task)] = [1] * 17 + [0] * 7
    md = quality_report.markdown_table(_rows(outcomes), "python -m eval.quality --x", "tiny", "heldout",
                                       ["t1", "t2"], [0.1], n, ["full", "jacap", "snapkv", "tova"], seconds=600)
    assert "n = 24 samples per task (48 per cell)" in md and "wall time 10 min" in md
    lo, hi = stats.wilson(36, 48)
    assert f"| jacap | **0.750** [{lo:.2f}, {hi:.2f}] |" in md
    # Best other row is tova (34/48): jacap right on 2 more samples, not significant.
    assert "| 0.1 | 0.750 | tova 0.708 | +4.2 pts | 2 | 0 | 0.5 | not significant |" in md
    # snapkv is far below: significant.
    assert "| snapkv | -54.2 (" in md and md.split("| snapkv | -54.2 (")[1].split("|")[0].strip().endswith("*")
    assert "| t1 | 24 | 0.833 [" in md  # the full cache per task


AGNOSTIC_ROWS = ["jacap[queries=repeat]", "kvzip[queries=repeat]", "jacap[queries=repeat,budget=global]",
                 "jacap[queries=repeat,budget=capacity]", "jacap[store=1]", "jacap[store=0.5]",
                 "jacap[queries=repeat,store=0.5]", "jacap",
                 # Rows a question reads differently from "jacap[store=1]"'s at the same decode budget: until
                 # 2026-12-04 the harness batched them with it and answered them under its config.
                 "jacap[store=1,reselect_budget=global]", "jacap[store=1,lookahead=3]", "snapkv[store=1]",
                 "jacap[chunk_size=40]"]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_replayed_repeat_route_selects_what_a_patched_prefill_selects(family):
    """queries="repeat" rows replayed from one recorded prefill and one shared repeat pass keep
    exactly what ``patch`` + ``compress`` keeps (issue 14's tables reuse both for every row)."""
    import jacap_attn

    model, prompt, _, record = _setup(family, n=80)
    observed: dict = {}
    replayed = {}
    for label in AGNOSTIC_ROWS[:4]:
        method, opts = quality.variant(label)
        config = quality.make_config(method, {**opts, "repeat_chunk": 24}, 0.2, repeat_ids=[5, 6, 7])
        replayed[label] = compress_recorded(model, record, config, prompt, observed=observed)
    assert observed and all({"mass", "peak", "sq", "sq_dist"} <= set(s) for s in observed.values())
    unpatch(model)
    for label, cache in replayed.items():
        method, opts = quality.variant(label)
        jacap_attn.patch(model, ratio=0.2, method=method, compile=False, repeat_ids=[5, 6, 7], repeat_chunk=24,
                         **opts)
        fresh = jacap_attn.compress(model, prompt)
        unpatch(model)
        for a, b in zip(fresh.layers, cache.layers):
            assert torch.equal(a.positions, b.positions) and torch.equal(a.valid, b.valid), label
    # A window-route config refuses repeat statistics.
    model, prompt, _, record = _setup(family, n=80)
    with pytest.raises(ValueError, match="queries='window'"):
        compress_recorded(model, record, quality.make_config("jacap", {}, 0.2), prompt, observed={})
    unpatch(model)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_fast_answers_equal_generate_for_question_agnostic_routes(family):
    """Route A (repeat queries) and route B (stored whole or at 50%, reselected to the decode
    budget when the question arrives) rows: the fast answers equal one-by-one ``generate``."""
    model, prompt, ids, record = _setup(family, n=80, q=9, seed=1)
    tok = _Tok()
    full = quality.replay_cache(model, record, quality.make_config("full", {}, 1.0), prompt)
    reference = answers.greedy(model, tok, full, ids, _Sample(["never"]), 8)[0]
    sample = _Sample([f"t{reference[5]}"])
    reference = answers.greedy(model, tok, quality.replay_cache(model, record, quality.make_config("full", {}, 1.0),
                                                               prompt), ids, sample, 8)[0]
    hows, observed = set(), {}
    for ratio in (0.5, 0.2, 0.05):
        caches = []
        for label in AGNOSTIC_ROWS:
            method, opts = quality.variant(label)
            config = quality.make_config(method, {**opts, "repeat_chunk": 40}, ratio, repeat_ids=[9, 8])
            if config.chunk_size is not None:  # a real chunked prefill; the question is a new turn, cut
                quality.ensure_patched(model)
                caches.append(compress(model, prompt, config=config))
                continue
            caches.append(compress_recorded(model, record, config, prompt,
                                            observed=observed if config.queries == "repeat" else None))
        assert caches[4].config.ratio == 1.0 and caches[4].config.reselect == ratio
        fast = answers.answer_rows(model, tok, caches, prompt, ids, sample, 8, reference)
        for label, cache, (tokens, how) in zip(AGNOSTIC_ROWS, caches, fast):
            one = answers.greedy(model, tok, copy.deepcopy(cache), ids, sample, 8)[0]
            assert tokens == one, (label, ratio, how)
            hows.add(how)
    assert "decoded" in hows
    unpatch(model)


def test_stacked_caches_refuse_configs_a_question_reads_differently():
    """A stacked batch answers under one config: rows whose questions would read theirs differently
    (lookahead, reselect_budget, method) are refused, naming the field; rows that select nothing at
    question time stack whatever their methods."""
    model, prompt, _, record = _setup()
    make = lambda label: compress_recorded(model, record, quality.make_config(*quality.variant(label), 0.2), prompt)
    plain = [make(label) for label in ("jacap", "snapkv", "streaming_llm")]
    assert answers.stack_caches(model, plain, prompt).layers[0].keys.shape[0] == 3
    for label, field in (("jacap[store=1,lookahead=3]", "lookahead"),
                         ("jacap[store=1,reselect_budget=global]", "reselect_budget"),
                         ("snapkv[store=1]", "method")):
        with pytest.raises(ValueError, match=field):
            answers.stack_caches(model, [make("jacap[store=1]"), make(label)], prompt)
    unpatch(model)


def test_route_b_rows_store_above_the_decode_budget():
    assert quality.make_config("jacap", {"store": 0.5}, 0.1).reselect == 0.1
    with pytest.raises(ValueError, match="store=0.05"):
        quality.make_config("jacap", {"store": 0.05}, 0.1)
    with pytest.raises(ValueError, match="not both"):
        quality.variant("jacap[store=0.5,reselect=0.1]")
