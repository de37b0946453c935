"""Tiny random-weight models of every supported family, built from configs (no downloads)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import transformers

# transformers < 5.24 names the returned cache `past_key_values` only; the tests read `out.cache`
# (the library itself reads either), so that the suite runs unchanged on 5.17, the GPU machine's.
if not hasattr(transformers.modeling_outputs.CausalLMOutputWithPast, "cache"):
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    for _output in (transformers.modeling_outputs.CausalLMOutputWithPast,
                    transformers.modeling_outputs.BaseModelOutputWithPast, GenerateDecoderOnlyOutput):
        _output.cache = property(lambda self: self.past_key_values)

# float32 tolerances, named once (docs/architecture.md#tests).
DECODE_ATOL = 2e-5
DECODE_RTOL = 1e-4

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False)

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(num_hidden_layers=3)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(num_hidden_layers=3, sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(num_hidden_layers=3)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(num_hidden_layers=3)),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(num_hidden_layers=3, sliding_window=None, pad_token_id=0)),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                    dict(num_hidden_layers=3, sliding_window=24, query_pre_attn_scalar=16,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}


@pytest.fixture(autouse=True, scope="session")
def _compress_short_prompts():
    """The suite checks the compression machinery on tiny prompts of 10-600 tokens; the shipped default
    keeps every entry of a prompt shorter than ``DEFAULT_MIN_TOKENS`` (256), so the suite runs with 0
    (every prompt longer than the window is compressed). Tests of the shipped default set it back
    (tests/test_short_prompt_default.py). Subprocess tests run with the shipped default."""
    import jacap_attn.config

    shipped = jacap_attn.config.DEFAULT_MIN_TOKENS
    jacap_attn.config.DEFAULT_MIN_TOKENS = 0
    yield
    jacap_attn.config.DEFAULT_MIN_TOKENS = shipped


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy machine OpenMP's spinning
    threads make every call much slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(family: str = "llama", *, seed: int = 0, dtype=torch.float32, attn="sdpa", **overrides):
    """A tiny eval-mode model of ``family`` with random weights (fixed seed)."""
    config_cls, model_cls, extra = FAMILIES[family]
    kwargs = {**COMMON, **extra, **overrides}
    config = config_cls(**kwargs)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = model_cls(config).eval().to(dtype)
    return model


def random_ids(batch: int, length: int, *, seed: int = 1, vocab: int = 96) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen)


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param


def copy_working_tree(root: Path, dest: Path) -> None:
    """Copy the files of the checkout at ``root`` that git tracks, or leaves untracked but not ignored,
    as they are now, to ``dest`` (what the GPU machine gets, and what a wheel is built from; no
    ``build/``, ``*.egg-info`` or venv). Skips the test outside a git checkout."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (or no git): cannot tell which files are the working tree's")
    for name in filter(None, listed.decode().split("\0")):
        source = root / name
        if source.is_file():  # a tracked file deleted in the working tree is not copied
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python that must not see this checkout: no
    ``PYTHONPATH``, ``PYTHONHOME``, ``PYTHONSTARTUP`` or user site-packages; ``extra`` added."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(PYTHONNOUSERSITE="1", **extra)
    return env


def library_files(root: Path) -> dict[str, Path]:
    """The library's ``.py`` files in the checkout at ``root``, keyed by their path once installed:
    ``jacap_attn/**`` as it is, the top-level ``patches/**`` as ``jacap_attn/patches/**`` (the
    ``package-dir`` of pyproject.toml)."""
    files = {path.relative_to(root).as_posix(): path for path in (root / "jacap_attn").rglob("*.py")}
    files.update({"jacap_attn/patches/" + path.relative_to(root / "patches").as_posix(): path
                  for path in (root / "patches").rglob("*.py")})
    return files


def write_tiny_gguf(path: Path, *, layers: int = 2, seed: int = 0) -> Path:
    """A tiny random-weight Llama written as a GGUF file with the ``gguf`` package, with its tokenizer in
    the file's metadata as llama.cpp writes it (a byte-level BPE: ``tokenizer.ggml.model = "gpt2"``,
    the 256 byte tokens plus four merges and ``<s>``, ``</s>``): what ``from_pretrained(folder,
    gguf_file=...)`` loads, model and tokenizer, with no other file beside it."""
    import numpy as np
    from gguf import GGUFWriter
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    merges = ["Ġ t", "Ġ a", "h e", "Ġt he"]
    tokens = ["<s>", "</s>", *(spelling[b] for b in range(256)), "Ġt", "Ġa", "he", "Ġthe"]
    hidden, heads, kv_heads, ffn = 64, 4, 2, 96
    head_dim = hidden // heads
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    gen = np.random.default_rng(seed)

    def weight(name, *shape):
        writer.add_tensor(name, (gen.standard_normal(shape) * 0.05).astype(np.float32))

    weight("token_embd.weight", len(tokens), hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    weight("output.weight", len(tokens), hidden)
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
        weight(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        weight(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        weight(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        weight(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        weight(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        weight(f"blk.{i}.ffn_up.weight", ffn, hidden)
        weight(f"blk.{i}.ffn_down.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
