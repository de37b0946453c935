"""Units larger than a word (issue 34): clause and chunk labels and the forward carry
(jacap_attn/selection/spans.py, jacap_attn/math/carry.py), as pure functions of tensors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jacap_attn.math import carry
from jacap_attn.selection import spans


class ClauseTokenizer:
    """Ids 0-2 special; 3-29 start a word ("Ġw<i>"); 30-59 continue one ("c<i>"); 60-69 are ". "-style
    punctuation that continues a word ("."); 70-79 hold a newline ("Ċ"); 80-95 ";" starting a word."""

    all_special_ids = [0, 1, 2]

    def __len__(self):
        return 96

    def convert_ids_to_tokens(self, ids):
        def name(i):
            if i < 3:
                return "<s>"
            if i < 30:
                return f"\u0120w{i}"
            if i < 60:
                return f"c{i}"
            if i < 70:
                return "."
            if i < 80:
                return "\u010a"
            return "\u0120;"
        return [name(i) for i in ids]


TOK = ClauseTokenizer()
STARTS = spans.word_starts(TOK)
CLAUSES = spans.clause_table(TOK)
SPECIALS = spans.special_table(TOK, 96)


def test_clause_table_kinds():
    assert CLAUSES[:3].tolist() == [2, 2, 2]  # special tokens
    assert not CLAUSES[3:60].any()
    assert (CLAUSES[60:70] == 1).all() and (CLAUSES[70:80] == 2).all() and (CLAUSES[80:] == 3).all()
    with pytest.raises(ValueError, match="Hugging Face tokenizer"):
        spans.clause_table(object())


def test_clause_ids_on_a_fact():
    # <s> | w3 c30 . w4 (a dotted name: no break) w5 . | w6 w7 Ċ | c31 w8 ; | w9
    ids = torch.tensor([[0, 3, 30, 60, 34, 4, 5, 61, 6, 7, 70, 31, 8, 80, 9]])
    labels = spans.clause_ids(ids, STARTS, CLAUSES, SPECIALS)
    assert labels.tolist() == [[0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4]]
    # Sentences: the ";" before a word ends nothing, "." and the newline still do.
    sentences = spans.clause_ids(ids, STARTS, CLAUSES, SPECIALS, sentences=True)
    assert sentences.tolist() == [[0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3]]
    valid = torch.ones(1, 15, dtype=torch.bool)
    tables = (STARTS, SPECIALS, CLAUSES)
    assert torch.equal(units.unit_labels("sentences", 64, valid, ids, tables), sentences)
    assert torch.equal(units.unit_labels("clauses", 64, valid, ids, tables), labels)
    # "w3 c30 . c34": the "." before a continuation does not end the clause.
    assert spans.clause_ids(torch.tensor([[3, 30, 60, 34]]), STARTS, CLAUSES).tolist() == [[0, 0, 0, 0]]
    assert spans.clause_ids(ids, STARTS, CLAUSES, SPECIALS, max_len=3).max() > labels.max()
    with pytest.raises(ValueError, match="max_len"):
        spans.clause_ids(ids, STARTS, CLAUSES, max_len=0)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 120), min_size=1, max_size=80), max_len=st.integers(1, 12))
def test_clause_ids_properties(ids, max_len):
    t = torch.tensor([ids])
    labels = spans.clause_ids(t, STARTS, CLAUSES, SPECIALS, max_len=max_len)[0]
    assert labels[0] == 0
    steps = labels[1:] - labels[:-1]
    assert ((steps == 0) | (steps == 1)).all()
    assert torch.bincount(labels).max() <= max_len
    for i in range(1, len(ids)):
        prev, cur = ids[i - 1], ids[i]
        if prev >= 96 or cur >= 96:
            continue
        if 70 <= prev < 80 or prev < 3 or cur < 3:  # newline or special: always a new clause
            assert steps[i - 1] == 1
        elif steps[i - 1] == 1 and (labels == labels[i - 1]).sum() < max_len:
            assert 60 <= prev < 70 or prev >= 80  # otherwise only punctuation before a word ends one
            assert bool(STARTS[cur])


def test_chunk_ids_ignore_left_padding():
    valid = torch.tensor([[True] * 10, [False] * 3 + [True] * 7])
    labels = spans.chunk_ids(valid, 4)
    assert labels[0].tolist() == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3]
    assert labels[1].tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="chunk size"):
        spans.chunk_ids(valid, 0)


def _recurrence(s, units, gamma):
    out = []
    for t in range(len(s)):
        c = s[t] if t == 0 or units[t] != units[t - 1] else max(s[t], gamma * out[-1])
        out.append(c)
    return out


@settings(max_examples=60, deadline=None)
@given(scores=st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=40),
       cuts=st.lists(st.booleans(), min_size=40, max_size=40), gamma=st.sampled_from([0.0, 0.5, 0.9, 1.0]))
def test_carry_forward_is_the_reset_recurrence(scores, cuts, gamma):
    n = len(scores)
    units = torch.tensor([cuts[:n]]).long().cumsum(-1)
    s = torch.tensor([[scores]], dtype=torch.float32)
    got = carry.carry_forward(s, units, gamma, max_len=n)[0, 0]
    assert got.tolist() == pytest.approx(_recurrence(scores, units[0].tolist(), gamma), rel=1e-5)
    assert (got >= s[0, 0]).all()


def test_carry_forward_is_bounded_by_max_len_and_units():
    s = torch.tensor([[[5.0, 0.0, 0.0, 0.0, 0.0, 0.0]]])
    units = torch.tensor([[0, 0, 0, 0, 1, 1]])
    out = carry.carry_forward(s, units, 1.0, max_len=3)[0, 0]
    assert out.tolist() == [5.0, 5.0, 5.0, 0.0, 0.0, 0.0]  # 3 tokens of reach, and not across the unit
    per_head = carry.carry_forward(s.expand(1, 2, 6), units[:, None].expand(1, 2, 6), 0.5, 8)
    assert per_head[0, 1].tolist() == [5.0, 2.5, 1.25, 0.625, 0.0, 0.0]
    assert torch.equal(carry.carry_forward(s, units, 0.0, 8), s)
    with pytest.raises(ValueError, match="gamma"):
        carry.carry_forward(s, units, 1.5, 8)


# ------------------------------------------------------------------------------ Jacap's options


import jacap_attn  # noqa: E402
from conftest import random_ids, tiny_model  # noqa: E402
from jacap_attn import methods  # noqa: E402
from jacap_attn.math import scoring  # noqa: E402
from jacap_attn.selection import units  # noqa: E402
from jacap_attn.types import LayerPlan  # noqa: E402


def _kept(layer, row: int = 0) -> list[set[int]]:
    return [set(layer.positions[row, h][layer.valid[row, h]].tolist()) for h in range(layer.valid.shape[1])]


def _peaked(peak):
    def consensus(layer_scores, key_valid):
        out = torch.zeros(key_valid.shape, dtype=torch.float32)
        out[:, peak] = 1.0
        return out
    return consensus


@pytest.mark.parametrize("kind", ["chunks", "clauses", "clauses without a vocabulary", "none"])
def test_consensus_is_carried_to_the_end_of_its_unit(monkeypatch, kind):
    """Budget 20 = 4 window + 4 sinks + 12 consensus tokens, one consensus peak at 120. Without units
    the peak's forward pooling (15 tokens) forces 12 of 120..134, the latest; with units it forces the
    peak's unit from the peak to the unit's end (chunks of 10: 120..129; a clause ending with the newline
    token at 127: 120..127), then the latest tokens before the window. Clauses without the model's
    vocabulary fall back to the forward pooling."""
    n, peak = 200, 120
    monkeypatch.setattr(scoring, "consensus_scores", _peaked(peak))
    ids = torch.randint(3, 30, (1, n), generator=torch.Generator().manual_seed(3))  # words only: no clause end
    ids[0, 127] = 70  # a newline ends the clause at 127
    model = tiny_model("llama")
    options = {"chunks": dict(units="chunks", unit_len=10), "clauses": dict(units="clauses"),
               "clauses without a vocabulary": dict(units="clauses"), "none": {}}[kind]
    tokenizer = ClauseTokenizer() if kind == "clauses" else None
    jacap_attn.patch(model, ratio=0.1, window=4, consensus=1.0, sinks=4, compile=False, budget="uniform",
                     spans="none", tokenizer=tokenizer, **options)
    cache = jacap_attn.compress(model, ids)
    want = {"chunks": set(range(120, 130)), "clauses": set(range(120, 128))}.get(kind, set(range(123, 135)))
    for layer in cache.layers:
        for head in _kept(layer):
            assert head & set(range(110, 140)) == want, (kind, sorted(head))
    jacap_attn.unpatch(model)


def test_label_units_step_fills_the_plans_only_when_asked():
    model = tiny_model("llama")
    ids = random_ids(1, 60, seed=2)
    seen = {}

    def spy(self, plans, key_valid, window):
        seen[self.units] = [p.parts.get(units.PART) for p in plans]

    for options in ({}, dict(units="chunks", unit_len=7)):
        jacap_attn.patch(model, ratio=0.3, window=4, compile=False, **options)
        original = methods.Jacap.across_layers
        methods.Jacap.across_layers = spy
        try:
            jacap_attn.compress(model, ids)
        finally:
            methods.Jacap.across_layers = original
        jacap_attn.unpatch(model)
    assert all(x is None for x in seen["none"])
    expected = spans.chunk_ids(torch.ones(1, 60, dtype=torch.bool), 7)
    assert all(torch.equal(x, expected) for x in seen["chunks"]) and len(seen["chunks"]) == 3


def test_carry_moves_each_heads_ranking_along_its_unit():
    """``carry`` replaces each head's scores by their carry along the units before the consensus and
    sinks are placed (with neither, exactly :func:`jacap_attn.carry.carry_forward`)."""
    gen = torch.Generator().manual_seed(0)
    b, h, n = 2, 3, 30
    key_valid = torch.ones(b, n, dtype=torch.bool)
    labels = spans.chunk_ids(key_valid, 6)
    plans = [LayerPlan(i, None, torch.rand(b, h, n, generator=gen), key_valid, 4,
                       {"leverage": torch.rand(b, h, n, generator=gen), units.PART: labels},
                       head_budgets=torch.full((b, h), 10)) for i in range(2)]
    before = [p.scores.clone() for p in plans]
    methods.Jacap(consensus=0.0, sinks=0, units="chunks", unit_len=6, carry=0.8, carry_len=64,
                  carry_count=0).across_layers(plans, key_valid, 4)
    for p, s in zip(plans, before):
        assert torch.equal(p.scores, carry.carry_forward(s, labels, 0.8, 6))
        assert not torch.equal(p.scores, s)
    untouched = [p.scores.clone() for p in plans]
    methods.Jacap(consensus=0.0, sinks=0, units="chunks", carry=0.0).across_layers(plans, key_valid, 4)
    assert all(torch.equal(p.scores, s) for p, s in zip(plans, untouched))


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("options", [dict(units="chunks", unit_len=5, carry=0.9), dict(units="clauses", carry=0.5)])
def test_unit_options_keep_the_budget_and_pad_invariance(family, options):
    """Under the units options every compressed head keeps what the default budget gives it (the
    options move tokens, not the budget), and a left-padded row keeps what it keeps alone."""
    model = tiny_model(family)
    ids = torch.randint(3, 96, (1, 120), generator=torch.Generator().manual_seed(4))
    padded = torch.cat([torch.zeros(1, 9, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 9, dtype=torch.long), torch.ones_like(ids)], 1)
    counts = {}
    for name, extra in (("default", {}), ("units", options)):
        jacap_attn.patch(model, ratio=0.2, window=4, compile=False, tokenizer=ClauseTokenizer(), **extra)
        alone = jacap_attn.compress(model, ids)
        counts[name] = [layer.kept_counts().tolist() for layer in alone.layers]
        both = jacap_attn.compress(model, torch.cat([padded, torch.cat([torch.zeros(1, 9, dtype=torch.long), ids], 1)]),
                                   torch.cat([mask, mask]))
        for a, p in zip(alone.layers, both.layers):
            assert _kept(a) == _kept(p, 1)
        jacap_attn.unpatch(model)
    assert counts["default"] == counts["units"]


def test_bad_unit_options_are_refused():
    with pytest.raises(ValueError, match="units"):
        methods.Jacap(units="words")
    with pytest.raises(ValueError, match="carry"):
        methods.Jacap(carry=1.5)
    with pytest.raises(ValueError, match="unit_len"):
        methods.Jacap(unit_len=0)
    with pytest.raises(ValueError, match="units must be one of"):
        units.unit_labels("paragraphs", 4, torch.ones(1, 3, dtype=torch.bool), None, None)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), share=st.sampled_from([0.1, 0.25, 0.5, 1.0]), window=st.integers(0, 6),
       reserved=st.integers(0, 3))
def test_top_of_budget_is_the_heads_best_share_outside_the_window(seed, share, window, reserved):
    gen = torch.Generator().manual_seed(seed)
    b, h, n = 2, 3, 20
    scores = torch.randint(0, 6, (b, h, n), generator=gen).float()  # ties on purpose
    budgets = torch.randint(0, n + 1, (b, h), generator=gen)
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :4] = False
    got = scoring.top_of_budget(scores, budgets, valid, window, reserved, share)
    for r in range(b):
        for k in range(h):
            free = max(int(budgets[r, k]) - min(window, n) - reserved, 0)
            count = math.ceil(share * free - 1e-9)
            cands = [i for i in range(n - min(window, n)) if valid[r, i]]
            best = sorted(cands, key=lambda i: (-float(scores[r, k, i]), -i))[:count]
            assert set(torch.nonzero(got[r, k]).flatten().tolist()) == set(best)


def test_carry_from_sources_only():
    s = torch.tensor([[[5.0, 0.0, 3.0, 0.0, 0.0]]])
    units = torch.zeros(1, 5, dtype=torch.long)
    sources = torch.tensor([[[False, False, True, False, False]]])
    out = carry.carry_forward(s, units, 1.0, 8, sources)[0, 0]
    assert out.tolist() == [5.0, 0.0, 3.0, 3.0, 3.0]  # position 0 keeps its 5 but lends nothing
    assert torch.equal(carry.carry_forward(s, units, 1.0, 8, torch.ones_like(sources)), carry.carry_forward(s, units, 1.0, 8))


def test_carry_top_lends_from_the_heads_best_tokens_only():
    gen = torch.Generator().manual_seed(1)
    b, h, n = 1, 2, 40
    key_valid = torch.ones(b, n, dtype=torch.bool)
    labels = spans.chunk_ids(key_valid, 8)

    def run(**options):
        plans = [LayerPlan(0, None, torch.rand(b, h, n, generator=torch.Generator().manual_seed(2)), key_valid, 4,
                           {"leverage": torch.rand(b, h, n, generator=gen), units.PART: labels},
                           head_budgets=torch.full((b, h), 16))]
        raw = plans[0].scores.clone()
        methods.Jacap(consensus=0.0, sinks=0, units="chunks", unit_len=8, carry=1.0, carry_count=0, **options).across_layers(
            plans, key_valid, 4)
        return raw, plans[0].scores

    raw, everything = run()
    _, top = run(carry_top=0.25)  # ceil(0.25 * (16 - 4)) = 3 lending tokens per head
    sources = scoring.top_of_budget(raw, torch.full((b, h), 16), key_valid, 4, 0, 0.25)
    assert int(sources.sum()) == 2 * 3
    assert torch.equal(top, carry.carry_forward(raw, labels, 1.0, 8, sources))
    assert (top <= everything).all() and not torch.equal(top, everything)
    with pytest.raises(ValueError, match="carry_top"):
        methods.Jacap(carry_top=0.0)


def test_peaks_are_a_heads_outliers_whatever_its_scale():
    scores = torch.tensor([[[1.0, 1.0, 1.0, 9.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]]])
    valid = torch.tensor([[True, True, True, True, True, False]])
    got = scoring.peaks(scores, valid, 3.0)  # head 0: mean 12 / 5 = 2.4, so 9 only; head 1: none
    assert got.tolist() == [[[False, False, False, True, False, False], [False] * 6]]
    assert torch.equal(scoring.peaks(scores * 1e-4, valid, 3.0), got)
    assert torch.equal(scoring.peaks(scores, valid, 0.0), valid[:, None, :].expand(1, 2, 6))
    with pytest.raises(ValueError, match="factor"):
        scoring.peaks(scores, valid, -1.0)


def test_carry_peak_lends_from_a_heads_outliers_only():
    b, h, n = 1, 2, 40
    key_valid = torch.ones(b, n, dtype=torch.bool)
    labels = spans.chunk_ids(key_valid, 8)
    raw = torch.rand(b, h, n, generator=torch.Generator().manual_seed(2))
    raw[0, 0, 9] = 30.0  # one outlier in head 0; head 1 has none at factor 8

    def run(**options):
        plans = [LayerPlan(0, None, raw.clone(), key_valid, 4,
                           {"leverage": torch.rand(b, h, n), units.PART: labels}, head_budgets=torch.full((b, h), 16))]
        methods.Jacap(consensus=0.0, sinks=0, units="chunks", unit_len=8, carry=1.0, carry_count=0, **options).across_layers(
            plans, key_valid, 4)
        return plans[0].scores

    peaked = run(carry_peak=8.0)
    sources = scoring.peaks(raw, key_valid, 8.0)
    assert sources.sum().item() == 1 and sources[0, 0, 9]
    assert torch.equal(peaked, carry.carry_forward(raw, labels, 1.0, 8, sources))
    assert torch.equal(peaked[0, 1], raw[0, 1])  # a head without outliers keeps its own ranking
    assert (peaked[0, 0, 10:16] == 30.0).all()  # the outlier lends to the end of its unit
    assert not torch.equal(peaked, run())
    with pytest.raises(ValueError, match="carry_peak"):
        methods.Jacap(carry_peak=-1.0)


def test_carry_len_bounds_the_reach():
    key_valid = torch.ones(1, 12, dtype=torch.bool)
    labels = torch.zeros(1, 12, dtype=torch.long)  # one unit
    scores = torch.zeros(1, 1, 12)
    scores[0, 0, 2] = 1.0
    plan = LayerPlan(0, None, scores.clone(), key_valid, 2, {"leverage": torch.rand(1, 1, 12), units.PART: labels},
                     head_budgets=torch.full((1, 1), 6))
    methods.Jacap(consensus=0.0, sinks=0, units="clauses", carry=1.0, carry_len=3, carry_count=0).across_layers(
        [plan], key_valid, 2)
    assert plan.scores[0, 0].tolist() == [0, 0, 1, 1, 1] + [0] * 7  # the source and the 2 tokens after it
    with pytest.raises(ValueError, match="carry_len"):
        methods.Jacap(carry_len=0)


# ------------------------------------------------------------------------------ every cut labels alike


def _spy_labels(monkeypatch):
    """Record, at every call of Jacap's cross-layer step, the cut's ``key_valid`` and the labels the
    plans carry (the same in every plan)."""
    seen = []
    original = methods.Jacap.across_layers

    def spy(self, plans, key_valid, window):
        labels = [p.parts.get(units.PART) for p in plans]
        assert all(x is None for x in labels) or all(torch.equal(x, labels[0]) for x in labels)
        seen.append((key_valid.clone(), None if labels[0] is None else labels[0].clone()))
        return original(self, plans, key_valid, window)

    monkeypatch.setattr(methods.Jacap, "across_layers", spy)
    return seen


@pytest.mark.parametrize("kind", ["chunks", "clauses"])
def test_chunked_prefill_labels_every_chunk_cut_as_the_whole_prompt(monkeypatch, kind):
    """Under ``chunk_size`` each chunk's cut (``Cut("chunk")``) labels its index space as a prefill of
    the tokens so far would: chunks count positions (not the indices some head still holds, which
    have holes after the first cut), clauses read the prompt's ids grown by each chunk. A label never
    changes from one cut to the next, and the units still move tokens, not the budget."""
    seen = _spy_labels(monkeypatch)
    model = tiny_model("llama")
    n, chunk = 150, 40
    ids = torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(6))
    options = dict(units="chunks", unit_len=7, carry=0.9) if kind == "chunks" else dict(units="clauses", carry=0.5)
    common = dict(ratio=0.2, window=4, compile=False, budget="uniform", tokenizer=ClauseTokenizer())
    jacap_attn.patch(model, **common, **options)
    cache = jacap_attn.compress(model, ids, chunk_size=chunk)
    assert len(seen) == math.ceil(n / chunk)  # the first chunk's prefill cut, then one per later chunk
    whole = units.unit_labels(kind, 7 if kind == "chunks" else 64, torch.ones(1, n, dtype=torch.bool), ids,
                              spans.vocabulary_tables(ClauseTokenizer()))
    for key_valid, labels in seen:
        length = key_valid.shape[-1]
        assert labels is not None and labels.shape == (1, length)
        assert torch.equal(labels[key_valid], whole[:, :length][key_valid])
    assert any(not bool(k.all()) for k, _ in seen[1:])  # the later cuts' index spaces have holes
    counts = [layer.kept_counts().tolist() for layer in cache.layers]
    jacap_attn.patch(model, **common)
    default = jacap_attn.compress(model, ids, chunk_size=chunk)
    assert counts == [layer.kept_counts().tolist() for layer in default.layers]
    jacap_attn.unpatch(model)


def test_units_under_split_heads_label_the_full_plans(monkeypatch):
    """On a tensor-parallel model the cut's steps 1-5 run over plans of every KV head
    (:func:`jacap_attn.selection.heads.full_plans`); the unit labels ``[b, T]`` are made there, from
    what every rank holds alike (the prompt's ids, the vocabulary, the index space), so every rank
    makes one process's decision. Here a fake group of two ranks whose other rank holds a copy of
    this one's heads: rank 0 keeps what one process keeps (per-head budgets, and a consensus that a
    copy of every head leaves as it is)."""
    from jacap_attn.selection import heads

    class Mirror:
        split, distributed = True, True

        def gather(self, x):
            return torch.cat([x, x], dim=1)

        def gather_many(self, tensors):
            calls.append(len(tensors))
            return [self.gather(t) for t in tensors]

        def any(self, x):
            return x

        def local(self, x):
            return x[:, : x.shape[1] // 2]

    calls = []
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 120), generator=torch.Generator().manual_seed(7))
    options = dict(ratio=0.2, window=4, compile=False, budget="uniform", tokenizer=ClauseTokenizer(), units="chunks",
                   unit_len=6, carry=0.9)
    jacap_attn.patch(model, **options)
    alone = [_kept(layer) for layer in jacap_attn.compress(model, ids).layers]
    seen = _spy_labels(monkeypatch)
    monkeypatch.setattr(heads, "group_of", lambda cache, local_heads: Mirror())
    mirrored = [_kept(layer) for layer in jacap_attn.compress(model, ids).layers]
    assert calls and seen and all(labels is not None for _, labels in seen)
    assert mirrored == alone
    jacap_attn.unpatch(model)


def test_carry_count_lends_from_each_heads_few_best_tokens_and_needs_no_units():
    """``carry_count=k``: only each head's ``k`` best tokens outside the window and the sinks lend
    their score, and with ``units="none"`` the reach is ``carry_len`` alone (before, a carry without
    units did nothing). The sink, the head's best score here, lends nothing."""
    b, h, n = 1, 2, 30
    key_valid = torch.ones(b, n, dtype=torch.bool)
    raw = torch.rand(b, h, n, generator=torch.Generator().manual_seed(0))
    raw[0, 0, 0], raw[0, 0, 5], raw[0, 0, 20], raw[0, 1, 12] = 50.0, 20.0, 10.0, 15.0

    def run(**options):
        plan = LayerPlan(0, None, raw.clone(), key_valid, 4, {"leverage": torch.rand(b, h, n)},
                         head_budgets=torch.full((b, h), 10))
        methods.Jacap(consensus=0.0, sinks=1, carry=1.0, carry_len=4, carry_by="score",
                      **{"carry_count": 0, **options}).across_layers([plan], key_valid, 4)
        return plan.scores

    one = run(carry_count=1)
    assert (one[0, 0, 5:9] == 20.0).all() and (one[0, 1, 12:16] == 15.0).all()
    assert torch.equal(one[0, 0, 21:26], raw[0, 0, 21:26])  # the second best lends only from k = 2
    assert torch.equal(one[0, 0, 1:5], raw[0, 0, 1:5])  # the sink lends nothing
    two = run(carry_count=2)
    assert (two[0, 0, 20:24] == 10.0).all()
    assert torch.equal(two[0, 0, 24:], raw[0, 0, 24:])
    every = run()  # every token lends, over carry_len = 4 tokens, without units
    assert torch.equal(every[..., 1:], carry.carry_forward(raw, torch.zeros(b, n, dtype=torch.long), 1.0, 4)[..., 1:])
    with pytest.raises(ValueError, match="carry_count"):
        methods.Jacap(carry_count=-1)


