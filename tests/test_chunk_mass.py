"""``chunk_mass``: the entries a chunked prefill's cuts evict hand their attention mass to the nearest
held entry (docs/method.md#carried-mass). The masking oracle (:func:`eval.chunk_oracle.carried_bias`,
worked out from the cuts alone) replays it; without the bias the logits differ; the decode reads no
bias."""

from __future__ import annotations

import pytest
import torch

import jacap_attn
from conftest import DECODE_ATOL, DECODE_RTOL, random_ids, tiny_model
from eval.chunk_oracle import chunked_run, oracle_logits
from jacap_attn.math.masked import carried_bias

N, CHUNK = 150, 40


def replay(model, ids, mask, extra, mass_cosine=-1.0):
    got, held, cache = chunked_run(model, ids, mask, CHUNK, extra)
    real = torch.cat([mask, torch.ones_like(extra)], 1).bool()
    return got[real], [oracle_logits(model, ids, mask, CHUNK, held, extra, mass=m, mass_cosine=mass_cosine)[real]
                       for m in (True, False)], cache


@pytest.mark.parametrize("family_,budget,rows", [("llama", "global", 1), ("llama", "uniform", 2), ("qwen3", "global", 2),
                                                 ("gemma3_text", "global", 1), ("mistral", "global", 2)])
def test_carried_mass_matches_the_oracle_and_changes_the_logits(family_, budget, rows):
    model = tiny_model(family_)
    ids = random_ids(rows, N)
    mask = torch.ones_like(ids)
    if rows > 1:
        mask[1, :17] = 0
    jacap_attn.patch(model, ratio=0.25, window=8, budget=budget, chunk_mass=True)
    got, (want, unbiased), cache = replay(model, ids, mask, random_ids(rows, 4, seed=9))
    torch.testing.assert_close(got, want, atol=DECODE_ATOL, rtol=DECODE_RTOL)
    assert (got - unbiased).abs().max() > 1e-2, "the carried mass changed nothing"
    assert all(layer.mass is None for layer in cache.layers), "the decode must read the entries unbiased"


@pytest.mark.parametrize("family_,rows", [("llama", 2), ("gemma3_text", 1)])
def test_a_cosine_gate_hands_on_only_near_duplicates_as_the_oracle_does(family_, rows):
    """``mass_cosine``: an evicted entry whose nearest held key is less similar is dropped, not handed on; the
    oracle replays the gate, and the gated logits are neither the ungated nor the unbiased ones."""
    model = tiny_model(family_)
    ids = random_ids(rows, N)
    mask = torch.ones_like(ids)
    if rows > 1:
        mask[1, :17] = 0
    extra = random_ids(rows, 4, seed=9)
    jacap_attn.patch(model, ratio=0.25, window=8, chunk_mass=True)
    ungated, _, _ = replay(model, ids, mask, extra)
    jacap_attn.patch(model, ratio=0.25, window=8, chunk_mass=True, mass_cosine=0.5)
    got, (want, unbiased), _ = replay(model, ids, mask, extra, mass_cosine=0.5)
    torch.testing.assert_close(got, want, atol=DECODE_ATOL, rtol=DECODE_RTOL)
    assert (got - unbiased).abs().max() > 1e-3, "the gate handed nothing on"
    assert (got - ungated).abs().max() > 1e-3, "the gate dropped nothing"


def test_a_gate_no_key_passes_carries_nothing():
    """``mass_cosine=1``: random keys are never exact duplicates, so nothing is handed on and the chunked
    prefill is the one without ``chunk_mass``."""
    model = tiny_model("llama")
    ids = random_ids(1, N)
    jacap_attn.patch(model, ratio=0.25, window=8, chunk_mass=True, mass_cosine=1.0)
    got, (_, unbiased), _ = replay(model, ids, torch.ones_like(ids), random_ids(1, 4, seed=9), mass_cosine=1.0)
    torch.testing.assert_close(got, unbiased, atol=DECODE_ATOL, rtol=DECODE_RTOL)


@pytest.mark.parametrize("value", [1.5, -2, float("nan"), "0.9", True])
def test_mass_cosine_must_be_a_cosine(value):
    with pytest.raises(ValueError, match="mass_cosine must be a"):
        jacap_attn.patch(tiny_model("llama"), ratio=0.25, chunk_mass=True, mass_cosine=value)


