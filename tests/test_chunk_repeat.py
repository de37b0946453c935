"""``chunk_scores="repeat"``: a chunked prefill whose cuts before the last are scored by a repeat pass of
each chunk over the held entries (jacap_attn.routes.repeat.held_repeat_statistics). The pass stores
nothing (every chunk still attends exactly what the cut before it kept: the masking oracle of
test_chunked), its statistics are those of a stock replay over the prompt, and it changes the choice."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import jacap_attn
from jacap_attn.math import attention_stats
from jacap_attn.routes import repeat
from jacap_attn.storage.cache import JacapCache
from conftest import random_ids, tiny_model
from test_chunked import assert_matches_oracle, chunked_run, positions_of

N, CHUNK = 150, 40
INSTRUCTION = (5, 6, 7)  # a repeat instruction of token ids (the tokenizer's is prompts.repeat_instruction_ids)


@contextlib.contextmanager
def passes_recorded():
    """Within it, every held repeat pass a chunk cut runs appends its ``(start, end)`` to the list it yields."""
    calls, original = [], repeat.held_repeat_statistics
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("jacap_attn.routes.chunk.held_repeat_statistics", lambda *a: calls.append(a[2:4]) or original(*a))
        yield calls


def patched(model, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer for word spans: token by token
        return jacap_attn.patch(model, **{"ratio": 0.25, "window": 8, "min_tokens": 0, "chunk_scores": "repeat",
                                          "repeat_ids": INSTRUCTION, **options})


@pytest.mark.parametrize("family_", ["llama", "gemma3_text", "qwen3"])
def test_every_chunk_attends_what_the_repeat_scored_cut_kept(family_):
    """The pass's forwards store nothing: a left-padded batch still matches the oracle that replays
    every cut over the unpatched model, decode tokens after the prompt included."""
    model = tiny_model(family_)
    ids = random_ids(2, N)
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    patched(model)
    evicted = assert_matches_oracle(model, ids, mask, CHUNK, extra=random_ids(2, 4, seed=9))
    assert sum(evicted) > 0, "nothing was evicted"


@pytest.mark.parametrize("budget", ["global", "uniform"])
def test_the_repeat_pass_changes_what_the_cuts_before_the_last_keep(budget):
    model = tiny_model("llama")
    ids = random_ids(1, N)
    mask = torch.ones_like(ids)
    patched(model, ratio=0.5, chunk_scores="rescore", budget=budget, chunk_budget="seen")
    _, window_held, _ = chunked_run(model, ids, mask, CHUNK)
    patched(model, ratio=0.5, budget=budget, chunk_budget="seen")
    with passes_recorded() as calls:
        _, repeat_held, _ = chunked_run(model, ids, mask, CHUNK)
    assert calls == [(CHUNK, 2 * CHUNK), (2 * CHUNK, 3 * CHUNK)]  # every cut but the first (its own pass) and last
    first_cut = [int((a != b).sum()) for a, b in zip(window_held[0], repeat_held[0])]
    assert sum(first_cut) > 0, "the first chunk's repeat pass kept what its window kept"
    # The running budget is the same whatever scores the cut (per head under the uniform policy).
    if budget == "uniform":
        assert all(torch.equal(a.sum(-1), b.sum(-1)) for a, b in zip(window_held[1], repeat_held[1]))
    assert sum(int(a.sum()) for a in window_held[1]) == sum(int(b.sum()) for b in repeat_held[1])


def test_the_held_pass_sees_what_a_stock_replay_over_the_prompt_sees():
    """With nothing evicted yet (a running budget of 1), the pass's statistics over the held entries
    equal those of the unpatched model reading the prompt, then the instruction and the chunk again
    (causal attention, positions continuing), for every layer: the attention the pass computes itself
    is the model's."""
    model = tiny_model("llama", attn="eager")
    n = 2 * CHUNK
    ids = random_ids(1, n)
    patched(model, ratio=0.25, chunk_ratio=1.0, repeat_chunk=CHUNK, chunk_scores="rescore", beta=0.5)
    cache = JacapCache(model)
    cache.prefill_until, cache.prefill_chunk = n + CHUNK, CHUNK  # a third chunk follows: no last cut
    position = torch.arange(n)[None]
    with torch.no_grad():
        for start in (0, CHUNK):
            model(input_ids=ids[:, start:start + CHUNK], position_ids=position[:, start:start + CHUNK], cache=cache)
        layers = range(len(cache.layers))
        assert all(int(layer.valid[:, :, :int(layer.write_pos)].sum()) == n * layer.kv_heads() for layer in cache.layers)
        got = repeat.held_repeat_statistics(cache, model._jacap_state.forward_over(cache), CHUNK, n, layers)
    jacap_attn.unpatch(model)
    replay = torch.cat([torch.tensor([INSTRUCTION]), ids[:, CHUNK - repeat.LEAD:]], dim=1)
    whole = torch.cat([ids, replay], dim=1)
    with torch.no_grad():
        out = model(whole, output_attentions=True, use_cache=True)
    names = repeat.repeat_statistics(cache.config)
    assert {"mass", "peak", "sq", "sq_dist"} <= set(names)
    assert_stock_statistics(got, out, layers, n, n, names)  # the replay's rows


