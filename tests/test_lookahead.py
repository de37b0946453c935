"""``lookahead=k`` (jacap_attn.routes.lookahead): the prompt scored by the observation window's
queries plus those of the ``k`` tokens the full-cache model writes next. The written tokens are the
stock model's greedy ones, their statistics those of a stock forward over the prompt and them, the
prompt's entries stay the prefill's, and it changes what is kept."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import pytest
import torch

import jacap_attn
from jacap_attn.routes import lookahead, repeat
from jacap_attn.routes.replay import compress_recorded
from jacap_attn.storage.cache import JacapCache
from conftest import random_ids, tiny_model
from test_chunk_repeat import assert_stock_statistics
from test_chunked import assert_matches_oracle

N, K = 96, 5


def patched(model, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer for word spans: token by token
        return jacap_attn.patch(model, **{"ratio": 0.25, "window": 8, "min_tokens": 0, "lookahead": K, **options})


@contextlib.contextmanager
def passes_recorded():
    """Within it, each lookahead pass appends ``(written tokens [b, k], observed statistics)`` to the
    list it yields (copies, taken before the scores are computed from them)."""
    calls, original = [], lookahead.LookaheadRoute.score_deferred

    def spy(self, cache):
        calls.append((self.written.clone(), {i: {k: t.clone() for k, t in s.items()} for i, s in self.observed.items()}))
        return original(self, cache)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lookahead.LookaheadRoute, "score_deferred", spy)
        yield calls


def kept(cache) -> list:
    return [layer.positions[layer.valid].tolist() for layer in cache.layers]


@pytest.mark.parametrize("family_", ["llama", "gemma3_text", "qwen3"])
def test_the_written_tokens_are_the_full_cache_models_greedy_ones(family_):
    model = tiny_model(family_)
    ids = random_ids(1, N)
    with torch.no_grad():
        stock = model.generate(ids, max_new_tokens=K, do_sample=False, pad_token_id=0)[:, N:]
    patched(model)
    with passes_recorded() as calls:
        jacap_attn.compress(model, ids)
    assert len(calls) == 1
    assert torch.equal(calls[0][0], stock)


def test_the_statistics_are_the_windows_plus_a_stock_forward_over_the_written_tokens():
    """Every scored layer's statistics equal those of the unpatched model's attention: the window's
    rows over the prompt plus the written tokens' rows over the prompt's columns (causal, positions
    continuing after the prompt)."""
    model = tiny_model("llama", attn="eager")
    ids = random_ids(1, N)
    patched(model, beta=0.5)
    with passes_recorded() as calls:
        cache = jacap_attn.compress(model, ids)
    written, got = calls[0]
    jacap_attn.unpatch(model)
    with torch.no_grad():
        out = model(torch.cat([ids, written], dim=1), output_attentions=True, use_cache=True)
    names = repeat.repeat_statistics(cache.config)
    assert {"mass", "peak", "sq", "sq_dist"} <= set(names)
    assert sorted(got) == list(range(len(cache.layers)))
    assert_stock_statistics(got, out, got, N - cache.config.window, N, names)  # the window's and the written rows


def test_lookahead_changes_the_choice_and_keeps_the_prefills_entries():
    model = tiny_model("llama")
    ids = random_ids(1, N)
    patched(model, lookahead=0)
    window = jacap_attn.compress(model, ids)
    patched(model)
    ahead = jacap_attn.compress(model, ids)
    assert kept(window) != kept(ahead)
    assert [int(a.kept_counts().sum()) for a in window.layers] == [int(b.kept_counts().sum()) for b in ahead.layers]
    jacap_attn.unpatch(model)
    with torch.no_grad():
        full = model(ids, use_cache=True).past_key_values
    for layer, stock in zip(ahead.layers, full.layers):  # the kept entries are the prefill's, nothing of the pass
        for head in range(layer.kv_heads()):
            slots = layer.valid[0, head]
            positions = layer.positions[0, head][slots]
            torch.testing.assert_close(layer.keys[0, head][slots], stock.keys[0, head][positions])


def test_a_left_padded_row_keeps_what_it_keeps_alone():
    model = tiny_model("llama")
    ids = random_ids(2, N)
    mask = torch.ones_like(ids)
    mask[1, :13] = 0
    patched(model, budget="uniform")
    batch = jacap_attn.compress(model, ids, mask)
    alone = jacap_attn.compress(model, ids[1:, 13:])
    for a, b in zip(batch.layers, alone.layers):
        assert torch.equal(a.positions[1][a.valid[1]].sort().values, b.positions[0][b.valid[0]].sort().values)


def test_the_harness_replay_keeps_what_the_patched_prefill_keeps():
    model = tiny_model("llama")
    ids = random_ids(1, N)
    patched(model)
    records = []
    cache = JacapCache(model, config=dataclasses.replace(model._jacap_state.config, lookahead=0),
                       on_prefill=lambda i, q, k, v, s: records.append((q, k, v, s)))
    with torch.no_grad():
        model(ids, cache=cache)
    replayed = compress_recorded(model, records, model._jacap_state.config, ids)
    assert kept(replayed) == kept(jacap_attn.compress(model, ids))


def test_generate_runs_the_lookahead_and_leaves_the_model_as_it_was():
    model = tiny_model("llama")
    ids = random_ids(1, N)
    patched(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with passes_recorded() as calls:
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert len(calls) == 1 and out.shape == (1, N + 3)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_lookahead_is_checked_before_any_work():
    model = tiny_model("llama")
    for bad in (-1, 1.5, True, 257, "4"):
        with pytest.raises(ValueError, match=r"lookahead must be an integer in \[0, 256\]"):
            patched(model, lookahead=bad)
    with pytest.raises(ValueError, match="lookahead=5 .* needs queries='window'"):
        patched(model, queries="repeat")
    with pytest.raises(ValueError, match="lookahead=5 needs a method that scores from summed"):
        patched(model, method="tova")


@pytest.mark.parametrize("chunk", [None, 32])
def test_a_prefill_from_inputs_embeds_looks_ahead_as_one_from_input_ids(chunk):
    """The first written token replays the last input as given (its embedding), the rest are ids:
    the same tokens, and the same cut, as from ``input_ids``."""
    model = tiny_model("llama")
    ids = random_ids(1, N)
    patched(model, chunk_size=chunk, chunk_scores="rescore")
    from_ids = JacapCache(model)
    from_embeds = JacapCache(model)
    with torch.no_grad():
        model(input_ids=ids, cache=from_ids)
        model(inputs_embeds=model.get_input_embeddings()(ids), cache=from_embeds)
    assert kept(from_ids) == kept(from_embeds)
    patched(model, chunk_size=chunk, chunk_scores="rescore", lookahead=0)
    assert kept(from_ids) != kept(jacap_attn.compress(model, ids))


def test_without_a_cut_nothing_is_written():
    """A prompt shorter than ``min_tokens`` is kept whole: no lookahead pass runs."""
    model = tiny_model("llama")
    patched(model, min_tokens=N + 1)
    with passes_recorded() as calls:
        cache = jacap_attn.compress(model, random_ids(1, N))
    assert calls == [] and all(int(layer.kept_counts().min()) == N for layer in cache.layers)


@pytest.mark.parametrize("chunk", [None, 16])
def test_a_cut_that_can_evict_nothing_writes_nothing(chunk):
    """A prompt the cut keeps whole (every row within the window, ``min_tokens=0``) runs no lookahead
    pass, one-shot or at a chunked prefill's last cut (a 3-token prompt at ``lookahead=256`` took
    minutes for the same entries); a longer prompt through the same patch still looks ahead."""
    model = tiny_model("llama")
    patched(model, window=32, lookahead=64, **({"chunk_size": chunk} if chunk else {}))
    calls, original = [], lookahead.write

    def spy(*args, **kwargs):
        calls.append(args[2])
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lookahead, "write", spy)
        cache = jacap_attn.compress(model, random_ids(1, 24))
        assert calls == [] and all(int(layer.kept_counts().min()) == 24 for layer in cache.layers)
        jacap_attn.compress(model, random_ids(1, N))
    assert calls == [64]


def test_window_statistics_score_as_the_window_route_does():
    """The window part of the sum is the window route's attention: with the written tokens' rows
    left out, the scores are the window route's (the statistics path and the probabilities path of
    Jacap agree)."""
    model = tiny_model("llama")
    ids = random_ids(1, N)
    # the statistics carry no last window query: the carry's lenders rank by the score on both paths
    patched(model, lookahead=0, carry_by="score")
    window = jacap_attn.compress(model, ids)
    patched(model, carry_by="score")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lookahead.LookaheadRoute, "run_pass", lambda self, cache, forward: setattr(self, "written", None))
        only_window = jacap_attn.compress(model, ids)
    assert kept(only_window) == kept(window)


@pytest.mark.parametrize("family_", ["llama", "gemma3_text"])
def test_a_chunked_prefill_looks_ahead_at_its_last_cut_over_what_it_holds(family_):
    """With a running budget of 1 nothing is evicted before the last cut, so the lookahead over the held
    entries writes the stock model's greedy tokens and sees what a stock forward sees (the window's rows
    and the written tokens' over the prompt), exactly as the one-shot lookahead does."""
    model = tiny_model(family_, attn="eager")
    ids = random_ids(1, N)
    with torch.no_grad():
        stock = model.generate(ids, max_new_tokens=K, do_sample=False, pad_token_id=0)[:, N:]
    calls = []
    original = lookahead.held_lookahead_statistics

    def spy(cache, forward, windows):
        calls.append(original(cache, forward, windows))
        return calls[-1]

    patched(model, chunk_size=40, chunk_ratio=1.0, chunk_scores="rescore", beta=0.5)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("jacap_attn.routes.chunk.held_lookahead_statistics", spy)
        with passes_recorded() as one_shot:  # the one-shot route is not used by a chunked prefill
            cache = jacap_attn.compress(model, ids)
    assert len(calls) == 1 and one_shot == []
    got, own = calls[0]
    assert own == {}  # the window's own statistics are kept only under lookahead_share
    written = stock
    jacap_attn.unpatch(model)
    with torch.no_grad():
        out = model(torch.cat([ids, written], dim=1), output_attentions=True, use_cache=True)
    names = repeat.repeat_statistics(cache.config)
    full_layers = [i for i, layer in enumerate(cache.layers) if not layer.is_sliding]
    assert sorted(got) == full_layers
    assert_stock_statistics(got, out, full_layers, N - cache.config.window, N, names)


