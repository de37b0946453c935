"""Jacap's two additions to the method (docs/method.md#d2-attention-sinks, #d3-attention-mass-term): attention sinks
kept by force, and the attention-mass term of the per-head ranking (`mass`)."""

from __future__ import annotations

import pytest
import torch

import jacap_attn
from jacap_attn import methods
from jacap_attn.math import scoring
from conftest import random_ids, tiny_model


def kept(layer, row: int = 0) -> list[set[int]]:
    """Logical positions kept per KV head of batch row ``row``."""
    return [set(layer.positions[row, h][layer.valid[row, h]].tolist()) for h in range(layer.valid.shape[1])]


def probs_and_leverage(seed: int = 0, b: int = 2, h: int = 2, g: int = 2, w: int = 3, n: int = 12):
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(b, h, g, w, n, generator=gen), -1)
    leverage = torch.rand(b, h, n, generator=gen)
    return probs, leverage


def test_attention_mass_ranking_is_the_documented_formula():
    probs, leverage = probs_and_leverage()
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, :3] = False  # left padding
    got = scoring.add_attention_mass(leverage, probs, valid, 2.0)
    lev = leverage * valid[:, None]
    mass = probs.sum(dim=3).mean(dim=2) * valid[:, None]  # per token, not pooled
    want = (lev / lev.sum(-1, keepdim=True) + 2.0 * mass / mass.sum(-1, keepdim=True)) / 3.0
    torch.testing.assert_close(got, want)
    assert got.dtype == torch.float32
    assert got[1, :, :3].abs().max() == 0  # padding scores nothing
    torch.testing.assert_close(got.sum(-1), torch.ones(2, 2))  # a convex mix of two shares
    # Any finite weight: no overflow to inf (which would tie every token with the forced ones).
    huge = scoring.add_attention_mass(leverage, probs, valid, 1e300)
    assert torch.isfinite(huge).all()
    torch.testing.assert_close(huge, mass / mass.sum(-1, keepdim=True))
    # weight 0: the leverage share alone, so the ranking is the leverage ranking.
    alone = scoring.add_attention_mass(leverage, probs, valid, 0.0)
    torch.testing.assert_close(alone, lev / lev.sum(-1, keepdim=True))


def test_attention_mass_keeps_a_heavy_token_whose_value_is_the_mean():
    """A token that takes most of the window's attention but whose value equals the output has zero
    leverage (no Jacobian capacity at the full cache); evicting it still renormalises every other
    weight. The mass term ranks it first; the leverage alone ranks it last."""
    n, d = 10, 4
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(1, 1, n, d, generator=gen)
    keys = torch.randn(1, 1, n, d, generator=gen)
    logits = torch.zeros(1, 1, 1, 2, n)
    logits[..., 2] = 6.0  # token 2 takes ~ 90% of the attention
    probs = torch.softmax(logits, -1)
    valid = torch.ones(1, n, dtype=torch.bool)
    omega = scoring.pool_scores(scoring.jacap_weights(probs, keys, 1.0, 1.0), "none", 1)
    # Put token 2's value exactly at the omega-weighted mean of the others, so u_2 = v_2 - vbar = 0.
    others = torch.arange(n) != 2
    w = omega[0, 0, others]
    values[0, 0, 2] = (w[:, None] * values[0, 0, others]).sum(0) / w.sum()
    leverage, _ = scoring.jacap_scores(probs, keys, values, valid, scaling=1.0, pooling="none", kernel=1)
    assert int(leverage[0, 0].argmin()) == 2
    ranking = scoring.add_attention_mass(leverage, probs, valid, 2.0)
    assert int(ranking[0, 0].argmax()) == 2


def test_mass_option_changes_the_selection_and_is_validated():
    model = tiny_model("llama")
    ids = random_ids(1, 160, seed=4)
    choices = {}
    for mass in (0.0, 1000.0):
        jacap_attn.patch(model, ratio=0.1, window=4, mass=mass, consensus=0.0, compile=False)
        choices[mass] = [kept(layer) for layer in jacap_attn.compress(model, ids).layers]
        jacap_attn.unpatch(model)
    assert choices[0.0] != choices[1000.0]
    assert jacap_attn.JacapConfig().method.mass == 2.0
    # A huge weight ranks by attention mass alone; the sinks and the window are still kept.
    jacap_attn.patch(model, ratio=0.1, window=4, mass=1e39, consensus=0.0, compile=False)
    for layer in jacap_attn.compress(model, ids).layers:
        for head in kept(layer):
            assert {0, 1, 2, 3, 156, 157, 158, 159} <= head
    jacap_attn.unpatch(model)
    for bad in (-1.0, float("nan"), "2", True):
        with pytest.raises(ValueError, match="mass"):
            jacap_attn.patch(model, ratio=0.1, mass=bad)
    with pytest.raises(ValueError, match="mass"):
        jacap_attn.patch(model, ratio=0.1, method="snapkv", mass=1.0)