def assert_stock_statistics(got: dict, out, layers, first_row: int, n: int, names) -> None:
    """``got[layer][name]`` ``[b, h, n]`` equals the statistics of a stock eager forward's attention
    (``out``, run with ``output_attentions=True``): its rows from ``first_row`` on, over its first ``n``
    columns (the prompt's keys), for every layer in ``layers``."""
    for index in layers:
        probs = out.attentions[index][:, :, first_row:, :n].float()  # [b, Hq, r, n]
        keys = out.past_key_values.layers[index].keys[:, :, :n]
        b, hq, r, _ = probs.shape
        h = keys.shape[1]
        want = attention_stats.attention_statistics(probs.reshape(b, h, hq // h, r, n), keys, names)
        for name in names:
            torch.testing.assert_close(got[index][name], want[name], atol=1e-5, rtol=1e-4, msg=f"layer {index} {name}")


def test_repeat_chunk_scores_is_checked_before_any_work():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="chunk_scores='repeat' needs a method"):
        patched(model, method="tova", chunk_size=CHUNK)
    with pytest.raises(ValueError, match="chunk_scores must be one of rescore, carry, repeat"):
        patched(model, chunk_scores="replay")
    with pytest.raises(ValueError, match="queries='repeat'.*chunk_scores='repeat'"):
        patched(model, queries="repeat", chunk_size=CHUNK)
    # inputs_embeds: nothing to replay, said at the first cut that replays
    patched(model, chunk_size=CHUNK)
    embeds = model.get_input_embeddings()(random_ids(1, N))
    with pytest.raises(ValueError, match="chunk_scores='repeat' replays"), torch.no_grad():
        model(inputs_embeds=embeds)


def test_generate_with_prefill_chunk_size_scores_chunks_by_the_repeat_pass():
    """``generate(prefill_chunk_size=N)`` on a model patched with ``chunk_scores="repeat"`` runs it
    (the same tokens as the chunked prefill driven by hand, then greedy decode)."""
    model = tiny_model("llama")
    ids = random_ids(1, N)
    patched(model)
    with passes_recorded() as calls:
        out = model.generate(ids, max_new_tokens=4, do_sample=False, prefill_chunk_size=CHUNK, pad_token_id=0)
    assert calls == [(CHUNK, 2 * CHUNK), (2 * CHUNK, 3 * CHUNK)]
    assert out.shape == (1, N + 4)


@pytest.mark.parametrize("method, want", [("jacap", "repeat"), ("snapkv", "repeat"), ("pyramidkv", "repeat"),
                                          ("adakv", "repeat"), ("kvzip", "repeat"), ("tova", "rescore"),
                                          ("streaming_llm", "rescore")])
def test_the_default_scores_chunk_cuts_by_use(method, want):
    """The rule of docs/method.md (2026-12-06, chunk cuts scored by use): ``chunk_scores=None`` resolves
    to ``"rescore"`` for a prompt answered in the same call, whatever the method, and for a document
    (questions later) to ``"repeat"`` for a method that reads the repeat pass, ``"rescore"`` for the
    others; an explicit value wins."""
    from jacap_attn.methods import get_method
    from jacap_attn.route_settings import chunk_scoring

    config = jacap_attn.JacapConfig.from_options(ratio=0.25, method=method, chunk_size=CHUNK)
    assert config.chunk_scores is None and config.chunk_scoring == "rescore"
    assert chunk_scoring(None, get_method(method), document=True) == want
    explicit = jacap_attn.JacapConfig.from_options(ratio=0.25, method=method, chunk_size=CHUNK, chunk_scores="carry")
    assert explicit.chunk_scoring == "carry" and chunk_scoring("carry", get_method(method), document=True) == "carry"
    assert jacap_attn.JacapConfig.from_options(ratio=1.0, method="full").chunk_scoring == "rescore"


def test_a_document_is_cut_by_the_repeat_pass_and_a_prompt_by_its_window(monkeypatch):
    """``Document.compress(chunk_size=...)`` (questions come later) scores its cuts before the last by the
    repeat pass and records ``chunk_scores="repeat"`` in the config it saves; ``compress`` of the same
    prompt (answered in the same call) runs no pass, and an explicit ``chunk_scores`` is kept in both."""
    from jacap_attn.routes import chunk as chunk_route

    calls = []
    original = chunk_route.held_repeat_statistics

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(chunk_route, "held_repeat_statistics", spy)
    model = tiny_model("llama")
    ids = random_ids(1, N)
    jacap_attn.patch(model, ratio=0.25, window=8, repeat_ids=INSTRUCTION)
    cache = jacap_attn.compress(model, ids, chunk_size=CHUNK)
    assert calls == [] and cache.config.chunk_scores is None
    doc = jacap_attn.Document.compress(model, ids, store=0.5, chunk_size=CHUNK)
    assert calls and doc.cache.config.chunk_scores == "repeat"
    calls.clear()
    assert jacap_attn.Document.compress(model, ids, store=None, chunk_size=CHUNK).cache.config.chunk_scores == "repeat"
    assert calls
    calls.clear()
    jacap_attn.patch(model, ratio=0.25, window=8, chunk_scores="carry")
    doc = jacap_attn.Document.compress(model, ids, store=0.5, chunk_size=CHUNK)
    assert calls == [] and doc.cache.config.chunk_scores == "carry"
    jacap_attn.unpatch(model)


def test_a_method_that_reads_every_prompt_query_refuses_chunking_before_any_work():
    """H2O scores from every prompt query, which no chunk's cut has: ``chunk_size`` at ``patch`` and
    ``prefill_chunk_size`` at ``generate`` are ``ValueError``s naming the setting (a chunked H2O prefill
    used to fail deep in its scorer with an ``AttributeError``)."""
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="chunk_size=64: method='h2o' scores from every prompt query"):
        jacap_attn.patch(model, ratio=0.25, method="h2o", chunk_size=64)
    jacap_attn.patch(model, ratio=0.25, method="h2o", min_tokens=0)
    with pytest.raises(ValueError, match="prefill_chunk_size=32: method='h2o'"):
        model.generate(random_ids(1, N), max_new_tokens=2, prefill_chunk_size=32, pad_token_id=0)
    jacap_attn.unpatch(model)