def test_the_chunked_lookahead_stores_nothing_and_changes_the_last_cut():
    """Every chunk, and the decode tokens after the prompt, still attend exactly what the cuts kept (the
    masking oracle of test_chunked, a left-padded batch), and the lookahead changes the last cut."""
    model = tiny_model("llama")
    ids = random_ids(2, 150)
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    patched(model, chunk_scores="rescore")
    evicted = assert_matches_oracle(model, ids, mask, 40, extra=random_ids(2, 4, seed=9))
    assert sum(evicted) > 0
    patched(model, chunk_scores="rescore")  # the oracle unpatches the model
    ahead = kept(jacap_attn.compress(model, ids, mask, chunk_size=40))
    patched(model, chunk_scores="rescore", lookahead=0)
    assert ahead != kept(jacap_attn.compress(model, ids, mask, chunk_size=40))


def test_generate_with_prefill_chunk_size_looks_ahead_at_the_last_cut():
    model = tiny_model("llama")
    patched(model, chunk_scores="rescore")
    calls = []
    original = lookahead.held_lookahead_statistics
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("jacap_attn.routes.chunk.held_lookahead_statistics", lambda *a: calls.append(1) or original(*a))
        out = model.generate(random_ids(1, N), max_new_tokens=3, do_sample=False, prefill_chunk_size=32, pad_token_id=0)
    assert calls == [1] and out.shape == (1, N + 3)



