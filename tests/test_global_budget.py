"""The ``global`` budget policy (docs/method.md#global-budget): one ranking over every compressed
(layer, KV head, token) shares exactly the uniform total, with a per-head floor, the window and
sinks kept, left padding invisible, for every method and both global scores."""

from __future__ import annotations

import math

import pytest
import torch

import jacap_attn
from jacap_attn.math import budget as budgets
from jacap_attn import methods
from jacap_attn.selection import global_budget
from jacap_attn.math import scoring
from conftest import random_ids, tiny_model
from test_robustness import kept_prompt_positions, left_pad

COMPRESSING = [m for m in methods.names() if methods.get_method(m).compresses]
SCORES = ["attention", "normalized", "output"]
LENGTHS = (90, 61, 20)  # the last row's padding (70) is more than the others' whole budget


def kept_counts(cache, full_only=True) -> torch.Tensor:
    """``[b]`` prompt entries kept over the layers the policy covers (every layer if ``full_only`` is
    False)."""
    layers = [layer for layer in cache.layers if not (full_only and layer.is_sliding)]
    return sum(kept.sum(-1) for kept, layer in zip(cache.prompt_kept, cache.layers) if layer in layers)


def compressed(model, samples, **options):
    jacap_attn.patch(model, **options)
    ids, mask = left_pad(samples)
    return jacap_attn.compress(model, ids, mask)


@pytest.mark.parametrize("global_score", SCORES)
@pytest.mark.parametrize("method", COMPRESSING)
def test_total_equals_uniform_and_padded_rows_keep_what_they_keep_alone(method, global_score):
    """The issue's two conditions, for every registered method: per batch row, the entries kept over
    every compressed layer and KV head equal the uniform policy's exactly; a left-padded row keeps,
    head by head, what it keeps alone."""
    model = tiny_model("llama")
    samples = [random_ids(1, n, seed=20 + n)[0] for n in LENGTHS]
    common = dict(ratio=0.3, method=method, window=8, compile=False)
    uniform = compressed(model, samples, budget=None if method == "pyramidkv" else "uniform", **common)
    if methods.get_method(method).fixed_budget is not None:
        with pytest.raises(ValueError, match="fixes budget"):
            jacap_attn.patch(model, budget="global", **common)
        return
    batch = compressed(model, samples, budget="global", global_score=global_score, **common)
    assert kept_counts(batch).tolist() == kept_counts(uniform).tolist()
    for layer in batch.layers:
        assert not bool((layer.valid & (layer.positions < 0)).any()), "a padding position was kept"
    for row, sample in enumerate(samples):
        alone = compressed(model, [sample], budget="global", global_score=global_score, **common)
        for index, (layer, ref) in enumerate(zip(batch.layers, alone.layers)):
            m = sample.shape[0]
            assert kept_prompt_positions(layer, row, m) == kept_prompt_positions(ref, 0, m), (
                f"row {row}, layer {index}: the padded row keeps another set than alone")


@pytest.mark.parametrize("global_score", SCORES)
def test_budgets_move_between_layers_and_heads(global_score):
    """The policy is really global: some heads keep more than the uniform budget, some less."""
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.2, window=8, budget="global", global_score=global_score)
    cache = jacap_attn.compress(model, random_ids(1, 150))
    counts = torch.stack(cache.prompt_kept)  # [L, b, h]
    assert int(counts.sum()) == 3 * 2 * 30 and counts.min() < 30 < counts.max()


def test_head_floor_is_honoured():
    model = tiny_model("llama")
    ids = random_ids(1, 200)
    uniform = jacap_attn.compress(jacap_attn.patch(model, ratio=0.2, window=8, budget="uniform"), ids)
    for floor in (0.0, 0.5, 0.9):
        cache = jacap_attn.compress(jacap_attn.patch(model, ratio=0.2, window=8, budget="global", head_floor=floor), ids)
        counts = torch.stack(cache.prompt_kept)
        assert int(counts.min()) >= max(8 + 4, math.floor(floor * 40)), floor  # window + Jacap's 4 sinks
    # A floor of the whole uniform budget leaves nothing to move: the uniform budgets, head by head.
    full = jacap_attn.compress(jacap_attn.patch(model, ratio=0.2, window=8, budget="global", head_floor=1.0), ids)
    assert [k.tolist() for k in full.prompt_kept] == [k.tolist() for k in uniform.prompt_kept]


