"""User-reported faults (issue "Bugs users hit"), one test (or a few) per input; each docstring names
its kind:

1. compression silently off on all-sliding checkpoints (Mistral, Phi3 with ``sliding_window`` set);
2. a short chat prompt degenerates.
"""

from __future__ import annotations

import math

import pytest
import torch

import jacap_attn
from jacap_attn.config import JacapConfig
from conftest import DECODE_ATOL, DECODE_RTOL, random_ids, tiny_model
from test_core import kept_masks, reference_logits

GREEDY = dict(do_sample=False)


def kept_counts(cache) -> list[float]:
    """Per layer, the entries kept per KV head of row 0, averaged over the heads (Ada-KV's differ)."""
    return [float(layer.valid[0].sum(-1).double().mean()) for layer in cache.layers]


def kept_positions(layer, row: int = 0) -> list[list[int]]:
    return [sorted(layer.positions[row, h][layer.valid[row, h]].tolist()) for h in range(layer.valid.shape[1])]


# -- kind 1: compression silently off on all-sliding checkpoints ------------------------------------

@pytest.mark.parametrize("family,sliding_window", [("mistral", 4096), ("phi3", 2047)])
def test_all_sliding_checkpoint_is_compressed(family, sliding_window):
    """Kind 1 (compression silently off on all-sliding checkpoints): Mistral-7B-v0.1 ships
    sliding_window=4096, Phi-3-mini-4k 2047; every layer counted as sliding and kept 500 of 500
    entries at ratio 0.1. Now each layer keeps ceil(0.1 * 500) = 50, as a full-attention model does."""
    model = jacap_attn.patch(tiny_model(family, sliding_window=sliding_window), ratio=0.1, budget="uniform")
    cache = jacap_attn.compress(model, random_ids(1, 500))
    assert all(layer.is_sliding for layer in cache.layers)
    assert kept_counts(cache) == [50] * 3
    llama = jacap_attn.compress(jacap_attn.patch(tiny_model("llama"), ratio=0.1, budget="uniform"), random_ids(1, 500))
    assert kept_counts(cache) == kept_counts(llama)


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_small_sliding_window_budget_is_ratio_within_the_window(family):
    """Kind 1 (compression silently off on all-sliding checkpoints): with sliding_window=64 every
    layer kept its last 63 tokens at ratio 0.1 and 0.5 alike. Now the budget ceil(ratio * n) applies
    within the window: 50 at 0.1, and at 0.5 the 63 tokens the window can use (never more); every
    kept token lies within the window, whose older tokens no later query can attend."""
    n = 500
    for ratio, want in ((0.1, 50), (0.5, 63), (0.05, 32)):  # 0.05: 25, below the observation window
        model = jacap_attn.patch(tiny_model(family, sliding_window=64), ratio=ratio, budget="uniform")
        cache = jacap_attn.compress(model, random_ids(1, n))
        assert kept_counts(cache) == [want] * 3, ratio
        for layer in cache.layers:
            for head in kept_positions(layer):
                assert head[0] >= n - 63 and head[-32:] == list(range(n - 32, n))


@pytest.mark.parametrize("family", ["mistral", "phi3"])
@pytest.mark.parametrize("method", ["jacap", "snapkv", "adakv", "h2o", "streaming_llm"])
def test_all_sliding_continuation_matches_masked_reference(family, method):
    """Kind 1 (compression silently off on all-sliding checkpoints): the compressed sliding layers
    decode correctly: a 24-token continuation (long enough for kept tokens to slide out of the
    window) equals the full model with its sliding mask and exactly the evicted entries masked out,
    at the right RoPE positions."""
    prompt, cont = 150, 24
    model = tiny_model(family, sliding_window=64)
    ids = random_ids(1, prompt + cont)
    jacap_attn.patch(model, ratio=0.2, method=method, window=8)
    with torch.no_grad():
        cache = model(ids[:, :prompt]).cache
        assert sum(kept_counts(cache)) == 3 * 30  # per layer and KV head under uniform budgets, in total under global
        kept = kept_masks(cache, prompt)
        got = model(ids[:, prompt:], cache=cache).logits
    jacap_attn.unpatch(model)
    want = reference_logits(model, ids, kept, prompt)[:, prompt:]
    torch.testing.assert_close(got, want, atol=DECODE_ATOL, rtol=DECODE_RTOL)


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_all_sliding_ratio_one_is_unchanged(family):
    """Kind 1 (compression silently off on all-sliding checkpoints): at ratio=1 a prompt longer than
    the window still generates the stock model's tokens (the sliding layers keep their window)."""
    model = tiny_model(family, sliding_window=32)
    ids = random_ids(1, 120)
    expected = model.generate(ids, max_new_tokens=12, min_new_tokens=12, **GREEDY)
    jacap_attn.patch(model, ratio=1.0)
    assert torch.equal(model.generate(ids, max_new_tokens=12, min_new_tokens=12, **GREEDY), expected)


