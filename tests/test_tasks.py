"""Tests of eval.synthetic (synthetic long-context tasks) with the library's prose corpus and prompt
formatting (jacap_attn.prose, jacap_attn.prompts), and eval/make_tasks (data + lm-eval YAMLs).

Fast and offline: the tokenizers are a whitespace stand-in and two byte-level BPE tokenizers
trained in memory on the haystack prose (GPT-2 style pre-tokenization, as SmolLM2's, and
Llama-3 style), never downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jacap_attn import prompts

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `eval` is a top-level folder of the repository, not installed
    sys.path.insert(0, str(ROOT))

from eval import make_tasks  # noqa: E402
from eval import synthetic as T  # noqa: E402

TOLERANCE = 0.05  # relative length tolerance promised by the module


class WhitespaceTokenizer:
    """Stand-in tokenizer: one token per whitespace-separated word, ChatML-like chat template."""

    chat_template = "chatml-like"

    def encode(self, text, add_special_tokens=False):
        return list(range(len(text.split())))

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        assert tokenize is False
        out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


WS = WhitespaceTokenizer()

CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _train_bpe(style: str):
    """A small byte-level BPE tokenizer trained on the haystack prose (deterministic, < 1 s)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if style == "gpt2":  # SmolLM2's pre-tokenizer: single digits, then GPT-2's byte-level regex
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:  # Llama-3 / Qwen style
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=3000,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    paragraphs = T.haystack_paragraphs()
    texts = ["\n\n".join(" ".join(p) for p in paragraphs[i:i + 20]) for i in range(0, len(paragraphs), 20)]
    tok.train_from_iterator(texts, trainer)
    return tok


@pytest.fixture(scope="module", params=["gpt2", "llama3"])
def bpe(request):
    """A Hugging Face fast tokenizer (BPE trained in memory) with a ChatML chat template."""
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(request.param),
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        chat_template=CHATML,
    )


# ------------------------------------------------------------------------------ corpus


def test_corpus_is_prose():
    paragraphs = T.haystack_paragraphs()
    assert len(paragraphs) > 300
    words = sum(len(s.split()) for p in paragraphs for s in p)
    assert words > 15_000
    for p in paragraphs:
        text = " ".join(p)
        assert text.endswith(".")
        assert "::=" not in text and ">>>" not in text and "\n" not in text
        assert not re.search(r"\d{4,}", text)  # needle-like numbers never come from the prose
    assert T.CORPUS_FINGERPRINT.startswith("pydoc_data.topics/python-")


# ------------------------------------------------------------------------------ determinism


@pytest.mark.parametrize("task", list(T.TASKS))
def test_same_seed_same_samples_other_seed_other_samples(task):
    a = [s.to_dict() for s in T.generate(task, WS, 3, 400, seed=5)]
    b = [s.to_dict() for s in T.generate(task, WS, 3, 400, seed=5)]
    c = [s.to_dict() for s in T.generate(task, WS, 3, 400, seed=6)]
    assert a == b
    assert all(x["context"] != y["context"] for x, y in zip(a, c, strict=True))
    assert len({x["context"] for x in a}) == 3  # samples within a set differ too
    # Sample i depends only on (task, seed, i): a bigger set extends a smaller one.
    assert [s.to_dict() for s in T.generate(task, WS, 5, 400, seed=5)][:3] == a


def test_sample_round_trips_through_dict():
    sample = T.generate("multiple_choice", WS, 1, 300, seed=1)[0]
    row = json.loads(json.dumps(sample.to_dict()))
    assert T.Sample.from_dict({**row, "prompt": "ignored"}) == sample


# ------------------------------------------------------------------------------ length targeting


@pytest.mark.parametrize("task", list(T.TASKS))
@pytest.mark.parametrize("target", [300, 1500, 4000])
def test_length_targeting_whitespace(task, target):
    for s in T.generate(task, WS, 2, target, seed=3):
        n = T.count_tokens(WS, s.context)
        assert n == s.meta["n_tokens"]
        assert target * (1 - TOLERANCE) <= n <= target


