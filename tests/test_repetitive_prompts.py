"""Repetitive prompts (issue 33; the rule of docs/method.md, "Repetitive prompts"): a chunked prefill of a prompt
whose every row repeats itself (at least half its tokens inside an 8-gram that occurs twice or more) takes a
document's chunk settings for that prefill, repeat-scored cuts carrying the mass of near-duplicates, where the
caller left ``chunk_scores`` and ``chunk_mass`` unset; any other prompt is cut as before."""

from __future__ import annotations

import pytest
import torch

import jacap_attn
from conftest import random_ids, tiny_model
from jacap_attn.route_settings import REPEAT_NGRAM, prompt_chunking, repeated_share
from test_robustness import kept_prompt_positions, left_pad

REPEATED = random_ids(1, 20, seed=3).repeat(1, 10)  # 200 tokens, every one inside a repeated 8-gram
PLAIN = random_ids(1, 200, seed=4)
DOCUMENT = dict(chunk_scores="repeat", chunk_mass=True, mass_cosine=0.95)


def _kept(ids, mask=None, row=0, **options):
    model = jacap_attn.patch(tiny_model(), ratio=0.25, chunk_size=64, min_tokens=1, **options)
    cache = jacap_attn.compress(model, ids, mask)
    n = int(ids.shape[1] if mask is None else mask[row].sum())
    return [kept_prompt_positions(layer, row, n) for layer in cache.layers], cache


def test_the_repeated_share_counts_tokens_inside_repeated_ngrams():
    block = torch.arange(10)
    assert repeated_share(block.repeat(4)[None]).tolist() == [1.0]
    assert repeated_share(torch.arange(50)[None]).tolist() == [0.0]
    once_twice = torch.cat([torch.arange(100, 112), torch.arange(30), torch.arange(100, 112)])  # 24 of 54 repeated
    assert repeated_share(once_twice[None]).tolist() == pytest.approx([24 / 54])
    assert repeated_share(torch.arange(REPEAT_NGRAM - 1)[None]).tolist() == [0.0]
    padded = torch.cat([torch.zeros(30, dtype=torch.long), block.repeat(3)])[None]  # padding never counts
    valid = torch.arange(60)[None] >= 30
    assert repeated_share(padded, valid).tolist() == [1.0]


def test_a_repetitive_prompt_is_cut_as_a_document_and_the_settings_come_back():
    kept, cache = _kept(REPEATED)
    assert kept == _kept(REPEATED, **DOCUMENT)[0]
    assert kept != _kept(REPEATED, chunk_scores="rescore")[0]
    assert cache.config.chunk_scores is None and cache.config.chunk_mass is None  # this prefill only
    assert _kept(PLAIN)[0] == _kept(PLAIN, chunk_scores="rescore")[0]


def test_generate_chunks_a_repetitive_prompt_as_compress_does():
    model = jacap_attn.patch(tiny_model(), ratio=0.25, chunk_size=64, min_tokens=1)
    out = model.generate(REPEATED, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    reference = jacap_attn.patch(tiny_model(), ratio=0.25, chunk_size=64, min_tokens=1, **DOCUMENT)
    want = reference.generate(REPEATED, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want.sequences)
    assert [kept_prompt_positions(layer, 0, 200) for layer in out.past_key_values.layers] == \
        [kept_prompt_positions(layer, 0, 200) for layer in want.past_key_values.layers]


def test_what_the_rule_leaves_alone():
    """A setting the caller chose, a method that reads no repeat pass, a batch with one plain row, no ids."""
    from jacap_attn.config import JacapConfig

    ids = REPEATED
    assert prompt_chunking(JacapConfig(chunk_size=64), ids) == DOCUMENT
    assert prompt_chunking(JacapConfig(chunk_size=64, chunk_scores="rescore"), ids) == {}
    assert prompt_chunking(JacapConfig(chunk_size=64, chunk_mass=False), ids) == {}
    assert prompt_chunking(JacapConfig(chunk_size=64, method="streaming_llm"), ids) == {}
    assert prompt_chunking(JacapConfig(chunk_size=64), torch.cat([ids, PLAIN])) == {}
    assert prompt_chunking(JacapConfig(chunk_size=64), None) == {}


def test_a_left_padded_repetitive_row_counts_its_own_tokens():
    ids, mask = left_pad([PLAIN[0, :150], REPEATED[0]])
    assert repeated_share(ids, mask.bool()).tolist() == pytest.approx([float(repeated_share(PLAIN[:, :150])), 1.0])
    both, mask2 = left_pad([REPEATED[0, :180], REPEATED[0]])
    kept, _ = _kept(both, mask2, row=1)
    assert kept == _kept(both, mask2, row=1, **DOCUMENT)[0]


def test_the_harness_never_reuses_a_chunked_rows_results_from_before_the_rule():
    """A default chunked row may now run a document's settings on a repetitive prompt, which its result key (built
    without the prompt) cannot see: every row the rule may apply to carries the rule's version; a row that set
    its chunk settings keeps its key."""
    from eval import quality

    def spec(options):
        return quality._spec("jacap", options, 0.1)

    assert spec({"chunk_size": 1024})["repetitive_prompts"] == quality.REPETITIVE_PROMPTS_VERSION
    assert "repetitive_prompts" not in spec({"chunk_size": 1024, "chunk_scores": "rescore"})
    assert "repetitive_prompts" not in spec({"chunk_size": 1024, **DOCUMENT})
    assert "repetitive_prompts" not in spec({})
