"""The quality benchmark (eval/quality.py): its record-once/replay path equals the normal patch +
compress path; its result-cache keys; ``--report-only`` reproduces every published table."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import torch

from conftest import random_ids, tiny_model
from jacap_attn.config import OPTIONS_BEFORE
from jacap_attn.patching import compress, patch, unpatch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `eval` is a top-level folder of the repository, not installed
    sys.path.insert(0, str(ROOT))

from eval import quality, quality_report  # noqa: E402

PROMPT = 80
STEPS = 3


def _kept(cache):
    """Per layer, per (batch, head), the sorted kept logical positions of the prompt."""
    out = []
    for layer in cache.layers:
        n = int(layer.write_pos)
        pos, valid = layer.positions[..., :n], layer.valid[..., :n]
        out.append([sorted(pos[b, h][valid[b, h]].tolist()) for b in range(pos.shape[0]) for h in range(pos.shape[1])])
    return out


def _greedy(model, ids, cache):
    with torch.no_grad():
        return model.generate(ids, cache=cache, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                              disable_compile=True)[:, ids.shape[1]:]


# Every row on Llama; on Gemma3 (sliding layers) the rows whose selection paths differ (budget
# policies, consensus, per-head budgets, all-query scores, per-layer seeds).
CASES = [("llama", label) for label in sorted(quality.VARIANTS)] + [
    ("gemma3_text", label) for label in ("full", "jacap", "jacap+capacity", "jacap-per-head", "jacap+pyramid",
                                         "adakv", "h2o", "random", "capkv")]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_replay_matches_patch_and_compress(family):
    labels = [label for fam, label in CASES if fam == family]
    model = tiny_model(family)
    ids = random_ids(1, PROMPT)
    question = random_ids(1, 7, seed=3)
    record = quality.record_prefill(model, ids[:, :-1])  # patches with method="full"
    record_ctx = quality.record_prefill(model, ids)
    unpatch(model)
    for label in labels:
        method, opts = quality.VARIANTS[label]
        config = quality.make_config(method, opts, 0.25)
        # Normal path.
        patch(model, ratio=config.ratio, method=method, compile=False, **quality.row_options(opts, 0.25)[0])
        ref_cache = compress(model, ids[:, :-1])
        ref_kept, ref_tokens = _kept(ref_cache), _greedy(model, ids, ref_cache)
        ref_agn = _greedy(model, torch.cat([ids, question], 1), compress(model, ids))
        unpatch(model)
        # Replay path (the model patched with any method).
        quality.ensure_patched(model)
        cache = quality.replay_cache(model, record, config, ids[:, :-1])
        assert _kept(cache) == ref_kept, label
        assert torch.equal(_greedy(model, ids, cache), ref_tokens), label
        agn = _greedy(model, torch.cat([ids, question], 1), quality.replay_cache(model, record_ctx, config, ids))
        assert torch.equal(agn, ref_agn), label
        unpatch(model)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_one_prefill_for_both_settings_equals_separate_prefills(family):
    """A prompt that is a token prefix of a longer one (the agnostic context part of the aware
    prompt) gets its record cut out of the longer one's prefill: per layer the same queries, keys,
    values and scaling as a prefill of its own (causal attention; up to summation order), and the
    same selection replayed from it. A prompt that is no prefix gets its own prefill."""
    model = tiny_model(family)
    ids = random_ids(1, PROMPT)
    m = 57
    counters = {}
    records = quality.record_prompts(model, {"agnostic": ids[:, :m], "aware": ids}, counters)
    assert len(counters["prefill_s"]) == 1 and counters["shared"] == 1
    separate = quality.record_prefill(model, ids[:, :m])
    assert len(records["agnostic"]) == len(separate) == model.config.num_hidden_layers
    for cut, alone in zip(records["agnostic"], separate):
        assert cut[3] == alone[3]
        for a, b in zip(cut[:3], alone[:3]):
            assert a.shape == b.shape and a.shape[-2] == m
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for label in ("jacap", "snapkv", "jacap+pyramid", "jacap, stored whole, reselected"):
        config = quality.make_config(*quality.variant(label), 0.25)
        assert _kept(quality.replay_cache(model, records["agnostic"], config, ids[:, :m])) == \
            _kept(quality.replay_cache(model, separate, config, ids[:, :m])), label
    other = ids.clone()
    other[0, 3] = (other[0, 3] + 1) % 96  # no longer a prefix of the longer prompt
    counters = {}
    records = quality.record_prompts(model, {"aware": ids, "agnostic": other[:, :m]}, counters)
    assert len(counters["prefill_s"]) == 2 and counters.get("shared", 0) == 0
    for a, b in zip(records["agnostic"], quality.record_prefill(model, other[:, :m])):
        assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3]))
    unpatch(model)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_span_recall_counts_the_kept_value_tokens(family):
    """StreamingLLM at 25% of 200 tokens keeps the 4 sinks and the last 46 positions in every layer
    it compresses: a value in the sinks has recall 1, one in the middle 0, one half in each 0.5. On
    Gemma only the full-attention layer counts (its sliding layers hold their window, which holds
    no sink). ``full`` compresses nothing: no recall. Route B is measured after the question's cut."""
    model = tiny_model(family)
    ids = random_ids(1, 200)
    question = random_ids(1, 6, seed=3)
    record = quality.record_prefill(model, ids)
    stream = lambda: quality.replay_cache(model, record, quality.make_config("streaming_llm", {}, 0.25), ids)  # noqa: E731
    assert quality.span_recall(model, stream(), question, [1, 2]) == 1.0
    assert quality.span_recall(model, stream(), question, [40, 41]) == 0.0
    assert quality.span_recall(model, stream(), question, [2, 40]) == 0.5
    assert quality.span_recall(model, stream(), question, None) is None
    full = quality.replay_cache(model, record, quality.make_config("full", {}, 1.0), ids)
    assert quality.span_recall(model, full, question, [1, 2]) is None
    stored = lambda: quality.replay_cache(model, record, quality.make_config("jacap", {"store": 1.0}, 0.1), ids)  # noqa: E731
    middle = list(range(10, 190))
    assert quality.span_recall(model, stored(), question[:, :1], middle) == 1.0  # one token: no reselection
    assert quality.span_recall(model, stored(), question, middle) < 0.5  # cut to 10% of the held entries
    unpatch(model)


