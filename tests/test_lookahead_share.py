"""``lookahead_share`` (docs/method.md, the rule for ``lookahead_share``): each scored head ranks the
window's own top ``floor((1 - f) * B)`` entries first, then the rest by the window's and the written
tokens' summed statistics."""

from __future__ import annotations

import warnings

import pytest
import torch

import jacap_attn
from jacap_attn.math.share import share_ranking
from conftest import random_ids, tiny_model

N, K = 96, 5


def patched(model, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer for word spans: token by token
        return jacap_attn.patch(model, **{"ratio": 0.25, "window": 8, "min_tokens": 0, "budget": "uniform",
                                          "lookahead": K, **options})


def kept(cache) -> list:
    return [layer.positions[layer.valid].tolist() for layer in cache.layers]


def test_share_ranking_keeps_the_forced_then_the_windows_share_then_the_summed_order():
    from jacap_attn.math.scoring import CONSENSUS_RANK

    inf = float("inf")
    # positions: 0 a sink (forced), 1-5 free, 6 padding-invalid, 7 the window (forced)
    scores = torch.tensor([[[CONSENSUS_RANK * 2, 0.9, 0.1, 0.5, 0.3, 0.2, 0.0, 0.4]]])
    summed = torch.tensor([[[0.0, 0.0, 0.8, 0.1, 0.05, 0.7, 0.0, 0.0]]])
    valid = torch.tensor([[True, True, True, True, True, True, False, True]])
    out = share_ranking(scores, summed, torch.tensor([[6]]), valid, 1, 0.5)  # free = 6 - 2 = 4: 2 of the window's
    assert out[0, 0, 0] == scores[0, 0, 0]  # the sink keeps its forced score
    order = [i for i in out[0, 0, 1:6].argsort(descending=True).add(1).tolist()]
    assert order[:2] == [1, 3]  # the window's own top two free entries, in its order
    assert order[2:] == [2, 5, 4]  # then the summed order of the rest
    assert bool((out[0, 0, [1, 3]] < CONSENSUS_RANK).all())
    # share 1: the summed ranking orders every free entry; a budget no larger than the forced: the same
    for got in (share_ranking(scores, summed, torch.tensor([[6]]), valid, 1, 1.0),
                share_ranking(scores, summed, torch.tensor([[2]]), valid, 1, 0.5)):
        assert torch.equal(got[0, 0, 1:6], summed[0, 0, 1:6])
    assert torch.isfinite(out).all() or out[0, 0, 6] == summed[0, 0, 6]
    with pytest.raises(ValueError, match="share must be in"):
        share_ranking(scores, summed, torch.tensor([[6]]), valid, 1, 0.0)
    with pytest.raises(ValueError, match="one shape"):
        share_ranking(scores, summed[..., :4], torch.tensor([[6]]), valid, 1, 0.5)
    del inf


@pytest.mark.parametrize("route", ["prefill", "chunked", "question"])
def test_each_head_keeps_the_windows_share_and_the_lookahead_fills_the_rest(route):
    """On every route that looks ahead (a prefill, a chunked prefill's last cut, question-time
    reselection): a share near 0 leaves all but one free slot per head to the window's own ranking
    (what ``lookahead=0`` keeps, but for at most one entry per head); a share of 1 lets the summed
    ranking order every free entry (not the window's choice); and at 0.5 each head keeps what is kept
    by force plus the window's own top ``floor(0.5 * free)`` entries (a spy on the cut's ranking)."""
    from jacap_attn.math import share as share_module
    from jacap_attn.math.scoring import CONSENSUS_RANK

    model = tiny_model("llama")
    ids, question = random_ids(1, N), random_ids(1, 6, seed=4)

    def run(**options):
        options = {"carry": 0.0, **options}  # the carry (D10) is not this test's subject: off
        if route == "prefill":
            patched(model, **options)
            return kept(jacap_attn.compress(model, ids))
        if route == "chunked":
            # the tokens-seen running budget, as before the small-chunk default (not this test's subject)
            patched(model, chunk_size=32, chunk_scores="rescore", chunk_budget="seen", **options)
            return kept(jacap_attn.compress(model, ids))
        patched(model, ratio=1.0, reselect=0.25, **options)
        cache = jacap_attn.Document.compress(model, ids).fresh_cache()
        with torch.no_grad():
            model(input_ids=question, cache=cache, use_cache=True)
        return kept(cache)

    def per_head(flat: list, heads: int) -> list:
        size = len(flat) // heads
        return [set(flat[i * size:(i + 1) * size]) for i in range(heads)]

    window = run(lookahead=0)
    near = run(lookahead_share=1e-9)
    for a, b in zip(window, near):
        assert len(a) == len(b)
        assert all(len(x - y) <= 1 for x, y in zip(per_head(a, 2), per_head(b, 2)))
    assert run(lookahead_share=1.0) != window
    calls, original = [], share_module.share_ranking

    def spy(scores, summed, budgets, key_valid, window_, share):
        calls.append((scores.clone(), budgets.clone(), key_valid, window_))
        return original(scores, summed, budgets, key_valid, window_, share)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(share_module, "share_ranking", spy)
        half = run(lookahead_share=0.5)
    assert calls and half != window
    positions = half if route != "question" else None
    for layer_index, (scores, budgets, key_valid, w) in enumerate(calls):
        n = scores.shape[-1]
        valid = (key_valid[:, None, :] if key_valid.dim() == 2 else key_valid).expand_as(scores)
        forced = valid & ((torch.arange(n) >= n - w) | (scores >= CONSENSUS_RANK))
        for head in range(scores.shape[1]):
            free = int(budgets[0, head]) - int(forced[0, head].sum())
            candidates = (valid[0, head] & ~forced[0, head]).nonzero().flatten().tolist()
            best = sorted(candidates, key=lambda i: (-float(scores[0, head, i]), -i))[:int(0.5 * max(free, 0))]
            if positions is not None:  # the index space of a prompt is its positions
                got = per_head(positions[layer_index], 2)[head]
                assert set(best) <= got and set(forced[0, head].nonzero().flatten().tolist()) <= got


@pytest.mark.parametrize("options, message", [
    ({"lookahead": 0, "lookahead_share": 0.25}, "lookahead_share=0.25 is the share .* needs lookahead > 0"),
    ({"lookahead_share": 0.0}, r"lookahead_share must be a share of each head's budget in \(0, 1\]"),
    ({"lookahead_share": 1.5}, "got lookahead_share=1.5"),
    ({"lookahead_share": "0.5"}, "lookahead_share"),
])
def test_a_bad_lookahead_share_is_refused_naming_it(options, message):
    with pytest.raises(ValueError, match=message):
        patched(tiny_model("llama"), **options)


def test_a_saved_document_keeps_its_lookahead_share(tmp_path):
    model = tiny_model("llama")
    patched(model, ratio=1.0, reselect=0.25, lookahead_share=0.25)
    doc = jacap_attn.Document.compress(model, random_ids(1, N))
    doc.save(tmp_path / "doc.safetensors")
    jacap_attn.unpatch(model)
    loaded = jacap_attn.Document.load(tmp_path / "doc.safetensors", model)
    assert loaded.cache.config.lookahead_share == 0.25 and loaded.cache.config.lookahead == K
