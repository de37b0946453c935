"""generate settings a user tries that the patch served wrongly (found by an attack on generate, 2026-12-07):
``use_cache=False`` under ``chunk_size`` failed with transformers' "prefill chunking without a cache",
``use_cache=False`` turned compression off without a word, and a padded new turn over a filled cache
was attended where stock transformers masks it."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import jacap_attn
from conftest import random_ids, tiny_model

GREEDY = dict(do_sample=False)


def _no_cache_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "use_cache=False" in str(w.message)]


@pytest.mark.parametrize("how", ["keyword", "generation_config"])
def test_generate_without_a_cache_is_stock_and_says_it_compresses_nothing(how):
    ids = random_ids(1, 80)
    expected = tiny_model().generate(ids, max_new_tokens=6, use_cache=False, **GREEDY)
    model = jacap_attn.patch(tiny_model(), ratio=0.25, min_tokens=0, chunk_size=16)
    kwargs = {"use_cache": False} if how == "keyword" else {}
    if how == "generation_config":
        model.generation_config.use_cache = False  # as some checkpoints ship it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(ids, max_new_tokens=6, **kwargs, **GREEDY)
    assert torch.equal(out, expected)
    (message,) = _no_cache_warnings(caught)
    assert "compresses nothing" in message
    assert next(w for w in caught if "use_cache=False" in str(w.message)).filename == __file__
    # with a cache, no such warning, and the patch compresses (another output than stock's here)
    model.generation_config.use_cache = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(ids, max_new_tokens=6, **GREEDY)
    assert not _no_cache_warnings(caught)


def _two_turns(model, turn_mask):
    ids = random_ids(2, 60, seed=4)
    mask = torch.ones_like(ids)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=5, return_dict_in_generate=True, **GREEDY)
    turn = random_ids(2, 12, seed=5)
    full = torch.cat([first.sequences, turn], 1)
    full_mask = torch.cat([mask, torch.ones(2, 5, dtype=torch.long), turn_mask], 1)
    return first, full, full_mask


def test_a_padded_new_turn_over_a_filled_cache_is_refused():
    """Row 1's new turn is 4 tokens shorter, its first 4 positions masked: stock transformers skips
    them; a compressed cache would store and attend them, so both generate and a plain forward refuse."""
    model = jacap_attn.patch(tiny_model(), ratio=0.5, min_tokens=0)
    turn_mask = torch.ones(2, 12, dtype=torch.long)
    turn_mask[1, :4] = 0
    first, full, full_mask = _two_turns(model, turn_mask)
    with pytest.raises(ValueError, match=r"attention_mask rows \[1\] mask some of the 13 tokens appended"):
        model.generate(full, attention_mask=full_mask, cache=copy.deepcopy(first.cache),
                       max_new_tokens=1, **GREEDY)
    held = first.cache.get_seq_length()
    with pytest.raises(ValueError, match=r"attention_mask rows \[1\] mask some of the 13 tokens appended"):
        with torch.no_grad():
            model(full[:, held:], attention_mask=full_mask, cache=copy.deepcopy(first.cache))


def test_an_unpadded_new_turn_over_a_filled_cache_still_runs_as_stock():
    """The check refuses only masked new tokens: at ratio 1 an unpadded second turn of a batch is stock's."""
    turn_mask = torch.ones(2, 12, dtype=torch.long)
    outs = []
    for model in (tiny_model(), jacap_attn.patch(tiny_model(), ratio=1.0)):
        first, full, full_mask = _two_turns(model, turn_mask)
        outs.append(model.generate(full, attention_mask=full_mask, cache=first.cache,
                                   max_new_tokens=4, **GREEDY))
    assert torch.equal(*outs)
