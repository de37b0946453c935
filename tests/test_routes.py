"""Issue 14: question-agnostic scoring (queries="repeat", kvzip), question-time reselection
(reselect), the Document object, the route in saved files and `jacap ask`."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

import jacap_attn
from jacap_attn.files.cache_file import padded_tensors
from jacap_attn.storage.identity import legacy_weights_fingerprint
from jacap_attn.math import attention_stats, scoring
from jacap_attn.routes.repeat import RepeatRoute
from jacap_attn.math.budget import bucket
from jacap_attn.files.persist import read_cache_file
from conftest import random_ids, tiny_model

N = 80


def _record(store):
    def on_prefill(index, query, keys, values, scaling):
        store[index] = (query.detach().clone(), keys.detach().clone(), values.detach().clone(), scaling)
    return on_prefill


def _compress_recording(model, ids):
    store = {}
    cache = jacap_attn.JacapCache(model, on_prefill=_record(store))
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    return cache, store


# ---------------------------------------------------------------- route A: the repeat pass

@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_repeat_pass_keeps_the_prefills_entries_exactly(family):
    model = tiny_model(family)
    jacap_attn.patch(model, ratio=0.2, window=8, queries="repeat", repeat_ids=[5, 6, 7], repeat_chunk=24)
    cache, store = _compress_recording(model, random_ids(1, N))
    assert cache.state == "compressed"
    for i, layer in enumerate(cache.layers):
        _, keys, values, _ = store[i]
        k = int(layer.write_pos)
        idx = layer.positions[:, :, :k]
        valid = layer.valid[:, :, :k]
        want_k = keys.gather(2, idx[..., None].expand(-1, -1, -1, keys.shape[-1]))
        want_v = values.gather(2, idx[..., None].expand(-1, -1, -1, values.shape[-1]))
        assert torch.equal(layer.keys[:, :, :k][valid], want_k[valid])
        assert torch.equal(layer.values[:, :, :k][valid], want_v[valid])


def test_repeat_statistics_equal_an_explicit_teacher_forced_forward(monkeypatch):
    model = tiny_model("llama")
    instruction = [5, 6, 7]
    ids = random_ids(1, N)
    jacap_attn.patch(model, ratio=0.2, window=8, queries="repeat", repeat_ids=instruction, repeat_chunk=N,
                     budget="uniform", beta=1.0)  # beta > 0: Jacap reads sq_dist
    seen = {}
    original = RepeatRoute.score_deferred

    def spy(route, cache):
        seen.update({i: {k: v.clone() for k, v in d.items()} for i, d in route.observed.items()})
        return original(route, cache)

    monkeypatch.setattr(RepeatRoute, "score_deferred", spy)
    jacap_attn.compress(model, ids)
    assert sorted(seen) == [0, 1, 2] and set(seen[0]) == {"mass", "sq", "sq_dist"}
    # Reference: one prefill of prompt + instruction + prompt (one chunk), nothing evicted.
    jacap_attn.patch(model, ratio=1.0)
    full = torch.cat([ids, torch.tensor([instruction]), ids], dim=1)
    _, store = _compress_recording(model, full)
    for i in range(3):
        query, keys, _, scaling = store[i]
        b, hq, _, d = query.shape
        h = keys.shape[1]
        q = query[:, :, N:].reshape(b, h, hq // h, -1, d)
        probs = attention_stats.repeat_attention(q, keys[:, :, :N], keys[:, :, N:], scaling,
                                         torch.ones(1, N, dtype=torch.bool), torch.ones(1, q.shape[3], dtype=torch.bool))
        want = attention_stats.attention_statistics(probs, keys[:, :, :N], ("mass", "sq", "sq_dist"))
        for name in want:
            torch.testing.assert_close(seen[i][name], want[name], atol=1e-5, rtol=1e-4)


def test_repeat_chunks_cover_the_prompt_once_with_a_lead():
    from jacap_attn.routes.repeat import LEAD, chunks

    ids = torch.arange(50)[None]
    parts = list(chunks(ids, torch.ones(1, 50, dtype=torch.bool), torch.tensor([90, 91]), 20))
    assert [p[0].shape[1] for p in parts] == [22, 2 + LEAD + 20, 2 + LEAD + 10]
    assert torch.equal(parts[1][0][0, 2:], torch.arange(20 - LEAD, 40))


def test_repeat_route_changes_the_selection_and_kvzip_shares_it():
    model = tiny_model("llama")
    ids = random_ids(1, N)
    kept = {}
    for queries in ("window", "repeat"):
        jacap_attn.patch(model, ratio=0.2, window=8, queries=queries)
        cache = jacap_attn.compress(model, ids)
        kept[queries] = [layer.positions[layer.valid].tolist() for layer in cache.layers]
    assert kept["window"] != kept["repeat"]
    jacap_attn.patch(model, ratio=0.2, window=8, method="kvzip")
    assert jacap_attn.compress(model, ids).config.queries == "window"  # the default route, until measured
    jacap_attn.patch(model, ratio=0.2, window=8, method="kvzip", queries="repeat")
    cache = jacap_attn.compress(model, ids)
    assert all(layer.positions[layer.valid][:4].tolist() == [0, 1, 2, 3] for layer in cache.layers)  # sinks


def test_route_options_are_validated():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="queries='repeat' needs a method"):
        jacap_attn.patch(model, method="tova", queries="repeat")
    with pytest.raises(ValueError, match="queries must be one of"):
        jacap_attn.patch(model, queries="question")
    with pytest.raises(ValueError, match="reselect must be a kept fraction"):
        jacap_attn.patch(model, reselect=0.0)
    with pytest.raises(ValueError, match="reselect needs a method"):
        jacap_attn.patch(model, method="h2o", reselect=0.1)
    with pytest.raises(ValueError, match="repeat_ids must be"):
        jacap_attn.patch(model, repeat_ids="Repeat")
    vocab = model.config.vocab_size  # once accepted, then a bare IndexError inside the repeat pass's embedding
    with pytest.raises(ValueError, match=rf"vocabulary \(vocab_size={vocab}\), got repeat_ids=\[1, {vocab}\]"):
        jacap_attn.patch(model, queries="repeat", repeat_ids=[1, vocab])
    assert not jacap_attn.is_patched(model)
    with pytest.raises(ValueError, match="repeat_chunk"):
        jacap_attn.patch(model, repeat_chunk=0)
    assert jacap_attn.JacapConfig().queries == "window" and jacap_attn.JacapConfig().reselect is None


def test_repeat_route_refuses_inputs_embeds():
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.2, window=8, queries="repeat")
    embeds = model.get_input_embeddings()(random_ids(1, N))
    with pytest.raises(ValueError, match="replays the prompt's token ids"), torch.no_grad():
        model(inputs_embeds=embeds, use_cache=True)


# ---------------------------------------------------------------- route B: reselection

def test_reselection_equals_an_explicit_prefill_selection():
    """A document stored whole, reselected at 10% by an 8-token question, keeps what a prefill of
    prompt + question keeps with the same budget (SnapKV: no cross-layer step)."""
    model = tiny_model("llama")
    ids, question = random_ids(1, N), random_ids(1, 8, seed=4)
    jacap_attn.patch(model, ratio=1.0, method="snapkv", window=8, reselect=0.1)
    cache = jacap_attn.compress(model, ids)
    with torch.no_grad():
        model(input_ids=question, cache=cache, use_cache=True)
    target = math.ceil(0.1 * N)
    assert all(int(c.max()) == target + 8 for c in (layer.kept_counts() for layer in cache.layers))
    jacap_attn.patch(model, ratio=(target + 8 - 0.5) / (N + 8), method="snapkv", window=8)
    reference = jacap_attn.compress(model, torch.cat([ids, question], dim=1))
    for got, want in zip(cache.layers, reference.layers):
        assert got.positions[got.valid].tolist() == want.positions[want.valid].tolist()
        torch.testing.assert_close(got.keys[got.valid], want.keys[want.valid], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_reselection_runs_jacaps_cross_layer_consensus(family):
    """Jacap's reselection of a document stored whole keeps what Jacap's prefill of prompt +
    question keeps with the same budget: its cross-layer consensus (and sinks) run at question
    time too. Without the consensus the selection differs (the consensus forces tokens in)."""
    model = tiny_model(family)
    ids, question = random_ids(1, N), random_ids(1, 8, seed=4)
    target = math.ceil(0.2 * N)
    ratio = (target + 8 - 0.5) / (N + 8)

    def reselected(**options):
        jacap_attn.patch(model, ratio=1.0, window=8, reselect=0.2, budget="uniform", **options)
        cache = jacap_attn.compress(model, ids)
        with torch.no_grad():
            model(input_ids=question, cache=cache, use_cache=True)
        return cache

    def prefilled(**options):
        jacap_attn.patch(model, ratio=ratio, window=8, budget="uniform", **options)  # reselection's budgets are uniform
        return jacap_attn.compress(model, torch.cat([ids, question], dim=1))

    def kept(cache):  # the compressed (full-attention) layers; sliding layers keep their window
        return [layer.positions[layer.valid].tolist() for layer in cache.layers if not layer.is_sliding]

    assert kept(reselected()) == kept(prefilled())
    assert kept(reselected(consensus=0.0)) == kept(prefilled(consensus=0.0))
    assert kept(prefilled()) != kept(prefilled(consensus=0.0))
    # Units larger than a word (issue 34) are laid out over the positions at question time too.
    chunks = dict(units="chunks", unit_len=5, carry=0.9)
    assert kept(reselected(**chunks)) == kept(prefilled(**chunks)) != kept(prefilled())
    jacap_attn.unpatch(model)


def test_reselection_reads_clause_units_of_the_stored_prompt():
    """Under ``units="clauses"`` a document stored whole keeps at question time what a prefill of
    prompt + question keeps (the question's own tokens are the window, kept either way)."""
    from test_units import ClauseTokenizer

    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 96, (1, N), generator=gen)
    question = torch.randint(3, 30, (1, 8), generator=gen)
    target = math.ceil(0.2 * N)
    options = dict(window=8, budget="uniform", units="clauses", carry=1.0, tokenizer=ClauseTokenizer())
    jacap_attn.patch(model, ratio=1.0, reselect=0.2, **options)
    cache = jacap_attn.compress(model, ids)
    with torch.no_grad():
        model(input_ids=question, cache=cache, use_cache=True)
    jacap_attn.patch(model, ratio=(target + 8 - 0.5) / (N + 8), **options)
    reference = jacap_attn.compress(model, torch.cat([ids, question], dim=1))
    jacap_attn.patch(model, ratio=(target + 8 - 0.5) / (N + 8), window=8, budget="uniform")
    default = jacap_attn.compress(model, torch.cat([ids, question], dim=1))
    got = [layer.positions[layer.valid].tolist() for layer in cache.layers]
    assert got == [layer.positions[layer.valid].tolist() for layer in reference.layers]
    assert got != [layer.positions[layer.valid].tolist() for layer in default.layers]
    jacap_attn.unpatch(model)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_reselected_question_attends_from_the_probabilities_it_is_scored_with(family, monkeypatch):
    """Question-time reselection computes each scored layer's window attention once: the layer's
    attention output is ``probs @ V`` from the probabilities the scoring reads (no second ``Q K^T``,
    no SDPA over the held entries), equal to the plain question forward's within float32 rounding,
    and the selection equals the one scored from a separate window attention. A question longer than
    the window, and the eager implementation (which returns weights), attend as before."""
    from jacap_attn.math import masked
    from jacap_attn.selection import scorer

    model = tiny_model(family)
    ids, question = random_ids(1, N), random_ids(1, 8, seed=4)
    calls = {"window": 0, "sdpa": 0}
    window_attention, grouped, split = scoring.window_attention, masked.grouped_attention, masked.chunk_attention

    def counted_window(*args, **kwargs):
        calls["window"] += 1
        return window_attention(*args, **kwargs)

    def counted_grouped(*args, **kwargs):
        calls["sdpa"] += 1
        return grouped(*args, **kwargs)

    def counted_split(*args, **kwargs):  # the same attention over the held entries, in two parts (on the CPU)
        calls["sdpa"] += 1
        return split(*args, **kwargs)

    monkeypatch.setattr(scoring, "window_attention", counted_window)
    monkeypatch.setattr(masked, "grouped_attention", counted_grouped)
    monkeypatch.setattr("jacap_attn.storage.layer.grouped_attention", counted_grouped)
    monkeypatch.setattr("jacap_attn.storage.layer.chunk_attention", counted_split)

    def ask(reselect, q=question, window=8):
        jacap_attn.patch(model, ratio=1.0, window=window, reselect=reselect)
        cache = jacap_attn.compress(model, ids)
        calls.update(window=0, sdpa=0)
        with torch.no_grad():
            logits = model(input_ids=q, cache=cache, use_cache=True).logits
        return logits, cache, dict(calls)

    plain, _, plain_calls = ask(None)
    scored = sum(scorer.scores_layer(jacap_attn.JacapConfig(), _cache_layers(model, ids), i)
                 for i in range(model.config.num_hidden_layers))
    fused, cache, fused_calls = ask(0.1)
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    assert plain_calls == {"window": 0, "sdpa": model.config.num_hidden_layers}
    assert fused_calls == {"window": scored, "sdpa": model.config.num_hidden_layers - scored}
    # The same selection as scoring from its own window attention (the attention computed as before).
    monkeypatch.setattr(jacap_attn.routes.reselect.ReselectRoute, "attends_held", False)
    _, separate, separate_calls = ask(0.1)
    assert separate_calls == {"window": scored, "sdpa": model.config.num_hidden_layers}
    for a, b in zip(cache.layers, separate.layers):
        assert a.positions[a.valid].tolist() == b.positions[b.valid].tolist()
    monkeypatch.undo()
    # A question longer than the window attends as a plain forward does, then is scored.
    long_question = random_ids(1, 12, seed=6)
    monkeypatch.setattr(scoring, "window_attention", counted_window)
    monkeypatch.setattr("jacap_attn.storage.layer.grouped_attention", counted_grouped)
    monkeypatch.setattr("jacap_attn.storage.layer.chunk_attention", counted_split)
    _, _, long_calls = ask(0.1, long_question)
    assert long_calls == {"window": scored, "sdpa": model.config.num_hidden_layers}
    jacap_attn.unpatch(model)
    # The eager implementation returns each layer's weights over its held slots, as without reselection.
    eager = tiny_model(family, attn="eager")
    weights = {}
    for reselect in (None, 0.1):
        jacap_attn.patch(eager, ratio=1.0, window=8, reselect=reselect)
        with torch.no_grad():
            out = eager(input_ids=question, cache=jacap_attn.compress(eager, ids), use_cache=True,
                        output_attentions=True)
        weights[reselect] = out.attentions
    assert all(w is not None and w.shape[-2] == 8 for w in weights[0.1])
    for a, b in zip(weights[None], weights[0.1]):
        torch.testing.assert_close(a, b)
    jacap_attn.unpatch(eager)