def test_all_sliding_padded_batch_rows_equal_alone():
    """Kind 1 (compression silently off on all-sliding checkpoints): in a left-padded batch each
    row of an all-sliding model keeps what it keeps alone and generates the same tokens."""
    model = jacap_attn.patch(tiny_model("mistral", sliding_window=64), ratio=0.2, window=8, budget="uniform")
    rows = [random_ids(1, 200, seed=3)[0], random_ids(1, 130, seed=4)[0]]
    ids = torch.zeros(2, 200, dtype=torch.long)
    mask = torch.zeros(2, 200, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 200 - len(row):], mask[i, 200 - len(row):] = row, 1
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, pad_token_id=0,
                           return_dict_in_generate=True, **GREEDY)
    for i, (row, budget) in enumerate(zip(rows, (40, 26))):  # ceil(0.2 * n), within the 63-token window
        alone = model.generate(row[None], max_new_tokens=6, min_new_tokens=6, return_dict_in_generate=True, **GREEDY)
        assert [k.tolist() for k in alone.cache.prompt_kept] == [[[budget] * 2]] * 3
        assert torch.equal(batch.sequences[i, -6:], alone.sequences[0, -6:])
        for a, b in zip(batch.cache.layers, alone.cache.layers):
            assert kept_positions(a, i) == kept_positions(b, 0)


def _gemma(ratio, **options):
    return jacap_attn.patch(tiny_model("gemma3_text"), ratio=ratio, window=8, **options)


def test_mixed_model_sliding_policies():
    """Kind 1 (compression silently off on all-sliding checkpoints), the mixed-model policy: Gemma3
    sliding layers keep their last sliding_window - 1 tokens unscored under sliding="window" (the
    default: see docs/usage.md, "Sliding-window layers") whatever the ratio; under sliding="compress"
    the method selects ceil(ratio * min(n, sliding_window - 1)) of them (at least the observation
    window). The full-attention layer keeps ceil(ratio * n) either way."""
    n, sw = 200, 24
    for ratio in (0.5, 0.1):
        window = jacap_attn.compress(_gemma(ratio, sliding="window"), random_ids(1, n))
        compress = jacap_attn.compress(_gemma(ratio, sliding="compress"), random_ids(1, n))
        full = max(math.ceil(ratio * n), 8)
        assert kept_counts(window) == [sw - 1, full, sw - 1]
        assert kept_counts(compress) == [max(math.ceil(ratio * (sw - 1)), 8), full, max(math.ceil(ratio * (sw - 1)), 8)]
        for layer in compress.layers:
            for head in kept_positions(layer):
                assert head[-8:] == list(range(n - 8, n))
                if layer.is_sliding:
                    assert head[0] >= n - (sw - 1)
    assert JacapConfig().sliding == "window"


@pytest.mark.parametrize("sliding", ["window", "compress"])
def test_mixed_model_continuation_matches_masked_reference(sliding):
    """Kind 1 (compression silently off on all-sliding checkpoints): both sliding policies decode
    as the full Gemma3 model with its masks and exactly the evicted entries hidden."""
    prompt, cont = 120, 30
    model = _gemma(0.5, sliding=sliding)
    ids = random_ids(1, prompt + cont)
    with torch.no_grad():
        cache = model(ids[:, :prompt]).cache
        kept = kept_masks(cache, prompt)
        got = model(ids[:, prompt:], cache=cache).logits
    jacap_attn.unpatch(model)
    want = reference_logits(model, ids, kept, prompt)[:, prompt:]
    torch.testing.assert_close(got, want, atol=DECODE_ATOL, rtol=DECODE_RTOL)