def test_span_recall_table_and_old_results_without_it():
    """Rows with span recalls get the span-recall table (over the samples the full cache answers
    right, and over all) and per-task columns; a row whose results carry none shows ``–``; tables
    without any span recall render as before (``test_published_tables_render_from_their_json``)."""
    class A:
        split = "heldout"

    raw = [("t1", "aware", "full", 0.1, f"s{i}", float(i < 2), None) for i in range(4)]
    raw += [("t1", "aware", "jacap", 0.1, f"s{i}", float(i == 0), [1.0, 0.5, 0.0, 0.25][i]) for i in range(4)]
    raw += [("t1", "aware", "snapkv", 0.1, f"s{i}", 0.0) for i in range(4)]  # cached before the metric
    rows = quality.aggregate(raw, [], "tiny", A)
    jacap = next(r for r in rows if r["label"] == "jacap")
    assert jacap["span_recall"] == {"s0": 1.0, "s1": 0.5, "s2": 0.0, "s3": 0.25}
    assert all("span_recall" not in r for r in rows if r["label"] != "jacap")
    assert quality_report.span_recall(rows, "aware", "jacap", 0.1, ["t1"], True) == (0.75, 2)
    assert quality_report.span_recall(rows, "aware", "jacap", 0.1, ["t1"], False) == (0.4375, 4)
    md = quality_report.markdown_table(rows, "python -m eval.quality --x", "tiny", "heldout", ["t1"], [0.1], 4,
                                       ["full", "jacap", "snapkv"])
    assert "| method | recall@0.1 right | recall@0.1 all |" in md
    assert "| jacap | 0.750 (2) | 0.438 (4) |" in md and "| snapkv | – | – |" in md
    assert "| aware | t1 | jacap | 0.1 | 4 | 0.250 [0.05, 0.70] | 0.250 | 0.750 (2) | 0.438 (4) |" in md
    plain = quality_report.markdown_table(quality.aggregate([r[:6] for r in raw], [], "tiny", A), "c", "tiny",
                                          "heldout", ["t1"], [0.1], 4, ["full", "jacap", "snapkv"])
    assert "recall" not in plain