def _cache_layers(model, ids):
    jacap_attn.patch(model, ratio=1.0, window=8)
    return jacap_attn.compress(model, ids).layers


def test_reselection_is_off_by_default_and_never_on_decode_steps():
    model = tiny_model("llama")
    ids = random_ids(1, N)
    jacap_attn.patch(model, ratio=0.5, window=8, budget="uniform")
    out = model.generate(torch.cat([ids, random_ids(1, 5, seed=3)], 1), cache=jacap_attn.compress(model, ids),
                         max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert int(out.cache.layers[0].kept_counts().max()) == 40 + 5 + 2
    jacap_attn.patch(model, ratio=0.5, window=8, reselect=0.1)
    cache = jacap_attn.compress(model, ids)
    out = model.generate(torch.cat([ids, random_ids(1, 5, seed=3)], 1), cache=cache, max_new_tokens=3,
                         do_sample=False, return_dict_in_generate=True)
    assert int(out.cache.layers[0].kept_counts().max()) == 8 + 5 + 2  # the decode steps appended


def test_reselection_batch_row_keeps_what_it_keeps_alone():
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.5, window=8, reselect=0.15)
    long, short = random_ids(1, N, seed=1), random_ids(1, 60, seed=2)
    question = random_ids(1, 6, seed=5)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 20, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :20] = 0
    cache = jacap_attn.compress(model, batch, attention_mask=mask)
    # The question continues each row at its own RoPE positions (what generate passes for a padded row).
    positions = torch.tensor([[N], [60]]) + torch.arange(question.shape[1])
    with torch.no_grad():
        model(input_ids=question.expand(2, -1), position_ids=positions, cache=cache, use_cache=True)
    for row, prompt in enumerate((long, short)):
        alone = jacap_attn.compress(model, prompt)
        with torch.no_grad():
            model(input_ids=question, cache=alone, use_cache=True)
        for got, want in zip(cache.layers, alone.layers):
            assert got.positions[row][got.valid[row]].tolist() == want.positions[0][want.valid[0]].tolist()


