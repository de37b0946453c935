"""The cache path end to end on tiny models of every family: exactness, positions, budgets, memory."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import transformers
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

import jacap_attn
from jacap_attn.math import budget as budgets
from jacap_attn.storage.cache import JacapCache
from conftest import DECODE_ATOL, DECODE_RTOL, random_ids, tiny_model

PROMPT, CONT = 90, 7


def kept_masks(cache: JacapCache, n: int) -> list[torch.Tensor]:
    """Per layer, ``[b, h, n]`` bool: which prompt positions the compressed cache still holds."""
    out = []
    for layer in cache.layers:
        b, h, _ = layer.valid.shape
        mask = torch.zeros(b, h, n + 1, dtype=torch.bool)
        pos = torch.where(layer.valid[..., : int(layer.write_pos)], layer.positions[..., : int(layer.write_pos)], n)
        mask.scatter_(2, pos.clamp(max=n), True)
        out.append(mask[..., :n])
    return out


def reference_logits(model, ids: torch.Tensor, kept: list[torch.Tensor], n: int) -> torch.Tensor:
    """Unpatched model on the full sequence, with an explicit per-(layer, KV head) mask that hides
    exactly the evicted prompt entries from the rows after the prompt."""
    windows = jacap_attn.patches.get_adapter(model.config.model_type).sliding_windows(model.config)
    total = ids.shape[1]

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        layer = module.layer_idx
        b, hq, q, d = query.shape
        h = key.shape[1]
        rows = torch.arange(total)[:, None]
        cols = torch.arange(total)[None, :]
        allowed = (cols <= rows)[None, None].expand(b, h, total, total).clone()
        if windows[layer] is not None:
            allowed &= (rows - cols < windows[layer])[None, None]
        hidden = torch.zeros(b, h, total, total, dtype=torch.bool)
        hidden[:, :, n:, :n] = ~kept[layer][:, :, None, :]
        allowed &= ~hidden
        allowed = allowed.repeat_interleave(hq // h, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(hq // h, 1), value.repeat_interleave(hq // h, 1), attn_mask=allowed, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("jacap_test_reference", attention)
    AttentionMaskInterface.register("jacap_test_reference", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    original = model.config._attn_implementation
    model.set_attn_implementation("jacap_test_reference")
    try:
        with torch.no_grad():
            return model(ids, use_cache=False).logits
    finally:
        model.set_attn_implementation(original)


def test_ratio_one_generate_is_unchanged(family):
    model = tiny_model(family)
    ids = random_ids(1, 60)
    with torch.no_grad():
        logits_ref = model(ids).logits
    expected = model.generate(ids, max_new_tokens=12, do_sample=False)
    jacap_attn.patch(model, ratio=1.0)
    with torch.no_grad():
        out = model(ids)
    assert isinstance(out.cache, JacapCache)
    torch.testing.assert_close(out.logits, logits_ref, rtol=0, atol=0)  # prefill runs the stock math
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), expected)


def test_ratio_one_padded_batch_is_unchanged(family):
    model = tiny_model(family)
    ids = random_ids(2, 40)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    jacap_attn.patch(model, ratio=1.0)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0), expected)


@pytest.mark.parametrize("method,budget", [("jacap", "uniform"), ("jacap", "pyramid"), ("jacap", "capacity"),
                                           ("jacap", "global"), ("snapkv", "uniform"), ("snapkv", "global"),
                                           ("adakv", "uniform")])
def test_compressed_continuation_matches_masked_reference(family, method, budget):
    """The exactness test of the whole cache path: a multi-token continuation over the compressed
    cache gives the logits of the full model with exactly the evicted entries masked out."""
    model = tiny_model(family)
    ids = random_ids(1, PROMPT + CONT)
    jacap_attn.patch(model, ratio=0.25, method=method, window=8, budget=budget)
    with torch.no_grad():
        cache = model(ids[:, :PROMPT]).cache
        kept = kept_masks(cache, PROMPT)
        got = model(ids[:, PROMPT:], cache=cache).logits
    jacap_attn.unpatch(model)
    assert any(not bool(k.all()) for k in kept), "nothing was evicted"
    want = reference_logits(model, ids, kept, PROMPT)[:, PROMPT:]
    torch.testing.assert_close(got, want, atol=DECODE_ATOL, rtol=DECODE_RTOL)


def test_decode_positions_are_logical():
    model = tiny_model("llama")
    ids = random_ids(1, 70)
    seen = []
    hook = model.model.rotary_emb.register_forward_hook(lambda m, args, kwargs, out: seen.append(kwargs.get("position_ids", args[1] if len(args) > 1 else None).clone()), with_kwargs=True)
    jacap_attn.patch(model, ratio=0.2, window=8)
    model.generate(ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    hook.remove()
    assert seen[0].tolist() == [list(range(70))]
    assert [p.tolist() for p in seen[1:]] == [[[70 + step]] for step in range(4)]
    with torch.no_grad():
        cache = model(ids).cache
        assert cache.get_seq_length() == 70
        model(ids[:, :3], cache=cache)
        assert cache.get_seq_length() == 73
        assert cache.layers[0].positions[0, 0, int(cache.layers[0].write_pos) - 3:int(cache.layers[0].write_pos)].tolist() == [70, 71, 72]


def test_kept_counts_equal_budgets_and_storage_is_kv_heads():
    model = tiny_model("llama")
    ids = random_ids(1, 200)
    jacap_attn.patch(model, ratio=0.1, window=8, budget="uniform")
    with torch.no_grad():
        cache = model(ids).cache
    for layer in cache.layers:
        assert layer.keys.shape[:2] == (1, model.config.num_key_value_heads)
        assert layer.keys.shape[-1] == model.config.head_dim
        assert layer.valid.sum(-1).tolist() == [[20, 20]]
        # storage holds the kept entries plus free room, never the prompt length
        assert layer.keys.untyped_storage().nbytes() == layer.keys.numel() * layer.keys.element_size()
    full_bytes = 2 * 3 * 2 * 200 * 16 * 4
    assert cache.kept_bytes() * 10 == full_bytes


def test_memory_bounded_by_budget_plus_room_not_prompt():
    model = tiny_model("llama", max_position_embeddings=4096)
    jacap_attn.patch(model, ratio=0.05, window=8, budget="uniform")
    ids = random_ids(1, 2000)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    cache = out.cache
    per_slot = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head dim 16, float32
    capacity = cache.layers[0].capacity
    assert capacity == 104  # 100 kept + 4 new tokens: a bucket of the 1/8-octave series
    assert cache.kv_bytes() == 3 * capacity * per_slot
    assert cache.kv_bytes() < 3 * 2000 * per_slot / 7


def test_each_layer_sizes_its_own_capacity(tmp_path):
    """Layers that keep different counts do not pad to the largest one (docs/cache.md#capacity-buckets-and-growth):
    each layer's buffers hold ``bucket(its largest kept count + room)`` slots, after a prefill and
    after save/load alike."""
    model = tiny_model("gemma3_text")  # sliding layers keep their 23-token window, the full one 150
    jacap_attn.patch(model, ratio=0.5, window=8, reserve=4, budget="uniform")
    ids = random_ids(1, 300)
    cache = jacap_attn.compress(model, ids)
    assert [int(layer.write_pos) for layer in cache.layers] == [23, 150, 23]
    assert [layer.capacity for layer in cache.layers] == [64, 160, 64]
    assert [tuple(layer.keys.shape[:3]) for layer in cache.layers] == [(1, 2, 64), (1, 2, 160), (1, 2, 64)]
    jacap_attn.save_cache(cache, tmp_path / "c.safetensors", model=model, prompt_ids=ids)
    loaded = jacap_attn.load_cache(tmp_path / "c.safetensors", model)
    assert [layer.capacity for layer in loaded.layers] == [64, 160, 64]
    out = model.generate(torch.cat([ids, random_ids(1, 2, seed=3)], 1), cache=loaded, max_new_tokens=70,
                         min_new_tokens=70, do_sample=False)
    assert out.shape[1] == 372  # each layer grew on its own past its capacity


def test_capacity_buckets_are_geometric():
    sizes = range(1, 5000)
    got = [budgets.bucket(s) for s in sizes]
    assert all(b >= max(s, 64) and b <= max(s, 64) * 1.125 for s, b in zip(sizes, got))
    assert all(a <= b for a, b in zip(got, got[1:])) and all(budgets.bucket(b) == b for b in got)
    assert len(set(got)) < 70  # few distinct shapes: caches of similar size share compiled graphs


def test_window_kept_when_scores_tie():
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()  # uniform attention: every SnapKV score ties
    jacap_attn.patch(model, ratio=0.1, method="snapkv", window=16, pooling="none")
    with torch.no_grad():
        cache = model(random_ids(1, 300)).cache
    for layer in cache.layers:
        kept = set(layer.positions[0, 0][layer.valid[0, 0]].tolist())
        assert set(range(300 - 16, 300)) <= kept
        assert len(kept) == 30


def test_scores_are_float32_in_bf16_model():
    model = tiny_model("llama", dtype=torch.bfloat16)
    jacap_attn.patch(model, ratio=0.2, window=8)
    captured = []
    original = jacap_attn.selection.finalize_prefill

    def spy(cache):
        captured.extend(parts["scores"] for parts in cache.prefill.parts.values())
        return original(cache)

    jacap_attn.selection.finalize_prefill = spy
    try:
        with torch.no_grad():
            cache = model(random_ids(1, 80)).cache
    finally:
        jacap_attn.selection.finalize_prefill = original
    assert captured and all(s.dtype == torch.float32 for s in captured)
    assert cache.layers[0].keys.dtype == torch.bfloat16


def test_unpatch_restores_same_objects_and_outputs():
    model = tiny_model("llama")
    twin = tiny_model("llama")
    ids = random_ids(1, 50)
    before = [m.forward for m in (layer.self_attn for layer in model.model.layers)]
    impl = model.config._attn_implementation
    with torch.no_grad():
        logits = model(ids).logits
    jacap_attn.patch(model, ratio=0.2)
    assert twin.config._attn_implementation == impl and "forward" not in twin.model.layers[0].self_attn.__dict__
    jacap_attn.unpatch(model)
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)
    assert [layer.self_attn.forward.__func__ for layer in model.model.layers] == [f.__func__ for f in before]
    assert model.config._attn_implementation == impl
    assert "_prepare_cache_for_generation" not in model.__dict__
    assert not model.model._forward_hooks and not model.model._forward_pre_hooks
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, logits, rtol=0, atol=0)
    jacap_attn.unpatch(model)  # no-op


def test_unsupported_model_type_raises_listing_supported():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*llama.*qwen3"):
        jacap_attn.patch(model, ratio=0.1)
    assert not jacap_attn.is_patched(model)


def test_user_supplied_cache_and_multi_turn():
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.3, window=8)
    ids = random_ids(1, 80)
    cache = JacapCache(model)
    first = model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert cache.get_seq_length() == 80 + 5
    kept_after_first = cache.layers[0].valid.sum().item()
    second_turn = torch.cat([first, random_ids(1, 10, seed=5)], dim=1)
    out = model.generate(second_turn, cache=cache, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out.shape[1] == second_turn.shape[1] + 4
    # the continuation was appended uncompressed
    assert cache.layers[0].valid.sum().item() == kept_after_first + (second_turn.shape[1] - 85 + 3) * 2


def test_bad_inputs_to_patch_and_compress_are_clear_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="ForCausalLM"):
        jacap_attn.patch(None)
    with pytest.raises(ValueError, match="ForCausalLM"):
        jacap_attn.patch(model.model)
    jacap_attn.patch(model, ratio=0.2)
    ids = random_ids(1, 40)
    with pytest.raises(ValueError, match="integer tensor"):
        jacap_attn.compress(model, ids[0])
    with pytest.raises(ValueError, match="integer tensor"):
        jacap_attn.compress(model, ids.float())
    with pytest.raises(ValueError, match="integer tensor"):
        jacap_attn.compress(model, ids[:, :0])
    with pytest.raises(ValueError, match="attention_mask has shape"):
        jacap_attn.compress(model, ids, attention_mask=torch.ones(1, 39, dtype=torch.long))
    all_pad = torch.ones(2, 40, dtype=torch.long)
    all_pad[1] = 0
    # An all-padding row is named as such (padding_side would not fix it); right padding is told to pad left.
    with pytest.raises(ValueError, match=r"batch rows \[1\] of the prompt are all padding"):
        jacap_attn.compress(model, random_ids(2, 40), attention_mask=all_pad)
    right = torch.ones(2, 40, dtype=torch.long)
    right[1, -5:] = 0
    with pytest.raises(ValueError, match="padding_side = 'left'"):
        jacap_attn.compress(model, random_ids(2, 40), attention_mask=right)


def test_cache_from_a_model_of_another_shape_is_refused():
    small = jacap_attn.patch(tiny_model("llama", num_hidden_layers=2), ratio=0.2)
    big = jacap_attn.patch(tiny_model("llama"), ratio=0.2)
    ids = random_ids(1, 40)
    cache = jacap_attn.compress(small, ids)
    with pytest.raises(ValueError, match="built for a model with"):
        big.generate(torch.cat([ids, random_ids(1, 3)], 1), cache=cache, max_new_tokens=2)


def test_either_cache_keyword_works_on_every_transformers_version():
    """`cache=` (transformers >= 5.24) and `past_key_values=` (older, and deprecated later) both
    reach the same JacapCache: the model must never build a second cache of its own beside ours
    (on 5.17 `cache=` used to be forwarded next to a fresh DynamicCache, and decode crashed)."""
    model = tiny_model("llama")
    ids = random_ids(1, 60)
    jacap_attn.patch(model, ratio=0.25, window=8)
    prompt = jacap_attn.compress(model, ids[:, :-1])
    outs = {}
    for keyword in ("cache", "past_key_values"):
        cache = copy.deepcopy(prompt)
        with torch.no_grad():
            step = model(ids[:, -1:], **{keyword: copy.deepcopy(prompt)})
        assert isinstance(step.cache, JacapCache) and step.cache.get_seq_length() == 60
        outs[keyword] = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, **{keyword: cache})
        assert cache.get_seq_length() == 60 + 3  # the cache given was the one used
    assert torch.equal(outs["cache"], outs["past_key_values"])
    # Both given: `cache` wins, as transformers 5.24 decides (with a warning there).
    used, ignored = copy.deepcopy(prompt), copy.deepcopy(prompt)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model(ids[:, -1:], cache=used, past_key_values=ignored)
    assert (used.get_seq_length(), ignored.get_seq_length()) == (60, 59)


def test_reusing_an_extended_cache_for_a_shorter_input_is_refused():
    """After one `generate`, the cache also holds that answer: a second question of the same or
    shorter length would be fed on top of it and silently give garbage. It is refused instead."""
    model = tiny_model("llama")
    ids = random_ids(1, 60)
    jacap_attn.patch(model, ratio=0.25, window=8)
    cache = jacap_attn.compress(model, ids)
    fresh = copy.deepcopy(cache)
    model.generate(torch.cat([ids, random_ids(1, 3, seed=5)], 1), cache=cache, max_new_tokens=6,
                   min_new_tokens=6, do_sample=False)
    with pytest.raises(ValueError, match="copy.deepcopy"):
        model.generate(torch.cat([ids, random_ids(1, 4, seed=6)], 1), cache=cache, max_new_tokens=2)
    out = model.generate(torch.cat([ids, random_ids(1, 4, seed=6)], 1), cache=fresh, max_new_tokens=2)
    assert out.shape == (1, 66)


def test_cache_used_after_unpatch_is_an_error_not_a_wrong_answer():
    model = tiny_model("llama")
    ids = random_ids(1, 60)
    jacap_attn.patch(model, ratio=0.25, window=8)
    cache = jacap_attn.compress(model, ids)
    jacap_attn.unpatch(model)
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with pytest.raises(RuntimeError, match="not patched"), torch.no_grad():
        model(ids[:, -1:], **{keyword: copy.deepcopy(cache)})
    jacap_attn.patch(model, ratio=0.25, window=8)  # patched again: the same cache works
    with torch.no_grad():
        assert model(ids[:, -1:], cache=copy.deepcopy(cache)).logits.isfinite().all()