def test_recording_uses_the_library_hook_and_changes_nothing_global():
    """The harness records through the cache's documented ``on_prefill`` hook; no module global of
    the library is replaced, and a cache without the hook is unaffected."""
    from jacap_attn import selection
    from jacap_attn.selection import scorer

    before = (scorer.score_layer, selection.finalize_prefill)
    model = tiny_model("llama")
    record = quality.record_prefill(model, random_ids(1, 40))
    assert (scorer.score_layer, selection.finalize_prefill) == before
    assert len(record) == model.config.num_hidden_layers
    query, keys, values, scaling = record[0]
    assert query.shape[-2] == keys.shape[-2] == values.shape[-2] == 40 and isinstance(scaling, float)


@pytest.mark.parametrize("other", [{"repeat_chunk": 64}, {"repeat_ids": (9, 10, 11)}])
def test_rows_share_a_repeat_pass_only_when_they_run_the_same_one(other):
    """The rows of a sample share the repeat pass's statistics; a row with another pass (``repeat_chunk``,
    ``repeat_ids``) was answered from the first row's pass (its selection, under its own result key)."""
    model = tiny_model("llama")
    ids = random_ids(1, 300)
    record = quality.record_prefill(model, ids)

    def held(options, observed):
        cache = quality.row_cache(model, record, ids, "jacap", {"queries": "repeat", **options}, 0.2,
                                  repeat_ids=(5, 6, 7), parts={}, observed=observed)
        return [layer.valid.clone() for layer in cache.layers]

    shared: dict = {}
    first, after = held({}, shared), held(other, shared)
    alone = held(other, {})
    assert all(torch.equal(a, b) for a, b in zip(after, alone))
    assert not all(torch.equal(a, b) for a, b in zip(first, alone))  # the two passes select differently here
    assert all(torch.equal(a, b) for a, b in zip(held({}, shared), first))  # the same pass is still shared
    unpatch(model)


def test_fidelity_full_is_zero_and_compression_is_not():
    model = tiny_model("llama")
    ids = random_ids(1, PROMPT + 17)
    prefix, cont = ids[:, :PROMPT], ids[:, PROMPT:]
    record = quality.record_prefill(model, prefix)
    ref_logp, ref_nll, _ = quality.fidelity(model, record, prefix, cont, quality.make_config("full", {}, 1.0))
    assert ref_logp.shape[0] == cont.shape[1] - 1
    _, _, same = quality.fidelity(model, record, prefix, cont, quality.make_config("full", {}, 1.0), (ref_logp, ref_nll))
    assert abs(same["kl"]) < 1e-6 and abs(same["nll_increase"]) < 1e-6
    _, _, res = quality.fidelity(model, record, prefix, cont, quality.make_config("streaming_llm", {}, 0.1),
                                 (ref_logp, ref_nll))
    assert res["kl"] > 0
    unpatch(model)


def test_table_marks_best_and_states_the_command():
    class A:
        split = "heldout"

    raw = [("t1", "aware", label, 0.1, f"s{i}", float(i % 2 == 0 or label == "jacap"))
           for label in ("full", "jacap", "snapkv") for i in range(2)]
    fid = [("jacap", 0.1, 0.2, 0.1), ("snapkv", 0.1, 0.3, 0.2)]
    rows = quality.aggregate(raw, fid, "tiny", A)
    md = quality_report.markdown_table(rows, "jacap bench quality --x", "tiny", "heldout", ["t1"], [0.1], 2,
                                ["full", "jacap", "snapkv"])
    assert "`jacap bench quality --x`" in md
    assert "| jacap | **1.000** [0.34, 1.00] | **0.200** |" in md
    assert "| snapkv | 0.500 [0.09, 0.91] | 0.300 |" in md


def test_configs_are_consistent():
    for name in ("quality_quick.json", "quality_full.json", "quality.json", "quality_agnostic.json"):
        cfg = quality.load_config(quality.CONFIG_DIR / name)
        assert set(cfg["methods"]) <= set(quality.VARIANTS) and "full" in cfg["methods"]
        assert cfg["splits"]["tuning"]["seed"] != cfg["splits"]["heldout"]["seed"]
        assert all(0 < r <= 1 for r in cfg["ratios"])
    agnostic = quality.load_config(quality.CONFIG_DIR / "quality_agnostic.json")
    assert agnostic["settings"] == ["agnostic"] and agnostic["n"] >= 24
    full = quality.load_config(quality.CONFIG_DIR / "quality.json")
    assert full["n"] >= 24  # decisions about the method rest on at least 24 samples per task
    from jacap_attn import methods

    builtin = {m for m in methods.names() if methods.get_method(m).__module__.startswith("jacap_attn.methods.")}
    assert set(full["methods"]) >= builtin  # every built-in method, each in its own row (not a test's own)
    assert all(quality.variant(label) for label in quality.ABLATION)  # the Jacap variants: the ablation


