"""The ``hf-jacap`` lm-evaluation-harness model (jacap_attn.integrations.lm_eval, docs/architecture.md#lm-evaluation-harness).

A tiny random-weight Llama and a word-level tokenizer are saved to a temporary folder, so everything
runs offline: in process against lm-eval's stock ``hf`` model, and once through the stock ``lm_eval``
command in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="needs the eval extra: pip install -e '.[eval]'")

import transformers  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

import jacap_attn  # noqa: E402
from jacap_attn.integrations.lm_eval import JacapLM, pop_jacap_options  # noqa: E402

# float32 tolerances (docs/architecture.md#tests): hf-jacap at ratio 1 vs stock hf, and vs a manual computation.
FULL_RATIO_ATOL = 1e-4
MANUAL_ATOL = 1e-5
# How much compression must move a first-token log-prob for the test to call it "used".
COMPRESSION_EFFECT = 1e-3

WORDS = [f"w{i}" for i in range(60)]
MAX_LENGTH = 72  # small, so that one request below is left-truncated
COMPRESSED = dict(ratio=0.25, window=4)
STOP = "w7"


def _save_tiny_model(folder: Path) -> Path:
    vocab = {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                     pad_token="<pad>", unk_token="<unk>")
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, bos_token_id=2, eos_token_id=3, pad_token_id=0,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _text(n: int, seed: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (n,), generator=gen).tolist())


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return _save_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def lms(folder):
    """Stock ``hf``, ``hf-jacap`` at ratio 1 and compressed ``hf-jacap`` on the same weights."""
    common = dict(pretrained=str(folder), device="cpu", batch_size=3, max_length=MAX_LENGTH)
    return HFLM(**common), JacapLM(**common, ratio=1), JacapLM(**common, **COMPRESSED)


def _loglikelihood_requests() -> list[Instance]:
    shared = _text(40, seed=1)
    pairs = [(shared, " " + _text(k, seed=10 + k)) for k in (1, 1, 3, 6)]  # one context, four continuations
    pairs += [(shared, " w5"), (shared, " w5 w6")]  # same continuation prefix, different lengths
    pairs += [(_text(25, seed=2), " " + _text(2, seed=3))]
    pairs += [("w1", " " + _text(4, seed=4))]  # one-token context: nothing to compress
    pairs += [("", " " + _text(3, seed=5))]  # empty context: lm-eval puts the prefix token
    pairs += [(_text(MAX_LENGTH + 5, seed=6), " " + _text(3, seed=7))]  # left-truncated like hf
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def _generate_requests() -> list[Instance]:
    kwargs = {"until": [STOP], "max_gen_toks": 8, "do_sample": False}
    return [Instance("generate_until", {}, (_text(n, seed=20 + n), dict(kwargs)), i) for i, n in enumerate((50, 20, 35))]


def test_options_are_cast_from_lm_eval_values():
    # What lm-eval's `key=value` parser produces, plus strings from a JSON --model_args.
    kwargs = {"window": "16", "ridge": "None", "pooling": None, "kernel": 5.0, "compile": "false", "beta": 1,
              "dtype": "float32"}
    options = pop_jacap_options(kwargs)
    # `ridge=None`: the method's default (the option is left out)
    assert options == {"window": 16, "pooling": "none", "kernel": 5, "compile": False, "beta": 1.0}
    assert kwargs == {"dtype": "float32"}  # the rest goes on to HFLM / from_pretrained
    for bad in ({"window": "3.5"}, {"window": True}, {"compile": "maybe"}, {"beta": "high"}, {"head_floor": "some"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            pop_jacap_options(dict(bad))
    # The global budget's options pass through like the other shared settings.
    options = pop_jacap_options({"budget": "global", "global_score": "normalized", "head_floor": "0.3"})
    assert options == {"budget": "global", "global_score": "normalized", "head_floor": 0.3}
    # `backend` is hf's argument too (which model class): its values stay with HFLM (once: "backend must be one
    # of auto, sdpa, xformers; got backend='causal'"), Jacap's are the patch's
    kwargs = {"backend": "causal"}
    assert pop_jacap_options(kwargs) == {} and kwargs == {"backend": "causal"}
    kwargs = {"backend": "sdpa"}
    assert pop_jacap_options(kwargs) == {"backend": "sdpa"} and kwargs == {}


def test_bad_settings_fail_before_loading(tmp_path):
    missing = str(tmp_path / "no_such_model")  # would fail later, in from_pretrained
    with pytest.raises(ValueError, match="ridge"):
        JacapLM(pretrained=missing, method="snapkv", ridge=0.1)
    with pytest.raises(ValueError, match="ratio"):
        JacapLM(pretrained=missing, ratio=0)
    # A Jacap option one typo away went to the model class and failed after the weights loaded (TypeError:
    # LlamaForCausalLM.__init__() got an unexpected keyword argument 'chunksize'); hf's own arguments pass.
    for typo, meant in (("chunksize", "chunk_size"), ("windw", "window"), ("lookup_shar", "lookup_share")):
        with pytest.raises(ValueError, match=f"unknown model argument '{typo}': did you mean the Jacap option '{meant}'"):
            JacapLM(pretrained=missing, **{typo: 1})
    with pytest.raises(OSError):  # past the checks, to the missing folder: hf's arguments are not taken for typos
        JacapLM(pretrained=missing, ratio=0.5, max_length=64, trust_remote_code=False, revision="main")


def test_full_ratio_matches_stock_hf(lms):
    stock, full, _ = lms
    requests = _loglikelihood_requests()
    greedy_context = _text(30, seed=9)  # its greedy continuation must score is_greedy=True
    [greedy] = stock.generate_until([Instance("generate_until", {}, (greedy_context, {"max_gen_toks": 3}), 0)],
                                    disable_tqdm=True)
    requests.append(Instance("loglikelihood", {}, (greedy_context, " " + greedy), len(requests)))
    expected = stock.loglikelihood(requests, disable_tqdm=True)
    got = full.loglikelihood(requests, disable_tqdm=True)
    assert expected[-1][1] is True
    for (want_lp, want_greedy), (lp, is_greedy) in zip(expected, got, strict=True):
        assert abs(lp - want_lp) <= FULL_RATIO_ATOL
        assert is_greedy == want_greedy
    rolling = [Instance("loglikelihood_rolling", {}, (_text(2 * MAX_LENGTH + 10, seed=8),), 0)]
    [want_rolling] = stock.loglikelihood_rolling(rolling, disable_tqdm=True)
    [got_rolling] = full.loglikelihood_rolling(rolling, disable_tqdm=True)
    assert abs(got_rolling - want_rolling) <= FULL_RATIO_ATOL
    generations = _generate_requests()
    assert full.generate_until(generations, disable_tqdm=True) == stock.generate_until(generations, disable_tqdm=True)
    info = full.get_model_info()
    assert info["jacap_ratio"] == 1.0 and info["jacap_config"]["ratio"] == 1.0


def _manual_loglikelihood(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """Library API only: compress(ctx[:-1]), then ctx[-1:] + cont[:-1] over the cache (positions
    from the cache's logical length)."""
    cache = jacap_attn.compress(model, torch.tensor([context[:-1]]))
    tokens = torch.tensor([context[-1:] + continuation[:-1]])
    with torch.no_grad():
        logits = model(input_ids=tokens, **{model._jacap_state.cache_keyword: cache}).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(continuation)
    return float(logprobs.gather(-1, target[:, None]).sum()), bool((logprobs.argmax(-1) == target).all())


def test_compressed_scores_use_the_cache_at_the_right_positions(lms):
    _, full, compressed = lms
    context = [compressed.tokenizer.bos_token_id] + compressed.tok_encode(_text(48, seed=1))
    continuations = [compressed.tok_encode(_text(k, seed=30 + k)) for k in (1, 4)]
    long_context = compressed.tok_encode(_text(MAX_LENGTH + 9, seed=6))  # left-truncated
    requests = [(("c", f"x{i}"), context, cont) for i, cont in enumerate(continuations)]
    requests.append((("long", "x"), long_context, continuations[1]))

    got = compressed._loglikelihood_tokens(requests, disable_tqdm=True)
    ratio_one = full._loglikelihood_tokens(requests[:1], disable_tqdm=True)
    # The first continuation token is predicted from the compressed cache.
    assert abs(got[0][0] - ratio_one[0][0]) > COMPRESSION_EFFECT

    truncated = (long_context + continuations[1])[-(MAX_LENGTH + 1):][: -len(continuations[1])]
    for (_, ctx, cont), (lp, greedy), ctx_seen in zip(requests, got, (context, context, truncated), strict=True):
        want_lp, want_greedy = _manual_loglikelihood(compressed.model, ctx_seen, cont)
        assert abs(lp - want_lp) <= MANUAL_ATOL
        assert greedy == want_greedy

    # Each request alone gives the same answer: a shared context is compressed once, and every
    # continuation runs on its own copy of that cache.
    alone = [compressed._loglikelihood_tokens([request], disable_tqdm=True)[0] for request in requests]
    assert alone == got


def test_left_padded_generation_batch_matches_batch_size_one(lms):
    _, _, compressed = lms
    requests = _generate_requests()
    lengths = {len(compressed.tok_encode(r.args[0])) for r in requests}
    assert len(lengths) == 3  # really a padded batch
    batched = compressed.generate_until(requests, disable_tqdm=True)
    compressed.batch_size_per_gpu = 1
    try:
        single = [compressed.generate_until([request], disable_tqdm=True)[0] for request in requests]
    finally:
        compressed.batch_size_per_gpu = 3
    assert batched == single
    assert all(STOP not in text for text in batched)


def _write_tasks(folder: Path) -> None:
    data = folder / "data.jsonl"
    rows = [{"context": _text(30 + 3 * i, seed=40 + i), "choices": ["w1 w2", "w3", "w4 w5 w6"], "label": i % 3}
            for i in range(4)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    source = f"""dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "{{{{context}}}}"
"""
    (folder / "tiny_mc.yaml").write_text(f"""task: jacap_tiny_mc
{source}output_type: multiple_choice
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
""")
    (folder / "tiny_gen.yaml").write_text(f"""task: jacap_tiny_gen
{source}output_type: generate_until
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["{STOP}"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
""")


def test_stock_lm_eval_command_finds_hf_jacap(folder, tmp_path):
    """The stock ``lm_eval`` console script, unmodified, runs ``--model hf-jacap`` (offline)."""
    script = Path(sys.executable).with_name("lm_eval")
    assert script.exists(), f"no lm_eval command next to {sys.executable}: pip install -e '.[eval]'"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _write_tasks(tasks)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    command = [str(script), "--model", "hf-jacap",
               "--model_args", f"pretrained={folder},ratio=0.5,window=4,method=jacap",
               "--tasks", "jacap_tiny_mc,jacap_tiny_gen", "--include_path", str(tasks),
               "--device", "cpu", "--batch_size", "2", "--output_path", str(out)]
    run = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (
        "lm_eval failed (is jacap-attn installed with its start-up hook jacap_attn_lm_eval.pth?):\n"
        + run.stderr[-4000:])
    [result_file] = out.glob("**/results_*.json")
    results = json.loads(result_file.read_text())
    assert set(results["results"]) == {"jacap_tiny_mc", "jacap_tiny_gen"}
    assert "acc,none" in results["results"]["jacap_tiny_mc"]
    assert "exact_match,none" in results["results"]["jacap_tiny_gen"]
    config = results["config"]
    assert config["model"] == "hf-jacap"
    assert config["jacap_ratio"] == 0.5 and config["jacap_method"] == "jacap"
    assert config["jacap_options"] == {"window": 4}


def test_a_model_handed_to_hf_jacap_is_left_as_it_was_found(folder):
    """Kind: a wrapper that changes an object it was handed beyond its own lifetime (lm-eval #1978's
    kind: ``HFLM(pretrained=model)`` takes a loaded model). ``JacapLM(pretrained=model, ratio=0.2)``
    left the caller's model patched, so a later stock ``HFLM(pretrained=model)`` answered as
    hf-jacap. A handed model is now patched only while a request runs: stock ``hf``'s loglikelihoods
    and generations after hf-jacap equal those before it (exactly), while hf-jacap's own differ from
    them (compression is on during its calls); a model its owner had patched with other settings keeps
    that patch (the same state, the owner's settings and selection)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    common = dict(tokenizer=tokenizer, batch_size=1, max_length=MAX_LENGTH)
    loglikelihood, generation = _loglikelihood_requests(), _generate_requests()
    stock = HFLM(pretrained=model, **common)
    before = stock.loglikelihood(loglikelihood, disable_tqdm=True), stock.generate_until(generation, disable_tqdm=True)

    jacap = JacapLM(pretrained=model, ratio=0.2, window=4, **common)
    assert not jacap_attn.is_patched(model)
    ours = jacap.loglikelihood(loglikelihood, disable_tqdm=True), jacap.generate_until(generation, disable_tqdm=True)
    assert not jacap_attn.is_patched(model)
    assert max(abs(a[0] - b[0]) for a, b in zip(ours[0], before[0])) > COMPRESSION_EFFECT
    assert ours[1] != before[1]
    again = HFLM(pretrained=model, **common)
    assert (again.loglikelihood(loglikelihood, disable_tqdm=True), again.generate_until(generation, disable_tqdm=True)) \
        == before

    jacap_attn.patch(model, ratio=0.5, method="snapkv", window=4)  # the owner's own patch
    state, config = model._jacap_state, model._jacap_state.config
    owner_tables = state.repeat_ids, state.spans
    ids = torch.tensor([tokenizer(_text(50, seed=8))["input_ids"]])
    owners = jacap_attn.compress(model, ids)
    assert jacap.generate_until(generation, disable_tqdm=True) == ours[1]
    assert model._jacap_state is state and state.config is config
    assert (state.repeat_ids, state.spans) == owner_tables  # once: the request's repeat instruction stayed
    assert all(torch.equal(a.positions, b.positions) for a, b in zip(jacap_attn.compress(model, ids).layers,
                                                                         owners.layers))


def test_shipped_tasks_run_from_any_folder_without_include_path(folder, tmp_path):
    """Kind: a README line that ran only in the checkout. ``lm_eval ... --tasks jacap_single_needle
    --include_path eval/tasks`` failed from any other folder ("Tasks not found"), and in the checkout
    until ``python -m eval.make_tasks`` had written the data. The task and its data ship in the package
    (``jacap_attn/tasks``) and the start-up hook adds them to lm-eval's task manager: the stock command
    runs it from an empty folder with no ``--include_path``; a task of the same name on an
    ``--include_path`` still wins, and ``include_defaults=False`` leaves them out."""
    script = Path(sys.executable).with_name("lm_eval")
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    run = subprocess.run([str(script), "--model", "hf-jacap", "--model_args", f"pretrained={folder},ratio=0.5,window=4",
                          "--tasks", "jacap_single_needle", "--limit", "1", "--device", "cpu", "--batch_size", "1",
                          "--output_path", str(out)], env=env, cwd=empty, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    [result_file] = out.glob("**/results_*.json")
    assert "score,none" in json.loads(result_file.read_text())["results"]["jacap_single_needle"]
    assert list(empty.iterdir()) == []

    other = tmp_path / "other"
    other.mkdir()
    (other / "jacap_single_needle.yaml").write_text(
        "task: jacap_single_needle\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {other / 'rows.jsonl'}\noutput_type: generate_until\ntest_split: test\ndoc_to_text: x\n"
        "doc_to_target: y\nmetric_list:\n  - metric: exact_match\n")
    check = ("import jacap_attn.tasks as shipped\nfrom lm_eval.tasks import TaskManager\n"
             "entry = lambda m: str(m.task_index['jacap_single_needle'].yaml_path)\n"
             "assert entry(TaskManager()).startswith(shipped.path()), entry(TaskManager())\n"
             f"assert entry(TaskManager(include_path={str(other)!r})).startswith({str(other)!r})\n"
             "assert 'jacap_single_needle' not in TaskManager(include_defaults=False).all_tasks\n"
             "print('TASKS_OK')\n")
    run = subprocess.run([sys.executable, "-c", check], env=env, cwd=empty, capture_output=True, text=True, timeout=300)
    assert "TASKS_OK" in run.stdout, run.stderr[-4000:]


def test_hf_jacap_on_a_gguf_file_keeps_words_whole(tmp_path):
    """``--model_args pretrained=<folder>,gguf_file=<file>`` (a model loaded straight from a GGUF file,
    which ``hf`` supports): the Jacap patch reads its word spans from lm-eval's own tokenizer (built
    from the file), where before it found none and ranked token by token."""
    from conftest import write_tiny_gguf
    from jacap_attn.selection.spans import word_starts

    write_tiny_gguf(tmp_path / "tiny.gguf")
    lm = JacapLM(pretrained=str(tmp_path), gguf_file="tiny.gguf", ratio=0.5, window=4, device="cpu", batch_size=1)
    spans = lm.model._jacap_state.spans
    assert spans is not None and torch.equal(spans[0], word_starts(lm.tokenizer))


def test_chunk_size_compresses_every_context_in_chunks(folder, lms):
    """``--model_args ...,chunk_size=16``: each context is prefilled in chunks of 16 tokens, each cut to
    the running budget: the scores are the library's own chunked compress + forward; at ``ratio=1`` they
    are stock ``hf``'s."""
    stock, _, _ = lms
    common = dict(pretrained=str(folder), device="cpu", batch_size=3, max_length=MAX_LENGTH)
    chunked = JacapLM(**common, **COMPRESSED, chunk_size="16")
    assert chunked.get_model_info()["jacap_config"]["chunk_size"] == 16
    context = [chunked.tokenizer.bos_token_id] + chunked.tok_encode(_text(48, seed=1))
    continuation = chunked.tok_encode(_text(4, seed=31))
    [(lp, greedy)] = chunked._loglikelihood_tokens([(("c", "x"), context, continuation)], disable_tqdm=True)
    jacap_attn.patch(chunked.model, **COMPRESSED, chunk_size=16)
    cache = jacap_attn.compress(chunked.model, torch.tensor([context[:-1]]))
    assert cache.layers[0].kept_counts().max() < len(context) - 1  # compressed, in chunks
    tokens = torch.tensor([context[-1:] + continuation[:-1]])
    with torch.no_grad():
        logits = chunked.model(input_ids=tokens, **{chunked.model._jacap_state.cache_keyword: cache}).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    want = float(logprobs.gather(-1, torch.tensor(continuation)[:, None]).sum())
    assert abs(lp - want) <= MANUAL_ATOL
    whole = JacapLM(**common, ratio=1, chunk_size=16)
    requests = _loglikelihood_requests()
    for (want_lp, _), (got_lp, _) in zip(stock.loglikelihood(requests, disable_tqdm=True),
                                         whole.loglikelihood(requests, disable_tqdm=True), strict=True):
        assert abs(got_lp - want_lp) <= FULL_RATIO_ATOL


def test_rolling_loglikelihood_is_compressed_under_chunk_size_and_warns_without(folder, lms, caplog):
    """Perplexity (``loglikelihood_rolling``): its windows have one-token contexts, so without ``chunk_size``
    nothing is compressed (a warning says so, and the score is ``hf``'s); under ``chunk_size`` each chunk's
    tokens are scored over the compressed chunks before it (at ``ratio=1``: ``hf``'s score)."""
    stock, _, _ = lms
    common = dict(pretrained=str(folder), device="cpu", batch_size=1, max_length=MAX_LENGTH)
    rolling = [Instance("loglikelihood_rolling", {}, (_text(MAX_LENGTH - 8, seed=12),), 0)]  # one window
    [want] = stock.loglikelihood_rolling(rolling, disable_tqdm=True)
    with caplog.at_level("WARNING", logger="jacap_attn.integrations.lm_eval"):
        [plain] = JacapLM(**common, **COMPRESSED, min_tokens=0).loglikelihood_rolling(rolling, disable_tqdm=True)
    assert abs(plain - want) <= FULL_RATIO_ATOL
    assert any("compresses nothing" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="jacap_attn.integrations.lm_eval"):
        [whole] = JacapLM(**common, ratio=1, chunk_size=16).loglikelihood_rolling(rolling, disable_tqdm=True)
        [chunked] = JacapLM(**common, **COMPRESSED, min_tokens=0, chunk_size=16).loglikelihood_rolling(
            rolling, disable_tqdm=True)
    assert not any("compresses nothing" in r.getMessage() for r in caplog.records)
    assert abs(whole - want) <= FULL_RATIO_ATOL
    assert abs(chunked - want) > COMPRESSION_EFFECT


def test_settings_lm_eval_cannot_act_on_or_hands_over_as_none(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(ValueError, match="reselect=0.1 would change nothing"):
        JacapLM(pretrained=missing, ratio=1, reselect=0.1)  # before loading: from_pretrained would fail otherwise
    # lm-eval hands `spans=none` over as None: it is the value "none" (no spans), not the method's default
    assert pop_jacap_options({"spans": None}) == {"spans": "none"}
    assert pop_jacap_options({"spans": "none"}) == {"spans": "none"}
    # ratio=None / method=None: hf-jacap's defaults, not a placeholder object in an error message
    with pytest.raises(ValueError, match="window") as error:
        JacapLM(pretrained=missing, ratio=None, method=None, window=-1)
    assert "object at" not in str(error.value)


def test_loglikelihood_with_a_one_token_context_is_not_chunked(folder, lms):
    """Only perplexity windows are prefilled in chunks: a loglikelihood request with a one-token or empty
    context scores its continuation exactly, as after any context (``hf``'s score), under ``chunk_size`` too."""
    stock, _, _ = lms
    common = dict(pretrained=str(folder), device="cpu", batch_size=4, max_length=MAX_LENGTH)
    requests = [Instance("loglikelihood", {}, ("w1", " " + _text(30, seed=41)), 0),
                Instance("loglikelihood", {}, ("", " " + _text(25, seed=42)), 1)]
    want = stock.loglikelihood(requests, disable_tqdm=True)
    got = JacapLM(**common, **COMPRESSED, min_tokens=0, chunk_size=16).loglikelihood(requests, disable_tqdm=True)
    for (want_lp, _), (lp, _) in zip(want, got, strict=True):
        assert abs(lp - want_lp) <= FULL_RATIO_ATOL