def test_sliding_option_is_validated_and_saved():
    """Kind 1 (compression silently off on all-sliding checkpoints): `sliding` is a shared option,
    validated with an error naming it; to_dict/from_dict carry it, and a saved configuration without
    it (files written before it existed) gets the default."""
    with pytest.raises(ValueError, match=r"sliding must be one of window, compress; got sliding='all'"):
        jacap_attn.patch(tiny_model("gemma3_text"), ratio=0.1, sliding="all")
    with pytest.raises(ValueError, match="sliding"):
        JacapConfig(sliding=None)
    with pytest.raises(ValueError, match="does not apply to method='full'"):
        JacapConfig.from_options(method="full", sliding="compress")
    for method in ("jacap", "snapkv", "streaming_llm", "random"):
        config = JacapConfig.from_options(ratio=0.1, method=method, sliding="compress")
        assert JacapConfig.from_dict(config.to_dict()) == config
    old = JacapConfig().to_dict()
    del old["sliding"]
    assert JacapConfig.from_dict(old).sliding == JacapConfig().sliding


def test_quality_harness_row_with_sliding_option():
    """Kind 1 (compression silently off on all-sliding checkpoints): the quality harness's ad-hoc row
    `jacap[sliding=compress]` is its own row (its own result-cache key), not the default's."""
    from eval.quality import _resolved, variant

    method, options = variant("jacap[sliding=compress]")
    assert (method, options) == ("jacap", {"sliding": "compress"})
    assert _resolved(method, options, 0.1) != _resolved("jacap", {}, 0.1)
    assert _resolved("jacap", {"sliding": "window"}, 0.1) == _resolved("jacap", {}, 0.1)
    with pytest.raises(ValueError, match="sliding"):
        variant("jacap[sliding=everything]")


# -- kind 2: a short chat prompt degenerates --------------------------------------------------------

BOS, EOS = 1, 2  # the tiny Llama's generation_config bos / eos ids (random_ids draws from 3 up)


def chat_like(lengths=(20, 10, 20), seed=5) -> torch.Tensor:
    """``[1, n]`` ids shaped like a chat template: each turn ``BOS content EOS``, the last one open
    (the assistant's), as SmolLM2's ``<|im_start|> ... <|im_end|>``."""
    ids = []
    for i, length in enumerate(lengths):
        ids += [BOS] + random_ids(1, length, seed=seed + i)[0].tolist()
        if i < len(lengths) - 1:
            ids.append(EOS)
    return torch.tensor([ids])


def special_positions(ids: torch.Tensor) -> list[int]:
    return [i for i, t in enumerate(ids[0].tolist()) if t in (BOS, EOS)]


