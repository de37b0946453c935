"""A prompt's chunked prefill takes the final budget where its first cut is smaller than what a cut sets aside
(docs/method.md, "The final budget where a first cut is smaller than what it sets aside"; issue 33, the rule
confirmed 2026-12-07): ``chunk_budget`` left unset resolves by the chunk size, a document keeps ``"seen"``."""

from __future__ import annotations

import warnings

import pytest
import torch

import jacap_attn
from jacap_attn.route_settings import prompt_chunk_budget, reserved_slots
from conftest import random_ids, tiny_model
from eval.chunk_oracle import chunked_run

N, WINDOW = 300, 8


def config(**options):
    return jacap_attn.JacapConfig.from_options(**options)


@pytest.mark.parametrize("options,chunk,want", [
    ({"ratio": 0.1}, 512, "final"),  # 52 kept after the first cut, 32 + 4 + 24 = 60 set aside
    ({"ratio": 0.1}, 590, "final"),  # 59
    ({"ratio": 0.1}, 600, "seen"),  # 60
    ({"ratio": 0.1}, 1024, "seen"),
    ({"ratio": 0.25}, 236, "final"),  # 59
    ({"ratio": 0.25}, 240, "seen"),
    ({"ratio": 0.1, "lookup": 0}, 512, "seen"),  # no prompt lookup: 36 set aside
    ({"ratio": 0.1, "sinks": 0, "lookup": 0}, 100, "seen"),  # the window alone: a cut keeps at least it
    ({"ratio": 0.1, "lookup": 0}, 350, "final"),  # 35 against 32 + 4
    ({"ratio": 0.1, "method": "snapkv"}, 512, "seen"),  # no sinks, no lookup
    ({"ratio": 0.1, "chunk_budget": "seen"}, 512, "seen"),  # as given
    ({"ratio": 0.1, "chunk_budget": "final"}, 1024, "final"),
    ({"ratio": 0.1}, None, "seen"),  # no chunk size
])
def test_the_default_resolves_by_the_first_cut_against_the_slots_a_cut_sets_aside(options, chunk, want):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = config(**options)
    assert cfg.chunk_budget == options.get("chunk_budget")
    assert prompt_chunk_budget(cfg, chunk) == want


def test_the_slots_a_cut_sets_aside_are_the_methods_own():
    assert reserved_slots(config(ratio=0.1)) == 32 + 4 + 24
    assert reserved_slots(config(ratio=0.1, window=8, lookup_free=10)) == 8 + 4 + 10
    assert reserved_slots(config(ratio=0.1, method="snapkv")) == 32


def held_after_each_cut(model, ids, chunk, **options):
    jacap_attn.patch(model, ratio=0.1, window=WINDOW, min_tokens=0, **options)
    return chunked_run(model, ids, torch.ones_like(ids), chunk)[1]


def same(a, b) -> bool:
    return all(all(torch.equal(x, y) for x, y in zip(p, q)) for p, q in zip(a, b))


@pytest.mark.parametrize("family_", ["llama", "gemma3_text"])
def test_a_prompts_small_chunks_keep_the_final_budget_from_the_first_cut_by_default(family_):
    """Chunks of 50 at 10% (a first cut of 8, below the 8 + 4 + 24 a cut sets aside): every cut keeps what
    ``chunk_budget="final"`` keeps, not what ``"seen"`` keeps; chunks of 400 (40 kept) keep ``"seen"``'s."""
    model = tiny_model(family_, num_hidden_layers=3)
    ids = random_ids(1, N)
    default = held_after_each_cut(model, ids, 50)
    assert same(default, held_after_each_cut(model, ids, 50, chunk_budget="final"))
    assert not same(default, held_after_each_cut(model, ids, 50, chunk_budget="seen"))
    long_ids = random_ids(1, 1000)
    default = held_after_each_cut(model, long_ids, 400)
    assert same(default, held_after_each_cut(model, long_ids, 400, chunk_budget="seen"))
    assert not same(default, held_after_each_cut(model, long_ids, 400, chunk_budget="final"))