@pytest.mark.parametrize("method", ["jacap", "streaming_llm", "capkv", "snapkv"])
def test_window_and_sinks_always_kept(method):
    """Even with no floor, a head the ranking passes over keeps its observation window and the
    method's sinks, inside its budget."""
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.15, method=method, window=8, budget="global",
                             head_floor=0.0, compile=False)
    n = 160
    cache = jacap_attn.compress(model, random_ids(1, n, seed=5))
    sinks = methods.get_method(method)().forced_sinks
    for layer in cache.layers:
        for head in kept_prompt_positions(layer, 0, n):
            assert set(range(n - 8, n)) | set(range(sinks)) <= set(head)


def test_sinks_fit_in_a_head_the_ranking_passes_over():
    """A head whose every token but one ranks last globally keeps just its floor: with no floor
    fraction, its window, Jacap's 4 sinks (kept later, by the cross-layer step) and a token the
    method ranks above every score (a marker as high as the sinks' rank) all fit, beside the one
    token the global ranking gives it."""

    @methods.register("peaked_jacap")
    class Peaked(methods.Jacap):
        def score_parts(self, inputs):
            parts = super().score_parts(inputs)
            peak = torch.zeros_like(parts["scores"][:, 0])
            peak[:, 50] = 1.0
            peak[:, 20] = 2 * scoring.CONSENSUS_RANK
            parts["scores"] = torch.cat([peak[:, None], parts["scores"][:, 1:]], dim=1)
            return parts

    try:
        model = jacap_attn.patch(tiny_model("llama"), ratio=0.2, method="peaked_jacap", consensus=0.0, window=8,
                                 budget="global", global_score="normalized", head_floor=0.0, compile=False)
        n = 150
        cache = jacap_attn.compress(model, random_ids(1, n, seed=9))
        for layer in cache.layers:
            head = kept_prompt_positions(layer, 0, n)[0]
            assert set(range(n - 8, n)) | set(range(4)) | {20, 50} == set(head)
    finally:
        methods.unregister("peaked_jacap")


def test_attention_score_is_the_max_of_the_method_queries_and_only_b_h_n_is_kept(monkeypatch):
    """``global_score="attention"``: per layer one ``[b, h, n]`` tensor, the largest attention
    probability over the window queries and the GQA group (over every prompt query for H2O, which
    scores with all of them), not the ``[b, h, g, w, n]`` window attention."""
    records, seen = {}, {}
    original = global_budget.global_scores

    def spy(plan, cfg):
        seen[plan.index] = {k: v.shape for k, v in plan.parts.items()}
        out = original(plan, cfg)
        seen[plan.index]["value"] = out.clone()
        return out

    monkeypatch.setattr(global_budget, "global_scores", spy)
    for method in ("jacap", "h2o"):
        model = jacap_attn.patch(tiny_model("llama"), ratio=0.2, method=method, window=8, budget="global",
                                 compile=False)
        cache = jacap_attn.JacapCache(model, on_prefill=lambda i, q, k, v, s: records.__setitem__(i, (q, k, v, s)))
        with torch.no_grad():
            model(random_ids(1, 90), cache=cache)
        for index, (query, keys, values, scaling) in records.items():
            b, hq, n, d = query.shape
            h = keys.shape[1]
            grouped = query.reshape(b, h, hq // h, n, d)
            valid = torch.ones(b, n, dtype=torch.bool)
            if method == "h2o":
                logits = torch.einsum("bhgqd,bhnd->bhgqn", grouped, keys) * scaling
                causal = torch.ones(n, n, dtype=torch.bool).tril()
                want = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1).amax(dim=(2, 3))
            else:
                want = scoring.window_attention(grouped[:, :, :, n - 8:], keys, scaling, valid).amax(dim=(2, 3))
            torch.testing.assert_close(seen[index]["value"], want, rtol=1e-5, atol=1e-6)
            assert seen[index][global_budget.GLOBAL_ATTENTION] == (b, h, n)
            assert all(len(shape) <= 3 for key, shape in seen[index].items() if key != "value")


