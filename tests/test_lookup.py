"""Prompt lookup (issue 34; docs/method.md#d12-prompt-lookup): the prompt's runs that repeat a run of the
observation window, kept by force with the tokens after them (jacap_attn/math/lookup.py, the cut's
step jacap_attn.selection.units.label_lookup, Jacap(lookup=...))."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import jacap_attn
from conftest import random_ids, tiny_model
from jacap_attn import methods
from jacap_attn.math import lookup
from jacap_attn.math.scoring import CONSENSUS_RANK
from jacap_attn.types import LayerPlan


def brute_lengths(ids: list[int], valid: list[bool], window: int, max_count: int = 0) -> list[int]:
    """The longest run ending at each context position equal to a run inside the window (with
    ``max_count``: only where at most that many positions share the window run's longest match), by brute force."""
    n = len(ids)
    real = [i for i in range(n) if valid[i]]
    win = set(real[-window:]) if window else set()
    context = [j for j in range(n) if valid[j] and j not in win]
    run = {}
    for j in context:
        for t in win:
            k = 0
            while k < lookup.MAX_MATCH and j - k >= 0 and t - k >= 0 and valid[j - k] and j - k not in win \
                    and t - k in win and ids[j - k] == ids[t - k]:
                k += 1
            run[j, t] = k
    out = [0] * n
    for j in context:
        for t in win:
            best = max(run[i, t] for i in context)
            if max_count and (run[j, t] < best or sum(run[i, t] == best for i in context) > max_count):
                continue
            out[j] = max(out[j], run[j, t])
    return out


def test_match_lengths_counts_the_longest_run_repeated_in_the_window():
    ids = torch.tensor([[5, 1, 2, 3, 9, 9, 9, 7, 1, 2, 4, 9, 8, 8, 0, 1, 2, 3, 6]])
    got = lookup.match_lengths(ids, torch.ones_like(ids, dtype=torch.bool), 5)
    assert got[0].tolist() == [0, 1, 2, 3, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    # Left padding (-1 ids, invalid) matches nothing; a run does not cross it.
    padded = torch.cat([torch.full((1, 3), 1), ids], dim=1)
    valid = torch.cat([torch.zeros(1, 3, dtype=torch.bool), torch.ones_like(ids, dtype=torch.bool)], dim=1)
    assert lookup.match_lengths(padded, valid, 5)[0, 3:].tolist() == got[0].tolist()
    assert lookup.match_lengths(ids, torch.ones_like(ids, dtype=torch.bool), 0).sum() == 0
    with pytest.raises(ValueError, match="must both be"):
        lookup.match_lengths(ids, torch.ones(1, 3, dtype=torch.bool), 5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(0, 12), st.integers(0, 5), st.integers(0, 2))
def test_match_lengths_equals_brute_force(ids, window, pad, max_count):
    valid = [False] * pad + [True] * len(ids)
    tensor = torch.tensor([[7] * pad + ids])
    got = lookup.match_lengths(tensor, torch.tensor([valid]), window, max_count=max_count)[0].tolist()
    assert got == brute_lengths([7] * pad + ids, valid, window, max_count)


def test_a_specific_match_is_the_one_run_that_repeats_the_whole_key():
    """``max_count=1``: four look-alike facts share "the Brandt-" with the question, one shares
    "the Brandt-4 vault": only that one counts."""
    facts = [[50, 51, 52, 60 + d, 53, 70 + d] for d in (2, 4, 8, 9)]  # "the Brandt- <digit> vault is <value>"
    ids = torch.tensor([[1, 2, 3] + [t for f in facts for t in f + [4, 5]] + [40, 50, 51, 52, 64, 53, 41]])
    valid = torch.ones_like(ids, dtype=torch.bool)
    loose = lookup.match_lengths(ids, valid, 7)[0]
    specific = lookup.match_lengths(ids, valid, 7, max_count=1)[0]
    asked = 3 + 8 + 4  # the " vault" of the second fact
    assert loose[asked] == 5 and specific[asked] == 5
    assert sorted(loose.tolist())[-5:] == [3, 3, 3, 4, 5]  # the look-alikes' "the Brandt-" count loosely
    assert (specific > 0).nonzero().flatten().tolist() == [asked - 1, asked]  # "4 vault": no look-alike has it
    marked = (lookup.lookup_strength(specific[None], 3, 2)[0] > 0).nonzero().flatten().tolist()
    assert marked == list(range(asked - 4, asked + 3))  # the whole match, back from its end, and 2 after
    with pytest.raises(ValueError, match="max_count"):
        lookup.match_lengths(ids, valid, 7, max_count=-1)


def test_a_capped_head_keeps_the_value_after_the_key_first():
    """A head whose ``lookup_share`` holds only part of a run keeps the match's end and the tokens after it
    (the value), not the run's tail or its first tokens (found at 5% kept on Gemma-3-270m, where a share of
    five tokens kept the text after the value)."""
    b, h, n = 1, 1, 60
    key_valid = torch.ones(b, n, dtype=torch.bool)
    lengths = torch.zeros(b, n, dtype=torch.int64)
    lengths[0, 10:18] = torch.arange(1, 9)  # a match of 8 tokens ending at 17
    strength = lookup.lookup_strength(lengths, 4, 24)
    plan = LayerPlan(0, None, torch.rand(b, h, n, generator=torch.Generator().manual_seed(0)), key_valid, 8,
                     {"leverage": torch.rand(b, h, n), lookup.PART: strength}, head_budgets=torch.full((b, h), 24))
    methods.Jacap(consensus=0.0, sinks=2, lookup=4, lookup_share=0.5, lookup_free=0).across_layers([plan], key_valid, 8)
    forced = (plan.scores[0, 0] >= CONSENSUS_RANK).nonzero().flatten().tolist()  # floor(0.5 * (24 - 8 - 2)) = 7
    assert [p for p in forced if p >= 2] == list(range(17, 24))


def test_a_head_below_lookup_free_forces_nothing():
    """``lookup_free=F``: a head whose free budget (beyond its window and sinks) is below ``F`` tokens keeps
    its own ranking, a head at or above it forces its share, per head under per-head budgets (found at 5%
    kept on Gemma-3-270m: a free budget of ~10 forced the key's end and dropped the digits of the value
    its own ranking kept)."""
    b, h, n = 1, 2, 60
    key_valid = torch.ones(b, n, dtype=torch.bool)
    lengths = torch.zeros(b, n, dtype=torch.int64)
    lengths[0, 10:18] = torch.arange(1, 9)
    strength = lookup.lookup_strength(lengths, 4, 24)
    scores = torch.rand(b, h, n, generator=torch.Generator().manual_seed(0))

    def run(**options):  # free budgets: head 0 24 - 8 - 2 = 14, head 1 40 - 8 - 2 = 30
        plan = LayerPlan(0, None, scores.clone(), key_valid, 8, {"leverage": torch.rand(b, h, n), lookup.PART: strength},
                         head_budgets=torch.tensor([[24, 40]]))
        methods.Jacap(**{"consensus": 0.0, "sinks": 2, "lookup": 4, "lookup_share": 0.5, **options}).across_layers(
            [plan], key_valid, 8)
        return [(plan.scores[0, i, 2:] >= CONSENSUS_RANK).sum().item() for i in range(h)]

    assert run(lookup_free=0) == [7, 15]  # floor(0.5 * 14), floor(0.5 * 30)
    assert run(lookup_free=14) == [7, 15]
    assert run() == run(lookup_free=24) == [0, 15]  # the default since 2026-12-06
    assert run(lookup_free=15) == [0, 15]
    assert run(lookup_free=31) == [0, 0]
    assert run(lookup_free=15, lookup_share=1.0) == [0, 32]  # uncapped: the whole marked run (8 + 24 tokens)


def test_lookup_strength_marks_a_match_and_the_tokens_after_it_the_longer_first():
    lengths = torch.tensor([[0, 1, 2, 3, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 0, 0]])
    strength = lookup.lookup_strength(lengths, 2, 3)[0]
    got = (strength * lookup.MAX_MATCH).round().tolist()
    assert got == [0, 3, 3, 3, 3, 3, 3, 0, 2, 2, 2, 2, 2, 0, 0, 0]
    # Within a run: its end first, then the tokens after it (the value), then its earlier tokens.
    first = strength[1:7]
    assert torch.argsort(first, descending=True, stable=True).tolist() == [2, 3, 4, 5, 1, 0]
    assert float(strength[1:7].min()) > float(strength[8:13].max())  # a longer match above a shorter one
    assert lookup.lookup_strength(lengths, 4, 3).sum() == 0  # no match of 4 tokens
    assert (lookup.lookup_strength(lengths, 1, 0) > 0).sum() == 5  # the matches alone
    with pytest.raises(ValueError, match="min_len"):
        lookup.lookup_strength(lengths, 0, 3)


def test_jacap_lookup_forces_the_runs_above_the_consensus_within_its_share():
    """``lookup=m``: the positions the step marked (``parts["lookup"]``) rank above the consensus and
    below the sinks in every head, the longest match first, at most ``floor(lookup_share x free)``."""
    b, h, n = 1, 2, 30
    key_valid = torch.ones(b, n, dtype=torch.bool)
    strength = torch.zeros(b, n)
    strength[0, 5:11], strength[0, 14:16] = 6 / 64, 3 / 64

    def run(**options):
        plan = LayerPlan(0, None, torch.rand(b, h, n, generator=torch.Generator().manual_seed(0)), key_valid, 4,
                         {"leverage": torch.rand(b, h, n), lookup.PART: strength}, head_budgets=torch.full((b, h), 16))
        methods.Jacap(consensus=0.5, sinks=1, lookup_free=0, **options).across_layers([plan], key_valid, 4)
        return plan.scores

    off, on = run(), run(lookup=3, lookup_share=1.0)
    assert (on[:, :, 5:11] == CONSENSUS_RANK * (1 + 6 / 64)).all()
    assert (on[:, :, 14:16] == CONSENSUS_RANK * (1 + 3 / 64)).all()
    assert (on[:, :, 0] > on[:, :, 5]).all()  # the sink above
    assert not (off[:, :, 5:11] >= CONSENSUS_RANK).all()
    capped = run(lookup=3, lookup_share=0.5)  # floor(0.5 * (16 - 4 - 1)) = 5: the longer run's later 5
    forced = capped >= CONSENSUS_RANK * (1 + 1 / 128)
    forced[:, :, 0] = False
    assert forced[0, 0].nonzero().flatten().tolist() == [6, 7, 8, 9, 10]
    with pytest.raises(ValueError, match="lookup_share"):
        methods.Jacap(lookup=3, lookup_share=0.0)


def _kept(cache) -> list:
    """Per layer, per KV head of row 0: the set of prompt positions held."""
    return [[set(layer.positions[0, h][layer.valid[0, h]].tolist()) for h in range(layer.positions.shape[1])]
            for layer in cache.layers]


def test_a_prefill_keeps_the_run_its_question_repeats_and_what_follows():
    """Through a patched prefill: a run of the prompt that the window repeats, and the ``lookup_len``
    tokens after it, are held in every layer and KV head; without the option they are not."""
    model = tiny_model("llama")
    ids = random_ids(1, 120, vocab=96)
    ids[0, 40:46] = torch.arange(90, 96)  # the key, repeated by the question at the end
    ids[0, -6:] = torch.arange(90, 96)
    wanted = set(range(40, 46 + 8))
    jacap_attn.patch(model, ratio=0.3, window=8, budget="uniform",
                     method=methods.Jacap(lookup=4, lookup_len=8, lookup_share=1.0))
    on = _kept(jacap_attn.compress(model, ids))
    jacap_attn.patch(model, ratio=0.3, window=8, budget="uniform")
    off = _kept(jacap_attn.compress(model, ids))
    jacap_attn.unpatch(model)
    for layer in on:
        for head in layer:
            assert wanted <= set(head)
    assert not all(wanted <= set(head) for layer in off for head in layer)


def test_question_time_reselection_keeps_the_run_the_question_repeats():
    """A document stored whole, reselected at question time: the question's ids (``cache.forward_ids``)
    follow the stored prompt's, so the run it repeats is kept; a prefill of prompt + question keeps
    the same (the one cut)."""
    model = tiny_model("llama")
    ids = random_ids(1, 120, vocab=96)
    ids[0, 30:36] = torch.arange(90, 96)
    question = torch.cat([torch.tensor([[7, 8]]), torch.arange(90, 96)[None]], dim=1)
    options = dict(window=8, budget="uniform",  # a decode budget of 24: below the default lookup_free
                   method=methods.Jacap(lookup=4, lookup_len=8, lookup_share=1.0, lookup_free=0))
    jacap_attn.patch(model, ratio=1.0, reselect=0.2, **options)
    cache = jacap_attn.compress(model, ids)
    with torch.no_grad():
        model(input_ids=question, cache=cache, use_cache=True)
    wanted = set(range(30, 36 + 8))
    for layer in _kept(cache):
        for head in layer:
            assert wanted <= set(head)
    jacap_attn.patch(model, ratio=1.0, reselect=0.2, window=8, budget="uniform")
    plain = jacap_attn.compress(model, ids)
    with torch.no_grad():
        model(input_ids=question, cache=plain, use_cache=True)
    jacap_attn.unpatch(model)
    assert not all(wanted <= set(head) for layer in _kept(plain) for head in layer)


def test_lookup_needs_the_ids_and_skips_chunk_cuts():
    """From ``inputs_embeds`` (no ids) the option changes nothing; the cut of a chunk before the last (its
    window is the chunk's end, not the question) reads no lookup, a chunked prefill's last cut does."""
    from jacap_attn.selection import units
    from jacap_attn.selection.steps import Cut, _ids_over

    class Cache:
        prompt_ids = torch.arange(10)[None]
        forward_ids = None
        config = jacap_attn.JacapConfig(method=methods.Jacap(lookup=2))

    plan = LayerPlan(0, None, torch.zeros(1, 1, 10), torch.ones(1, 10, dtype=torch.bool), 2, {})
    cut = Cut("chunk", torch.tensor([10]), 0.5, 2, 0, 2, 0, torch.ones(1, 10, dtype=torch.bool), "uniform",
              bucketed=False)
    units.label_lookup(Cache(), [plan], cut, _ids_over(Cache(), cut))
    assert lookup.PART not in plan.parts
    Cache.prompt_ids = None
    prefill = Cut("prefill", torch.tensor([10]), 0.5, 2, 0, 2, 0, cut.key_valid, "uniform")
    units.label_lookup(Cache(), [plan], prefill, _ids_over(Cache(), prefill))
    assert lookup.PART not in plan.parts
    model = tiny_model("llama")
    ids = random_ids(1, 120, vocab=96)
    ids[0, 40:46] = torch.arange(90, 96)
    ids[0, -6:] = torch.arange(90, 96)
    embeds = model.get_input_embeddings()(ids)
    kept = []
    for method in (methods.Jacap(lookup=4), methods.Jacap()):
        jacap_attn.patch(model, ratio=0.2, window=8, method=method)
        with torch.no_grad():
            out = model(inputs_embeds=embeds, use_cache=True)
        kept.append(_kept(out.past_key_values))
    jacap_attn.unpatch(model)
    assert kept[0] == kept[1]


def test_a_chunked_prefill_looks_up_at_its_last_cut():
    """Chunked (``chunk_size``): the last chunk holds the question, so its cut keeps the run it repeats,
    in every layer and KV head."""
    model = tiny_model("llama")
    ids = random_ids(1, 160, vocab=96)
    ids[0, 130:136] = torch.arange(90, 96)  # in the last chunk (128-160), before its window
    ids[0, -6:] = torch.arange(90, 96)
    wanted = set(range(130, 136 + 8))
    got = []
    for method in (methods.Jacap(lookup=4, lookup_len=8, lookup_share=1.0), methods.Jacap()):
        jacap_attn.patch(model, ratio=0.3, window=8, budget="uniform", chunk_size=64, method=method)
        got.append(_kept(jacap_attn.compress(model, ids)))
    jacap_attn.unpatch(model)
    assert all(wanted <= head for layer in got[0] for head in layer)
    assert not all(wanted <= head for layer in got[1] for head in layer)


def test_lookup_ahead_keeps_the_run_the_prompts_end_repeats_through_every_cut():
    """``lookup_ahead``: a chunked prefill given its whole prompt cuts its earlier chunks with the prompt's
    own end as the lookup window, so a run in the first chunk that the question repeats (and the tokens
    after it) survives every cut before the question arrives, through ``compress``, a plain forward split by
    ``chunk_size`` and ``generate(prefill_chunk_size=...)``; without it the earlier cuts read no lookup and
    lose it. From ``inputs_embeds`` (no ids ahead) it changes nothing."""
    model = tiny_model("llama")
    ids = random_ids(1, 224, vocab=88)
    ids[0, 20:26] = torch.arange(90, 96)  # in the first chunk (0-64), three cuts before the question
    ids[0, -6:] = torch.arange(90, 96)
    wanted = set(range(22, 26 + 4))  # the run's last 4 tokens and the 4 after it (the first cut's free budget: 8)
    options = dict(lookup=4, lookup_len=4, lookup_share=1.0, lookup_free=0)
    got = {}
    for ahead in (True, False):
        jacap_attn.patch(model, ratio=0.3, window=8, budget="uniform", chunk_size=64, chunk_scores="rescore",
                         method=methods.Jacap(lookup_ahead=ahead, **options))
        got[ahead, "compress"] = _kept(jacap_attn.compress(model, ids))
        with torch.no_grad():
            got[ahead, "forward"] = _kept(model(input_ids=ids, use_cache=True).past_key_values)
            out = model.generate(ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
            got[ahead, "embeds"] = _kept(model(inputs_embeds=model.get_input_embeddings()(ids),
                                               use_cache=True).past_key_values)
        # generate's cache holds the prompt's entries and the one token it wrote
        got[ahead, "generate"] = [[{p for p in head if p < ids.shape[1]} for head in layer]
                                  for layer in _kept(out.past_key_values)]
        assert out.past_key_values.prompt_ahead is None  # forgotten at the last cut
    jacap_attn.unpatch(model)
    for route in ("compress", "forward", "generate"):
        assert all(wanted <= head for layer in got[True, route] for head in layer), route
        assert not all(wanted <= head for layer in got[False, route] for head in layer), route
    assert got[True, "embeds"] == got[False, "embeds"]


def test_match_lengths_reads_a_probe_window_outside_the_ids():
    """``probe``: the window is given apart; every valid position of ``ids`` is context, as if the probe
    were appended after them."""
    ids = torch.tensor([[5, 1, 2, 3, 9, 9, 7, 1, 2, 4]])
    probe = torch.tensor([[0, 1, 2, 3, 6]])
    valid = torch.ones_like(ids, dtype=torch.bool)
    got = lookup.match_lengths(ids, valid, 99, probe=(probe, torch.ones_like(probe, dtype=torch.bool)))
    joined = lookup.match_lengths(torch.cat([ids, probe], 1), torch.ones(1, 15, dtype=torch.bool), 5)[:, :10]
    assert got.tolist() == joined.tolist() == [[0, 1, 2, 3, 0, 0, 0, 1, 2, 0]]
    masked = torch.tensor([[True, True, False, True, True]])  # a run does not cross the probe's padding
    assert lookup.match_lengths(ids, valid, 5, probe=(probe, masked))[0].tolist() == [0, 1, 0, 1, 0, 0, 0, 1, 0, 0]
    with pytest.raises(ValueError, match="probe ids"):
        lookup.match_lengths(ids, valid, 5, probe=(probe, masked[:, :3]))


def test_lookup_room_holds_the_looked_up_run_in_every_head_through_the_cuts_within_the_bound():
    """``lookup_room`` (docs/method.md#lookup-room): under the global budget and the default share and floor, the
    cuts before the question force the run the prompt's end repeats (and the tokens after it) in only some heads;
    with the room every head of every layer holds it after every cut before the last, and no layer's heads hold
    more in all than the final budget plus the window (the bound leaves the rest for the next chunk). A one-shot
    prefill is unchanged."""
    from eval.chunk_oracle import chunked_run

    model = tiny_model("llama")
    ids = random_ids(1, 600, vocab=88)
    ids[0, 20:26] = torch.arange(90, 96)  # in the first chunk (0-200), two cuts before the question
    ids[0, -6:] = torch.arange(90, 96)
    wanted = torch.arange(20, 26 + 24)  # the run and the lookup_len (24) tokens after it
    bound = (150 + 16) * 3  # (ceil(0.25 * 600) + window) per KV head, 3 layers of the global policy
    held, kept = {}, {}
    for room in (True, False):
        jacap_attn.patch(model, ratio=0.25, window=16, chunk_scores="rescore", method=methods.Jacap(lookup_room=room))
        _, held[room], _ = chunked_run(model, ids, torch.ones_like(ids), 200)
        kept[room] = _kept(jacap_attn.compress(model, ids))  # one-shot: the room acts only between chunks
    jacap_attn.unpatch(model)
    before_last = held[True][:-1]
    assert all(bool(layer[0][:, wanted].all()) for cut in before_last for layer in cut)
    assert not all(bool(layer[0][:, wanted].all()) for cut in held[False][:-1] for layer in cut)
    assert all(sum(int(layer[0].sum()) for layer in cut) <= bound * cut[0].shape[1] for cut in before_last)
    assert kept[True] == kept[False]
    # a run with more tokens after it (lookup_len 64) than the room at the second cut (150 + 16 - 100): capped
    jacap_attn.patch(model, ratio=0.25, window=16, chunk_scores="rescore", method=methods.Jacap(lookup_room=True,
                                                                                              lookup_len=64))
    _, long_run, _ = chunked_run(model, ids, torch.ones_like(ids), 200)
    jacap_attn.unpatch(model)
    assert all(sum(int(layer[0].sum()) for layer in cut) <= bound * cut[0].shape[1] for cut in long_run[:-1])