@pytest.mark.parametrize("task", list(T.TASKS))
def test_length_targeting_bpe(task, bpe):
    for s in T.generate(task, bpe, 2, 1500, seed=4):
        n = len(bpe.encode(s.context, add_special_tokens=False))
        assert n == s.meta["n_tokens"]
        assert 1500 * (1 - TOLERANCE) <= n <= 1500


def test_needles_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="needles alone"):
        T.kv_retrieval(WS, 1, 20, n_pairs=50)
    with pytest.raises(ValueError):
        T.single_needle(WS, 1, 0)


# ------------------------------------------------------------------------------ needles and answers

MAGIC = re.compile(r"The special magic number for ([a-z]+-[a-z]+) is: (\d{7})\.")


def _question_key(question):
    return re.search(r"for ([a-z]+-[a-z]+) mentioned", question).group(1)


def _check_derivable(s: T.Sample):
    """The answers follow from the document alone (parsed the way a reader would)."""
    ctx = s.context
    assert 0.0 <= s.depth <= 1.0
    assert all(0.0 <= d <= 1.0 for d in s.meta["needle_depths"])
    if s.task == "single_needle":
        found = MAGIC.findall(ctx)
        assert found == [(_question_key(s.question), s.answers[0])]
        assert ctx.count(s.answers[0]) == 1
    elif s.task == "multikey_needle":
        found = dict(MAGIC.findall(ctx))
        assert len(found) == 4
        assert [found[_question_key(s.question)]] == s.answers
        assert len(set(found.values())) == 4
    elif s.task == "multivalue_needle":
        key = _question_key(s.question)
        found = re.findall(rf"One of the special magic numbers for {key} is: (\d{{7}})\.", ctx)
        assert sorted(found) == sorted(s.answers) and len(found) == 4
    elif s.task == "variable_tracking":
        value = re.search(r"assigned the value (\d+)", s.question).group(1)
        assignments = re.findall(r"VAR ([A-Z]{5}) = ([A-Z]{5}|\d{5})\.", ctx)
        env = {}
        for name, rhs in assignments:  # chains are stated in order: one pass resolves them
            env[name] = env[rhs] if rhs in env else rhs
        assert sorted(n for n, v in env.items() if v == value) == sorted(s.answers)
        assert len(assignments) == 10  # 2 chains of 5 variables
    elif s.task == "kv_retrieval":
        key = re.search(r'key "([0-9a-f-]+)"', s.question).group(1)
        block = re.search(r"JSON data:\n(\{.*?\n\})", ctx, re.S).group(1)
        data = json.loads(block)
        assert len(data) == s.meta["n_pairs"]
        assert [data[key]] == s.answers
    elif s.task == "multiple_choice":
        assert s.choices is not None and len(s.choices) == 4 and len(set(s.choices)) == 4
        assert s.answers == [s.choices[s.gold]]
        city = re.search(r"(?:of|in) ([A-Z][a-z]+)", s.question).group(1)
        assert city in s.answer_prefix
        # The answer prefix opens exactly one sentence of the document (the prose never names a
        # city), and the gold option is how that sentence goes on.
        (at,) = [m.end() for m in re.finditer(re.escape(s.answer_prefix), ctx)]
        assert ctx[at:].startswith(" " + s.choices[s.gold] + ".")
        for i, choice in enumerate(s.choices):
            stated = len(re.findall(rf"\b{re.escape(choice)}\.", ctx))
            if i == s.gold or s.meta["same_kind"]:
                assert stated == 1  # same_kind: every wrong option is a fact about another city
            else:
                assert stated == 0  # default: wrong options are plausible but not in the document
    else:  # pragma: no cover
        raise AssertionError(s.task)
    if s.task != "multiple_choice":
        assert all(a in ctx for a in s.answers)
    assert T.score(s, " ".join(s.answers)) == 1.0