def test_unknown_method_row_is_rejected():
    with pytest.raises(SystemExit, match="unknown method row 'nope'"):
        quality.quality_main(["--quick", "--methods", "jacap", "nope"])
    with pytest.raises(SystemExit, match="ridge"):
        quality.quality_main(["--quick", "--methods", "snapkv[ridge=1]"])
    with pytest.raises(SystemExit, match="not in"):
        quality.quality_main(["--quick", "--models", "nope"])


def test_rows_named_after_an_earlier_default_run_that_default_without_todays_carry():
    """Rows named after an earlier default ran, and still run, without the carry that is Jacap's
    default since 2026-12-05 (before the fix they picked it up, and their published rows changed)."""
    for label in ("jacap (2026-11-30 defaults)", "jacap (consensus 0.25)",
                  "jacap (consensus 0.25), stored whole, reselected", "defaults of 2026-11-30",
                  "defaults before 2026-11-30"):
        options = quality.make_config(*quality.variant(label), 0.1).method.options()
        assert {name: options[name] for name in OPTIONS_BEFORE["jacap"]} == OPTIONS_BEFORE["jacap"], label
        assert "carry" not in quality._resolved(*quality.variant(label), 0.1), label  # their earlier results' keys
    assert quality.make_config(*quality.variant("jacap"), 0.1).method.carry == 1.0


def test_lookup_ahead_is_keyed_only_on_chunked_rows():
    """``lookup_ahead`` acts only in a chunked prefill: a one-shot row's key never records it (its cached
    results stay valid whatever its default), a chunked row's records it off the default of its first
    results (off), so the two chunked rows never share results."""
    one_shot = quality._resolved("jacap", {}, 0.1)
    assert quality._resolved("jacap", {"lookup_ahead": True}, 0.1) == one_shot
    assert quality._resolved("jacap", {"lookup_ahead": False}, 0.1) == one_shot
    plain = quality._resolved("jacap", {"chunk_size": 1024, "chunk_scores": "repeat", "lookup_ahead": False}, 0.1)
    ahead = quality._resolved("jacap", {"chunk_size": 1024, "chunk_scores": "repeat", "lookup_ahead": True}, 0.1)
    assert "lookup_ahead" not in plain and ahead == {**plain, "lookup_ahead": True}
    # the default chunked row records it (on since 2026-12-06); the row named for the earlier default does not
    assert quality._resolved(*quality.variant("jacap, chunked 1024, repeat"), 0.1) == ahead
    assert quality._resolved(*quality.variant("jacap, chunked 1024, repeat, no lookup ahead"), 0.1) == plain


def test_ad_hoc_rows_and_kvpress_rows():
    assert quality.variant("jacap[ridge=1,pooling=max,selector=greedy]") == (
        "jacap", {"ridge": 1, "pooling": "max", "selector": "greedy"})
    assert quality.variant("jacap+greedy") == ("jacap", {"selector": "greedy"})
    assert quality.variant("kvpress:snapkv") == ("kvpress", {"press": "kvpress:snapkv"})
    for bad in ("jacap[ridge]", "jacap[nope=1]", "jacap[pooling=median]", "kvpress:nope", "jacap[ratio=0.5]",
                "jacap[method=full]", "jacap[ridge=1,ridge=2]"):
        with pytest.raises(ValueError):
            quality.variant(bad)
    # kvpress rows and our rows never share a result-cache key; kvpress's key depends on the ratio.
    ours = quality.task_key("m", "t", "s", "aware", "snapkv", {}, 0.1, 32, 100, True)
    theirs = quality.task_key("m", "t", "s", "aware", "kvpress", {"press": "kvpress:snapkv"}, 0.1, 32, 100, True)
    other = quality.task_key("m", "t", "s", "aware", "kvpress", {"press": "kvpress:snapkv"}, 0.05, 32, 100, True)
    assert len({ours, theirs, other}) == 3


