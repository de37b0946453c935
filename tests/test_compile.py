"""torch.compile: the decode step and the scoring path compile into one graph, match eager, and do
not recompile across decode steps or fresh caches of the same capacity bucket (docs/cache.md#compiled-decode).

CPU only (inductor's C++ backend); the same properties are measured on a GPU by
``tools/gpu_bench.py``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import jacap_attn
from jacap_attn.math import baseline_scores, scoring
from conftest import random_ids, tiny_model

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `eval` is a top-level folder of the repository, not installed
    sys.path.insert(0, str(ROOT))

from eval.speed import cache_keyword, make_step  # noqa: E402

STEPS = 8
RATIO = 0.25
# Two prompts of different lengths whose compressed caches fall in the same capacity bucket.
PROMPT_A, PROMPT_B = 120, 112


def greedy(step, cache, first, start, steps=STEPS):
    """``steps`` greedy tokens ``[b, steps]`` from ``first`` ``[b, 1]`` at logical position ``start``."""
    b = first.shape[0]
    # Fresh [b, 1] tensors: a view such as ids[:, -1:] has other strides, which dynamo guards on.
    tok, out = torch.empty(b, 1, dtype=first.dtype).copy_(first), []
    with torch.no_grad():
        for i in range(steps):
            pos = torch.full((b, 1), start + i)
            tok = step(tok, pos, cache).clone()
            out.append(tok)
    return torch.cat(out, -1)


def compressed(model, ids):
    cache = jacap_attn.compress(model, ids)
    cache.ensure_room(STEPS + 1)
    return cache


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_decode_step_has_no_graph_breaks(family):
    torch._dynamo.reset()
    model = jacap_attn.patch(tiny_model(family), ratio=RATIO)
    ids = random_ids(1, PROMPT_A)
    cache = compressed(model, ids)
    if family == "gemma3_text":  # sliding and full layers keep different counts, in one capacity
        assert len({int(layer.write_pos) for layer in cache.layers}) > 1
    step = make_step(model, cache_keyword(model))
    with torch.no_grad():
        explained = torch._dynamo.explain(step)(ids[:, -1:], torch.tensor([[PROMPT_A]]), cache)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_scoring_compiles_fullgraph_with_dynamic_lengths():
    torch._dynamo.reset()
    b, h, g, w, d, budget = 1, 2, 2, 8, 16, 20

    def score_and_select(window_queries, keys, values, key_valid, budgets):
        probs = scoring.window_attention(window_queries, keys, 0.25, key_valid)
        jacap, _ = scoring.jacap_scores(probs, keys, values, key_valid, scaling=0.25)
        snap = baseline_scores.snapkv_scores(probs)
        indices, kept = scoring.select_indices(jacap, budgets, key_valid, w, k=budget)
        return jacap, snap, indices, kept

    compiled = torch.compile(score_and_select, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    for n in (100, 137):
        inputs = (torch.randn(b, h, g, w, d, generator=gen), torch.randn(b, h, n, d, generator=gen),
                  torch.randn(b, h, n, d, generator=gen), torch.ones(b, n, dtype=torch.bool),
                  torch.full((b, h), budget))
        got, want = compiled(*inputs), score_and_select(*inputs)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-6)
        assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
        # The static `k` gives the same selection as the data-dependent default.
        indices, kept = scoring.select_indices(want[0], inputs[4], inputs[3], w)
        assert torch.equal(indices, want[2]) and torch.equal(kept, want[3])


@pytest.fixture(scope="module")
def compiled_llama():
    """A patched tiny Llama, its eager decode step and the same step compiled with fullgraph=True."""
    torch._dynamo.reset()
    model = jacap_attn.patch(tiny_model("llama"), ratio=RATIO)
    step = make_step(model, cache_keyword(model))
    return model, step, torch.compile(step, fullgraph=True)


def test_compiled_decode_matches_eager(compiled_llama):
    model, step, compiled = compiled_llama
    ids = random_ids(1, PROMPT_A)
    cache = compressed(model, ids)
    expected = greedy(step, copy.deepcopy(cache), ids[:, -1:], PROMPT_A)
    assert torch.equal(greedy(compiled, cache, ids[:, -1:], PROMPT_A), expected)


def test_no_recompile_across_steps_and_fresh_caches(compiled_llama):
    model, step, compiled = compiled_llama
    ids_a = random_ids(1, PROMPT_A)
    greedy(compiled, compressed(model, ids_a), ids_a[:, -1:], PROMPT_A, steps=1)  # warm-up (compiles once)
    ids_b = random_ids(1, PROMPT_B, seed=7)
    cache = compressed(model, ids_b)
    assert cache.layers[0].capacity == compressed(model, ids_a).layers[0].capacity  # same bucket
    expected = greedy(step, copy.deepcopy(cache), ids_b[:, -1:], PROMPT_B)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(greedy(compiled, cache, ids_b[:, -1:], PROMPT_B), expected)


def test_generate_compiles_the_decode_step_with_a_jacap_cache():
    """transformers' own path: ``generate`` compiles the decode step when the cache is compileable;
    on CPU only with ``compile_config._compile_all_devices``. One graph for all steps."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    model = jacap_attn.patch(tiny_model("llama"), ratio=RATIO)
    ids = random_ids(1, PROMPT_A)
    expected = model.generate(ids, max_new_tokens=STEPS, do_sample=False, disable_compile=True)
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True
    graphs = counters["stats"]["unique_graphs"]
    got = model.generate(ids, max_new_tokens=STEPS, do_sample=False, compile_config=config)
    assert torch.equal(got, expected)
    assert hasattr(model, "_compiled_call")
    assert counters["stats"]["unique_graphs"] - graphs == 1  # compiled once, no recompile per step
    again = model.generate(random_ids(1, PROMPT_B, seed=7), max_new_tokens=STEPS, do_sample=False,
                           compile_config=config)
    assert again.shape == (1, PROMPT_B + STEPS)
    assert counters["stats"]["unique_graphs"] - graphs == 1  # a fresh cache, same bucket: no recompile