def test_carry_by_last_lends_from_the_tokens_the_last_window_query_reads():
    """``carry_by="last"``: the ``carry_count`` lending tokens are each head's best by the attention
    of the window's last query (GQA mean; the answer position's read: the asked key in a retrieval
    head), not by the head's score; ``score_parts`` keeps that attention as a part only then, and a
    plan without it (the repeat pass's queries) ranks by the score."""
    from jacap_attn.methods.jacap import LAST

    b, h, n = 1, 2, 30
    key_valid = torch.ones(b, n, dtype=torch.bool)
    raw = torch.rand(b, h, n, generator=torch.Generator().manual_seed(0))
    raw[0, 0, 5], raw[0, 1, 12] = 20.0, 15.0  # the score's best tokens
    last = torch.zeros(b, h, n)
    last[0, 0, 9], last[0, 1, 2] = 0.9, 0.8  # what the last query reads

    def run(parts, **options):
        plan = LayerPlan(0, None, raw.clone(), key_valid, 4, {"leverage": torch.rand(b, h, n), **parts},
                         head_budgets=torch.full((b, h), 10))
        methods.Jacap(consensus=0.0, sinks=1, carry=1.0, carry_len=4, carry_count=1, **options).across_layers(
            [plan], key_valid, 4)
        return plan.scores

    by_last = run({LAST: last}, carry_by="last")
    assert torch.equal(by_last[0, 0, 10:13], raw[0, 0, 10:13].clamp_min(raw[0, 0, 9]))
    assert torch.equal(by_last[0, 1, 3:6], raw[0, 1, 3:6].clamp_min(raw[0, 1, 2]))
    assert not torch.equal(by_last, raw)
    assert torch.equal(by_last[0, 0, 6:9], raw[0, 0, 6:9])  # the score's best lends nothing now
    assert torch.equal(run({}, carry_by="last"), run({}, carry_by="score"))  # no last-query part: by the score
    # score_parts keeps the last window query's attention only under carry_by="last" with a count.
    model = tiny_model("llama")
    ids = random_ids(1, 80)
    kept = {}
    for by in ("score", "last"):
        jacap_attn.patch(model, ratio=0.2, window=8, method=methods.Jacap(carry=1.0, carry_len=4, carry_count=2,
                                                                          carry_by=by))
        kept[by] = [layer.positions[layer.valid].tolist() for layer in jacap_attn.compress(model, ids).layers]
    assert kept["score"] != kept["last"]
    jacap_attn.unpatch(model)
    with pytest.raises(ValueError, match="carry_by"):
        methods.Jacap(carry_by="first")