def test_kvpress_merge_scores_with_our_scorer(tmp_path):
    import json

    from eval.kvpress import bridge

    requests = {"requests": [{"key": "a", "kind": "task"}, {"key": "b", "kind": "task"},
                             {"key": "c", "kind": "fidelity"}],
                "answers": {"a": {"answers": ["4989595"]}, "b": {"answers": ["Budapest", "Paris"]}}}
    (tmp_path / "req.json").write_text(json.dumps(requests))
    lines = [{"key": "a", "text": "The number is 4989595."}, {"key": "b", "text": "paris"},
             {"key": "c", "kl": 0.25, "nll": 3.0, "nll_increase": 0.5}, {"key": "zz", "text": "ignored"}]
    (tmp_path / "res.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert bridge.merge(str(tmp_path / "req.json"), str(tmp_path / "res.jsonl"), tmp_path / "cache") == 0
    store = quality.ResultCache(tmp_path / "cache")
    assert store.get("a")["score"] == 1.0 and store.get("b")["score"] == 0.5
    assert store.get("c")["kl"] == 0.25 and store.get("zz") is None
    # A duplicated line does not hide a missing result; a truncated last line is skipped.
    (tmp_path / "dup.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines[:1] * 2 + lines[2:3])
                                        + '{"key": "b", "te')
    assert bridge.merge(str(tmp_path / "req.json"), str(tmp_path / "dup.jsonl"), tmp_path / "cache2") == 1
    (tmp_path / "bad.jsonl").write_text('{"key": "a"\n' + json.dumps(lines[1]) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        bridge.merge(str(tmp_path / "req.json"), str(tmp_path / "bad.jsonl"), tmp_path / "cache3")
    (tmp_path / "notext.jsonl").write_text(json.dumps({"key": "a", "answer": "x"}) + "\n")
    with pytest.raises(ValueError, match="has no text"):
        bridge.merge(str(tmp_path / "req.json"), str(tmp_path / "notext.jsonl"), tmp_path / "cache4")


def test_result_keys_follow_what_a_row_depends_on():
    """A knob added later (``mass``) leaves the keys of the rows it cannot change as they were; a
    Jacap row's key carries the version of Jacap's scoring, so results of an earlier scoring are
    never reused; changing a knob changes the key."""
    snapkv = quality._resolved("snapkv", {}, 0.1)
    assert "mass" not in snapkv and "jacap_scoring" not in snapkv
    # Jacap's consensus default changed after CACHE_VERSION 1; SnapKV's key is still its v1 key
    # (the published results in eval/cache were computed under it).
    assert snapkv["consensus"] == 0.5
    assert quality.fidelity_key("smollm2", 0, "heldout", "snapkv", {}, 0.1, 1500, 64) == "2219c3c666cbb9f7dc37a08e"
    jacap = quality._resolved("jacap", {}, 0.1)
    assert jacap["jacap_scoring"] == quality.JACAP_SCORING_VERSION and "mass" not in jacap
    key = lambda method, opts: quality.fidelity_key("smollm2", 0, "tuning", method, opts, 0.1, 1500, 64)  # noqa: E731
    assert key("jacap", {}) != key("jacap", {"mass": 0.0}) != key("jacap", {"sinks": 0})
    assert key("jacap", {}) == key("jacap", {})
    # The global budget's options (added later) enter a key only away from their defaults.
    assert key("jacap", {"budget": "global"}) == key("jacap", {"budget": "global", "head_floor": 0.2})
    assert len({key("jacap", {"budget": "global"}), key("jacap", {"budget": "global", "head_floor": 0.5}),
                key("jacap", {"budget": "global", "global_score": "normalized"})}) == 3
    # Jacap options added since the flat settings (units, issue 34) enter a key only away from their
    # defaults, given explicitly or not; the carry's, away from its default before 2026-12-05 (off): the
    # default since then shares the key of the row that gave its values, and none of the rows before it.
    carried = {"carry": 1.0, "carry_len": 8, "carry_count": 16, "carry_by": "last"}
    assert key("jacap", {}) == key("jacap", {"units": "none", "unit_len": 64, **carried})
    before = {"carry": 0.0, "carry_len": 64, "carry_count": 0, "carry_by": "score"}
    assert key("jacap", before) == key("jacap", {"units": "none", **before}) != key("jacap", {})
    assert not set(before) & set(quality._resolved("jacap", before, 0.1))  # the keys its results were cached under
    assert len({key("jacap", {}), key("jacap", {"units": "clauses"}), key("jacap", {"units": "clauses", "carry": 0.5}),
                key("jacap", {"units": "clauses", "unit_len": 32})}) == 4
    # A shared setting added since (lookahead, issue 34) too: once it was missing, and a lookahead row
    # and the default row shared one key, so that one's answers were reported for both.
    assert key("jacap", {}) == key("jacap", {"lookahead": 0}) != key("jacap", {"lookahead": 16})
    # chunk_mass (2026-12-06) too: a mass row once shared the chunked default's key and was answered by its results.
    chunked = {"chunk_size": 1024, "chunk_scores": "repeat"}
    assert key("jacap", chunked) == key("jacap", {**chunked, "chunk_mass": False}) != key("jacap", {**chunked, "chunk_mass": True})
    assert key("jacap", {}) == key("jacap", {"chunk_mass": True})  # acts only on a chunked prefill
    # mass_cosine (2026-12-06) too: a gated mass row once shared the ungated row's key.
    massed = {**chunked, "chunk_mass": True}
    assert key("jacap", massed) == key("jacap", {**massed, "mass_cosine": -1.0}) \
        != key("jacap", {**massed, "mass_cosine": 0.95})


def test_every_shared_setting_can_enter_a_result_key():
    """Every setting of ``JacapConfig`` is either a flat setting of the first cache version or a later one
    with its value from before (``_LATER_SETTINGS``): a setting known to neither would never enter a
    key, and rows differing only in it would share their results."""
    from jacap_attn.config import COMMON_OPTIONS

    known = set(quality._FLAT_OPTIONS["jacap"]) | set(quality._V1_DEFAULTS) | set(quality._LATER_SETTINGS)
    assert [name for name in COMMON_OPTIONS if name not in known] == []


# ------------------------------------------------------------------------------ published tables
RESULTS = ROOT / "eval" / "results"
PUBLISHED = sorted(p for pattern in ("quality_*.json", "ablation_*.json") for p in RESULTS.glob(pattern))
# Superseded tables (eval/results/history/): they still render from their JSON.
HISTORY = sorted((RESULTS / "history").glob("*.json"))
# Tables rendered before the renderer changed, kept as published. quality_smollm2_heldout_quick.md
# was written by the renderer of commit 1d3fbab, which bolded the best accuracy of a column even
# when every row scored 0; commit 1ac02e2 stopped bolding all-zero columns ("no bold for all-zero")
# and did not rerun the quick table. Only that bold markup differs.
OLDER_RENDERER = {"quality_smollm2_heldout_quick.json"}


def _published_md(path: Path, rendered: str) -> None:
    committed = path.with_suffix(".md").read_text()
    if path.name in OLDER_RENDERER:
        assert rendered != committed and rendered.replace("**", "") == committed.replace("**", ""), path.name
    else:
        assert rendered == committed, path.name


def test_published_tables_render_from_their_json():
    assert len(PUBLISHED) >= 4 and len(HISTORY) >= 8
    for path in PUBLISHED + HISTORY:
        _published_md(path, quality.render_saved(json.loads(path.read_text())))


def test_report_only_without_the_result_cache_rewrites_the_published_tables(tmp_path, capsys):
    """A fresh clone has no eval/cache: ``--report-only`` with the arguments of a published run (its
    recorded command) re-renders the table from the saved JSON, without loading a model."""
    for path in PUBLISHED:
        saved = json.loads(path.read_text())
        out = tmp_path / path.stem
        out.mkdir()
        (out / path.name).write_text(path.read_text())
        # The window16 runs wrote to /tmp (--out-dir) and were renamed into eval/results: --tag names them.
        base = f"ablation_{saved['model']}" if path.name.startswith("ablation_") else \
            f"quality_{saved['model']}_{saved['split']}"
        argv = quality.saved_argv(saved) + [
            "--report-only", "--no-plots", "--threads", "1", "--cache-dir", str(tmp_path / "empty-cache"),
            "--out-dir", str(out), "--tag", path.stem[len(base):]]
        assert quality.quality_main(argv) == 0, path.name
        assert sorted(p.name for p in out.iterdir()) == [path.name, path.with_suffix(".md").name]
        assert (out / path.name).read_text() == path.read_text()  # the saved results stay as they are
        _published_md(path, (out / path.with_suffix(".md").name).read_text())
    assert "re-rendered from" in capsys.readouterr().err


def test_report_only_never_replaces_a_table_of_another_grid_or_with_nothing(tmp_path):
    """``--report-only`` with an empty result cache and arguments that are not a published file's own (another
    ``--n``, or ``--methods``) replaced that file with a table of no rows (249,765 bytes -> 651): it now refuses and
    leaves it as it is; an empty run writes nothing either."""
    path = next(p for p in PUBLISHED if not p.name.startswith("ablation_") and not p.stem.endswith("_quick"))
    saved = json.loads(path.read_text())
    out = tmp_path / "out"
    out.mkdir()
    (out / path.name).write_text(path.read_text())
    base = f"quality_{saved['model']}_{saved['split']}"
    argv = quality.saved_argv(saved) + ["--report-only", "--no-plots", "--threads", "1", "--n", "2", "--cache-dir",
                                        str(tmp_path / "empty"), "--out-dir", str(out), "--tag", path.stem[len(base):]]
    with pytest.raises(SystemExit, match="holds another grid.*nothing written"):
        quality.quality_main(argv)
    assert (out / path.name).read_text() == path.read_text() and not (out / path.with_suffix(".md").name).exists()
    with pytest.raises(SystemExit, match="holds none of the"):  # no file of its own, nothing cached: nothing to table
        quality.quality_main(argv[:-1] + ["_new"])
    assert sorted(p.name for p in out.iterdir()) == [path.name]


def test_report_only_tables_the_result_cache(tmp_path):
    """With every result cached, ``--report-only`` tables the cache (and records the labels)."""
    args = quality.build_parser().parse_args(["--quick", "--no-fidelity", "--cache-dir", str(tmp_path / "c")])
    args.split = "heldout"
    cfg = quality.load_config(quality.config_path(args))
    variants = quality.resolve_variants(args, cfg)
    grid = quality.resolve_grid(cfg, args, "smollm2")
    store = quality.ResultCache(tmp_path / "c")
    for index in range(grid.n):
        for label, (method, opts) in variants.items():
            key = quality.task_key("smollm2", "single_needle", grid.sample_id("single_needle", index),
                                   "aware", method, opts, 1.0 if method == "full" else 0.1, grid.max_new["single_needle"],
                                   grid.ctx, grid.chat)
            store.put(key, {"score": float(label == "full" or index == 0)})
    argv = ["--quick", "--no-fidelity", "--report-only", "--no-plots", "--threads", "1", "--cache-dir",
            str(tmp_path / "c"), "--out-dir", str(tmp_path / "out")]
    assert quality.quality_main(argv) == 0
    saved = json.loads((tmp_path / "out" / "quality_smollm2_heldout_quick.json").read_text())
    assert saved["labels"] == list(variants) == quality.saved_labels(saved)
    assert saved["command"] == "python -m eval.quality " + shlex.join(argv)
    md = (tmp_path / "out" / "quality_smollm2_heldout_quick.md").read_text()
    assert md == quality.render_saved(saved) and "| jacap | **0.500** [0.09, 0.91] |" in md


def test_cache_keys_use_the_ids_of_the_generated_samples():
    class Words:
        def encode(self, text, add_special_tokens=False):
            return text.split()

    grid = quality.Grid(model="x", chat=False, ctx=300, seed=5000, n=2, ratios=[0.1], settings=["aware"],
                        tasks=["single_needle", "kv_retrieval", "multikey_8"], max_new={}, n_prose=0, prose_ctx=0,
                        prose_tokens=0, variants={"multikey_8": {"task": "multikey_needle", "n_keys": 8}})
    for task in grid.tasks:
        samples = grid.samples(task, Words())
        assert [s.id for s in samples] == [grid.sample_id(task, i) for i in range(2)]
    # A task variant: the generator's options apply, and its label (part of every key) is its own.
    assert len(grid.samples("multikey_8", Words())[0].meta["keys"]) == 8
    assert grid.spec("multikey_8") == ("multikey_needle", {"n_keys": 8})
    key = lambda task: quality.task_key("x", task, grid.sample_id(task, 0), "aware", "full", {}, 1.0, 32, 300, False)
    assert key("multikey_8") != key("multikey_needle")


def test_jacap_bench_names_the_replacing_commands(capsys):
    from jacap_attn import cli

    assert cli.main(["bench", "quality", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "python -m eval.quality --quick" in err and "make bench-quality" in err and "make bench " in err
    assert cli.main(["bench"]) == 2


def test_an_int8_row_answers_from_a_reloaded_8_bit_file_under_its_own_key():
    """``jacap, stored whole, reselected, int8`` (issue 24): the same config as the stored-whole row
    (its key adds only ``file_quantize``), answered from a saved and reloaded file of 8-bit entries."""
    method, opts = quality.variant("jacap, stored whole, reselected, int8")
    plain = quality._spec("jacap", {"store": 1.0}, 0.1, 1000)
    spec = quality._spec(method, opts, 0.1, 1000)
    assert spec == {**plain, "file_quantize": "int8"}
    assert quality.make_config(method, opts, 0.1) == quality.make_config("jacap", {"store": 1.0}, 0.1)
    model = tiny_model("llama")
    patch(model, ratio=1.0, reselect=0.3, window=8)
    ids = random_ids(1, 80)
    cache = compress(model, ids)
    loaded = quality.file_round_trip(model, cache, ids, "int8")
    assert loaded is not cache and loaded.config.reselect == 0.3
    for a, b in zip(cache.layers, loaded.layers):
        ka, _, pa, ma = a.export()
        kb, _, pb, mb = b.export()
        assert torch.equal(pa[ma], pb[mb]) and not torch.equal(ka[ma], kb[mb])  # 8-bit: close, not equal
        assert float((ka[ma] - kb[mb]).abs().max()) < 0.01 * float(ka[ma].abs().max())
    unpatch(model)


def test_kvpress_adakv_row_wraps_snapkv_at_the_removed_fraction(monkeypatch):
    """``kvpress:adakv`` is kvpress's AdaKVPress over its SnapKVPress (our window and kernel); the
    inner press gets the removed fraction ``1 - ratio``, the wrapper none of its own."""
    import sys
    import types

    sys.path.insert(0, str(quality.pathlib.Path(quality.__file__).parent / "kvpress"))
    try:
        import run_presses
    finally:
        sys.path.pop(0)

    class Press:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    fake = types.SimpleNamespace(AdaKVPress=type("AdaKVPress", (Press,), {}),
                                 SnapKVPress=type("SnapKVPress", (Press,), {}))
    monkeypatch.setitem(sys.modules, "kvpress", fake)
    name, kwargs = quality.KVPRESS["kvpress:adakv"]
    press = run_presses.make_press(name, kwargs, 0.25)
    assert type(press).__name__ == "AdaKVPress" and set(press.kwargs) == {"press"}
    inner = press.kwargs["press"]
    assert type(inner).__name__ == "SnapKVPress"
    assert inner.kwargs == {"compression_ratio": 0.75, "window_size": 32, "kernel_size": 5}
    plain = run_presses.make_press(*quality.KVPRESS["kvpress:snapkv"], 0.1)
    assert plain.kwargs["compression_ratio"] == pytest.approx(0.9)



def test_a_run_shards_its_samples_over_processes():
    """``--shard K/N``: N processes share a run, each computing every N-th sample of each task from K
    (disjoint, together every sample); a bad value or one with ``--report-only`` is refused."""
    samples = list(range(7))
    shards = [quality.shard_of(samples, quality.build_parser().parse_args(["--shard", f"{k}/3"]).shard)
              for k in range(3)]
    assert shards == [[0, 3, 6], [1, 4], [2, 5]] and quality.shard_of(samples, None) == samples
    for bad in ("2/2", "1", "a/b", "-1/2"):
        with pytest.raises(SystemExit):
            quality.build_parser().parse_args(["--shard", bad])
    with pytest.raises(SystemExit):
        quality.quality_main(["--quick", "--report-only", "--shard", "0/2"])
    with pytest.raises(SystemExit):  # once: each shard wrote its half over the run's own table
        quality.quality_main(["--quick", "--shard", "0/2"])


@pytest.mark.parametrize("argv, match", [(["--ratios", "1.5"], r"kept fractions in \(0, 1\], got \[1.5\]"),
                                         (["--ratios", "0"], r"got \[0.0\]"),
                                         (["--tasks", "bogus"], r"unknown --tasks \['bogus'\]")])
def test_grid_arguments_are_named_before_a_model_loads(argv, match, monkeypatch):
    """``--ratios 1.5`` and ``--tasks bogus`` once failed with a bare ValueError / KeyError after the model loaded."""
    monkeypatch.setattr(quality, "run_model", lambda *a, **k: pytest.fail("the model ran before the check"))
    with pytest.raises(SystemExit, match=match):
        quality.quality_main(["--quick", "--models", "smollm2", *argv])
