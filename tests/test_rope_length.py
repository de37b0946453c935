"""RoPE types whose frequencies depend on a forward's length (issue 25, case 4: the kind of case 1).

``hf-jacap`` compresses a context in one forward and feeds the continuation in another; ``dynamic``
and Phi3's ``longrope`` pick their frequencies from each forward's longest position, so at
``ratio=1`` the cached context had other frequencies than ``hf``'s single forward over the request.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval", reason="needs the eval extra: pip install -e '.[eval]'")

import transformers  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from jacap_attn.integrations.lm_eval import JacapLM  # noqa: E402
from jacap_attn.model_state import length_dependent_rope, rope_for_length  # noqa: E402

ATOL = 1e-4  # float32: hf-jacap at ratio 1 vs stock hf (tests/test_lm_eval.py's FULL_RATIO_ATOL)
WORDS = [f"w{i}" for i in range(60)]


def _save(folder, family: str):
    vocab = {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                     pad_token="<pad>", unk_token="<unk>")
    common = dict(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, bos_token_id=2, eos_token_id=3, pad_token_id=0,
                  tie_word_embeddings=False)
    if family == "dynamic":
        config = transformers.LlamaConfig(**common, head_dim=16, max_position_embeddings=64,
                                          rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
        model = transformers.LlamaForCausalLM
    else:  # Phi-3-128k's layout: long factors beyond original_max_position_embeddings
        half = 8
        config = transformers.Phi3Config(**common, max_position_embeddings=256, sliding_window=None,
                                         original_max_position_embeddings=64,
                                         rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                          "short_factor": [1.0] * half,
                                                          "long_factor": [1.0 + 0.5 * i for i in range(half)],
                                                          "original_max_position_embeddings": 64})
        model = transformers.Phi3ForCausalLM
    torch.manual_seed(0)
    model(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _text(n: int, seed: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (n,), generator=gen).tolist())


@pytest.mark.parametrize("family", ["dynamic", "longrope"])
def test_ratio_one_equals_hf_under_length_dependent_rope(tmp_path, family):
    """Kind: hidden extra forwards / length-dependent state. Requests of 60 + 10 tokens (over the
    64 positions of the original RoPE), and shorter ones, at batch size 1: ``hf-jacap`` at
    ``ratio=1`` equals ``hf`` within 1e-4 (it differed by 3.6e-2 with ``dynamic``, 0.79 with
    ``longrope``)."""
    folder = _save(tmp_path / family, family)
    common = dict(pretrained=str(folder), device="cpu", batch_size=1, max_length=200)
    stock, full = HFLM(**common), JacapLM(**common, ratio=1)
    assert length_dependent_rope(full.model)
    shared = _text(60, seed=1)
    pairs = [(shared, " " + _text(10, seed=2)), (shared, " " + _text(3, seed=3)), (_text(30, seed=4), " w5 w6")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    expected = stock.loglikelihood(requests, disable_tqdm=True)
    got = full.loglikelihood(requests, disable_tqdm=True)
    for (want, want_greedy), (lp, greedy) in zip(expected, got, strict=True):
        assert abs(lp - want) <= ATOL, (family, lp, want)
        assert greedy == want_greedy


def test_rope_for_length_computes_the_longer_forwards_frequencies():
    """The context manager gives a short forward the cos/sin of the same positions in a longer one,
    and puts the rotary modules back."""
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64,
                                      rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    model = transformers.LlamaForCausalLM(config).eval()
    rotary = model.model.rotary_emb
    x = torch.zeros(1, 1, 16)
    long_cos, _ = rotary(x, torch.arange(100)[None])
    rotary.__init__(config)  # a fresh module: the long forward above grew its cached frequencies
    with rope_for_length(model, 100):
        short_cos, _ = rotary(x, torch.arange(40)[None])
    torch.testing.assert_close(short_cos, long_cos[:, :40], rtol=0, atol=0)
    assert "forward" not in rotary.__dict__


def test_generate_over_a_given_cache_says_length_dependent_rope_is_not_exact():
    """``generate`` over a cache compressed before its continuation cannot give a length-dependent
    RoPE the frequencies of one forward over prompt and continuation: it says so, once per model."""
    import warnings

    import jacap_attn
    from conftest import random_ids, tiny_model

    model = tiny_model("llama", max_position_embeddings=64,
                       rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    jacap_attn.patch(model, ratio=0.5, window=8)
    ids = random_ids(1, 60)
    question = torch.cat([ids, random_ids(1, 8, seed=3)], dim=1)
    with pytest.warns(UserWarning, match="dynamic / longrope"):
        model.generate(question, cache=jacap_attn.compress(model, ids), max_new_tokens=2, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate(question, cache=jacap_attn.compress(model, ids), max_new_tokens=2, do_sample=False)
        plain = tiny_model("llama")
        jacap_attn.patch(plain, ratio=0.5, window=8, spans="none")  # no vocabulary: say so elsewhere
        plain.generate(question, cache=jacap_attn.compress(plain, ids), max_new_tokens=2, do_sample=False)