def test_normalized_scores_are_comparable_across_heads():
    """``global_score="normalized"`` ranks each head's share of its own total: a method whose raw
    scores are 1000 times larger in one head (raw leverage sums to each head's effective rank) gets
    the same budgets as the unscaled one."""

    @methods.register("scaled_snapkv")
    class Scaled(methods.SnapKV):
        def score(self, inputs):
            scale = torch.tensor([1.0, 1000.0])[None, :, None]
            return super().score(inputs) * scale

    try:
        ids = random_ids(1, 150)
        got = {}
        for method in ("snapkv", "scaled_snapkv"):
            model = jacap_attn.patch(tiny_model("llama"), ratio=0.2, method=method, window=8, budget="global",
                                     global_score="normalized", compile=False)
            got[method] = [k.tolist() for k in jacap_attn.compress(model, ids).prompt_kept]
        assert got["snapkv"] == got["scaled_snapkv"]
        assert len({tuple(heads) for layer in got["snapkv"] for heads in layer}) > 1  # budgets differ
    finally:
        methods.unregister("scaled_snapkv")


def test_mixed_model_sliding_layers_follow_the_sliding_policy():
    """Gemma3: the full-attention layers are the pool; the sliding layers keep what the ``sliding``
    setting gives them, as under ``uniform``."""
    model = tiny_model("gemma3_text", num_key_value_heads=2)
    ids = random_ids(1, 150)
    for sliding in ("window", "compress"):
        uniform = jacap_attn.compress(jacap_attn.patch(model, ratio=0.2, window=8, sliding=sliding), ids)
        glob = jacap_attn.compress(jacap_attn.patch(model, ratio=0.2, window=8, sliding=sliding, budget="global",
                                                    head_floor=0.0), ids)
        for u, g, layer in zip(uniform.prompt_kept, glob.prompt_kept, glob.layers):
            if layer.is_sliding:
                assert g.tolist() == u.tolist()
            else:
                assert int(g.sum()) == int(u.sum())


def test_all_sliding_model_layers_are_the_pool():
    """Mistral with a sliding window shorter than the prompt: every layer is in the pool, no head keeps
    more than its window can still attend, and the total is the uniform one."""
    model = tiny_model("mistral", sliding_window=48)
    ids = random_ids(1, 150)
    uniform = jacap_attn.compress(jacap_attn.patch(model, ratio=0.25, window=8), ids)
    glob = jacap_attn.compress(jacap_attn.patch(model, ratio=0.25, window=8, budget="global", head_floor=0.0), ids)
    assert int(kept_counts(glob, full_only=False)) == int(kept_counts(uniform, full_only=False))
    for layer in glob.layers:
        for head in kept_prompt_positions(layer, 0, 150):
            assert len(head) <= 47 and min(head) >= 150 - 47


def test_short_rows_keep_everything_as_under_uniform():
    model = tiny_model("llama")
    samples = [random_ids(1, n, seed=3 + n)[0] for n in (120, 40)]
    uniform = compressed(model, samples, ratio=0.2, window=8, min_tokens=64)
    glob = compressed(model, samples, ratio=0.2, window=8, min_tokens=64, budget="global")
    assert kept_counts(glob).tolist() == kept_counts(uniform).tolist()
    assert [k[1].tolist() for k in glob.prompt_kept] == [[40, 40]] * 3


