"""Valid settings a randomized search over patch options found served wrongly (2026-12-07): two crashes
(lookahead under ``reselect_budget="global"``; Ada-KV's head split at a question whose budget exceeds
what the prefill kept) and two breaks of the left-padding promise (a row of a left-padded batch, prefilled
in one piece, keeps the set and gives the tokens it does alone; docs/usage.md, Padding): the repeat pass
chunked the padded batch's columns, and ``lookahead_share`` broke score ties by ``torch.topk``'s order."""

from __future__ import annotations

import pytest
import torch

import jacap_attn
from conftest import random_ids, tiny_model
from test_robustness import kept_prompt_positions, left_pad

GREEDY = dict(do_sample=False)


def _padded(long: int, short: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [2, long], mask, the short row's own ids [1, short])``: row 1 left-padded."""
    short_row = random_ids(1, short, seed=2)[0]
    return (*left_pad([random_ids(1, long, seed=1)[0], short_row]), short_row[None])


def _kept(cache, row: int, n: int) -> list:
    """Per layer and KV head, the sorted prompt positions row ``row`` holds."""
    return [kept_prompt_positions(layer, row, n) for layer in cache.layers]


def _assert_padded_row_as_alone(model, long: int, short: int, new_tokens: int = 6):
    ids, mask, alone = _padded(long, short)
    assert _kept(jacap_attn.compress(model, ids, mask), 1, short) == _kept(jacap_attn.compress(model, alone), 0, short)
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=0, **GREEDY)[1, long:]
    own = model.generate(alone, max_new_tokens=new_tokens, **GREEDY)[0, short:]
    assert torch.equal(batch, own)


@pytest.mark.parametrize("method", ["snapkv", "adakv", "pyramidkv", "jacap", "kvzip"])
def test_lookahead_at_a_question_under_the_global_reselect_budget(method):
    """The lookahead's statistics at question time are gathered for the question's budget policy
    (``reselect_budget``), not the prefill's: ``global`` reads the attention peak (was a KeyError)."""
    model = jacap_attn.patch(tiny_model(), ratio=0.25, method=method, lookahead=2, reselect_budget="global",
                             min_tokens=0, compile=False)
    doc = jacap_attn.Document.compress(model, random_ids(1, 60, seed=1))  # stored whole, reselected per question
    out = doc.generate(random_ids(1, 6, seed=2), max_new_tokens=4, **GREEDY)
    assert out.shape == (1, 4)


def test_adakv_question_budget_above_what_the_prefill_kept():
    """``ratio=0.05`` keeps the 32-entry window; ``reselect=0.5`` of 101 tokens asks for more than the 38
    entries held (with the question): that row keeps everything, the other row is split by Ada-KV (the
    method's own head check used to refuse the batch, and the long row alone)."""
    model = jacap_attn.patch(tiny_model(), ratio=0.05, method="adakv", reselect=0.5, min_tokens=0, compile=False)
    ids, mask, _ = _padded(95, 42)
    question = random_ids(2, 6, seed=3)
    for rows in (slice(0, 2), slice(0, 1)):
        cache = jacap_attn.compress(model, ids[rows], mask[rows])
        held = [layer.kept_counts().clone() for layer in cache.layers]
        full = torch.cat([ids[rows], question[rows]], 1)
        full_mask = torch.cat([mask[rows], torch.ones_like(question[rows])], 1)
        model.generate(full, attention_mask=full_mask, cache=cache, max_new_tokens=3, pad_token_id=0, **GREEDY)
        for before, layer in zip(held, cache.layers):
            # row 0 keeps all it held plus the question (and the decoded tokens since)
            assert bool((layer.kept_counts()[0] >= before[0] + question.shape[1]).all())


@pytest.mark.parametrize("method", ["kvzip", "jacap"])
@pytest.mark.parametrize("repeat_chunk, long, short", [(16, 80, 50), (512, 700, 600)])  # 512: the default
def test_repeat_pass_chunks_count_each_rows_own_tokens(method, repeat_chunk, long, short):
    """The repeat pass replays a padded row in the chunks it has alone (counted from its first real
    token), so a prompt longer than ``repeat_chunk`` keeps the row's own set (was: the batch's columns)."""
    model = jacap_attn.patch(tiny_model(), ratio=0.25, method=method, queries="repeat", repeat_chunk=repeat_chunk,
                             window=8, min_tokens=0, compile=False)
    _assert_padded_row_as_alone(model, long, short)


def test_repeat_pass_chunks_of_an_unpadded_batch_are_the_prompt_columns():
    """Without padding the chunks are the prompt's columns, ``LEAD`` tokens before each but the first."""
    from jacap_attn.routes.repeat import LEAD, chunks

    ids = random_ids(2, 50, seed=4)
    got = list(chunks(ids, torch.ones(2, 50, dtype=torch.bool), torch.tensor([7, 8]), 20))
    assert [c[0].shape[1] for c in got] == [2 + 20, 2 + LEAD + 20, 2 + LEAD + 10]
    assert torch.equal(got[1][0][:, 2:], ids[:, 20 - LEAD:40]) and bool(all(c[1].all() for c in got))


def test_lookahead_share_breaks_ties_as_every_cut_does():
    """Max pooling makes plateaus of equal scores; ``lookahead_share``'s ranking now breaks their ties
    toward the later position (math.ranking), as every cut does, so a padded row keeps its own set."""
    model = jacap_attn.patch(tiny_model(), ratio=0.25, method="snapkv", window=8, lookahead=4, lookahead_share=0.25,
                             pooling="max", kernel=9, min_tokens=0, compile=False)
    _assert_padded_row_as_alone(model, 80, 40, new_tokens=8)



@pytest.mark.parametrize("policy", ["pyramid", "capacity"])
@pytest.mark.parametrize("chunk", [32, 48, 80])
def test_a_chunked_prefill_under_layer_budgets_keeps_the_whole_total(policy, chunk):
    """Under ``pyramid``/``capacity`` a layer whose share at the last cut exceeds what it holds plus the last
    chunk passes the surplus to the other layers (per-layer caps in :func:`jacap_attn.math.budget.distribute`),
    so the chunked prefill keeps the one-shot total: it ended 12-30 entries under it (810 of 840 here)."""
    from jacap_attn.math import budget
    n, ratio = 200, 0.7
    model = jacap_attn.patch(tiny_model(), ratio=ratio, budget=policy, chunk_size=chunk, min_tokens=1)
    cache = jacap_attn.compress(model, random_ids(1, n, seed=0))
    counts = torch.stack([layer.kept_counts().cpu() for layer in cache.layers])  # [L, 1, h]
    per_head = int(budget.layer_budget(torch.tensor([n]), ratio, cache.config.window)[0])
    assert int(counts.sum()) == per_head * counts.shape[0] * counts.shape[-1]


def test_layer_budgets_pass_a_capped_layers_surplus_on():
    """``distribute`` with a cap per layer: the capped layer's surplus goes to the others, the total kept."""
    from jacap_attn.math.budget import distribute
    got = distribute(torch.tensor([30]), torch.tensor([[4.0, 1.0, 1.0]]), torch.tensor([2]), torch.tensor([[10, 40, 40]]))
    assert got.tolist() == [[10, 10, 10]]
    assert distribute(torch.tensor([30]), torch.tensor([[4.0, 1.0, 1.0]]), torch.tensor([2]), torch.tensor([40])).tolist() \
        == [[18, 6, 6]]