@pytest.mark.parametrize("task", list(T.TASKS))
def test_needles_present_and_answers_derivable(task):
    for s in T.generate(task, WS, 8, 800, seed=11):
        assert s.task == task and s.id == f"{task}-11-{s.meta['index']}"
        _check_derivable(s)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_depth_parameter_places_the_needle(depth):
    for s in T.single_needle(WS, 3, 1000, seed=2, depth=depth):
        assert abs(s.depth - depth) < 0.035  # needles sit between sentences
    with pytest.raises(ValueError):
        T.single_needle(WS, 1, 1000, depth=1.5)


def test_kv_depth_is_the_queried_pair():
    s = T.kv_retrieval(WS, 1, 2000, seed=3, depth=0.5, n_pairs=40)[0]
    before = s.context[: s.context.index(f'"{s.meta["key"]}"')]
    assert s.depth == pytest.approx(len(before.split()) / s.meta["n_tokens"], abs=0.01)
    assert s.meta["block_depth"] <= s.depth


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    task=st.sampled_from(list(T.TASKS)),
    seed=st.one_of(st.integers(0, 10**9), st.text(min_size=1, max_size=8)),
    target=st.integers(200, 3000),
)
def test_property_any_seed_and_length(task, seed, target):
    (s,) = T.generate(task, WS, 1, target, seed)
    assert target * (1 - TOLERANCE) <= T.count_tokens(WS, s.context) <= target
    _check_derivable(s)


def test_generate_rejects_unknown_task():
    with pytest.raises(KeyError):
        T.generate("nope", WS, 1, 100)


# ------------------------------------------------------------------------------ scoring


def test_score():
    single = T.Sample("single_needle", "x", "ctx", "q", ["1234567"])
    assert T.score(single, "The number is 1234567.") == 1.0
    assert T.score(single, "The number is 1234568.") == 0.0
    assert T.score(single, "") == 0.0
    multi = T.Sample("variable_tracking", "y", "ctx", "q", ["ABCDE", "FGHIJ", "KLMNO", "PQRST"])
    assert T.score(multi, "abcde and fghij") == 0.5  # case-insensitive, fractional
    assert T.score(multi, "ABCDE FGHIJ KLMNO PQRST") == 1.0
    assert T.score({"answers": ["Lisbon"]}, "lisbon!") == 1.0  # lm-eval docs are dicts
    with pytest.raises(ValueError):
        T.score({"answers": []}, "x")


# ------------------------------------------------------------------------------ prompts


@pytest.mark.parametrize("task", list(T.TASKS))
@pytest.mark.parametrize("chat", [False, True])
def test_question_agnostic_split(task, chat):
    s = T.generate(task, WS, 1, 300, seed=8)[0]
    full = T.format_prompt(s, WS, chat=chat)
    prefix = T.format_prompt(s, WS, question_position="none", chat=chat)
    suffix = T.format_question(s, WS, chat=chat)
    assert prefix + suffix == full
    assert T.split_prompt(full) == (prefix, suffix)
    assert prefix.endswith("\n\nQuestion:") and suffix.startswith(" " + s.question)
    assert s.context in prefix and s.question not in prefix
    assert T.PREAMBLE in prefix
    if chat:
        assert full.startswith("<|im_start|>user\n")
        assert full.endswith("<|im_start|>assistant\n" + (s.answer_prefix or ""))
    else:
        answer = "Answer:" + (f" {s.answer_prefix}" if s.answer_prefix else "")
        assert full == f"{T.PREAMBLE}\n\n{s.context}\n\nQuestion: {s.question}\n{answer}"
    with pytest.raises(ValueError):
        T.format_prompt(s, WS, question_position="start")


def test_chat_without_tokenizer_is_an_error_and_auto_follows_the_template():
    s = T.generate("single_needle", WS, 1, 200, seed=0)[0]
    with pytest.raises(ValueError):
        T.format_prompt(s, None, chat=True)

    class Plain:
        chat_template = None

        def encode(self, text, add_special_tokens=False):
            return text.split()

    assert T.format_prompt(s, Plain(), chat=None).endswith("\nAnswer:")
    assert T.format_prompt(s, WS, chat=None).endswith("assistant\n")