def test_options_are_checked_and_round_trip(tmp_path):
    with pytest.raises(ValueError, match="global_score='max'"):
        jacap_attn.JacapConfig(global_score="max")
    for bad in (-0.1, 1.5, float("nan"), "high", True):
        with pytest.raises(ValueError, match="head_floor"):
            jacap_attn.JacapConfig(head_floor=bad)
    config = jacap_attn.JacapConfig.from_options(0.2, "snapkv", budget="global", global_score="normalized",
                                                 head_floor=0.3)
    assert jacap_attn.JacapConfig.from_dict(config.to_dict()) == config
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.2, window=8, budget="global", global_score="normalized",
                             head_floor=0.3)
    ids = random_ids(1, 100)
    cache = jacap_attn.compress(model, ids)
    jacap_attn.save_cache(cache, tmp_path / "c.safetensors", model=model, prompt_ids=ids)
    loaded = jacap_attn.load_cache(tmp_path / "c.safetensors", model)
    assert loaded.config.budget == "global" and loaded.config.global_score == "normalized"
    assert loaded.config.head_floor == 0.3
    assert [layer.capacity for layer in loaded.layers] == [layer.capacity for layer in cache.layers]


def test_cli_exposes_the_global_options():
    import argparse

    from jacap_attn import cli

    parser = argparse.ArgumentParser()
    cli._add_method_arguments(parser)
    args = parser.parse_args(["--budget", "global", "--global-score", "normalized", "--head-floor", "0.4"])
    assert cli._method_options(args) == {"budget": "global", "global_score": "normalized", "head_floor": 0.4}


# ---------------------------------------------------------------- the pure functions

def test_global_head_budgets_ties_take_turns_and_floors_hold():
    """All scores equal: the heads share the rest in turns (their budgets differ by at most one), and
    every head keeps its floor."""
    b, n = 2, 50
    scores = [torch.ones(b, 3, n), torch.ones(b, 2, n)]
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :10] = False
    window = torch.arange(n) >= n - 4
    forced = [valid & window, valid & window]
    uniform = torch.tensor([[10, 10], [9, 8]])
    out = budgets.global_head_budgets(scores, [valid, valid], forced, uniform, 0.0)
    flat = torch.cat(out, dim=-1)
    assert flat.sum(-1).tolist() == [50, 43]
    assert (flat.amax(-1) - flat.amin(-1)).tolist() == [0, 1]
    assert (flat >= 4).all()


def test_global_head_budgets_follow_the_scores():
    """Layer 1 scores every token above layer 0: it takes everything beyond layer 0's window; with
    Ada-KV's safeguard half of each head's budget is the uniform one."""
    n = 40
    valid = torch.ones(1, n, dtype=torch.bool)
    forced = torch.arange(n)[None] >= n - 4
    scores = [torch.rand(1, 2, n) * 0.1, 0.5 + torch.rand(1, 2, n)]
    out = budgets.global_head_budgets(scores, [valid, valid], [forced, forced], torch.tensor([[10, 10]]), 0.0)
    assert out[0].tolist() == [[4, 4]] and int(out[1].sum()) == 32
    out = budgets.global_head_budgets(scores, [valid, valid], [forced, forced], torch.tensor([[10, 10]]), 0.5)
    assert out[0].tolist() == [[7, 7]] and int(out[1].sum()) == 26 and (out[1] >= 5).all()