@pytest.mark.parametrize("method", ["jacap", "snapkv"])
def test_reselection_scores_each_head_over_its_own_entries_only(method):
    """Per-head budgets leave a head's buffer with slots it does not hold (filler, whatever data
    they carry) where another head of the row holds entries. Question-time reselection scores each
    head over its own held entries only: the data in those slots never changes what is kept (it
    did when the row's validity stood for every head: a row reselected in a batch of other
    documents, padded with zeros, kept other tokens than alone)."""
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.5, window=8, reselect=0.15, method=method, budget="global")
    prompt, question = random_ids(1, N, seed=1), random_ids(1, 6, seed=5)
    cache = jacap_attn.compress(model, prompt)
    held = [layer.valid[0, :, :int(layer.write_pos)].sum(-1) for layer in cache.layers]
    assert any(len(set(h.tolist())) > 1 for h in held)  # the heads hold different counts
    noisy = copy.deepcopy(cache)
    generator = torch.Generator().manual_seed(0)
    for layer in noisy.layers:
        free = ~layer.valid[..., None]
        layer.keys.copy_(torch.where(free, 50 * torch.randn(layer.keys.shape, generator=generator), layer.keys))
        layer.values.copy_(torch.where(free, 50 * torch.randn(layer.values.shape, generator=generator), layer.values))
    for c in (cache, noisy):
        with torch.no_grad():
            model(input_ids=question, cache=c, use_cache=True)
    for a, b in zip(cache.layers, noisy.layers):
        for head in range(a.valid.shape[1]):
            assert sorted(a.positions[0, head][a.valid[0, head]].tolist()) == \
                sorted(b.positions[0, head][b.valid[0, head]].tolist()), (a.index, head)
    jacap_attn.unpatch(model)