@pytest.mark.parametrize("family_", ["llama", "gemma3_text"])
def test_question_time_reselection_looks_ahead_over_the_whole_document(family_):
    """A document stored whole (``ratio=1``, ``reselect=0.25``): the question's forward writes the stock
    model's greedy tokens after document + question over everything the cache holds, scores with the
    question window's rows plus theirs (a stock eager forward's statistics over the document's and
    question's columns), keeps the reselected count with nothing of them stored, and changes the cut."""
    model = tiny_model(family_, attn="eager")
    ids, question = random_ids(1, N), random_ids(1, 6, seed=4)
    prompt = torch.cat([ids, question], dim=1)
    with torch.no_grad():
        stock = model.generate(prompt, max_new_tokens=K, do_sample=False, pad_token_id=0)[:, prompt.shape[1]:]
    calls = []
    original = lookahead.held_lookahead_statistics

    def spy(*args, **kwargs):
        calls.append(original(*args, **kwargs))
        return calls[-1]

    counts = {}
    for k in (0, K):
        patched(model, ratio=1.0, reselect=0.25, beta=0.5, lookahead=k)
        doc = jacap_attn.Document.compress(model, ids)
        cache = doc.fresh_cache()
        with pytest.MonkeyPatch.context() as mp, torch.no_grad():
            mp.setattr("jacap_attn.routes.reselect.held_lookahead_statistics", spy)
            model(input_ids=question, cache=cache, use_cache=True)
        counts[k] = ([layer.kept_counts().tolist() for layer in cache.layers], kept(cache), cache)
    assert len(calls) == 1
    assert counts[0][0] == counts[K][0] and counts[0][1] != counts[K][1]
    cache = counts[K][2]
    jacap_attn.unpatch(model)
    with torch.no_grad():
        out = model(torch.cat([prompt, stock], dim=1), output_attentions=True, use_cache=True)
    names = repeat.repeat_statistics(cache.config, cache.config.reselect_budget)  # the question's policy
    full_layers = [i for i, layer in enumerate(cache.layers) if not layer.is_sliding]
    observed, own = calls[0]
    assert own == {}  # the window's own statistics are kept only under lookahead_share
    assert sorted(observed) == full_layers
    assert_stock_statistics(observed, out, full_layers, N, N + 6, names)
    for index in full_layers:  # the kept entries are the document's and the question's, nothing written
        layer, want = cache.layers[index], out.past_key_values.layers[index]
        for head in range(layer.kv_heads()):
            slots = layer.valid[0, head]
            torch.testing.assert_close(layer.keys[0, head][slots], want.keys[0, head][layer.positions[0, head][slots]])


def test_a_config_saved_without_lookahead_reads_back_without_it():
    """A file's config from before the setting (its cut scored by the window alone) reads back as 0;
    one written since keeps its value."""
    from jacap_attn import JacapConfig

    data = JacapConfig(method="jacap", lookahead=5).to_dict()
    assert JacapConfig.from_dict(data).lookahead == 5
    del data["lookahead"]
    assert JacapConfig.from_dict(data).lookahead == 0

def test_a_split_forward_returns_every_logit_when_its_last_cut_looks_ahead():
    """A plain forward under ``chunk_size`` runs its chunks but the last itself and keeps their hidden
    states for the caller; the lookahead's own forwards at the last cut must not take them (they did:
    the forward returned the last chunk's logits only)."""
    model = tiny_model("llama")
    ids = random_ids(1, N)
    patched(model, chunk_size=32, chunk_scores="rescore")
    with torch.no_grad():
        out = model(ids)
    assert out.logits.shape[:2] == (1, N)
    patched(model, chunk_size=32, chunk_scores="rescore", lookahead=0)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[:, :64], out.logits[:, :64])  # the chunks before the last cut