def test_mass_cosine_is_stored_as_a_float_and_saves(tmp_path):
    """A numpy or int ``mass_cosine`` is a Python float in the config, so a document saves its settings
    (a ``numpy.float32`` there failed in the JSON header, after the compression)."""
    import numpy as np

    model = tiny_model("llama")
    for given in (np.float32(0.5), 1):
        config = jacap_attn.patch(model, ratio=0.25, window=8, chunk_size=CHUNK, chunk_mass=True,
                                  mass_cosine=given)._jacap_state.config
        assert type(config.mass_cosine) is float and config.mass_cosine == float(given)
    ids = random_ids(1, N)
    path = tmp_path / "doc.safetensors"
    jacap_attn.Document.compress(model, ids).save(path)
    assert jacap_attn.Document.load(path, model).cache.config.mass_cosine == 1.0


def test_mass_cosine_without_chunk_mass_is_refused():
    """``mass_cosine`` gates what ``chunk_mass`` carries: set alone it would do nothing, silently."""
    with pytest.raises(ValueError, match="mass_cosine=0.95 gates .* needs chunk_mass=True"):
        jacap_attn.patch(tiny_model("llama"), ratio=0.25, chunk_size=CHUNK, mass_cosine=0.95)


def test_without_chunk_mass_the_oracle_has_no_bias():
    model = tiny_model("llama")
    ids = random_ids(1, N)
    jacap_attn.patch(model, ratio=0.25, window=8)
    got, (_, unbiased), _ = replay(model, ids, torch.ones_like(ids), random_ids(1, 4, seed=9))
    torch.testing.assert_close(got, unbiased, atol=DECODE_ATOL, rtol=DECODE_RTOL)


def test_at_ratio_one_nothing_is_carried():
    model = tiny_model("llama")
    ids = random_ids(1, N)
    kwargs = dict(max_new_tokens=6, do_sample=False, prefill_chunk_size=CHUNK)
    expected = model.generate(ids, **kwargs)
    jacap_attn.patch(model, ratio=1.0, chunk_mass=True)
    assert torch.equal(model.generate(ids, **kwargs), expected)


def test_carried_bias_reads_the_table_at_each_held_index():
    table = torch.log1p(torch.tensor([[[0.0, 2.0, 0.0, 5.0]]]))  # [1, 1, 4]: indices 1 and 3 carry 2 and 5
    positions = torch.tensor([[[0, 1, 2, 3, 4]]]) - 1  # one token of left padding: index = position + 1
    valid = torch.tensor([[[True, True, False, True, True]]])
    bias = carried_bias(table, positions, valid, torch.tensor([1]))
    assert torch.allclose(bias, torch.tensor([[[0.0, float(table[0, 0, 1]), 0.0, float(table[0, 0, 3]), 0.0]]]))


def test_chunk_mass_must_be_a_bool_or_none():
    with pytest.raises(ValueError, match="chunk_mass must be True or False or None, got chunk_mass='yes'"):
        jacap_attn.patch(tiny_model("llama"), ratio=0.25, chunk_mass="yes")
    assert jacap_attn.JacapConfig(ratio=0.25).chunk_mass is None  # the route's default