def test_reselection_keeps_sliding_layers_windows_gemma3():
    model = tiny_model("gemma3_text")
    jacap_attn.patch(model, ratio=0.5, window=8, reselect=0.1)
    ids = random_ids(1, N)
    cache = jacap_attn.compress(model, ids)
    before = [layer.positions[0, 0][layer.valid[0, 0]].tolist() for layer in cache.layers]
    with torch.no_grad():
        model(input_ids=random_ids(1, 6, seed=3), cache=cache, use_cache=True)
    for layer, old in zip(cache.layers, before):
        now = layer.positions[0, 0][layer.valid[0, 0]].tolist()
        if layer.is_sliding:
            assert now == old + list(range(N, N + 6))
        else:
            assert len(now) == 8 + 6 and set(now) <= set(old) | set(range(N, N + 6))


def test_reselection_works_turn_after_turn():
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=1.0, window=8, reselect=0.2)
    cache = jacap_attn.compress(model, random_ids(1, N))
    with torch.no_grad():
        model(input_ids=random_ids(1, 6, seed=3), cache=cache, use_cache=True)
        assert int(cache.layers[0].kept_counts().max()) == 16 + 6
        model(input_ids=random_ids(1, 5, seed=4), cache=cache, use_cache=True)
    assert int(cache.layers[0].kept_counts().max()) == math.ceil(0.2 * (N + 6)) + 5


