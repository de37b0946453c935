"""``chunk_scores="end"``: a chunked prefill's cuts before the last scored by one pass of the prompt's
end (its last ``window`` tokens: the question, where it ends the prompt) over the held entries."""

from __future__ import annotations

import math

import pytest
import torch

import jacap_attn
from conftest import random_ids, tiny_model
from test_chunked import CHUNK, N, assert_matches_oracle


@pytest.mark.parametrize("family_", ["llama", "gemma3_text"])
def test_end_scored_cuts_attend_what_they_kept_in_a_left_padded_batch(family_):
    """Every chunk attends exactly what the cut before it kept (the masking oracle), a left-padded
    batch too, on a model with sliding-window layers as well."""
    model = tiny_model(family_)
    ids = random_ids(2, N)
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    jacap_attn.patch(model, ratio=0.2, window=8, chunk_scores="end")
    assert_matches_oracle(model, ids, mask, CHUNK)


def test_every_cut_before_the_last_reads_the_prompts_end_at_its_own_positions(monkeypatch):
    """The first chunk's pass and each later cut's (all but the last, which the prompt's own window
    scores) replay the prompt's last ``window`` ids at their RoPE positions (left padding counted
    out), store nothing, and keep entries other than the repeat pass's and the chunk window's."""
    from jacap_attn.routes import chunk as chunk_route
    from jacap_attn.routes import repeat as repeat_route

    seen = []
    original_held, original_first = chunk_route.held_end_statistics, repeat_route.EndRoute.run_pass

    def held(cache, forward, scored):
        seen.append(("held", *[t.clone() for t in repeat_route.prompt_end(cache)]))
        return original_held(cache, forward, scored)

    def first(self, cache, forward):
        seen.append(("first", *[t.clone() for t in repeat_route.prompt_end(cache)]))
        return original_first(self, cache, forward)

    monkeypatch.setattr(chunk_route, "held_end_statistics", held)
    monkeypatch.setattr(repeat_route.EndRoute, "run_pass", first)
    model = tiny_model("llama")
    ids = random_ids(2, N)
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    kept = {}
    for scores in ("end", "repeat", "rescore"):
        jacap_attn.patch(model, ratio=0.2, window=8, chunk_size=CHUNK, chunk_scores=scores)
        cache = jacap_attn.compress(model, ids, attention_mask=mask)
        kept[scores] = [layer.positions[layer.valid].tolist() for layer in cache.layers]
        assert sum(int(layer.kept_counts()[0].sum()) for layer in cache.layers) \
            <= sum(layer.kept_counts()[0].numel() for layer in cache.layers) * (0.2 * N + 1)  # the final budget
    cuts = (N - 1) // CHUNK  # the cuts before the last
    assert [s[0] for s in seen] == ["first"] + ["held"] * (cuts - 1)
    for _, end_ids, valid, positions in seen:
        assert torch.equal(end_ids, ids[:, -8:]) and bool(valid.all())
        assert positions[0].tolist() == list(range(N - 8, N)) and positions[1].tolist() == list(range(N - 19, N - 11))
    assert kept["end"] != kept["repeat"] and kept["end"] != kept["rescore"]


def test_end_scores_are_refused_clearly_where_there_is_no_prompt_end_or_pass():
    """A prompt given as embeddings has no ids to read ahead: ``ValueError`` naming the setting, before
    any cut; a method that does not score from summed statistics is refused when patched."""
    model = tiny_model("llama")
    ids = random_ids(1, N)
    jacap_attn.patch(model, ratio=0.2, window=8, chunk_size=CHUNK, chunk_scores="end")
    embeds = model.get_input_embeddings()(ids).detach()
    with pytest.raises(ValueError, match="chunk_scores='end'"):
        model.generate(inputs_embeds=embeds, max_new_tokens=1, do_sample=False)
    with pytest.raises(ValueError, match="chunk_scores='end'.*tova"):
        jacap_attn.patch(model, ratio=0.2, method="tova", chunk_scores="end")
    with pytest.raises(ValueError, match="chunk_scores must be one of .*end.*'question'"):
        jacap_attn.patch(model, ratio=0.2, chunk_scores="question")


def test_a_new_turn_in_chunks_reads_the_turns_end():
    """A chat turn over the returned cache, prefilled in chunks, scores its cuts before the last by the
    end of the conversation it is given (the turn's last tokens) and stays within its running budget."""
    from jacap_attn.routes import repeat as repeat_route

    model = jacap_attn.patch(tiny_model("llama"), ratio=0.3, window=8, chunk_size=16, min_tokens=0, chunk_scores="end")
    out = model.generate(random_ids(1, 50, seed=11), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    history = torch.cat([out.sequences, random_ids(1, 50, seed=12)], dim=1)
    ends = []
    original = repeat_route.prompt_end

    def spy(cache):
        ends.append(original(cache)[0].clone())
        return ends[-1]
    try:
        repeat_route.prompt_end = lambda cache: (spy(cache), *original(cache)[1:])
        turn = model.generate(history, cache=out.cache, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    finally:
        repeat_route.prompt_end = original
    assert ends and all(torch.equal(e, history[:, -8:]) for e in ends)
    seen = turn.cache.get_seq_length()
    heads = sum(layer.kept_counts().numel() for layer in turn.cache.layers)  # the global budget's total
    assert sum(int(layer.kept_counts().sum()) for layer in turn.cache.layers) <= heads * (math.ceil(0.3 * (seen - 1)) + 1)