def test_the_default_of_a_prompt_scores_by_the_window_from_ids_and_from_embeddings():
    """Patched without ``chunk_scores``, a chunked Jacap prefill of a prompt (``compress``, ``generate``:
    answered in the same call) scores its cuts by the chunk's window (lookup ahead on), the same cuts as
    ``chunk_scores="rescore"``, and runs no repeat pass; one from ``inputs_embeds`` too, where an explicit
    ``"repeat"`` raises (:func:`test_repeat_chunk_scores_is_checked_before_any_work`)."""
    model = tiny_model("llama")
    ids = random_ids(1, N)
    mask = torch.ones_like(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jacap_attn.patch(model, ratio=0.25, window=8, min_tokens=0, repeat_ids=INSTRUCTION)
    with passes_recorded() as calls:
        _, default_held, _ = chunked_run(model, ids, mask, CHUNK)
    assert calls == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jacap_attn.patch(model, ratio=0.25, window=8, min_tokens=0, repeat_ids=INSTRUCTION, chunk_scores="rescore")
    _, window_held, _ = chunked_run(model, ids, mask, CHUNK)
    assert len(default_held) == len(window_held) == 4
    for default_cut, window_cut in zip(default_held, window_held):  # every cut: what each layer and head holds
        assert all(torch.equal(a, b) for a, b in zip(default_cut, window_cut))

    embeds = model.get_input_embeddings()(ids)

    def embedded_prefill(**options):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            jacap_attn.patch(model, ratio=0.25, window=8, min_tokens=0, chunk_size=CHUNK, **options)
        cache = JacapCache(model)
        with torch.no_grad():
            logits = model(inputs_embeds=embeds, cache=cache, use_cache=True).logits
        return logits, [layer.kept_counts() for layer in cache.layers]

    with passes_recorded() as calls:
        default_logits, default_kept = embedded_prefill()
    assert calls == []
    window_logits, window_kept = embedded_prefill(chunk_scores="rescore")
    torch.testing.assert_close(default_logits, window_logits)
    assert all(torch.equal(a, b) for a, b in zip(default_kept, window_kept))


def test_the_command_line_gives_a_chunked_prefill_the_repeat_instruction_when_its_pass_runs():
    """``jacap`` (the CLI) adds the tokenizer's repeat instruction to a chunked prefill whose cuts the
    repeat pass scores (a document's default for a method that reads it, ``jacap compress``, or
    ``--chunk-scores repeat``), and to nothing else."""
    from jacap_attn.cli_support import _with_repeat_ids

    class Tokenizer:  # the call protocol of a Hugging Face tokenizer, without a chat template
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [len(word) for word in text.split()]}

    tok = Tokenizer()
    want = [len(word) for word in "Repeat the previous context exactly.".split()]
    assert _with_repeat_ids({"chunk_size": 64}, tok, False, "jacap", document=True)["repeat_ids"] == want
    assert "repeat_ids" not in _with_repeat_ids({"chunk_size": 64}, tok, False, "jacap")  # window-scored cuts
    assert _with_repeat_ids({"chunk_size": 64, "chunk_scores": "repeat"}, tok, False, "snapkv")["repeat_ids"] == want
    assert "repeat_ids" not in _with_repeat_ids({"chunk_size": 64, "chunk_scores": "rescore"}, tok, False, "jacap")
    assert "repeat_ids" not in _with_repeat_ids({"chunk_size": 64}, tok, False, "tova")
    assert "repeat_ids" not in _with_repeat_ids({}, tok, False, "jacap")
    assert _with_repeat_ids({"queries": "repeat"}, tok, False, "jacap")["repeat_ids"] == want