def test_carry_force_keeps_the_runs_the_last_query_reads_strongly_above_the_consensus():
    """``carry_force=a``: a lender (one of the ``carry_count`` the last window query reads most) whose
    last-query attention is at least ``a`` keeps its run of ``carry_len`` tokens by force: above the
    consensus tokens, below the sinks, the strongest lender's run first; weaker lenders only carry."""
    from jacap_attn.methods.jacap import LAST
    from jacap_attn.math.scoring import CONSENSUS_RANK

    b, h, n = 1, 2, 30
    key_valid = torch.ones(b, n, dtype=torch.bool)
    raw = torch.rand(b, h, n, generator=torch.Generator().manual_seed(0))
    last = torch.zeros(b, h, n)
    last[0, 0, 9], last[0, 0, 15], last[0, 1, 2] = 0.5, 0.05, 0.2
    leverage = torch.rand(b, h, n, generator=torch.Generator().manual_seed(1))

    def run(**options):
        plan = LayerPlan(0, None, raw.clone(), key_valid, 4, {"leverage": leverage, LAST: last},
                         head_budgets=torch.full((b, h), 12))
        methods.Jacap(consensus=0.5, sinks=1, carry=1.0, carry_len=4, carry_count=2, **options).across_layers(
            [plan], key_valid, 4)
        return plan.scores

    off, on = run(), run(carry_force=0.1)
    assert (on[0, 0, 9:13] == CONSENSUS_RANK * 1.5).all() and (on[0, 1, 2:6] == CONSENSUS_RANK * 1.2).all()
    assert (off[0, 0, 9:13] < CONSENSUS_RANK * 1.5).all()
    assert torch.equal(on[0, 0, 15:19], off[0, 0, 15:19])  # read at 0.05 < 0.1: carried, not forced
    assert (on[0, :, 0] > on[0, 0, 9]).all()  # the sink stays above
    outside = torch.ones(n, dtype=torch.bool)
    outside[9:13] = False
    assert torch.equal(on[0, 0, outside], off[0, 0, outside])
    # carry_force_share: at most floor(share * (budget - window - sinks)) forced tokens per head, strongest first.
    capped = run(carry_force=0.1, carry_force_share=0.5)  # floor(0.5 * (12 - 4 - 1)) = 3 of each run's 4
    assert (capped[0, 0, 10:13] == CONSENSUS_RANK * 1.5).all() and capped[0, 0, 9] < CONSENSUS_RANK * 1.5
    assert (capped[0, 1, 3:6] == CONSENSUS_RANK * 1.2).all() and capped[0, 1, 2] < CONSENSUS_RANK * 1.2
    with pytest.raises(ValueError, match="carry_force"):
        methods.Jacap(carry_force=1.5)
    with pytest.raises(ValueError, match="carry_force_share"):
        methods.Jacap(carry_force_share=0.0)
    for lenders in ({"carry": 0.0}, {"carry_count": 0}, {"carry_by": "score"}):  # nothing to force: refused
        with pytest.raises(ValueError, match="carry_force=0.03 .*needs carry > 0"):
            methods.Jacap(carry_force=0.03, **lenders)
    # Through the patched prefill: the forced runs change what a tiny model keeps, and their bound too.
    model = tiny_model("llama")
    ids = random_ids(1, 80)

    def kept(**options):
        jacap_attn.patch(model, ratio=0.2, window=8, method=methods.Jacap(**options))
        try:
            return [layer.positions[layer.valid].tolist() for layer in jacap_attn.compress(model, ids).layers]
        finally:
            jacap_attn.unpatch(model)

    forced = kept(carry_force=0.01)
    assert forced != kept() and kept(carry_force=0.01, carry_force_share=0.2) != forced