def test_loaded_cache_reselects_like_the_saved_one(tmp_path):
    model = tiny_model("llama")
    ids, question = random_ids(1, N), random_ids(1, 6, seed=7)
    jacap_attn.patch(model, ratio=0.5, window=8, reselect=0.1)
    cache = jacap_attn.compress(model, ids)
    path = tmp_path / "doc.safetensors"
    jacap_attn.save_cache(cache, path, model=model, prompt_ids=ids)
    full = torch.cat([ids, question], 1)
    want = model.generate(full, cache=copy.deepcopy(cache), max_new_tokens=5, do_sample=False)
    jacap_attn.patch(model, ratio=0.5, window=8)  # the answering model has reselection off ...
    loaded = jacap_attn.load_cache(path, model, reselect=0.1)  # ... and asks for it on load
    assert loaded.config.reselect == 0.1
    assert torch.equal(model.generate(full, cache=loaded, max_new_tokens=5, do_sample=False), want)
    # The file's own decode budget by default (issue 25: it was the patched model's, None here), with a
    # warning that the patched settings differ; reselect=False turns it off.
    with pytest.warns(UserWarning, match="answers with the file's settings"):
        assert jacap_attn.load_cache(path, model).config.reselect == 0.1
    assert jacap_attn.load_cache(path, model, reselect=False).config.reselect is None


# ---------------------------------------------------------------- Document, the file's route, CLI

def test_document_answers_like_hand_concatenation_and_leaves_the_cache_unchanged(tmp_path):
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.2, window=8)
    ids = random_ids(1, N)
    doc = jacap_attn.Document.compress(model, ids)
    snapshot = [(layer.keys.clone(), layer.valid.clone(), int(layer.write_pos)) for layer in doc.cache.layers]
    for seed in (11, 12):
        q = random_ids(1, 5, seed=seed)
        by_hand = model.generate(torch.cat([ids, q], 1), cache=copy.deepcopy(doc.cache), max_new_tokens=4,
                                 do_sample=False)[:, N + 5:]
        assert torch.equal(doc.generate(q, max_new_tokens=4, do_sample=False), by_hand)
        assert torch.equal(doc.generate(q[0], max_new_tokens=4, do_sample=False), by_hand)
    for layer, (keys, valid, pos) in zip(doc.cache.layers, snapshot):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.valid, valid) and int(layer.write_pos) == pos
    with pytest.raises(ValueError, match="pass only the tokens after it"):
        doc.generate(torch.cat([ids, q], 1))
    path = tmp_path / "d.safetensors"
    doc.save(path, quantize=None)  # exact entries: the answers must equal the in-memory ones
    again = jacap_attn.Document.load(path, model)
    assert torch.equal(again.generate(q, max_new_tokens=4, do_sample=False), by_hand)
    # A per-question reselection on a copy.
    small = doc.generate(q, max_new_tokens=2, do_sample=False, reselect=0.1, return_dict_in_generate=True)
    assert int(small.cache.layers[0].kept_counts().max()) == 8 + 5 + 1
    assert doc.cache.config.reselect == 0.2 and doc.cache.config.ratio == 1.0  # stored whole (the default)


def test_document_stores_whole_and_reselects_to_the_patched_ratio_by_default():
    """Document.compress's default (store=1): the document stored whole, each question reselecting
    it to the patched ratio, exactly as patch(ratio=1, reselect=ratio) + compress; store=None (or
    store <= ratio) keeps the patched settings; a bad store is refused by name."""
    model = tiny_model("llama")
    ids, q = random_ids(1, N), random_ids(1, 6, seed=5)
    jacap_attn.patch(model, ratio=0.2, window=8)
    doc = jacap_attn.Document.compress(model, ids)
    assert [int(layer.kept_counts().max()) for layer in doc.cache.layers] == [N] * 3
    got = doc.generate(q, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert all(int(layer.kept_counts().max()) == math.ceil(0.2 * N) + 6 + 2 for layer in got.cache.layers)
    # Decoding reads buffers of the reselected size (kept + the 3 new tokens, bucketed), not the stored ones.
    assert all(layer.capacity < stored.capacity for layer, stored in zip(got.cache.layers, doc.cache.layers))
    assert all(layer.capacity == bucket(math.ceil(0.2 * N) + 6 + 3) for layer in got.cache.layers)
    plain = jacap_attn.Document.compress(model, ids, store=None)
    assert plain.cache.config.ratio == 0.2 and plain.cache.config.reselect is None
    with pytest.raises(ValueError, match="below the patched ratio"):  # before 2026-12-07: stored at 0.2, silently
        jacap_attn.Document.compress(model, ids, store=0.1)
    half = jacap_attn.Document.compress(model, ids, store=0.5)
    assert half.cache.config.ratio == 0.5 and half.cache.config.reselect == 0.2
    for bad in (0.0, 1.5, "all", True):
        with pytest.raises(ValueError, match="store must be a kept fraction"):
            jacap_attn.Document.compress(model, ids, store=bad)
    jacap_attn.patch(model, ratio=1.0, window=8, reselect=0.2)
    by_hand = model.generate(torch.cat([ids, q], 1), cache=jacap_attn.compress(model, ids), max_new_tokens=3,
                             do_sample=False)[:, N + 6:]
    assert torch.equal(got.sequences[:, N + 6:], by_hand)
    jacap_attn.unpatch(model)
    with pytest.raises(ValueError, match="needs a patched model"):
        jacap_attn.Document.compress(model, ids)


def test_document_of_a_padded_batch_matches_rows_alone():
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.3, window=8)
    a, b = random_ids(1, N, seed=1), random_ids(1, 70, seed=2)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 10, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :10] = 0
    q = random_ids(1, 4, seed=9)
    out = jacap_attn.Document.compress(model, batch, mask).generate(q, max_new_tokens=4, do_sample=False)
    for row, prompt in enumerate((a, b)):
        alone = jacap_attn.Document.compress(model, prompt).generate(q, max_new_tokens=4, do_sample=False)
        assert torch.equal(out[row:row + 1], alone)


