"""Tensor parallelism on the CPU: one ``torchrun --nproc_per_node 2`` launch (gloo) of tiny models of
every family transformers shards, loaded with ``tp_plan="auto"`` (docs/architecture.md#tensor-parallelism).

tests/tensor_parallel_worker.py runs every case on the tensor-parallel model and on a single-process copy
of the same weights; here each case is checked with exact equality: the kept positions per (layer, row,
KV head), the greedy tokens (on every rank), the weights fingerprint, and documents saved by one and
loaded by the other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import FAMILIES, child_env
from tensor_parallel_worker import FAMILIES as SHARDED, MATRIX, cases, save_family

if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("needs torch.distributed with the gloo backend", allow_module_level=True)

HERE = Path(__file__).resolve().parent
LOGLIKELIHOOD_ATOL = 1e-4  # the bound for lm-eval's loglikelihoods (float32)
CASES = {name: kind for family in SHARDED for name, (_, kind) in cases(family).items()}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """The worker's results (one launch for every case), with its wall time in ``seconds["launch"]``."""
    folder = tmp_path_factory.mktemp("tp_models")
    for family in SHARDED:
        save_family(family, folder / family, {})
    out = folder / "results.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(HERE / "tensor_parallel_worker.py"), str(folder), str(out)]
    start = time.perf_counter()
    done = subprocess.run(command, env=child_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=900)
    if done.returncode != 0:  # the ranks' tracebacks, once (not repeated by every test)
        errors = [line for line in done.stderr.splitlines() if line.startswith("[rank") or "Error" in line]
        pytest.fail("the torchrun launch failed:\n" + "\n".join(errors[-60:]), pytrace=False)
    results = json.loads(out.read_text())
    results["seconds"]["launch"] = time.perf_counter() - start
    return results


