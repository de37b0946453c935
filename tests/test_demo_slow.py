"""The main job on the real embedded model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import json

import pytest

from jacap_attn import cli


@pytest.mark.slow
def test_main_job_finds_the_secret_with_ten_percent_kept(tmp_path, capsys):
    code = cli.main(["run", "--cache-out", str(tmp_path / "doc.safetensors")])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ratio"] == 0.1 and result["method"] == "jacap"
    assert result["correct_full"] is True
    assert result["correct_jacap"] is True
    # about 10x fewer KV bytes for the prompt
    assert 9.0 <= result["kv_bytes_full"] / result["kv_bytes_jacap"] <= 10.5
    assert result["cache_file_bytes"] == (tmp_path / "doc.safetensors").stat().st_size
    assert result["answer_from_file"]
    # The saved document, compressed before its question was known, answers it (issue 14): stored
    # whole by default, reselected to the 10% decode budget by the question.
    assert result["correct_from_file"] is True
    assert result["file_stored_ratio"] == 1.0 and result["file_decode_budget"] == 0.1
    assert result["file_selection_route"] == "whole"
    # Means of kept counts print as the numbers they are, not float32's digits (99.3333358...).
    assert all(v == round(v, 3) for v in result["kept_tokens_per_layer"].values())


@pytest.mark.slow
def test_inspect_reads_the_demo_file(tmp_path, capsys):
    path = tmp_path / "doc.safetensors"
    assert cli.main(["run", "--cache-out", str(path), "--max-new-tokens", "4"]) == 0
    capsys.readouterr()
    assert cli.main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model"]["model_type"] == "llama" and len(info["kept_per_layer"]) == 30
    assert cli.main(["run", "--cache", str(path), "--question", "What is the secret city?", "--max-new-tokens", "4"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["answer"]
