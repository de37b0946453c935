"""``global_score="output"`` (docs/method.md#global-budget): the global policy's attention weighted by how
much each entry writes through each query head's output projection ``W_O`` (CriticalKV's factor), scaled
to mean 1 per layer and row; reaches every route that cuts under the global policy."""

from __future__ import annotations

import pytest
import torch

import jacap_attn
from jacap_attn.math import baseline_scores
from jacap_attn.selection import global_budget
from conftest import FAMILIES, random_ids, tiny_model
from test_robustness import left_pad


def _scaled(model, layer: int, kv_head: int, factor: float):
    """``model`` with the output columns of KV head ``kv_head``'s query heads in ``layer`` times ``factor``."""
    attention = model.model.layers[layer].self_attn
    d, group = attention.head_dim, model.config.num_attention_heads // model.config.num_key_value_heads
    with torch.no_grad():
        attention.o_proj.weight[:, kv_head * group * d:(kv_head + 1) * group * d] *= factor
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_grams_give_each_query_heads_output_norm(family):
    """``sqrt(v^T G_j v)`` is ``||o_proj(x)||`` for ``x`` holding ``v`` in query head ``j``'s slot and
    zeros elsewhere (no bias), for every family's adapter and GQA layout."""
    model = jacap_attn.patch(tiny_model(family), ratio=0.3, global_score="output")
    grams = model._jacap_state.grams()
    cfg = model.config
    attention = model._jacap_state.adapter.attention_modules(model)[0]
    d, hq, h = attention.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    assert len(grams) == cfg.num_hidden_layers and grams[0].shape == (h, hq // h, d, d)
    v = torch.randn(d)
    for j in range(hq):
        x = torch.zeros(hq * d)
        x[j * d:(j + 1) * d] = v
        want = torch.linalg.vector_norm(attention.o_proj.weight @ x)
        got = (v @ grams[0][j // (hq // h), j % (hq // h)] @ v).sqrt()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_gains_have_mean_one_per_row_and_ignore_padding():
    gen = torch.Generator().manual_seed(0)
    gram = torch.randn(2, 3, 8, 8, generator=gen)
    gram = gram @ gram.transpose(-1, -2)
    values = torch.randn(2, 2, 10, 8, generator=gen)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, :4] = False  # the second row left-padded by 4
    gains = global_budget.output_gains(values, valid, gram)
    assert gains.shape == (2, 2, 3, 10) and bool((gains[1, :, :, :4] == 0).all())
    for row in range(2):
        n = int(valid[row].sum())
        torch.testing.assert_close(gains[row].sum() / (2 * 3 * n), torch.tensor(1.0))
    alone = global_budget.output_gains(values[1:, :, 4:], valid[1:, 4:], gram)
    torch.testing.assert_close(gains[1:, :, :, 4:], alone)
    with pytest.raises(ValueError, match="does not fit"):
        global_budget.output_gains(values, valid, gram[:1])


def test_equal_gains_rank_the_plain_attention_and_unequal_ones_move_it():
    probs = torch.softmax(torch.randn(1, 2, 3, 4, 12), dim=-1)
    torch.testing.assert_close(global_budget.weighted_peak(probs, torch.ones(1, 2, 3, 12)),
                               baseline_scores.max_attention(probs))
    gains = torch.ones(1, 2, 3, 12)
    gains[0, 1] = 5.0
    torch.testing.assert_close(global_budget.weighted_peak(probs, gains)[0, 1], 5 * probs[0, 1].amax(dim=(0, 1)))


def _counts(model, ids, **options):
    jacap_attn.patch(model, ratio=0.2, window=8, budget="global", compile=False, **options)
    with torch.no_grad():
        return torch.stack(jacap_attn.compress(model, ids).prompt_kept)  # [L, b, h]


@pytest.mark.parametrize("route", [{}, {"queries": "repeat", "repeat_ids": [5, 6, 7]}, {"chunk_size": 48},
                                   {"lookahead": 2, "lookahead_share": 1.0}])
def test_a_head_that_writes_more_gets_more_budget(route):
    """Scaling up the output columns of one KV head's query heads (the layer's other heads unchanged)
    moves budget to that head under ``"output"`` and not under ``"attention"``, whose ranking does not
    read ``W_O``; the row total stays the uniform one. For the window, repeat-pass and chunked routes."""
    model = _scaled(tiny_model("llama"), layer=1, kv_head=0, factor=20.0)
    ids = random_ids(1, 160)
    plain = _counts(model, ids, global_score="attention", **route)
    output = _counts(model, ids, global_score="output", **route)
    assert int(output.sum()) == int(plain.sum())
    assert int(output[1, 0, 0]) > int(plain[1, 0, 0]), (output[1].tolist(), plain[1].tolist())


def test_a_left_padded_row_keeps_what_it_keeps_alone():
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.25, window=8, budget="global", global_score="output",
                             compile=False)
    samples = [random_ids(1, n, seed=n)[0] for n in (90, 61)]
    ids, mask = left_pad(samples)
    batch = jacap_attn.compress(model, ids, mask)
    for row, sample in enumerate(samples):
        alone = jacap_attn.compress(model, sample[None])
        assert [k[row].tolist() for k in batch.prompt_kept] == [k[0].tolist() for k in alone.prompt_kept]


def test_a_saved_cache_reads_the_grams_again_and_question_time_cuts_use_them(tmp_path):
    """The option round-trips through a saved file, and a document stored whole and reselected under the
    global policy (``reselect_budget="global"``) keeps other per-head counts with it than without."""
    model = _scaled(tiny_model("llama"), layer=1, kv_head=0, factor=20.0)
    ids, question = random_ids(1, 140), random_ids(1, 12, seed=9)
    held = {}
    for score in ("attention", "output"):
        jacap_attn.patch(model, ratio=1.0, reselect=0.2, reselect_budget="global", window=8, global_score=score,
                         compile=False)
        cache = jacap_attn.compress(model, ids)
        jacap_attn.save_cache(cache, tmp_path / f"{score}.safetensors", model=model, prompt_ids=ids)
        loaded = jacap_attn.load_cache(tmp_path / f"{score}.safetensors", model)
        assert loaded.config.global_score == score
        with torch.no_grad():
            model(input_ids=question, cache=loaded, use_cache=True)
        held[score] = loaded.layers[1].kept_counts()[0]
    assert int(held["output"][0]) > int(held["attention"][0]), held


def test_inspect_names_the_settings_that_differ_from_the_defaults(tmp_path, capsys):
    from jacap_attn import cli

    model = jacap_attn.patch(tiny_model("llama"), ratio=0.2, window=8, global_score="output", consensus=0.25)
    ids = random_ids(1, 90)
    jacap_attn.save_cache(jacap_attn.compress(model, ids), tmp_path / "doc.safetensors", model=model, prompt_ids=ids)
    assert cli.main(["inspect", str(tmp_path / "doc.safetensors")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  options :"))
    assert "global_score='output'" in line and "consensus=0.25" in line and "head_floor" not in line


def test_grams_only_where_a_global_cut_reads_them_and_fresh_after_each_patch():
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.2, budget="uniform", global_score="output")
    assert jacap_attn.JacapCache(model).output_grams is None  # nothing ranks across heads
    jacap_attn.patch(model, ratio=0.2, budget="uniform", reselect=0.1, reselect_budget="global", global_score="output")
    before = jacap_attn.JacapCache(model).output_grams[1].clone()
    _scaled(model, layer=1, kv_head=0, factor=2.0)
    jacap_attn.patch(model, ratio=0.2, global_score="output")  # patched again: the weights as they are now
    after = jacap_attn.JacapCache(model).output_grams[1]
    torch.testing.assert_close(after[0], 4 * before[0])
    torch.testing.assert_close(after[1], before[1])