def test_a_tokenizer_given_to_patch_writes_the_repeat_instruction():
    """``patch(model, tokenizer=...)`` without ``repeat_ids``: the repeat pass replays the tokenizer's
    instruction (``prompts.repeat_instruction_ids``), the same cuts as that instruction given as
    ``repeat_ids``; an explicit ``repeat_ids`` wins; without a tokenizer nothing is replayed before the chunk."""
    from jacap_attn.prompts import repeat_instruction_ids

    class Tokenizer:  # callable, a vocabulary of 96 ids, no chat template
        all_special_ids = [0]

        def __len__(self):
            return 96

        def convert_ids_to_tokens(self, ids):
            return [f"\u0120w{i}" for i in ids]

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [3 + len(word) for word in text.split()]}

    model = tiny_model("llama")
    ids = random_ids(1, N)
    mask = torch.ones_like(ids)
    want = tuple(repeat_instruction_ids(Tokenizer()))
    options = dict(ratio=0.25, window=8, min_tokens=0, spans="none")
    jacap_attn.patch(model, tokenizer=Tokenizer(), **options)
    assert model._jacap_state.repeat_ids == want
    assert repeat.instruction_ids(JacapCache(model)) == want
    _, from_tokenizer, _ = chunked_run(model, ids, mask, CHUNK)
    jacap_attn.patch(model, repeat_ids=want, **options)
    _, given, _ = chunked_run(model, ids, mask, CHUNK)
    for a_cut, b_cut in zip(from_tokenizer, given):
        assert all(torch.equal(a, b) for a, b in zip(a_cut, b_cut))
    jacap_attn.patch(model, repeat_ids=INSTRUCTION, **options)
    assert repeat.instruction_ids(JacapCache(model)) == INSTRUCTION
    jacap_attn.unpatch(model)
    jacap_attn.patch(model, **options)
    assert model._jacap_state.repeat_ids is None and repeat.instruction_ids(JacapCache(model)) == ()


def test_a_config_saved_before_chunk_scores_reads_back_scoring_cuts_by_the_window():
    """A file's config from before ``chunk_scores`` existed (2026-12-03) chunked by the window: it reads
    back as ``"rescore"``; one written since keeps its value, the default (``None``) included."""
    config = jacap_attn.JacapConfig.from_options(ratio=0.25, chunk_size=CHUNK)
    data = config.to_dict()
    assert data["chunk_scores"] is None and jacap_attn.JacapConfig.from_dict(data).chunk_scoring == "rescore"
    del data["chunk_scores"]
    assert jacap_attn.JacapConfig.from_dict(data).chunk_scores == "rescore"
    data["chunk_scores"] = "carry"
    assert jacap_attn.JacapConfig.from_dict(data).chunk_scores == "carry"