def test_multiple_choice_continuations_and_answer_prefix():
    s = T.multiple_choice(WS, 1, 300, seed=1)[0]
    assert T.format_choices(s, chat=False) == [" " + c for c in s.choices]
    assert T.format_choices(s, WS, chat=True) == [" " + c for c in s.choices]
    plain = T.format_prompt(s, chat=False)
    assert plain.endswith(f"Question: {s.question}\nAnswer: {s.answer_prefix}")
    chat = T.format_prompt(s, WS, chat=True)
    assert chat.endswith(f"<|im_start|>assistant\n{s.answer_prefix}")
    assert T.format_question(s, WS, chat=True).endswith(s.answer_prefix)
    # Without an answer prefix, chat continuations follow the assistant header directly.
    row = {"context": "c", "question": "q", "choices": ["x", "y"]}
    assert T.format_choices(row, WS, chat=True) == ["x", "y"]
    assert T.format_choices(row, WS, chat=False) == [" x", " y"]
    with pytest.raises(ValueError):
        T.format_choices(T.single_needle(WS, 1, 200)[0], chat=False)


@pytest.mark.parametrize("same_kind", [False, True])
def test_multiple_choice_variants(same_kind):
    for s in T.multiple_choice(WS, 6, 600, seed=4, same_kind=same_kind):
        assert s.meta["same_kind"] is same_kind
        assert len(s.meta["facts"]) == 4
        _check_derivable(s)
    (s,) = T.multiple_choice(WS, 1, 600, seed=4, n_facts=1, n_choices=3)
    assert len(s.meta["facts"]) == 1 and len(s.choices) == 3
    with pytest.raises(ValueError):
        T.multiple_choice(WS, 1, 600, n_facts=5)


def test_token_prefix_split_with_real_bpe(bpe):
    """The question-agnostic prefix is a token prefix of the full prompt (cache reuse works)."""
    for task in T.TASKS:
        s = T.generate(task, bpe, 1, 600, seed=9)[0]
        for chat in (True, False):
            prefix = T.format_prompt(s, bpe, question_position="none", chat=chat)
            suffix = T.format_question(s, bpe, chat=chat)
            ids = bpe.encode(prefix, add_special_tokens=False)
            assert ids + bpe.encode(suffix, add_special_tokens=False) == bpe.encode(
                prefix + suffix, add_special_tokens=False
            )
            assert T.is_token_prefix(bpe, prefix, prefix + suffix)


def test_blank_line_boundary_would_not_be_clean_for_gpt2_style_bpe():
    """Why the split is after "Question:" and not after the blank line before it."""
    tok = _train_bpe("gpt2")
    assert not T.is_token_prefix(tok, "the end.\n\n", "the end.\n\nQuestion: What?")
    assert T.is_token_prefix(tok, "the end.\n\nQuestion:", "the end.\n\nQuestion: What?")
    assert not T.is_token_prefix(tok, "abc", "abd")


def test_approx_tokenizer():
    text = "\n\n".join(" ".join(p) for p in T.haystack_paragraphs())
    per_word = T.count_tokens(T.ApproxTokenizer(), text) / len(text.split())
    assert 1.2 < per_word < 1.6
    s = T.single_needle(T.ApproxTokenizer(), 1, 1000, seed=0)[0]
    assert 950 <= T.count_tokens(T.ApproxTokenizer(), s.context) <= 1000


def test_raw_tokenizers_encoding_is_accepted():
    tok = _train_bpe("gpt2")  # tokenizers.Tokenizer: encode() returns an Encoding
    s = T.single_needle(tok, 1, 500, seed=0)[0]
    assert 475 <= len(tok.encode(s.context, add_special_tokens=False).ids) <= 500


# ------------------------------------------------------------------------------ demo helpers