def test_a_compiled_wrapper_patches_compresses_and_unpatches_as_its_model():
    """``torch.compile(model)`` before or after ``patch``: ``compress`` over the wrapper keeps what it keeps over
    the model (once: "built for another model", the wrapper's parameter names fingerprinted), ``patch`` and
    ``unpatch`` of the wrapper patch and unpatch its model (once: a dynamo error inside ``compress``), and
    ``generate`` through it answers as the patched model."""
    ids = random_ids(1, 120)
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.3)
    expected = jacap_attn.compress(model, ids)
    tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
    wrapped = torch.compile(tiny_model("llama"))
    assert jacap_attn.patch(wrapped, ratio=0.3) is wrapped and jacap_attn.is_patched(wrapped._orig_mod)
    for runner in (torch.compile(model), wrapped):
        cache = jacap_attn.compress(runner, ids)
        assert all(torch.equal(a.valid, b.valid) for a, b in zip(cache.layers, expected.layers))
    assert torch.equal(wrapped.generate(ids, max_new_tokens=4, do_sample=False), tokens)
    assert jacap_attn.unpatch(wrapped) is wrapped and not jacap_attn.is_patched(wrapped._orig_mod)


def test_speed_benchmark_runs_end_to_end(tmp_path):
    """The CPU path of ``python -m eval.speed`` on a tiny random model (eager configurations only;
    the compiled ones are exercised above)."""
    import json

    from eval.speed import speed_main

    out = tmp_path / "speed.json"
    assert speed_main(["--config", "tiny", "--context", "96", "--steps", "3", "--warmup", "1",
                       "--prefill-repeats", "1", "--configs", "stock-eager,jacap-full-eager,jacap-eager",
                       "--out", str(out), "--no-progress"]) == 0
    shape = json.loads(out.read_text())["shapes"][0]
    assert set(shape["decode"]) == {"stock-eager", "jacap-full-eager", "jacap-eager"}
    assert shape["decode"]["jacap-full-eager"]["tokens_match_reference"]
    assert shape["kv"]["jacap_kept_bytes"] < shape["kv"]["full_bytes"]
    assert all(row["floor_ms"] > 0 for row in shape["decode"].values())
    assert shape["prefill"]["jacap"]["selection_seconds"] > 0
    # The selection timer put the library's functions back.
    assert not hasattr(jacap_attn.selection.scorer.score_layer, "__wrapped__")
    assert not hasattr(jacap_attn.selection.finalize_prefill, "__wrapped__")
    # Route costs (issue 14): on by default, first shape only; --no-routes skips them.
    assert shape["routes"]["route_a"]["repeat"]["seconds"] > 0 and shape["routes"]["context"] == 96
    # Physical beside kept bytes for every budget policy (issue 15): they add up, kept equal.
    memory = shape["budget_memory"]
    assert list(memory) == ["uniform", "pyramid", "capacity", "global", "global:normalized"]
    kept = {row["kept_bytes"] for row in memory.values()}
    assert kept == {shape["kv"]["jacap_kept_bytes"]}  # every policy keeps the uniform total
    for row in memory.values():
        parts = row["kept_bytes"] + row["room_bytes"] + row["head_padding_bytes"] + row["rounding_bytes"]
        assert parts == row["physical_bytes"] and 0 <= row["unused_fraction"] < 1
        assert min(row[k] for k in ("room_bytes", "head_padding_bytes", "rounding_bytes")) >= 0