@pytest.mark.slow
@pytest.mark.parametrize("ratio", [0.5, 0.1])
def test_short_chat_prompt_answers_as_the_full_cache(ratio):
    """Kind 2 (a short chat prompt degenerates): SmolLM2-135M-Instruct, the user's 33-token chat
    prompt (geography system turn, "What is the largest ocean on Earth?"), greedy, 40 new tokens.
    At ratio 0.5 its budget was the 32-token window: <|im_start|> (position 0, the attention sink)
    was evicted and the answer looped "The largest ocean on Earth is the largest ocean on Earth
    is ...". Now the short prompt keeps its role markers and answers as the full cache does."""
    from jacap_attn.models import load_model

    model, tok = load_model("smollm2")
    messages = [{"role": "system", "content": "You are a helpful assistant created to answer geography questions."},
                {"role": "user", "content": "What is the largest ocean on Earth?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    expected = model.generate(ids, max_new_tokens=40, **GREEDY)
    assert tok.decode(expected[0, ids.shape[1]:]).startswith("The largest ocean on Earth is the Pacific Ocean")
    jacap_attn.patch(model, ratio=ratio)
    out = model.generate(ids, max_new_tokens=40, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, expected), tok.decode(out.sequences[0, ids.shape[1]:])
    # 33 tokens: the 32-token window plus <|im_start|> at position 0, the one token before it
    assert ids.shape[1] == 33 and tok.convert_ids_to_tokens(ids[0, :1].tolist()) == ["<|im_start|>"]
    assert all(k.tolist() == [[33] * model.config.num_key_value_heads] for k in out.cache.prompt_kept)


def test_short_prompt_keeps_the_special_tokens():
    """Kind 2 (a short chat prompt degenerates): a 55-token chat-shaped prompt at ratio 0.5 has the
    32-token window as its budget (ceil(27.5) <= 32); the first turn's BOS (the attention sink) and
    the markers around the second turn's start were evicted. Now every layer and head keeps the window plus the special tokens before it, and the
    continuation equals the full model with exactly the evicted entries masked out."""
    ids = chat_like()
    n = ids.shape[1]
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.5)
    specials = special_positions(ids)
    outside = [p for p in specials if p < n - 32]
    assert outside == [0, 21, 22] and n == 55
    with torch.no_grad():
        cache = model(ids).cache
    for layer in cache.layers:
        assert kept_positions(layer) == [sorted(outside + list(range(n - 32, n)))] * 2
    cont = random_ids(1, 6, seed=11)
    full = torch.cat([ids, cont], 1)
    with torch.no_grad():
        cache = model(ids).cache
        kept = kept_masks(cache, n)
        got = model(cont, cache=cache).logits
    jacap_attn.unpatch(model)
    torch.testing.assert_close(got, reference_logits(model, full, kept, n)[:, n:], atol=DECODE_ATOL, rtol=DECODE_RTOL)


@pytest.mark.parametrize("method", ["jacap", "snapkv", "adakv", "streaming_llm", "random"])
def test_special_tokens_kept_only_in_short_prompts(method):
    """Kind 2 (a short chat prompt degenerates): the rule acts on rows whose budget is the window
    floor (ceil(ratio * n) <= window), for every method; a longer prompt keeps exactly its budget;
    keep_special=False keeps the window alone."""
    ids = chat_like()
    short = jacap_attn.compress(jacap_attn.patch(tiny_model("llama"), ratio=0.5, method=method), ids)
    assert all(set(head) >= set(special_positions(ids)) for layer in short.layers for head in kept_positions(layer))
    assert kept_counts(short) == [35.0] * 3
    off = jacap_attn.compress(jacap_attn.patch(tiny_model("llama"), ratio=0.5, method=method, keep_special=False), ids)
    assert kept_counts(off) == [32.0] * 3
    long = chat_like((30, 25, 60))  # 120 tokens: ceil(0.5 * 120) = 60 > 32
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.5, method=method)
    assert sum(kept_counts(jacap_attn.compress(model, long))) == 3 * 60.0  # per layer, or in total (global)


def test_special_ids_come_from_the_generation_config():
    """Kind 2 (a short chat prompt degenerates): bos / eos / pad ids of the generation config and the
    model config, lists included (Llama 3 and Gemma 3 ship several eos ids)."""
    from jacap_attn.selection import special_token_ids

    model = tiny_model("llama")
    assert special_token_ids(model) == [BOS, EOS]
    model.generation_config.eos_token_id = [EOS, 7]
    model.generation_config.pad_token_id = 9
    assert special_token_ids(model) == [BOS, EOS, 7, 9]
    ids = chat_like()
    ids[0, 3], ids[0, 4] = 7, 9
    cache = jacap_attn.compress(jacap_attn.patch(model, ratio=0.5), ids)
    for layer in cache.layers:
        assert {0, 3, 4, 21, 22} <= set(kept_positions(layer)[0])


def _left_pad(rows):
    n = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, n - len(row):], mask[i, n - len(row):] = row, 1
    return ids, mask