def test_a_document_turns_reselection_off_with_false_as_load_cache_does():
    """``reselect=False`` (``load_cache``'s word for off) is ``None`` for a ``Document`` too: the question
    appended to the stored cache as it is; a one-row document's shape error names one row."""
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=1.0, reselect=0.25, window=8)
    doc = jacap_attn.Document.compress(model, random_ids(1, N))
    q = random_ids(1, 6, seed=4)
    assert doc.fresh_cache(reselect=False).config.reselect is None
    off = doc.generate(q, reselect=None, max_new_tokens=3, do_sample=False)
    assert torch.equal(doc.generate(q, reselect=False, max_new_tokens=3, do_sample=False), off)
    with pytest.raises(ValueError, match=r"\[q\] or \[1, q\] new token ids, got \(2, 6\)"):
        doc.generate(random_ids(2, 6), max_new_tokens=1)
    jacap_attn.unpatch(model)


def test_saved_file_records_its_route_and_old_files_read_as_window(tmp_path, capsys):
    from jacap_attn import cli
    from conftest import tiny_model as make
    from safetensors.torch import save_file

    model = make("llama")
    ids = random_ids(1, N)
    routes = {}
    # "kept whole": a prompt under min_tokens, which the cut keeps whole (no lookahead pass ran either)
    # chunked: once labelled "window" (and a document's repeat-scored cuts "window, question-aware" too)
    for name, options in {"repeat": dict(queries="repeat"), "window": {}, "whole": dict(ratio=1.0),
                          "lookahead": dict(lookahead=2), "kept whole": dict(lookahead=2, min_tokens=N + 1),
                          "chunked": dict(chunk_size=N // 2), "one chunk": dict(chunk_size=N),
                          "chunked-repeat": dict(chunk_size=N // 2, chunk_scores="repeat")}.items():
        jacap_attn.patch(model, **{"ratio": 0.2, "window": 8, **options})
        path = tmp_path / f"{name}.safetensors"
        jacap_attn.save_cache(jacap_attn.compress(model, ids), path, model=model, prompt_ids=ids)
        routes[name] = read_cache_file(path)[0]["selection_route"]
        assert cli.main(["inspect", str(path)]) == 0
        assert f"route   : {routes[name]} ({cli.ROUTES[routes[name]]})" in capsys.readouterr().out
        assert cli.main(["inspect", str(path), "--json"]) == 0
        assert "route" not in json.loads(capsys.readouterr().out)  # once printed beside selection_route
    assert routes == {"repeat": "repeat", "window": "window", "whole": "whole", "lookahead": "lookahead",
                      "kept whole": "whole", "chunked": "chunked", "one chunk": "window", "chunked-repeat": "chunked-repeat"}
    document = jacap_attn.Document.compress(model, ids, chunk_size=N // 2, store=0.5)  # a document's default cuts
    document.save(tmp_path / "document.safetensors")
    assert read_cache_file(tmp_path / "document.safetensors")[0]["selection_route"] == "chunked-repeat"
    meta, tensors = read_cache_file(tmp_path / "window.safetensors")
    meta.pop("selection_route")
    meta.pop("metadata_sha256")  # an old file: format 2, padded, no header checksum
    meta["format_version"] = "2"
    meta, tensors = padded_tensors(meta, tensors)
    meta["weights_sha256"] = legacy_weights_fingerprint(model, model.model.layers)  # the fingerprint of its time
    old = tmp_path / "old.safetensors"
    save_file(tensors, old, metadata=meta)
    assert cli.main(["inspect", str(old), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["selection_route"] == "window"
    jacap_attn.load_cache(old, model)  # old files still load


@pytest.mark.parametrize("family, options", [("gemma3_text", {}), ("llama", {"min_tokens": N + 1})])
def test_inspect_reports_the_held_fraction_beside_the_configured_one(tmp_path, capsys, family, options):
    """``jacap inspect`` printed the configured ``ratio`` as the file's kept fraction, also where the
    file holds far more: Gemma's sliding-window layers keep their window, a prompt under ``min_tokens``
    is kept whole. It now prints the held fraction too, the entries held over the full cache's."""
    from jacap_attn import cli

    model = tiny_model(family)
    ids = random_ids(1, N)
    jacap_attn.patch(model, ratio=0.2, window=8, **options)
    cache = jacap_attn.compress(model, ids)
    path = tmp_path / "doc.safetensors"
    jacap_attn.save_cache(cache, path, model=model, prompt_ids=ids)
    held = sum(int(layer.kept_counts().sum()) for layer in cache.layers)
    # a stock sliding-window layer holds its last sliding_window - 1 tokens (transformers' DynamicSlidingWindowLayer)
    full = sum(2 * (min(N, layer.sliding_window - 1) if layer.is_sliding else N) for layer in cache.layers)  # 2 KV heads
    assert cli.main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["stored_ratio"] == 0.2
    assert info["held_fraction"] == pytest.approx(held / full) and info["held_fraction"] > 0.35
    assert cli.main(["inspect", str(path)]) == 0
    assert f"kept fraction 0.2 of the prompt (configured), {held / full:.3f} of the full cache's entries held" \
        in capsys.readouterr().out
    jacap_attn.patch(model, ratio=1.0, window=8, **options)  # nothing evicted: every entry a stock cache holds
    jacap_attn.save_cache(jacap_attn.compress(model, ids), path, model=model, prompt_ids=ids)
    assert cli.main(["inspect", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["held_fraction"] == 1.0


class _CharTokenizer:
    """Enough of a tokenizer for `Document.ask`: one id per character (mod the tiny vocabulary)."""

    chat_template = None
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 90 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + int(i) % 26) for i in ids)


def test_jacap_ask_answers_every_question_from_a_file(tmp_path, monkeypatch, capsys):
    from jacap_attn import cli, prompts

    model, tokenizer = tiny_model("llama"), _CharTokenizer()
    monkeypatch.setattr(cli, "_load", lambda name: (model, tokenizer))
    text = prompts.format_prompt({"context": "a short document " * 4, "question": ""}, tokenizer,
                                 question_position="none")
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    jacap_attn.patch(model, ratio=0.3, window=8)
    path = tmp_path / "doc.safetensors"
    jacap_attn.Document.compress(model, ids, prompt_format={"chat": False}).save(path)
    assert cli.main(["ask", str(path), "--question", "Who?", "--question", "Where?", "--max-new-tokens", "3",
                     "--json"]) == 0
    result = json.loads(capsys.readouterr().out)  # --json: the JSON alone on stdout
    assert [a["question"] for a in result["answers"]] == ["Who?", "Where?"]
    doc = jacap_attn.Document.load(path, model)
    for item in result["answers"]:
        suffix = prompts.format_question({"context": "", "question": item["question"]}, tokenizer, chat=False)
        want = doc.generate(torch.tensor(tokenizer(suffix)["input_ids"]), max_new_tokens=3, do_sample=False,
                            pad_token_id=0)
        assert item["answer"] == tokenizer.decode(want[0]).strip()


class _ChatTokenizer(_CharTokenizer):
    chat_template = "yes"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        body = "".join(f"<{m['role']}>{m['content']}</turn>" for m in messages)
        return body + ("<assistant>" if add_generation_prompt else "")


def test_split_chat_puts_the_context_inside_the_user_turn():
    from jacap_attn import prompts

    tok = _ChatTokenizer()
    head, tail = prompts.split_chat(tok, "The document.  ", "What?", system="Be brief.")
    assert head == "<system>Be brief.</turn><user>The document."
    assert tail == "\n\nWhat?</turn><assistant>"
    ids = prompts.repeat_instruction_ids(tok)
    assert ids == tok("\n\nRepeat the previous context exactly.</turn><assistant>")["input_ids"]
    with pytest.raises(ValueError, match="chat template"):
        prompts.split_chat(_CharTokenizer(), "x", "y")


def test_document_edge_cases_found_by_attacking_it(tmp_path, monkeypatch):
    """Methods that cannot reselect store as patched; float or bool question ids and ask on a batch
    are refused; a row shorter than min_tokens keeps everything at question time too; a bad
    --store fails before the model loads."""
    from jacap_attn import cli

    model = tiny_model("llama")
    ids, q = random_ids(1, 48), random_ids(1, 6, seed=3)
    jacap_attn.patch(model, ratio=0.25, method="h2o", window=8)
    doc = jacap_attn.Document.compress(model, ids)  # H2O reads every query: it cannot reselect
    assert doc.cache.config.ratio == 0.25 and doc.cache.config.reselect is None
    jacap_attn.patch(model, ratio=0.2, window=8)
    doc = jacap_attn.Document.compress(model, ids, store=np.float32(1.0))
    for bad in (torch.tensor([[5.0, 7.0]]), torch.tensor([[True, False]])):
        with pytest.raises(ValueError, match="integer token ids"):
            doc.generate(bad)
    two = jacap_attn.Document.compress(model, torch.cat([ids, ids]))
    with pytest.raises(ValueError, match="single-row document"):
        two.ask("Who?", None)
    jacap_attn.patch(model, ratio=0.2, window=8, min_tokens=100)
    short = jacap_attn.Document.compress(model, ids).generate(q, max_new_tokens=2, do_sample=False,
                                                               return_dict_in_generate=True)
    assert [int(layer.kept_counts().max()) for layer in short.cache.layers] == [48 + 6 + 1] * 3
    monkeypatch.setattr(cli, "_load", lambda name: pytest.fail("the model loaded before --store was checked"))
    text = tmp_path / "doc.txt"
    text.write_text("a document")
    for bad in ("0", "2", "nan", "abc"):
        assert cli.main(["compress", "--prompt-file", str(text), "--out", str(tmp_path / "o.safetensors"),
                         "--store", bad]) == 2
    jacap_attn.unpatch(model)


def test_a_route_registered_from_a_test_file_is_one_class_and_one_map_entry():
    """A new route is one class registered in the one map: ``queries`` accepts it, the attention
    function calls its hooks, and its ``finish`` gets the decoder's forward (docs/architecture.md#routes)."""
    from jacap_attn.selection import scorer
    from jacap_attn.routes import ROUTES, prefill_routes, register_route, unregister_route
    from jacap_attn.routes.window import PrefillRoute

    calls = []

    @register_route("first_queries")
    class FirstQueries(PrefillRoute):
        """Scores the prompt from its first ``window`` queries instead of its last."""

        def score(self, cache, index, query, keys, values, scaling):
            cfg = cache.config
            b, hq, n, d = query.shape
            h, w = keys.shape[1], min(cfg.window, n)
            first = query[:, :, :w].reshape(b, h, hq // h, w, d)
            key_valid, budget = scorer.layer_inputs(cfg, cache.layers, index, cache.prefill.key_valid, keys.device)
            calls.append(index)
            cache.prefill.parts[index] = scorer.score_layer(cfg, index, first, keys, values, scaling, key_valid,
                                                            budget)

        def finish(self, cache, forward):
            assert callable(forward)
            super().finish(cache, forward)

    try:
        assert "first_queries" in prefill_routes() and ROUTES["first_queries"] is FirstQueries
        model = tiny_model("llama")
        ids = random_ids(1, 60)
        jacap_attn.patch(model, ratio=0.3, window=8, queries="first_queries", budget="uniform")
        toy = jacap_attn.compress(model, ids)
        assert calls == [0, 1, 2] and toy.route is None
        jacap_attn.patch(model, ratio=0.3, window=8, budget="uniform")
        default = jacap_attn.compress(model, ids)
        assert any(not torch.equal(a.positions, b.positions) for a, b in zip(toy.layers, default.layers))
        question = torch.cat([ids, random_ids(1, 2, seed=9)], dim=1)
        out = model.generate(question, cache=toy, max_new_tokens=3, do_sample=False)
        assert out.shape == (1, 65)
    finally:
        unregister_route("first_queries")
    with pytest.raises(ValueError, match="queries must be one of"):
        jacap_attn.JacapConfig(queries="first_queries")


@pytest.mark.parametrize("method", ["snapkv", "jacap"])
def test_reselection_under_the_global_budget_equals_a_global_prefill_selection(method):
    """The one cut gives question-time reselection every budget policy: ``reselect_budget="global"``
    over a document stored whole keeps what a ``budget="global"`` prefill of prompt + question keeps with
    the same total budget, per layer and KV head (one ranking across layers and heads)."""
    model = tiny_model("llama")
    ids, question = random_ids(1, N), random_ids(1, 8, seed=4)
    target = math.ceil(0.15 * N)
    jacap_attn.patch(model, ratio=1.0, method=method, window=8, reselect=0.15, reselect_budget="global",
                     budget="global")
    cache = jacap_attn.compress(model, ids)
    with torch.no_grad():
        model(input_ids=question, cache=cache, use_cache=True)
    jacap_attn.patch(model, ratio=(target + 8 - 0.5) / (N + 8), method=method, window=8, budget="global")
    reference = jacap_attn.compress(model, torch.cat([ids, question], dim=1))
    counts = [layer.kept_counts() for layer in cache.layers]
    assert len({int(c) for layer in counts for c in layer.flatten()}) > 1  # per-head budgets, not uniform
    for got, want in zip(cache.layers, reference.layers):
        for head in range(got.valid.shape[1]):
            assert got.positions[0, head][got.valid[0, head]].tolist() == \
                want.positions[0, head][want.valid[0, head]].tolist()
    jacap_attn.unpatch(model)


def test_ada_kv_splits_the_reselected_budget_over_heads():
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=1.0, method="adakv", window=8, reselect=0.2)
    cache = jacap_attn.compress(model, random_ids(1, N))
    with torch.no_grad():
        model(input_ids=random_ids(1, 8, seed=4), cache=cache, use_cache=True)
    counts = torch.stack([layer.kept_counts()[0] for layer in cache.layers])  # [layers, heads]
    total = math.ceil(0.2 * N) + 8
    assert bool((counts.sum(-1) == 2 * total).all()) and len(set(counts.flatten().tolist())) > 1
    jacap_attn.unpatch(model)