def test_speed_route_costs_on_a_tiny_model():
    """Issue 14's cost section of ``python -m eval.speed`` (:func:`eval.speed.route_costs`): route A
    (window vs repeat-pass compress, beside the stock prefill), route B (a question over a cache stored
    at the kept ratio, stored whole and reselected, stored whole as is), timed, with the stored
    caches' bytes and what they hold after the question; the model is left unpatched."""
    import math

    from eval.speed import route_costs, route_inputs

    model = tiny_model("llama")
    n, ratio = 120, 0.1
    ids = random_ids(1, n)
    repeat_ids, question = route_inputs(None, ids, model.config.vocab_size)
    q = question.shape[1]
    assert q == 32 and len(repeat_ids) > 0 and int(question.max()) < model.config.vocab_size
    out = route_costs(model, ids, question, ratio=ratio, repeat_ids=repeat_ids, repeats=2)
    assert not jacap_attn.is_patched(model)
    assert out["context"] == n and out["question_tokens"] == q and out["rss_high_water_mb"]["after"] > 0
    a, b = out["route_a"], out["route_b"]
    calls = [a["stock_prefill"], a["window"], a["lookahead"], a["repeat"], b["compress_whole"], b["stored_at_ratio"],
             b["stored_whole_reselect"], b["stored_whole"], b["stored_whole_reselect_lookahead"]]
    assert a["lookahead_tokens"] == 16 and a["lookahead_over_window"] == a["lookahead"]["seconds"] / a["window"]["seconds"]
    for row in calls:
        assert row["seconds"] > 0 and len(row["all_seconds"]) == 2 and row["seconds"] == min(row["all_seconds"])
        assert row["peak_bytes"] is None and row["peak_increase_bytes"] is None  # CPU: no device peak invented
    passes = a["repeat"]["repeat_pass_all_seconds"]  # one pass per timed call (not the warm-up's)
    assert len(passes) == 2 and 0 < a["repeat"]["repeat_pass_seconds"] == min(passes) < a["repeat"]["seconds"]
    assert "repeat_pass_seconds" not in a["window"] and "repeat_pass_seconds" not in b["compress_whole"]
    assert a["repeat_over_window"] == a["repeat"]["seconds"] / a["window"]["seconds"]
    assert b["reselect_over_plain"] == b["stored_whole_reselect"]["seconds"] / b["stored_at_ratio"]["seconds"]
    whole, at_ratio = b["stored_whole_reselect"]["stored"], b["stored_at_ratio"]["stored"]
    assert b["stored_whole"]["stored"] == whole
    assert whole["kept_bytes"] > at_ratio["kept_bytes"] and whole["physical_bytes"] > at_ratio["physical_bytes"]
    assert whole["max_held_per_head"] == [n] * 3  # stored whole: every prompt token
    # The question reselects the whole cache to ceil(R n) held entries per KV head, plus the question;
    # without reselect it only appends the question.
    assert b["stored_whole_reselect"]["after_question"]["max_held_per_head"] == [math.ceil(ratio * n) + q] * 3
    assert b["stored_whole"]["after_question"]["max_held_per_head"] == [n + q] * 3
    assert b["stored_whole_reselect"]["after_question"]["kept_bytes"] < whole["kept_bytes"]
    # The same question reselected with a lookahead keeps as much (nothing of the written tokens held).
    ahead = b["stored_whole_reselect_lookahead"]
    assert ahead["after_question"]["max_held_per_head"] == [math.ceil(ratio * n) + q] * 3
    assert b["reselect_lookahead_over_reselect"] == ahead["seconds"] / b["stored_whole_reselect"]["seconds"]
    held = at_ratio["max_held_per_head"]
    assert b["stored_at_ratio"]["after_question"]["max_held_per_head"] == [k + q for k in held]
    # The section in the report.
    from eval.speed import format_routes
    text = "\n".join(format_routes(out, {"model": {}}))
    assert "compress, repeat pass" in text and "stored whole, reselect" in text and "reselect + lookahead 16" in text
    assert b["whole_timing"] == "alternated" and "not rescored (timed taking turns)" in text