def test_a_chunked_document_carries_the_mass_of_near_duplicates_unless_told_not_to(monkeypatch):
    """The rule confirmed 2026-12-07 (docs/method.md, "Carried mass for near-duplicates in a document's
    chunked prefill"): ``Document.compress`` with repeat-scored chunk cuts and ``chunk_mass`` left unset
    carries the mass at ``mass_cosine=0.95`` (every cut before the last builds its table with that gate)
    and records it in its config; the same held entries as patching those settings by hand. A prompt's
    chunked prefill carries none; an explicit ``chunk_mass=False``, window-scored cuts, a method without
    the repeat pass and an explicit ``chunk_mass=True`` (ungated) are kept as given."""
    from jacap_attn.selection import mass

    gates = []
    original = mass.carried

    def spy(*args):
        gates.append(args[-1])
        return original(*args)

    monkeypatch.setattr(mass, "carried", spy)
    model, ids = tiny_model("llama"), random_ids(1, N)
    settings = dict(ratio=0.25, window=8, min_tokens=0, repeat_ids=(5, 6, 7))
    jacap_attn.patch(model, **settings)
    prompt = jacap_attn.compress(model, ids, chunk_size=CHUNK)
    assert gates == [] and prompt.config.chunk_mass is None and not prompt.config.carries_mass
    doc = jacap_attn.Document.compress(model, ids, store=None, chunk_size=CHUNK)
    config = doc.cache.config
    assert (config.chunk_scores, config.chunk_mass, config.mass_cosine) == ("repeat", True, 0.95)
    assert gates and set(gates) == {0.95}
    assert config.chunk_budget == "seen"  # a document's cuts keep their fraction of the tokens seen
    jacap_attn.patch(model, **settings, chunk_scores="repeat", chunk_mass=True, mass_cosine=0.95, chunk_budget="seen")
    by_hand = jacap_attn.compress(model, ids, chunk_size=CHUNK)
    for mine, theirs in zip(doc.cache.layers, by_hand.layers):
        assert torch.equal(mine.held_entries()[2], theirs.held_entries()[2])  # the same positions held
    for options, want in (({"chunk_mass": False}, (False, -1.0)), ({"chunk_scores": "rescore"}, (None, -1.0)),
                          ({"chunk_mass": True}, (True, -1.0))):
        jacap_attn.patch(model, **settings, **options)
        gates.clear()
        config = jacap_attn.Document.compress(model, ids, store=None, chunk_size=CHUNK).cache.config
        assert (config.chunk_mass, config.mass_cosine) == want
        assert set(gates) == ({-1.0} if want[0] else set())
    jacap_attn.patch(model, ratio=0.25, window=8, min_tokens=0, method="streaming_llm")
    config = jacap_attn.Document.compress(model, ids, store=None, chunk_size=CHUNK).cache.config
    assert config.chunk_mass is None and config.chunk_scoring == "rescore"
    jacap_attn.unpatch(model)


def test_a_file_saved_before_chunk_mass_reads_as_no_mass():
    """A config written before ``chunk_mass`` existed (2026-12-06) carried no mass: it reads as ``False``,
    not as today's unset default (which a later ``Document.compress`` would resolve to carrying)."""
    data = jacap_attn.JacapConfig(ratio=0.25).to_dict()
    del data["chunk_mass"]
    assert jacap_attn.JacapConfig.from_dict(data).chunk_mass is False
    data["chunk_mass"] = None
    assert jacap_attn.JacapConfig.from_dict(data).chunk_mass is None


def test_chunk_mass_reaches_the_command_line_and_lm_eval_options():
    """``jacap ... --chunk-mass`` and lm-eval's ``chunk_mass=True`` (a string there) give the option."""
    import argparse

    from jacap_attn.cli_support import _add_method_arguments, _check_config
    from jacap_attn.integrations.lm_eval import pop_jacap_options

    parser = argparse.ArgumentParser()
    _add_method_arguments(parser)
    assert _check_config(parser.parse_args(["--chunk-size", "64", "--chunk-mass"])).chunk_mass is True
    assert _check_config(parser.parse_args([])).chunk_mass is None
    assert _check_config(parser.parse_args(["--chunk-size", "64", "--no-chunk-mass"])).chunk_mass is False
    gated = parser.parse_args(["--chunk-size", "64", "--chunk-mass", "--mass-cosine", "0.95"])
    assert _check_config(gated).mass_cosine == 0.95
    assert pop_jacap_options({"chunk_mass": "True"}) == {"chunk_mass": True}
    assert pop_jacap_options({"mass_cosine": "0.95"}) == {"mass_cosine": 0.95}


from test_user_bugs_25 import cli_models  # noqa: E402,F401


@pytest.mark.parametrize("flags,want", [([], (True, 0.95)), (["--no-chunk-mass"], (False, -1.0))])
def test_jacap_compress_chunked_saves_the_documents_mass_default(tmp_path, cli_models, flags, want):
    """``jacap compress --chunk-size`` is a document's chunked prefill: the file it writes records the
    near-duplicates' carried mass (``chunk_mass=True, mass_cosine=0.95``) unless ``--no-chunk-mass``."""
    import json

    from jacap_attn import cli
    from jacap_attn.files.persist import read_cache_metadata

    text = tmp_path / "doc.txt"
    text.write_text("The secret city is Oslo, and the river runs north of it. " * 6)
    out = tmp_path / "doc.safetensors"
    argv = ["compress", "--prompt-file", str(text), "--out", str(out), "--ratio", "0.25", "--store", "ratio",
            "--window", "8", "--chunk-size", "32", *flags]
    assert cli.main(argv) == 0
    config = json.loads(read_cache_metadata(out)["jacap_config"])
    assert (config["chunk_scores"], config["chunk_mass"], config["mass_cosine"]) == ("repeat", *want)