@pytest.mark.parametrize("options", [{}, {"min_tokens": 60}, {"keep_special": False, "min_tokens": 60}])
def test_padded_batch_rows_get_what_they_get_alone(options):
    """Kind 2 (a short chat prompt degenerates): in a left-padded batch, a short chat row (55 tokens:
    its special tokens kept; with min_tokens=60, everything) next to a long one (200 tokens,
    compressed to its budget) keeps and generates what it does alone."""
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.2, **options)
    rows = [chat_like()[0], random_ids(1, 200, seed=8)[0]]
    ids, mask = _left_pad(rows)
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, pad_token_id=0,
                           return_dict_in_generate=True, **GREEDY)
    for i, row in enumerate(rows):
        alone = model.generate(row[None], max_new_tokens=5, min_new_tokens=5, return_dict_in_generate=True, **GREEDY)
        assert torch.equal(batch.sequences[i, -5:], alone.sequences[0, -5:])
        for a, b in zip(batch.cache.layers, alone.cache.layers):
            assert kept_positions(a, i) == kept_positions(b, 0)
    short = [len(set(p for h in kept_positions(layer, 0) for p in h if p < 55)) for layer in batch.cache.layers]
    assert short == [55 if "min_tokens" in options else 35] * 3


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_min_tokens_row_keeps_everything_and_equals_unpatched(family):
    """Kind 2 (a short chat prompt degenerates): a prompt shorter than min_tokens keeps every entry
    (every one its layer can attend: a sliding layer its window) and generates the unpatched
    model's tokens; one as long as min_tokens is compressed."""
    extra = {"sliding_window": 64} if family == "mistral" else {}
    model = tiny_model(family, **extra)
    ids = random_ids(1, 100, seed=4)
    expected = model.generate(ids, max_new_tokens=8, min_new_tokens=8, **GREEDY)
    jacap_attn.patch(model, ratio=0.1, min_tokens=101)
    out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, expected)
    assert [int(k.max()) for k in out.cache.prompt_kept] == [63 if extra else 100] * 3
    jacap_attn.patch(model, ratio=0.1, min_tokens=100)
    assert kept_counts(jacap_attn.compress(model, ids)) == [32.0] * 3