def test_top_tokens_excludes_the_window_and_the_excluded():
    scores = torch.tensor([[[9.0, 1.0, 5.0, 7.0, 8.0, 6.0]]])
    valid = torch.ones(1, 6, dtype=torch.bool)
    exclude = torch.tensor([[True, False, False, False, False, False]])
    got = scoring.top_tokens(scores, 2, valid, 2, exclude)  # window: the last 2; position 0 excluded
    assert got[0, 0].tolist() == [False, False, True, True, False, False]


def test_carry_budget_carries_the_global_score_from_the_carrys_lenders():
    """``carry_budget=True``: what the ``global`` budget ranks is carried as the head's ranking is, from the
    ``carry_count`` tokens the last window query reads most (not the window, not the sinks), over
    ``carry_len`` tokens with ``carry``; off, the scores pass unchanged. Through a patched prefill the
    per-head budgets move and the row's total stays the uniform one. Refused where nothing lends."""
    from jacap_attn.methods.jacap import LAST

    b, h, n = 1, 2, 30
    key_valid = torch.ones(b, n, dtype=torch.bool)
    attention = torch.full((b, h, n), 0.01)
    attention[0, 0, 9] = 0.6
    last = torch.zeros(b, h, n)
    last[0, 0, 9], last[0, 0, 27], last[0, 0, 0], last[0, 1, 4] = 0.5, 0.9, 0.8, 0.3  # 27: window, 0: sink
    plan = LayerPlan(0, None, torch.rand(b, h, n), key_valid, 4, {LAST: last})
    jacap = methods.Jacap(carry=0.5, carry_len=3, carry_count=2, sinks=1, carry_budget=True)
    got = jacap.global_scores(plan, attention.clone())
    assert got[0, 0, 10:12].tolist() == pytest.approx([0.3, 0.15]) and got[0, 0, 12] == pytest.approx(0.01)
    assert torch.equal(got[0, 0, :9], attention[0, 0, :9]) and torch.equal(got[0, 0, 28:], attention[0, 0, 28:])
    assert torch.equal(got[0, 1, 5:7], attention[0, 1, 5:7])  # a lender of 0.01 lends no more than its own
    assert torch.equal(methods.Jacap().global_scores(plan, attention), attention)
    gated = methods.Jacap(carry=0.5, carry_len=3, carry_count=2, sinks=1, carry_budget=True, carry_budget_min=0.6)
    assert torch.equal(gated.global_scores(plan, attention.clone()), attention)  # no lender read at 0.6
    gated = methods.Jacap(carry=0.5, carry_len=3, carry_count=2, sinks=1, carry_budget=True, carry_budget_min=0.4)
    assert torch.equal(gated.global_scores(plan, attention.clone()), got)  # position 9 (0.5) still lends
    for nothing in ({"carry": 0.0}, {"carry_count": 0}, {"units": "clauses"}):
        with pytest.raises(ValueError, match="carry_budget=True .*needs carry > 0"):
            methods.Jacap(carry_budget=True, **nothing)
    model = tiny_model("llama")
    ids = random_ids(1, 160)

    def counts(**options):
        jacap_attn.patch(model, ratio=0.1, window=8, compile=False, **options)
        return torch.stack(jacap_attn.compress(model, ids).prompt_kept)

    plain, carried = counts(), counts(carry_budget=True)
    assert int(plain.sum()) == int(carried.sum()) and not torch.equal(plain, carried)