def test_head_shares_are_distributions_per_head():
    gen = torch.Generator().manual_seed(0)
    raw = torch.rand(2, 3, 30, generator=gen)
    valid = torch.ones(2, 30, dtype=torch.bool)
    valid[1, :7] = False
    shares = global_budget.head_shares(raw, valid)
    assert shares.dtype == torch.float64
    torch.testing.assert_close(shares.sum(-1), torch.ones(2, 3, dtype=torch.float64))
    assert (shares[1, :, :7] == 0).all()
    torch.testing.assert_close(global_budget.head_shares(raw * torch.tensor([1.0, 7.0, 1e4])[None, :, None], valid), shares)
    negative = global_budget.head_shares(-raw, valid)  # shifted to start at 0: the lowest score gets 0
    assert (negative >= 0).all() and torch.equal(negative.argmax(-1), raw.masked_fill(~valid[:, None], 9).argmin(-1))
    marked = scoring.keep_sinks(raw, valid, 2)  # forced markers and NaN take no share
    marked[0, 0, 10] = float("nan")
    shares = global_budget.head_shares(marked, valid)
    assert (shares[0, :, :2] == 0).all() and shares[0, 0, 10] == 0
    torch.testing.assert_close(shares.sum(-1), torch.ones(2, 3, dtype=torch.float64))
    flat = global_budget.head_shares(torch.zeros(1, 1, 5), torch.ones(1, 5, dtype=torch.bool))
    torch.testing.assert_close(flat, torch.full((1, 1, 5), 0.2, dtype=torch.float64))


def test_jacaps_default_budget_is_global_and_the_baselines_stay_uniform():
    """Measured on 2026-12-01 (docs/results.md, "Budget policies"): Jacap's default budget policy is global;
    every other method keeps its own (uniform, PyramidKV's pyramid); an explicit budget wins."""
    from jacap_attn import methods

    assert jacap_attn.JacapConfig().budget == "global"
    assert jacap_attn.JacapConfig(budget="uniform").budget == "uniform"
    for name in methods.names():
        if name != "jacap":
            method = methods.get_method(name)
            assert jacap_attn.JacapConfig(method=name).budget == (method.fixed_budget or "uniform"), name
    model = tiny_model("llama")
    cache = jacap_attn.compress(jacap_attn.patch(model, ratio=0.2, window=8), random_ids(1, 120))
    counts = torch.stack([layer.kept_counts()[0] for layer in cache.layers])  # [layers, heads]
    assert int(counts.sum()) == 3 * 2 * 24 and len(set(counts.flatten().tolist())) > 1  # moved, same total
    jacap_attn.unpatch(model)


def test_fill_to_total_raises_heads_with_room_to_the_row_total():
    """A head with fewer candidates than its uniform budget passes what it lacks to the heads with room
    (one level for all, the last units to the first heads), never above a head's candidates; a row
    whose heads all reach their budget is left as it is."""
    base = torch.tensor([[10, 3, 10, 5], [4, 4, 4, 4]])
    room = torch.tensor([[12, 3, 20, 5], [9, 9, 9, 9]])
    got = budgets.fill_to_total(base, room, torch.tensor([35, 16]))
    assert got.tolist() == [[12, 3, 15, 5], [4, 4, 4, 4]]
    assert budgets.fill_to_total(base, room, torch.tensor([100, 19])).tolist() == [[12, 3, 20, 5], [5, 5, 5, 4]]


@pytest.mark.parametrize("reselect", [False, True])
def test_a_cut_over_held_entries_keeps_the_uniform_total(reselect):
    """At a chunk cut (or a question's reselection) the heads' candidates are what earlier global cuts
    gave them, some fewer than the uniform budget: the total is still ``ceil(ratio * seen)`` per layer
    and KV head (it fell short by what those heads lacked before: 330 of 366 entries for the chunks,
    418 of 420 for the question)."""
    model = tiny_model("llama", num_hidden_layers=3)
    n, chunk, ratio = (300, None, 0.25) if reselect else (301, 32, 0.2)
    ids = random_ids(1, n)
    if reselect:
        jacap_attn.patch(model, ratio=ratio, window=8, budget="global", reselect=0.2, reselect_budget="global")
        cache = jacap_attn.compress(model, ids)
        with torch.no_grad():
            model(random_ids(1, 10, seed=4), cache=cache)
        want = math.ceil(0.2 * n) + 10
    else:
        jacap_attn.patch(model, ratio=ratio, window=8, budget="global")
        cache = jacap_attn.compress(model, ids, chunk_size=chunk)
        want = math.ceil(ratio * n)
    total = sum(int(layer.kept_counts().sum()) for layer in cache.layers)
    assert total == 3 * 2 * want