def test_every_sharded_family_is_covered():
    assert set(SHARDED) == set(FAMILIES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_kept_sets_and_tokens_equal_single_process(run, name):
    case = run["cases"][name]
    tp, sp = case["tp"], case["sp"]
    assert len(tp["kept"]) == len(sp["kept"])
    for layer, (got, want) in enumerate(zip(tp["kept"], sp["kept"])):
        assert got == want, f"{name}: layer {layer} keeps other entries under tensor parallelism"
    assert tp.get("same_on_ranks", True), f"{name}: the ranks of a replicated-heads model kept different entries"
    for rank, tokens in enumerate(tp["tokens_per_rank"]):
        assert tokens == sp["tokens"], f"{name}: rank {rank} generated other tokens"


def test_heads_split_or_replicated_as_transformers_shards_them(run):
    for name, case in run["cases"].items():
        expected = "shards=1" if name.startswith("phi3/") else "shards=2"  # Phi-3 gathers its fused qkv_proj
        assert expected in case["heads"], (name, case["heads"])


@pytest.mark.parametrize("family", SHARDED)
def test_weights_fingerprint_of_sharded_weights_equals_single_process(run, family):
    fingerprint = run["fingerprint"][family]
    assert fingerprint["tp"] == fingerprint["sp"]


@pytest.mark.parametrize("quantize", ["int8", "None"])
@pytest.mark.parametrize("family", MATRIX)
def test_saved_by_sharded_model_loads_in_one_process_and_back(run, family, quantize):
    entry = run["files"][family][quantize]
    assert len(set(entry["size_per_rank"])) == 1  # one file, every rank told its size
    assert entry["size_per_rank"][0] == entry["sp_size"]  # the same entries as a single process saves
    assert entry["sp_loaded_kept"] == entry["sp_kept"]
    assert entry["sp_loaded_answer"] == entry["sp_answer"] == entry["tp_answer"]
    assert entry["tp_loaded_kept"] == entry["sp_kept"]
    assert entry["tp_loaded_answer"] == entry["sp_answer"]


def test_lm_eval_loglikelihoods_equal_single_process(run):
    """``hf-jacap`` with ``tp_plan="auto"`` (lm-eval's Python API, every rank) gives the single-process
    loglikelihoods within 1e-4 and the same greedy flags."""
    scores = run["lm_eval"]
    if scores["sp"] is None:
        pytest.skip("needs the eval extra (lm-eval)")
    for rank, got in enumerate(scores["tp_per_rank"]):
        assert [greedy for _, greedy in got] == [greedy for _, greedy in scores["sp"]]
        assert [value for value, _ in got] == pytest.approx([value for value, _ in scores["sp"]],
                                                            abs=LOGLIKELIHOOD_ATOL), f"rank {rank}"


def test_one_launch_stays_within_the_suite_time(run):
    seconds = run["seconds"]
    print(f"tensor-parallel launch: {seconds['launch']:.1f} s; in it, every case {seconds['all']:.1f} s, "
          f"lm-eval {seconds['lm_eval']:.1f} s")
    assert run["world_size"] == 2


@pytest.mark.slow  # three torchrun launches and two lm_eval runs: about 2-3 min on 2 shared cores
def test_readme_commands_under_torchrun_match_one_process(tmp_path):
    """The README's two tensor-parallel commands as written (``<folder>`` a tiny saved Llama):
    ``tools/tp_generate.py`` under torchrun prints the tokens it prints in one process, and the
    ``lm_eval`` line under torchrun gives the answers of the same line in one process (no torchrun,
    no ``tp_plan``)."""
    import re

    from test_readme import README, readme_blocks

    folder = tmp_path / "llama"
    save_family("llama", folder, {})
    prompt = tmp_path / "prompt.txt"
    words = [f"\u2581w{i}" if i % 3 else f"p{i}" for i in range(3, 96)]  # the vocabulary of save_family's tokenizer
    prompt.write_text(" ".join(words[(7 * i) % len(words)] for i in range(300)))
    env = child_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    [block] = [b for b in readme_blocks(README.read_text(encoding="utf-8"), "bash") if "tp_plan=auto" in b]
    lines = [line.split("#")[0].strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    generate, lm_eval = (re.sub(r"\s+", " ", line).replace("<folder>", str(folder)).split(" ") for line in lines)
    assert generate[:4] == ["torchrun", "--standalone", "--nproc_per_node", "2"] and generate[4] == "tools/tp_generate.py"
    assert lm_eval[:6] == ["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "lm_eval"]

    def run(command, **kwargs):
        # Two tries: a rank of the gloo CPU transport aborted mid-run once in 5 fresh-clone runs
        # (2026-12-04) and the rerun passed. Only that transport error earns the second try, and the
        # outputs are still compared below.
        for _ in range(2):
            done = subprocess.run(command, env=env, cwd=HERE.parent, capture_output=True, text=True, timeout=900,
                                  **kwargs)
            if not (done.returncode and "Connection reset by peer" in done.stderr and "gloo" in done.stderr):
                break
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        return done.stdout

    launcher = [sys.executable, "-m", "torch.distributed.run"]
    extra = ["--prompt-file", str(prompt), "--tokens", "8"]
    sharded = run(launcher + generate[1:] + extra)
    single = run([sys.executable] + generate[4:] + extra)
    assert "ids:" in sharded and sharded == single

    answers = {}
    for name, command in (("sharded", launcher + lm_eval[1:]),
                          ("single", [sys.executable] + lm_eval[4:])):
        if name == "single":
            command = [part.replace(",tp_plan=auto", "") for part in command]
        out = tmp_path / name
        run(command + ["--log_samples", "--output_path", str(out)])
        [samples] = list(out.rglob("samples_jacap_single_needle_*.jsonl"))
        answers[name] = [json.loads(line)["resps"] for line in samples.read_text().splitlines()]
    assert len(answers["single"]) == 2 and answers["sharded"] == answers["single"]


def test_ranks_that_disagree_fail_together_with_the_reason(run):
    """Ranks patched with other settings ran silently, each with its own budget (or died in gloo with "Received data
    size doesn't match"); ranks that loaded other files hung in the first collective; a file missing on one rank
    failed there alone. Each is now an error on every rank, naming what differs."""
    ranks = run["disagreements"]
    assert len(ranks) == 2
    for out in ranks:
        assert "disagree on the patch settings" in out["patch"] and "ratio" in out["patch"] and not out["patch patched"]
        assert "disagree on the patch settings" in out["repatch"] and "window" in out["repatch"]
        assert out["repatch patched"] == 0.25  # the earlier settings stay
        assert "disagree on the cache file" in out["other files"]
        assert "FileNotFoundError" in out["missing file"] or "no cache file" in out["missing file"], out["missing file"]