def test_speed_times_the_reselected_and_the_plain_question_taking_turns():
    """Route B's reselected question and the same question not rescored take turns (``a b a b``), each
    prepared afresh before its clock starts, so their ratio compares one stretch of a shared machine."""
    from eval.speed import _alternated_calls

    order = []
    calls = {name: (lambda arg, name=name: order.append((name, arg)) or name, lambda name=name: f"copy of {name}")
             for name in ("reselected", "unselected")}
    records, results = _alternated_calls(torch.device("cpu"), 3, calls)
    assert order == [("reselected", "copy of reselected"), ("unselected", "copy of unselected")] * 3
    assert results == {"reselected": "reselected", "unselected": "unselected"}
    for record in records.values():
        assert len(record["all_seconds"]) == 3 and record["seconds"] == min(record["all_seconds"])
        assert record["cpu_seconds"] == min(record["all_cpu_seconds"]) and record["peak_bytes"] is None


def test_speed_budget_options():
    from eval.speed import budget_policies

    assert budget_policies("uniform, global:normalized") == [
        {"budget": "uniform"}, {"budget": "global", "global_score": "normalized"}]
    assert budget_policies("none") == []
    from eval.speed import add_speed_arguments
    parse = add_speed_arguments(argparse.ArgumentParser()).parse_args
    assert parse([]).no_routes is False and parse(["--no-routes"]).no_routes is True
    for bad in ("uniformly", "capacity:attention", "global:max"):
        with pytest.raises(ValueError, match=bad):
            budget_policies(bad)
    # a bad --shape was a bare ValueError after the model loaded; --context 0 ran the default context
    assert parse(["--shape", "8192x2", "--shape", "512"]).shape == ["8192x2", "512"]
    for argv in (["--shape", "abc"], ["--shape", "8192x0"], ["--context", "0"]):
        with pytest.raises(SystemExit):
            parse(argv)


def test_benchmark_static_copy_continues_like_the_dynamic_cache():
    """The stock ``StaticCache`` baseline is filled from the stock prefill's ``DynamicCache`` (after
    the eager run is cropped back to the prompt): both must decode the same tokens."""
    from transformers.cache_utils import DynamicCache

    from eval.speed import static_copy

    model = tiny_model("llama")
    keyword = cache_keyword(model)
    step = make_step(model, keyword)
    ids = random_ids(2, PROMPT_A)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        first = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{keyword: cache}).logits[:, -1:].argmax(-1)
    expected = greedy(step, cache, first, PROMPT_A)
    cache.crop(-STEPS)
    assert cache.get_seq_length() == PROMPT_A
    static = static_copy(model, cache, PROMPT_A + STEPS + 1)
    assert torch.equal(greedy(step, static, first, PROMPT_A), expected)