def _check_demo(doc: T.DemoDoc, tokenizer):
    assert len(doc.questions) == len(doc.answers) == 2 and doc.questions[0] != doc.questions[1]
    assert re.fullmatch(r"\d{7}", doc.answers[0]) and doc.answers[1] in prompts._CITIES
    assert f"is: {doc.answers[0]}." in doc.document
    assert f"The secret city is {doc.answers[1]}." in doc.document
    assert doc.document in doc.prefix and doc.prefix.endswith("Question:")
    for i, q in enumerate(doc.questions):
        prompt = doc.prompt(i)
        assert prompt == doc.prefix + doc.suffix(i) and prompt.startswith(doc.prefix)
        assert q in doc.suffix(i) and q not in doc.prefix
        assert T.is_token_prefix(tokenizer, doc.prefix, prompt)


def test_demo_document_whitespace():
    doc = T.demo_document(WS, context_tokens=1400, seed=0)
    assert doc.chat and doc.prompt(1).endswith("<|im_start|>assistant\n")
    _check_demo(doc, WS)
    assert 1400 * (1 - TOLERANCE) <= T.count_tokens(WS, doc.document) <= 1400
    assert T.demo_document(WS, 1400, seed=0) == doc
    assert T.demo_document(WS, 1400, seed=1).document != doc.document


def test_demo_document_real_bpe_chat_template(bpe):
    doc = T.demo_document(bpe, context_tokens=1400, seed=3)
    assert doc.chat and doc.prefix.startswith("<|im_start|>system\n")
    _check_demo(doc, bpe)
    plain = T.demo_document(bpe, context_tokens=1400, seed=3, chat=False)
    assert not plain.chat and plain.document == doc.document
    _check_demo(plain, bpe)


def test_passkey_prompt():
    prompt, expected, question = T.passkey_prompt(WS, context_tokens=500, seed=4)
    assert re.fullmatch(r"\d{7}", expected) and expected in prompt
    assert prompt.endswith(f"Question: {question}<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.index(expected) < prompt.index(question)
    assert T.passkey_prompt(WS, 500, seed=4) == (prompt, expected, question)


# ------------------------------------------------------------------------------ eval/make_tasks


def test_committed_yamls_match_the_renderer():
    rendered = make_tasks.render_yamls()
    on_disk = {p.name: p.read_text(encoding="utf-8") for p in make_tasks.TASKS_DIR.glob("*.yaml")}
    assert on_disk == rendered, "run `python -m eval.make_tasks --write-yamls`"
    for task in T.TASKS:
        assert f"jacap_{task}.yaml" in rendered
    assert (make_tasks.TASKS_DIR / "utils.py").is_file()


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_make_tasks_writes_rows(tmp_path):
    folder = tmp_path / "tok"
    pytest.importorskip("transformers").PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe("gpt2"), eos_token="<|im_end|>", chat_template=CHATML
    ).save_pretrained(folder)
    out = tmp_path / "data"
    args = ["--tokenizer", str(folder), "--out", str(out), "--n", "2", "--context-tokens", "500", "--seed", "7"]
    assert make_tasks.main(args) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["chat"] is True and manifest["generator_seed"] == 7
    assert set(manifest["tasks"]) == set(T.TASKS)
    for task in T.TASKS:
        rows = _read_jsonl(out / f"{task}.jsonl")
        assert len(rows) == 2
        for row in rows:
            assert row["prompt"] == row["context_prompt"] + row["question_suffix"]
            assert row["meta"]["split"] == "tuning" and row["meta"]["chat"] is True
            assert "<|im_start|>assistant\n" in row["prompt"]
            assert T.split_prompt(row["prompt"]) == (row["context_prompt"], row["question_suffix"])
            sample = T.Sample.from_dict(row)
            assert sample.to_dict() == {k: row[k] for k in sample.to_dict()}
            if task == "multiple_choice":
                assert row["continuations"] == [" " + c for c in row["choices"]]
                assert row["prompt"].endswith("<|im_start|>assistant\n" + row["answer_prefix"])
            else:
                assert row["continuations"] is None
    # The tuning split uses the seed as is; heldout is an independent draw.
    held = tmp_path / "held"
    assert make_tasks.main(args[:2] + ["--out", str(held), "--n", "2", "--context-tokens", "500",
                                       "--seed", "7", "--split", "heldout", "--tasks", "single_needle"]) == 0
    tuning_rows = _read_jsonl(out / "single_needle.jsonl")
    held_rows = _read_jsonl(held / "single_needle.jsonl")
    assert held_rows[0]["meta"]["split"] == "heldout"
    assert {r["answers"][0] for r in held_rows}.isdisjoint({r["answers"][0] for r in tuning_rows})
    assert tuning_rows[0]["meta"]["seed"] == 7 and held_rows[0]["meta"]["seed"] == "7-heldout"