def test_short_prompt_options_are_validated_and_saved():
    """Kind 2 (a short chat prompt degenerates): keep_special and min_tokens are shared options,
    validated with errors naming them, carried by to_dict/from_dict; a saved configuration without
    them (written before they existed) gets the defaults."""
    with pytest.raises(ValueError, match=r"min_tokens must be an integer in \[0, "):
        jacap_attn.patch(tiny_model("llama"), ratio=0.1, min_tokens=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        JacapConfig(min_tokens=1.5)
    with pytest.raises(ValueError, match="keep_special must be True or False, got keep_special='yes'"):
        JacapConfig(keep_special="yes")
    config = JacapConfig.from_options(ratio=0.2, method="snapkv", keep_special=False, min_tokens=64)
    assert JacapConfig.from_dict(config.to_dict()) == config
    old = JacapConfig().to_dict()
    del old["keep_special"], old["min_tokens"]
    assert JacapConfig.from_dict(old) == JacapConfig()
    assert (JacapConfig().keep_special, JacapConfig().min_tokens) == (True, 0)


@pytest.mark.parametrize("reselect", [False, True])
def test_a_head_budget_method_keeps_a_short_padded_row_whole(reselect):
    """A method with per-head budgets (Ada-KV) keeps a row shorter than ``min_tokens`` whole in a left-padded
    batch, as alone: its hook once overwrote the short row's keep-everything budgets (a 100-token row kept 32
    per head beside a 300-token one, 100 alone), at prefill and when a question reselects a stored document."""
    model = tiny_model("llama")
    rows = [random_ids(1, 300, seed=3)[0], random_ids(1, 100, seed=4)[0]]
    ids, mask = _left_pad(rows)
    options = {"ratio": 1.0, "reselect": 0.2} if reselect else {"ratio": 0.2}
    jacap_attn.patch(model, method="adakv", min_tokens=256, **options)

    def held(cache, row, prompt):
        if reselect:
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
        return [layer.kept_counts()[row].tolist() for layer in cache.layers]

    question = random_ids(2, 8, seed=5)
    batch = held(jacap_attn.compress(model, ids, mask), 1, question)
    alone = held(jacap_attn.compress(model, rows[1][None]), 0, question[1:])
    assert batch == alone
    heads = model.config.num_key_value_heads
    assert batch == [[100 + 8 * reselect] * heads] * model.config.num_hidden_layers
    assert max(map(max, held(jacap_attn.compress(model, ids, mask), 0, question))) < 300  # the long row is cut


@pytest.mark.parametrize("family, options", [("mistral", {"sliding_window": 64}),
                                             ("gemma3_text", {"sliding": "compress", "ratio": 0.99})])
def test_chunk_cuts_drop_a_sliding_layers_entries_out_of_reach(family, options):
    """A chunk cut (and a new turn under ``chunk_size``) whose budget reached a sliding layer's window kept the layer
    as it was, entries beyond the window included: an all-sliding model at ratio 0.5 held 271 entries per layer
    after chunks of 64 (one-shot: 63, a stock sliding cache 63); Gemma's sliding layers under ``sliding="compress"``
    held 120 at ratio 0.99. The out-of-window entries are masked anyway: the answers were right, the memory not."""
    overrides = {k: v for k, v in options.items() if k == "sliding_window"}
    patch_options = {"ratio": 0.5, **{k: v for k, v in options.items() if k != "sliding_window"}}
    model = tiny_model(family, max_position_embeddings=2048, **overrides)
    jacap_attn.patch(model, **patch_options)
    ids = random_ids(1, 400)
    one_shot = [int(layer.kept_counts().max()) for layer in jacap_attn.compress(model, ids).layers]
    cache = jacap_attn.compress(model, ids, chunk_size=64)
    sliding = [layer for layer in cache.layers if layer.is_sliding]
    assert sliding and all(int(layer.kept_counts().max()) <= layer.sliding_window - 1 for layer in sliding)
    assert [int(layer.kept_counts().max()) for layer in cache.layers if layer.is_sliding] == \
        [k for k, layer in zip(one_shot, cache.layers) if layer.is_sliding]
    model(input_ids=random_ids(1, 30, seed=9), past_key_values=cache, use_cache=True)  # a new turn: cut again
    assert all(int(layer.kept_counts().max()) <= layer.sliding_window - 1 for layer in cache.layers if layer.is_sliding)


def test_a_head_budget_method_on_an_all_sliding_model_beyond_its_window():
    """Ada-KV on an all-sliding model whose budget ``ceil(ratio * n)`` exceeds the window (Mistral-7B at 25% past
    16k tokens) raised "head_budgets must be ... summing to h * budget": each head was capped at its reach, the
    layer's budget was not. It now keeps the window, as the other methods."""
    model = tiny_model("mistral", sliding_window=64, max_position_embeddings=2048)
    jacap_attn.patch(model, ratio=0.25, method="adakv")
    out = model.generate(random_ids(1, 400), max_new_tokens=4, min_new_tokens=4, return_dict_in_generate=True, **GREEDY)
    assert [int(k.max()) for k in out.cache.prompt_kept] == [63] * model.config.num_hidden_layers


def test_the_repeat_pass_keeps_a_padded_rows_sliding_window():
    """``queries="repeat"`` on a mixed model: the replay laid a padded row's padding inside its chunk, and the
    sliding-window mask counts slots, so the row's replayed tokens saw fewer of its own (9 keys instead of 24):
    its full-attention layers then kept another set than alone. The padding now follows the replay."""
    model = tiny_model("gemma3_text", max_position_embeddings=2048)
    jacap_attn.patch(model, ratio=0.25, method="snapkv", queries="repeat", repeat_ids=(5, 6, 7))
    ids = random_ids(2, 400)
    mask = torch.ones_like(ids)
    mask[1, :60] = 0
    batch, alone = jacap_attn.compress(model, ids, mask), jacap_attn.compress(model, ids[1:, 60:])
    for a, b in zip(batch.layers, alone.layers):
        assert kept_positions(a, 1) == kept_positions(b, 0)