def test_generate_and_compress_take_the_default_and_a_document_keeps_the_tokens_seen():
    """``compress(chunk_size=)`` and ``generate(prefill_chunk_size=)`` of a prompt hold the final budget's
    entries; ``Document.compress`` records ``chunk_budget="seen"`` and holds what ``"seen"`` holds."""
    model = tiny_model("llama", num_hidden_layers=3)
    ids = random_ids(1, N)

    def compressed(**options):
        jacap_attn.patch(model, ratio=0.1, window=WINDOW, min_tokens=0, **options)
        return [layer.slot_map(N)[1] for layer in jacap_attn.compress(model, ids, chunk_size=50).layers]

    def generated(**options):
        jacap_attn.patch(model, ratio=0.1, window=WINDOW, min_tokens=0, **options)
        cache = jacap_attn.JacapCache(model, max_length=N + 1)
        model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False, prefill_chunk_size=50)
        return [layer.slot_map(N)[1] for layer in cache.layers]

    for run in (compressed, generated):
        default = run()
        assert all(torch.equal(a, b) for a, b in zip(default, run(chunk_budget="final"))), run.__name__
        assert not all(torch.equal(a, b) for a, b in zip(default, run(chunk_budget="seen"))), run.__name__
    jacap_attn.patch(model, ratio=0.1, window=WINDOW, min_tokens=0, repeat_ids=(5, 6, 7))
    doc = jacap_attn.Document.compress(model, ids, store=None, chunk_size=50)
    assert doc.cache.config.chunk_budget == "seen"
    jacap_attn.patch(model, ratio=0.1, window=WINDOW, min_tokens=0, repeat_ids=(5, 6, 7), chunk_budget="seen")
    by_hand = jacap_attn.Document.compress(model, ids, store=None, chunk_size=50)
    for a, b in zip(doc.cache.layers, by_hand.cache.layers):
        assert torch.equal(a.slot_map(N)[1], b.slot_map(N)[1])


def test_a_new_turn_in_chunks_keeps_the_tokens_seen_and_the_cache_its_own_setting():
    """A turn that ``generate(prefill_chunk_size=)`` prefills in chunks over a compressed cache is no prompt's first
    cut: with ``chunk_budget`` unset it keeps what ``"seen"`` keeps (before, its small chunks took the final-budget
    floor of the whole conversation, 0.146 of it after its first cut instead of 0.1) and the same tokens; after it
    the cache's setting is unset again, as is a prompt's after its prefill."""
    model = tiny_model("llama", num_hidden_layers=3)
    ids, turn = random_ids(1, 200), random_ids(1, 150, seed=3)
    runs = {}
    for budget in (None, "seen"):
        jacap_attn.patch(model, ratio=0.1, window=WINDOW, min_tokens=0, chunk_budget=budget)
        cache = jacap_attn.compress(model, ids)
        counts = []
        original = jacap_attn.selection.cut

        def spy(cache_, plans, request):
            original(cache_, plans, request)
            counts.append([int(layer.kept_counts().sum()) for layer in cache_.layers])

        jacap_attn.selection.cut = spy
        try:
            out = model.generate(torch.cat([ids, turn], 1), past_key_values=cache, prefill_chunk_size=40,
                                 max_new_tokens=2, do_sample=False)
        finally:
            jacap_attn.selection.cut = original
        runs[budget] = (counts, out, cache.config.chunk_budget)
    assert runs[None][0] == runs["seen"][0] and len(runs[None][0]) >= 3
    assert torch.equal(runs[None][1], runs["seen"][1])
    assert runs[None][2] is None and runs["seen"][2] == "seen"
    jacap_attn.patch(model, ratio=0.1, window=WINDOW, min_tokens=0)
    assert jacap_attn.compress(model, ids, chunk_size=50).config.chunk_budget is None  # a prompt's too
