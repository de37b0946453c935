"""The repeat pass's statistics at the cost of its FLOPs (issue 24 item 4): the blocked statistics
(attention_stats.chunk_statistics) equal the reference definitions (repeat_attention +
attention_statistics), the pass computes a scored layer's attention with them instead of calling the
stock attention, and only the statistics the config reads; the kept sets do not change."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import jacap_attn
from jacap_attn.math import attention_stats
from jacap_attn.routes.repeat import RepeatRoute, repeat_statistics
from conftest import random_ids, tiny_model

N = 80
ALL = attention_stats.STATISTICS


@pytest.mark.parametrize("shape", [(1, 2, 2, 7, 30, 8), (2, 3, 1, 13, 40, 16), (2, 1, 4, 5, 9, 4)])
@pytest.mark.parametrize("block", [None, 1, 37, 10**9])
def test_chunk_statistics_equal_the_reference_and_the_softmax_attention(shape, block):
    b, h, g, c, n, d = shape
    gen = torch.Generator().manual_seed(sum(shape))
    queries = torch.randn(b, h, g, c, d, generator=gen)
    keys = 2 * torch.randn(b, h, n + c, d, generator=gen)
    values = torch.randn(b, h, n + c, d, generator=gen)
    key_valid = torch.rand(b, n, generator=gen) > 0.3
    key_valid[:, -1] = True
    own_valid = torch.rand(b, c, generator=gen) > 0.3
    want, _ = attention_stats.reference_chunk_statistics(queries, keys, 0.3, key_valid, own_valid, ALL)
    for size in range(len(ALL) + 1):
        for names in itertools.combinations(ALL, size):
            got, out = attention_stats.chunk_statistics(queries, keys, 0.3, key_valid, own_valid, names, values,
                                                        block_elements=block)
            assert set(got) == set(names)
            for name in names:
                assert got[name].dtype == torch.float32 and got[name].shape == (b, h, n)
                torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4)
    # The output: softmax attention over the valid prompt keys and, causally, the chunk's valid ones.
    allowed = torch.cat([key_valid[:, None, :].expand(b, c, n),
                         torch.ones(c, c, dtype=torch.bool).tril()[None] & own_valid[:, None, :]], dim=-1)
    logits = torch.einsum("bhgcd,bhkd->bhgck", queries, keys) * 0.3
    probs = torch.softmax(logits.masked_fill(~allowed[:, None, None], float("-inf")), dim=-1).nan_to_num(0.0)
    rows = own_valid[:, None, None, :, None]
    torch.testing.assert_close(out * rows, (probs @ values[:, :, None]) * rows, atol=1e-5, rtol=1e-5)
    assert attention_stats.chunk_statistics(queries, keys, 0.3, key_valid, own_valid, ALL)[1] is None


def test_chunk_statistics_refuse_unknown_names():
    q, k = torch.randn(1, 1, 1, 2, 4), torch.randn(1, 1, 5, 4)
    with pytest.raises(ValueError, match="unknown attention statistic"):
        attention_stats.chunk_statistics(q, k, 1.0, torch.ones(1, 3, dtype=torch.bool),
                                         torch.ones(1, 2, dtype=torch.bool), ("mass", "max"))


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "gemma3_text"])
@pytest.mark.parametrize("options", [{}, {"beta": 1.0, "budget": "capacity"}, {"method": "kvzip"}])
def test_pass_statistics_and_selection_equal_the_reference_path(family, options, monkeypatch):
    model = tiny_model(family)
    ids = random_ids(2, N)
    ids[1, :11] = 0  # left padding in the second row
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    ids = {"input_ids": ids, "attention_mask": mask}

    def compress(reference):
        seen = {}
        original = RepeatRoute.score_deferred

        def spy(route, cache):
            seen.update({i: {k: v.clone() for k, v in d.items()} for i, d in route.observed.items()})
            return original(route, cache)

        with monkeypatch.context() as patched:
            patched.setattr(RepeatRoute, "score_deferred", spy)
            if reference:
                patched.setattr(RepeatRoute, "shares_attention", False)
                patched.setattr(attention_stats, "chunk_statistics", attention_stats.reference_chunk_statistics)
            jacap_attn.patch(model, ratio=0.2, window=8, queries="repeat", repeat_ids=[5, 6, 7], repeat_chunk=24,
                             **options)
            with torch.no_grad():
                cache = jacap_attn.JacapCache(model)
                model(**ids, cache=cache, use_cache=True)
        jacap_attn.unpatch(model)
        return seen, [layer.positions[layer.valid].tolist() for layer in cache.layers]

    got, kept = compress(reference=False)
    want, want_kept = compress(reference=True)
    assert sorted(got) == sorted(want) and got
    for index in want:
        assert set(got[index]) == set(want[index])
        for name in want[index]:
            torch.testing.assert_close(got[index][name], want[index][name], atol=1e-5, rtol=1e-4)
    assert kept == want_kept


def test_pass_computes_the_scored_layers_attention_itself(monkeypatch):
    """In the pass the stock attention runs only for the layers the statistics cannot stand in for
    (gemma3's sliding-window layers here); the prefill's layers all run it."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counted(query, *args, **kwargs):
        calls.append(query.shape[-2])
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    # one stock call per layer: sliding layers not split into query blocks (tests/test_windowed.py)
    monkeypatch.setattr(jacap_attn.attention, "windowed_prefill", lambda *args, **kwargs: None)
    for family, per_chunk in (("llama", 0), ("gemma3_text", 2)):
        model = tiny_model(family)
        jacap_attn.patch(model, ratio=0.2, window=8, queries="repeat", repeat_ids=[5, 6, 7], repeat_chunk=40)
        calls.clear()
        jacap_attn.compress(model, random_ids(1, N))
        jacap_attn.unpatch(model)
        assert calls.count(N) == 3  # the prefill, three layers
        assert len(calls) - 3 == 2 * per_chunk  # two chunks


def test_the_pass_computes_only_the_statistics_the_config_reads():
    model = tiny_model("llama")
    expected = {(): ("mass", "peak", "sq"),  # Jacap at beta = 0 gives sq_dist no weight; global reads peak
                (("beta", 1.0),): ("mass", "peak", "sq", "sq_dist"),
                (("budget", "uniform"),): ("mass", "sq"),
                (("method", "kvzip"),): ("peak",),
                (("method", "snapkv"), ("budget", "capacity")): ("mass",)}
    for options, names in expected.items():
        jacap_attn.patch(model, ratio=0.2, queries="repeat", **dict(options))
        assert repeat_statistics(model._jacap_state.config) == names, options
    jacap_attn.unpatch(model)


def test_speed_only_routes_states_the_repeat_pass_ratio(tmp_path, capsys):
    """``python -m eval.speed --only-routes`` measures the route costs alone and its report states
    ``repeat pass / stock prefill`` and whether it is within 2.0x (wall and CPU seconds)."""
    import json

    from eval.speed import REPEAT_PASS_TARGET, speed_main

    out = tmp_path / "speed.json"
    assert speed_main(["--config", "tiny", "--context", "96", "--prefill-repeats", "1", "--only-routes",
                       "--out", str(out), "--no-progress"]) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["only_routes"] and len(result["shapes"]) == 1
    shape = result["shapes"][0]
    assert "prefill" not in shape and "decode" not in shape
    a = shape["routes"]["route_a"]
    ratio = a["repeat"]["repeat_pass_seconds"] / a["stock_prefill"]["seconds"]
    assert a["repeat_pass_over_stock_prefill"] == ratio and a["repeat_pass_target"] == REPEAT_PASS_TARGET == 2.0
    assert a["repeat_pass_within_target"] == (ratio <= 2.0)
    assert a["repeat"]["repeat_pass_cpu_seconds"] > 0 and a["stock_prefill"]["cpu_seconds"] > 0
    assert a["repeat_pass_over_stock_prefill_cpu"] == (a["repeat"]["repeat_pass_cpu_seconds"]
                                                       / a["stock_prefill"]["cpu_seconds"])
    text = capsys.readouterr().out
    assert "route costs only" in text and f"repeat pass / stock prefill: {ratio:.2f}x" in text
    assert "compress, window + lookahead 16" in text
    assert ("NOT within 2.0x" in text) == (ratio > 2.0) and "within 2.0x" in text
    with pytest.raises(SystemExit):
        speed_main(["--only-routes", "--no-routes"])