def test_make_tasks_approx_is_plain(tmp_path):
    out = tmp_path / "approx"
    assert make_tasks.main(["--approx", "--out", str(out), "--n", "1", "--context-tokens", "400",
                            "--tasks", "multiple_choice,kv_retrieval"]) == 0
    (row,) = _read_jsonl(out / "multiple_choice.jsonl")
    assert row["prompt"].endswith("\nAnswer: " + row["answer_prefix"]) and row["meta"]["chat"] is False
    assert row["continuations"] == [" " + c for c in row["choices"]]
    assert not (out / "single_needle.jsonl").exists()
    with pytest.raises(SystemExit):
        make_tasks.main(["--approx", "--chat", "yes", "--out", str(out)])
    with pytest.raises(SystemExit):
        make_tasks.main(["--model", str(tmp_path / "missing-model"), "--out", str(out)])
    with pytest.raises(SystemExit):
        make_tasks.main(["--approx", "--tasks", "nope", "--out", str(out)])


def _load_lm_eval_utils():
    """eval/tasks/utils.py loaded by path, the way lm-eval loads `!function utils.x`."""
    spec = importlib.util.spec_from_file_location("jacap_lm_eval_utils", make_tasks.TASKS_DIR / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lm_eval_utils_data_dir_and_scoring(tmp_path, monkeypatch):
    utils = _load_lm_eval_utils()
    out = tmp_path / "d"
    make_tasks.main(["--approx", "--out", str(out), "--n", "2", "--context-tokens", "300", "--tasks", "single_needle"])
    monkeypatch.delenv("JACAP_TASKS_DATA", raising=False)
    assert utils.resolve_data_dir() == make_tasks.TASKS_DIR / "data"  # beside the YAMLs, any CWD
    rows = utils.read_rows("single_needle", out)
    assert len(rows) == 2
    monkeypatch.setenv("JACAP_TASKS_DATA", str(out))
    assert utils.read_rows("single_needle") == rows
    monkeypatch.chdir(tmp_path)
    assert utils.read_rows("single_needle", "d") == rows  # a typed relative path is CWD-relative
    with pytest.raises(FileNotFoundError, match="make_tasks"):
        utils.read_rows("kv_retrieval", out)
    doc = rows[0]
    assert utils.process_results(doc, [f"It is {doc['answers'][0]}."]) == {"score": 1.0}
    assert utils.process_results(doc, ["no idea"]) == {"score": 0.0}


def test_lm_eval_task_manager_builds_the_tasks(tmp_path):
    """Only where lm-eval (0.4.13, the `eval` extra) is installed."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("datasets")
    from lm_eval.tasks import TaskManager

    out = tmp_path / "data"
    make_tasks.main(["--approx", "--out", str(out), "--n", "2", "--context-tokens", "300"])
    manager = TaskManager(include_path=str(make_tasks.TASKS_DIR), include_defaults=False,
                          metadata={"data_dir": str(out)})
    loaded = manager.load([make_tasks.GROUP, "jacap_multiple_choice"])
    assert set(loaded["tasks"]) == {f"jacap_{t}" for t in T.TASKS}
    for task in loaded["tasks"].values():
        docs = list(task.test_docs())
        assert len(docs) == 2
        doc = docs[0]
        assert task.doc_to_text(doc) == doc["prompt"]
        if task.OUTPUT_TYPE == "multiple_choice":
            assert task.doc_to_choice(doc) == doc["continuations"]
            assert task.doc_to_target(doc) == doc["gold"]
        else:
            assert task.process_results(doc, [" ".join(doc["answers"])]) == {"score": 1.0}


def test_single_needle_code_values_are_hex_codes_and_numbers_stay_as_they_were():
    """``value="code"`` (the tuning side's long-value task, docs/method.md#d8-answers-kept-whole):
    an 8-4-4 hex code in the needle and the answer; the default's samples are unchanged."""
    number = T.generate("single_needle", WS, 2, 300, seed=0)
    again = T.single_needle(WS, 2, 300, 0, value="number")
    assert [s.context for s in number] == [s.context for s in again]
    code = T.single_needle(WS, 2, 300, 0, value="code")
    for s in code:
        (answer,) = s.answers
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}", answer)
        assert f"The special magic code for {s.meta['key']} is: {answer}." in s.context
        assert "special magic code" in s.question and s.meta["value"] == "code"
    with pytest.raises(ValueError, match="value must be"):
        T.single_needle(WS, 1, 300, 0, value="uuid")


# ------------------------------------------------------------------------------ jacap_attn/tasks


def test_shipped_tasks_match_the_renderer_and_their_manifest():
    """The tasks shipped in the package (``jacap_attn/tasks``, what the README's ``lm_eval`` line runs):
    each YAML is what ``python -m eval.make_tasks --write-package`` renders, names its hooks by import
    path, and has its data: :data:`eval.make_tasks.PACKAGED`'s count of rows with the kept fields, in
    SmolLM2's chat layout, scored as :func:`eval.synthetic.score` scores them."""
    import jacap_attn.tasks as shipped

    folder = Path(shipped.path())
    assert folder == make_tasks.PACKAGE_DIR
    assert {p.name for p in folder.glob("*.yaml")} == {f"{name}.yaml" for name in shipped.TASKS}
    manifest = json.loads((folder / "data" / "manifest.json").read_text())
    for name, stem in shipped.TASKS.items():
        assert (folder / f"{name}.yaml").read_text(encoding="utf-8") == make_tasks.packaged_yaml(stem)
        rows = shipped.read_rows(stem)
        assert len(rows) == make_tasks.PACKAGED[stem]["n"] == manifest["tasks"][stem]["n"]
        assert all(list(row) == list(make_tasks.PACKAGED_FIELDS) for row in rows)
        assert all(row["prompt"].startswith("<|im_start|>system") and row["answers"] for row in rows)
        for row in rows[:3]:
            for text in (f"It is {row['answers'][0]}.", "no idea"):
                assert shipped.process_results(row, [text]) == {"score": T.score(row, text)}
    assert manifest["fields"] == list(make_tasks.PACKAGED_FIELDS) and manifest["chat"] is True
    with pytest.raises(FileNotFoundError, match="no task data"):
        shipped.read_rows("single_needle", str(folder / "nowhere"))


@pytest.mark.slow
def test_shipped_task_data_is_what_make_tasks_writes(tmp_path):
    """Regenerated with SmolLM2's tokenizer (the embedded model, fetched once), the shipped data is
    byte for byte the same; skipped on another Python, whose ``pydoc_data`` corpus differs."""
    import jacap_attn.tasks as shipped

    manifest = json.loads((Path(shipped.path()) / "data" / "manifest.json").read_text())
    if manifest["corpus"] != T.CORPUS_FINGERPRINT:
        pytest.skip(f"the shipped data was made on corpus {manifest['corpus']}, this Python has {T.CORPUS_FINGERPRINT}")
    tokenizer = make_tasks.load_tokenizer(make_tasks.resolve_model("smollm2"))
    make_tasks.write_package(tokenizer, "smollm2", True, tmp_path)
    for stem in shipped.TASKS.values():
        assert (tmp_path / "data" / f"{stem}.jsonl").read_bytes() == shipped.data_path(stem).read_bytes()
    assert json.loads((tmp_path / "data" / "manifest.json").read_text()) == manifest