@pytest.mark.parametrize("consensus", [0.0, 0.25])
def test_sinks_are_kept_in_every_head_and_row(consensus):
    """The first ``sinks`` real tokens are kept in every compressed layer and KV head, also in a
    left-padded row; ``sinks=0`` leaves them to the scores (and this prompt then loses some)."""
    model = tiny_model("llama")
    ids = random_ids(2, 200, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :50] = 0
    ids[0, :50] = 0
    jacap_attn.patch(model, ratio=0.05, window=4, consensus=consensus, sinks=4, compile=False)
    cache = jacap_attn.compress(model, ids, mask)
    for layer in cache.layers:
        for row in range(2):
            for head in kept(layer, row):
                assert {0, 1, 2, 3} <= head, (layer.index, row, sorted(head)[:8])
    jacap_attn.unpatch(model)
    jacap_attn.patch(model, ratio=0.05, window=4, consensus=consensus, sinks=0, compile=False)
    cache = jacap_attn.compress(model, ids, mask)
    assert any(not {0, 1, 2, 3} <= head for layer in cache.layers for head in kept(layer, 1))


def test_sinks_do_not_spend_the_consensus_share(monkeypatch):
    """A sink with the top consensus would, through the forward pooling, force itself and the 14
    tokens after it into every head. The sinks are kept anyway, so the consensus share (counted
    after the window and the sinks) goes to the next consensus peak instead."""
    n, peak = 200, 120

    def peaked(layer_scores, key_valid):
        consensus = torch.zeros(key_valid.shape, dtype=torch.float32)
        consensus[:, 0] = 1.0  # the first sink
        consensus[:, peak] = 0.5
        return consensus

    monkeypatch.setattr(scoring, "consensus_scores", peaked)
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.1, window=4, consensus=1.0, sinks=4, compile=False, budget="uniform")
    cache = jacap_attn.compress(model, random_ids(1, n, seed=6))
    for layer in cache.layers:
        for head in kept(layer):
            # Budget 20 = 4 window + 4 sinks + 12 consensus tokens: the latest 12 of the peak's span.
            assert head & set(range(peak, peak + 15)) == set(range(peak + 3, peak + 15)), sorted(head)
            assert not head & set(range(4, 15)), sorted(head)


def test_the_default_gives_half_of_each_heads_free_budget_to_the_consensus(monkeypatch):
    """Jacap's default consensus share is 0.5 (0.25 until the re-tune of 2026-12-01 on the tuning
    split, docs/method.md#consensus-share-re-tuned-2026-12-01): every head keeps by force the top
    ``floor(0.5 * (budget - window - sinks))`` consensus tokens."""
    n, peak = 200, 120

    def peaked(layer_scores, key_valid):
        consensus = torch.zeros(key_valid.shape, dtype=torch.float32)
        consensus[:, peak] = 1.0
        return consensus

    monkeypatch.setattr(scoring, "consensus_scores", peaked)
    assert methods.Jacap().consensus == 0.5
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.1, window=4, sinks=4, compile=False, budget="uniform")
    cache = jacap_attn.compress(model, random_ids(1, n, seed=6))
    for layer in cache.layers:
        for head in kept(layer):
            # Budget 20 = 4 window + 4 sinks + 6 consensus tokens (the latest 6 of the peak's forward-
            # pooled span, ties to the later position) + 6 of the head's own ranking.
            assert set(range(peak + 9, peak + 15)) <= head, sorted(head)
    forced = [head >= set(range(peak + 9, peak + 15)) for layer in cache.layers for head in kept(layer)]
    jacap_attn.unpatch(model)
    jacap_attn.patch(model, ratio=0.1, window=4, sinks=4, compile=False, budget="uniform", consensus=0.25)
    cache = jacap_attn.compress(model, random_ids(1, n, seed=6))
    # A quarter forces only 3: the other three peak tokens stay only where a head ranks them itself.
    assert not all(head >= set(range(peak + 9, peak + 15)) for layer in cache.layers for head in kept(layer))
    assert all(forced)


@pytest.mark.parametrize("method", ["jacap", "streaming_llm", "capkv"])
def test_sinks_beyond_the_free_budget_keep_the_earliest(method):
    """Budget 10 = window 8 + 2 free slots, 4 sinks: the first two sinks are kept (a sink's weight
    falls with its position), never the later ones in their place; the window is always kept."""
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.05, window=8, method=method, sinks=4, compile=False)
    for layer in jacap_attn.compress(model, random_ids(1, 200, seed=7)).layers:
        for head in kept(layer):
            assert head == {0, 1, *range(192, 200)}, sorted(head)


def test_huge_and_foreign_numbers_for_the_new_options():
    import fractions
    import json

    import numpy as np

    model = tiny_model("llama")
    for bad in (2**63, 10**30):
        with pytest.raises(ValueError, match=f"sinks={bad}"):
            jacap_attn.patch(model, ratio=0.1, sinks=bad)
    with pytest.raises(ValueError, match="window="):
        jacap_attn.patch(model, ratio=0.1, window=10**30)
    assert not jacap_attn.is_patched(model)
    cfg = jacap_attn.JacapConfig.from_options(sinks=np.int64(2), mass=np.float32(1.5),
                                              consensus=fractions.Fraction(1, 4), window=np.int32(8))
    jacap = cfg.method
    assert (type(jacap.sinks), type(jacap.mass), type(jacap.consensus), type(cfg.window)) == (int, float, float, int)
    json.dumps(cfg.to_dict())  # saved with every cache file
