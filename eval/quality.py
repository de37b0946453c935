"""`python -m eval.quality`: task accuracy and next-token fidelity of every method at several kept ratios.

One exact prefill per sample is shared by every (method, ratio, options): the prefill runs once on a
patched model while :func:`record_prefill` records, per layer, what the cache's ``on_prefill``
hook receives (post-RoPE queries, keys, values, scaling; :class:`jacap_attn.JacapCache`). Each
configuration then *replays* the selection (:func:`replay_cache`, i.e.
:func:`jacap_attn.routes.replay.compress_recorded`): a fresh :class:`JacapCache` with its own config
holding the recorded K/V, ``score_layer`` per layer, ``finalize_prefill``. ``model.generate`` then
decodes over the compressed cache exactly as after a normal ``patch`` + ``compress`` (checked in
``tests/test_quality.py``). A sample's two settings share one prefill where the agnostic context
part is a token prefix of the aware prompt (checked per sample; :func:`record_prompts`).
Every compressed row's result also records its span recall (:func:`span_recall`), for samples that
record their values' spans (:mod:`eval.ruler`).

Settings:

* ``aware``: the question is inside the compressed prompt (``question_position="end"``);
* ``agnostic``: the context part (``question_position="none"``) is compressed, then the question
  suffix (:func:`jacap_attn.prompts.format_question`) is fed uncompressed by ``generate``.

Fidelity (no task): held-out prose from :func:`jacap_attn.prose.haystack_paragraphs` (consecutive
paragraphs, in corpus order), ``n`` tokens compressed, then the next 64 tokens teacher-forced over the
full and over each compressed cache: mean KL(p_full || p_compressed) and the increase of mean NLL.

Per-sample results are cached in ``eval/cache/quality/<hash>.json``; a rerun skips done work.
``--report-only`` computes nothing and loads no model: it tables the cached results, or, when the
cache lacks some of them (a fresh clone: ``eval/cache`` is not committed), re-renders the table from
the committed ``eval/results/<stem>.json`` of the same grid (:func:`render_saved`).

    python -m eval.quality --quick                   # make bench-quality: the full grid
    python -m eval.quality --config eval/configs/quality.json --split heldout --models smollm2
    python -m eval.quality --ablation --models smollm2
    python -m eval.quality --report-only --models smollm2 --threads 1   # the published table again
    python -m eval.quality <args> --threads 1 --shard 0/2 --tag _a &   # one run on two cores: two processes,
    python -m eval.quality <args> --threads 1 --shard 1/2 --tag _b     # then <args> --report-only tables it whole
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import pathlib
import shlex
import sys
import time

import torch

from eval import stats
from eval.quality_report import markdown_table, plots
import jacap_attn
from jacap_attn import methods as methods_module
from jacap_attn.storage.cache import JacapCache
from jacap_attn.files.paths import write_atomically
from jacap_attn.config import OPTIONS_BEFORE, SETTINGS_BEFORE, JacapConfig
from jacap_attn.routes.replay import compress_recorded
from jacap_attn.route_settings import prompt_chunk_budget

# The published rows: the library's own methods (a method registered by user code runs as an ad-hoc row).
METHODS = tuple(m for m in methods_module.names()
                if methods_module.get_method(m).__module__.startswith("jacap_attn.methods."))

EVAL_DIR = pathlib.Path(__file__).resolve().parent  # eval/ of this checkout, whatever the current directory
CONFIG_DIR = EVAL_DIR / "configs"
RESULTS_DIR = EVAL_DIR / "results"
CACHE_DIR = EVAL_DIR / "cache" / "quality"
CACHE_VERSION = 1
# The config fields at CACHE_VERSION 1, with their defaults then. A field that does not apply to a
# method cannot change its results, so its key records the field at this value (a field added later
# only when set): changing a default or adding a knob keeps the other methods' cached results.
_V1_DEFAULTS = {"window": 32, "budget": "uniform", "ridge": None, "beta": 1.0, "pooling": "avg", "kernel": None,
                "selector": "leverage", "consensus": 0.5, "consensus_kernel": 15, "sinks": 4, "temperature": 5.0,
                "seed": 0, "pyramid_beta": 20.0, "capacity_alpha": 0.5, "adakv_alpha": 0.2, "reserve": 256,
                "compile": True}
# The flat settings of the library's config before methods became classes (commit 0ab974f): its
# fields and defaults then (``None``: the method's own default), the fields that applied to each
# method and the budget a method fixes. The keys of the methods of that time are computed from
# these (:func:`_flat_config`), so they, and the cached results, outlive refactors of the library.
_FLAT_DEFAULTS = {**_V1_DEFAULTS, "consensus": 0.25, "mass": None}
_FLAT_INTS = ("window", "kernel", "consensus_kernel", "sinks", "seed", "reserve")
_COMMON = frozenset({"window", "budget", "pyramid_beta", "capacity_alpha", "reserve", "compile"})
_FLAT_OPTIONS: dict[str, frozenset] = {
    "jacap": _COMMON | {"ridge", "beta", "pooling", "kernel", "selector", "consensus", "consensus_kernel", "mass",
                        "sinks"},
    "full": frozenset({"reserve", "compile"}),
    "streaming_llm": _COMMON | {"sinks"},
    "random": _COMMON | {"seed"},
    "knorm": _COMMON,
    "snapkv": _COMMON | {"pooling", "kernel"},
    "pyramidkv": _COMMON | {"pooling", "kernel"},
    "h2o": _COMMON,
    "tova": _COMMON,
    "keydiff": _COMMON,
    "capkv": _COMMON | {"ridge", "temperature", "sinks"},
    "adakv": _COMMON | {"pooling", "kernel", "adakv_alpha"},
}
_FLAT_FIXED_BUDGET = {"pyramidkv": "pyramid"}
# Shared settings added to the library's config since then, with the behaviour before each existed:
# a row's key records one only where the row's resolved value differs from that behaviour and can
# change its results (:func:`_later_setting_matters`), so results cached before it existed stay
# valid and `jacap[sliding=compress]` is a row of its own.
_LATER_SETTINGS = {"sliding": "window", "keep_special": False, "min_tokens": 0, "global_score": "attention",
                   "head_floor": 0.2, "queries": "window", "repeat_ids": None, "repeat_chunk": 512, "reselect": None,
                   "reselect_budget": "uniform", "chunk_size": None, "chunk_scores": "rescore", "lookahead": 0, "lookahead_share": None,
                   "chunk_ratio": None, "chunk_budget": "seen", "chunk_mass": False, "mass_cosine": -1.0,
                   "backend": "sdpa", **SETTINGS_BEFORE}  # spans, max_span: as a saved file without them reads


# Method options that act only in a chunked prefill: a row without `chunk_size` never records them, so
# its cached results outlive a change of their default.
_CHUNKED_ONLY = ("lookup_ahead", "lookup_room")


def _later_setting_matters(name: str, config: JacapConfig, ctx: int | None) -> bool:
    """Whether setting ``name`` can change the results of prompts of about ``ctx`` tokens (``None``:
    unknown). ``keep_special`` acts only on rows with ``ceil(ratio * n) <= window``, ``min_tokens``
    only on rows shorter than it (docs/method.md#short-prompts); every harness prompt has about
    ``ctx`` tokens, and a factor 2 of margin covers the shorter ones."""
    if ctx is None:
        return True
    if name == "keep_special":
        return config.ratio * ctx / 2 <= config.window
    if name == "min_tokens":
        return config.min_tokens > ctx / 2
    if name == "max_span":  # acts only where words are kept whole
        return config.spans == "words"
    if name in ("chunk_scores", "chunk_mass", "mass_cosine"):  # act only on a chunked prefill
        return config.chunk_size is not None
    return True
# Jacap's defaults from 2026-11-30 until they were re-tuned on the decisive tasks (2026-12-01).
DEFAULTS_2026_11_30 = {"window": 32, "budget": "uniform", "ridge": 0.1, "beta": 1.0, "pooling": "avg", "kernel": 7,
                       "consensus": 0.25, "mass": 2.0, "sinks": 4}
# The method options' defaults at the time of the flat settings (Jacap's at JACAP_SCORING_VERSION 3:
# the 2026-11-30 defaults); the other methods' have not changed since.
_FLAT_METHOD_DEFAULTS = {"jacap": {**{k: v for k, v in DEFAULTS_2026_11_30.items() if k not in ("window", "budget")},
                                   "selector": "leverage", "consensus_kernel": 15}}
# Jacap's scoring changed after CACHE_VERSION 1 (2: sinks kept, attention-mass term; 3: the mass
# term per token, unpooled): a Jacap row's key carries the version of its scoring, so earlier Jacap
# results are never reused.
JACAP_SCORING_VERSION = 3
# Question-time reselection changed (2: the method's cross-layer step runs at question time; 3: each
# KV head is scored over its own held entries only): a row with `reselect` (route B, `store=`)
# carries the version, so results of an earlier version are never reused.
RESELECT_VERSION = 3
# Rows whose question selects (reselect, or a chunked row's new turn) were answered, until 2026-12-04,
# in batches grouped by `reselect` alone under the batch's first config (eval.answers.question_settings):
# their key carries the batching's version, so those results are never reused.
QUESTION_BATCHING_VERSION = 2
# A prompt's chunked prefill takes a document's chunk settings where the prompt is repetitive (2026-12-07,
# jacap_attn.route_settings.prompt_chunking): a row the rule may apply to carries its version, so results of
# the rows before it are never reused (the key does not see the prompt, so every such row carries it).
REPETITIVE_PROMPTS_VERSION = 1

# Row label -> (method, options). `full` is the reference row.
VARIANTS: dict[str, tuple[str, dict]] = {m: (m, {}) for m in METHODS}
VARIANTS.update({
    "jacap-per-head": ("jacap", {"consensus": 0.0}),
    # Rows named after an earlier default rank token by token, as Jacap did then (`spans` "none"
    # until 2026-12-01, docs/method.md#d8-answers-kept-whole), and carry nothing (the carry is on
    # since 2026-12-05: OPTIONS_BEFORE).
    "jacap (2026-11-30 defaults)": ("jacap", {**DEFAULTS_2026_11_30, "spans": "none", **OPTIONS_BEFORE["jacap"]}),
    "jacap+pyramid": ("jacap", {"budget": "pyramid"}),
    "jacap+capacity": ("jacap", {"budget": "capacity"}),
    "jacap+greedy": ("jacap", {"selector": "greedy"}),
    # Jacap's default until its consensus share was re-tuned (2026-12-01, second change of the day).
    "jacap (consensus 0.25)": ("jacap", {"consensus": 0.25, "spans": "none", **OPTIONS_BEFORE["jacap"]}),
    "jacap+uniform": ("jacap", {"budget": "uniform"}),  # Jacap's default budget until 2026-12-01
    "jacap+global": ("jacap", {"budget": "global"}),
    "jacap+global (normalized)": ("jacap", {"budget": "global", "global_score": "normalized"}),
    # Question-agnostic routes (issue 14). Route A: scores from a repeat pass's queries; route B:
    # the document stored at kept fraction `store`, reselected to the row's kept ratio (the decode
    # budget) by the question's own queries when it arrives.
    "jacap (repeat)": ("jacap", {"queries": "repeat"}),
    "kvzip (repeat)": ("kvzip", {"queries": "repeat"}),
    "snapkv (repeat)": ("snapkv", {"queries": "repeat"}),
    "jacap (repeat)+uniform": ("jacap", {"queries": "repeat", "budget": "uniform"}),
    "jacap (repeat)+global": ("jacap", {"queries": "repeat", "budget": "global"}),
    "jacap (repeat)+global (normalized)": ("jacap", {"queries": "repeat", "budget": "global",
                                                     "global_score": "normalized"}),
    "jacap (repeat)+pyramid": ("jacap", {"queries": "repeat", "budget": "pyramid"}),
    "jacap (repeat)+capacity": ("jacap", {"queries": "repeat", "budget": "capacity"}),
    "jacap, stored whole, reselected": ("jacap", {"store": 1.0}),
    # The same, answered from a saved file whose entries are stored in 8 bits (issue 24).
    "jacap, stored whole, reselected, int8": ("jacap", {"store": 1.0, "quantize": "int8"}),
    "jacap (consensus 0.25), stored whole, reselected": ("jacap", {"store": 1.0, "consensus": 0.25,
                                                                   **OPTIONS_BEFORE["jacap"]}),
    "jacap, stored 0.5, reselected": ("jacap", {"store": 0.5}),
    "jacap (repeat), stored 0.5, reselected": ("jacap", {"queries": "repeat", "store": 0.5}),
    "jacap (uniform), stored 0.5, reselected": ("jacap", {"budget": "uniform", "store": 0.5}),
    # Question-time reselection under the global budget (issue 33: the one cut gave it every policy).
    "jacap, stored whole, reselected (global)": ("jacap", {"store": 1.0, "reselect_budget": "global"}),
    # Chunked prefill under a running budget (issue 33): real chunked forwards, each chunk attending
    # what the cuts before it kept; "exact prefix" replays the same cuts over one exact prefill's
    # recorded inputs, as kvpress's BlockPress scores its blocks (the cost of honesty).
    "jacap, chunked 1024": ("jacap", {"chunk_size": 1024, "chunk_scores": "rescore"}),
    "jacap, chunked 512": ("jacap", {"chunk_size": 512, "chunk_scores": "rescore"}),
    "jacap, chunked 1024 (carry)": ("jacap", {"chunk_size": 1024, "chunk_scores": "carry"}),
    "jacap, chunked 1024, exact prefix": ("jacap", {"chunk_size": 1024, "chunk_scores": "rescore",
                                                    "chunk_prefix": "exact"}),
    "jacap, chunked 512, exact prefix": ("jacap", {"chunk_size": 512, "chunk_scores": "rescore",
                                                   "chunk_prefix": "exact"}),
    "jacap, chunked 1024, stored 0.5, reselected": ("jacap", {"chunk_size": 1024, "chunk_scores": "rescore",
                                                              "store": 0.5}),
    # A running budget above the final one until the last cut, which sees the question (`chunk_ratio`).
    "jacap, chunked 1024, running 0.3": ("jacap", {"chunk_size": 1024, "chunk_scores": "rescore", "chunk_ratio": 0.3}),
    # The cuts before the last scored by a repeat pass of each chunk over the held entries (KVzip's
    # reconstruction queries: question-agnostic), the last by the question (`chunk_scores="repeat"`).
    "jacap, chunked 1024, repeat": ("jacap", {"chunk_size": 1024, "chunk_scores": "repeat"}),
    "jacap, chunked 512, repeat": ("jacap", {"chunk_size": 512, "chunk_scores": "repeat"}),
    # The evicted entries' attention mass carried to their nearest held entry between cuts (`chunk_mass`).
    "jacap, chunked 1024, repeat, mass": ("jacap", {"chunk_size": 1024, "chunk_scores": "repeat", "chunk_mass": True}),
    "jacap, chunked 512, repeat, mass": ("jacap", {"chunk_size": 512, "chunk_scores": "repeat", "chunk_mass": True}),
    "jacap, chunked 1024, repeat, no mass": ("jacap", {"chunk_size": 1024, "chunk_scores": "repeat", "chunk_mass": False}),
    # The runs the prompt's end looks up held beyond the running budget at the cuts before the last (`lookup_room`).
    "jacap, chunked 1024, repeat, lookup room": ("jacap", {"chunk_size": 1024, "chunk_scores": "repeat",
                                                           "lookup_room": True}),
    # The default chunked prefill before lookup ahead (2026-12-06): its cuts before the last read no lookup
    # (the rows labelled `jacap, chunked 1024, repeat` in results written before that date; the same key).
    "jacap, chunked 1024, repeat, no lookup ahead": ("jacap", {"chunk_size": 1024, "chunk_scores": "repeat",
                                                               "lookup_ahead": False}),
    # The same pass replaying each chunk without the repeat instruction (what a model patched without a
    # tokenizer runs: no ``repeat_ids`` to read).
    "jacap, chunked 1024, repeat, no instruction": ("jacap", {"chunk_size": 1024, "chunk_scores": "repeat",
                                                              "repeat_ids": None}),
    "jacap, chunked 1024, repeat, running 0.3": ("jacap", {"chunk_size": 1024, "chunk_scores": "repeat",
                                                           "chunk_ratio": 0.3}),
    "jacap, chunked 1024, running 0.5": ("jacap", {"chunk_size": 1024, "chunk_scores": "rescore", "chunk_ratio": 0.5}),
    "jacap, chunked 512, running 0.5": ("jacap", {"chunk_size": 512, "chunk_scores": "rescore", "chunk_ratio": 0.5}),
})
# Harness-only row options, not JacapConfig settings: `quantize` (answered from a saved file) and
# `chunk_prefix` ("exact": a chunked row replayed over the exact prefill's recorded inputs).
_ROW_ONLY = ("quantize", "chunk_prefix")

# Ablation: one knob at a time around the Jacap default. The defaults before a change stay as named
# rows with explicit options, so a change of default is visible in the table that made it.
ABLATION: dict[str, tuple[str, dict]] = {
    "jacap (default)": ("jacap", {}),
    "defaults of 2026-11-30": ("jacap", {**DEFAULTS_2026_11_30, "spans": "none", **OPTIONS_BEFORE["jacap"]}),
    "defaults before 2026-11-30": ("jacap", {"consensus": 0.5, "mass": 0.0, "sinks": 0, "spans": "none",
                                             **OPTIONS_BEFORE["jacap"]}),
    "window=16": ("jacap", {"window": 16}),
    "window=64": ("jacap", {"window": 64}),
    "ridge=0.01": ("jacap", {"ridge": 0.01}),
    "ridge=1": ("jacap", {"ridge": 1.0}),
    "beta=1": ("jacap", {"beta": 1.0}),  # the default until 2026-12-01
    "pooling=max": ("jacap", {"pooling": "max"}),
    "pooling=none": ("jacap", {"pooling": "none"}),
    "kernel=7": ("jacap", {"kernel": 7}),  # the default until 2026-12-01
    "kernel=15": ("jacap", {"kernel": 15}),
    "consensus=0": ("jacap", {"consensus": 0.0}),
    "consensus=0.25": ("jacap", {"consensus": 0.25}),  # the default until 2026-12-01 (second change)
    "consensus=0.75": ("jacap", {"consensus": 0.75}),
    "consensus=1": ("jacap", {"consensus": 1.0}),
    "mass=0": ("jacap", {"mass": 0.0}),
    "mass=8": ("jacap", {"mass": 8.0}),
    "sinks=0": ("jacap", {"sinks": 0}),
    "budget=pyramid": ("jacap", {"budget": "pyramid"}),
    "budget=capacity": ("jacap", {"budget": "capacity"}),
    "budget=uniform": ("jacap", {"budget": "uniform"}),
    "selector=greedy": ("jacap", {"selector": "greedy"}),
}

# kvpress presses run side by side (eval/kvpress/, an isolated venv): row label -> (press class,
# arguments). SnapKV's window and kernel match ours; the others run with kvpress's defaults.
KVPRESS: dict[str, tuple[str, dict]] = {
    "kvpress:snapkv": ("SnapKVPress", {"window_size": 32, "kernel_size": 5}),
    "kvpress:capkv": ("CapPress", {}),
    "kvpress:keydiff": ("KeyDiffPress", {}),
    "kvpress:expected_attention": ("ExpectedAttentionPress", {}),
    # Ada-KV's head-wise allocation over SnapKV's scores (kvpress masks the evicted keys per head).
    "kvpress:adakv": ("AdaKVPress", {"press": ["SnapKVPress", {"window_size": 32, "kernel_size": 5}]}),
    # KVzip (question-agnostic: repeat passes after the prefill); kvpress refuses Gemma3 for it.
    "kvpress:kvzip": ("KVzipPress", {}),
}

# Answer lengths: enough new tokens for the answer after the model's usual preamble.
DEFAULT_MAX_NEW = {"single_needle": 32, "multikey_needle": 32, "multivalue_needle": 64,
                   "variable_tracking": 48, "kv_retrieval": 64}


# --------------------------------------------------------------------------------------------
# Record once, replay per configuration
# --------------------------------------------------------------------------------------------


def ensure_patched(model) -> None:
    """Patch ``model`` (method ``full``) unless it already is; replayed caches bring their own config."""
    from jacap_attn.patching import is_patched, patch

    if not is_patched(model):
        patch(model, ratio=1.0, method="full", compile=False)


def record_prefill(model, ids: torch.Tensor) -> list:
    """Run the exact prefill of ``ids [1, n]`` once; per layer ``(query, keys, values, scaling)``."""
    ensure_patched(model)
    records: list = []

    def record(index, query, keys, values, scaling):
        records.append((index, query.detach(), keys.detach(), values.detach(), float(scaling)))

    cache = JacapCache(model, config=JacapConfig(ratio=1.0, method="full", compile=False), on_prefill=record)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, logits_to_keep=1, cache=cache)
    by_layer = {index: rest for index, *rest in records}
    if sorted(by_layer) != list(range(len(cache.layers))):
        raise RuntimeError(f"recorded {len(by_layer)} layers, the model has {len(cache.layers)}")
    return [by_layer[i] for i in range(len(cache.layers))]


def is_prefix(short: torch.Tensor, long: torch.Tensor) -> bool:
    """Whether ids ``short [1, m]`` are the first ``m`` ids of ``long [1, n]``."""
    return short.shape[1] <= long.shape[1] and torch.equal(long[:, :short.shape[1]], short)


def cut_record(record: list, length: int) -> list:
    """The record of the first ``length`` prompt tokens, cut out of a :func:`record_prefill` record of
    a longer prompt: under causal attention a prefix's queries, keys and values are those of the
    prefix alone (equal up to floating-point summation order, ``tests/test_quality.py``)."""
    return [tuple(t[..., :length, :].clone() for t in (query, keys, values)) + (scaling,)
            for query, keys, values, scaling in record]


def record_prompts(model, prompts: dict, counters: dict | None = None) -> dict:
    """Per name, the :func:`record_prefill` record of ``prompts[name]`` (ids ``[1, n]``), one prefill
    shared by prompts that are token prefixes of a longer one (:func:`cut_record`): the agnostic
    setting's context part is a prefix of the aware prompt, so a sample's two settings need one
    prefill. A prompt that is no prefix of a recorded one gets its own prefill. ``counters``: each
    prefill's seconds are appended to ``counters["prefill_s"]``, each cut counted in
    ``counters["shared"]``."""
    records: dict = {}
    done: list = []  # (ids, record) of the prefills run
    for name in sorted(prompts, key=lambda k: -prompts[k].shape[1]):
        ids = prompts[name]
        source = next((record for long, record in done if is_prefix(ids, long)), None)
        if source is None:
            t0 = time.time()
            records[name] = record_prefill(model, ids)
            done.append((ids, records[name]))
            if counters is not None:
                counters.setdefault("prefill_s", []).append(time.time() - t0)
        else:
            records[name] = cut_record(source, ids.shape[1])
            if counters is not None:
                counters["shared"] = counters.get("shared", 0) + 1
    return records


def replay_cache(model, record: list, config: JacapConfig, prompt_ids: torch.Tensor) -> JacapCache:
    """A compressed :class:`JacapCache` for ``config`` from a :func:`record_prefill` record of
    ``prompt_ids`` (the very selection a patched prefill would make)."""
    return compress_recorded(model, record, config, prompt_ids)


def row_options(options: dict, ratio: float) -> tuple[dict, float]:
    """``(config options, config ratio)`` of a row at grid kept ratio ``ratio``. A route B row
    (``store=S``, issue 14) stores its document at kept fraction ``S`` and reselects it to ``ratio``
    when the question arrives (``JacapConfig.reselect``), so ``ratio`` stays the decode budget of
    every row. A running budget (``chunk_ratio``) at or below ``ratio`` is the column's own: dropped.
    Raises ``ValueError`` for a row that sets both ``store`` and ``reselect``, or a ``store`` below the
    decode budget."""
    options = {k: v for k, v in options.items() if k not in _ROW_ONLY}  # harness options (:data:`_ROW_ONLY`)
    if options.get("chunk_ratio") is not None and float(options["chunk_ratio"]) <= ratio:
        options = {k: v for k, v in options.items() if k != "chunk_ratio"}  # a running budget at or below the column's
    if "store" not in options:
        return options, ratio
    opts = {k: v for k, v in options.items() if k != "store"}
    if "reselect" in opts:
        raise ValueError(f"a row sets store= or reselect=, not both: {options}")
    store = float(options["store"])
    if not ratio <= store <= 1.0:
        raise ValueError(f"store={options['store']!r} must lie between the decode budget {ratio} and 1")
    return {**opts, "reselect": ratio}, store


def repeats(options: dict) -> bool:
    """Whether a row's options run a repeat pass (``queries="repeat"``, or ``chunk_scores="repeat"``),
    which reads the repeat instruction ``repeat_ids``."""
    return options.get("queries") == "repeat" or options.get("chunk_scores") == "repeat"


def make_config(method: str, options: dict, ratio: float, repeat_ids=None) -> JacapConfig:
    """The config of a row at grid kept ratio ``ratio`` (:func:`row_options`); ``repeat_ids``: the
    repeat instruction of rows with ``queries="repeat"`` (the tokenizer's,
    :func:`jacap_attn.prompts.repeat_instruction_ids`)."""
    if method == "full":
        return JacapConfig.from_options(ratio=1.0, method="full", compile=False)
    options, ratio = row_options(options, ratio)
    if repeats(options) and "repeat_ids" not in options and repeat_ids is not None:
        options = {**options, "repeat_ids": tuple(repeat_ids)}
    return JacapConfig.from_options(ratio=ratio, method=method, compile=False, **options)


def file_round_trip(model, cache: JacapCache, prompt_ids: torch.Tensor, quantize: str | None) -> JacapCache:
    """``cache`` saved (``jacap_attn.save_cache(..., quantize=quantize)``) to a temporary file and
    loaded back, as a user's saved document answers: the harness's rows with ``quantize=`` (e.g.
    ``jacap, stored whole, reselected, int8``) measure what the file's 8-bit entries cost."""
    import tempfile
    import warnings

    from jacap_attn import load_cache, save_cache

    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "row.safetensors"
        save_cache(cache, path, model=model, prompt_ids=prompt_ids, quantize=quantize)
        with warnings.catch_warnings():  # the harness's model is patched `full`; the file's settings answer
            warnings.simplefilter("ignore")
            return load_cache(path, model)


def row_cache(model, record: list, prompt_ids: torch.Tensor, method: str, opts: dict, ratio: float,
              repeat_ids=None, parts: dict | None = None, observed: dict | None = None) -> JacapCache:
    """The compressed cache a row answers from at grid kept ratio ``ratio`` (:func:`make_config`): replayed
    from ``record`` (:func:`record_prefill` of ``prompt_ids [1, n]``; ``parts``: scores shared by the row's
    ratios where its method does not read the budget, ``observed``: the repeat passes' statistics, one entry per
    pass, by instruction ids and ``repeat_chunk``), or a real
    chunked prefill (each chunk's forward attends what the cuts before it kept) unless the row replays its
    chunks over the exact prefill (``chunk_prefix="exact"``); saved and reloaded (:func:`file_round_trip`)
    for a row with ``quantize=``."""
    config = make_config(method, opts, ratio, repeat_ids)
    if config.chunk_size is not None and opts.get("chunk_prefix") != "exact":
        cache = jacap_attn.compress(model, prompt_ids, config=config)
    else:
        shared = None if config.method.reads_budget or config.chunk_size else parts
        repeat = config.queries == "repeat" and observed is not None
        # rows share a pass only if they run the same one (instruction and query chunks)
        pass_key = (config.repeat_ids if config.repeat_ids is not None else repeat_ids, config.repeat_chunk)
        cache = compress_recorded(model, record, config, prompt_ids, parts=shared,
                                  observed=observed.setdefault(repr(pass_key), {}) if repeat else None)
    return file_round_trip(model, cache, prompt_ids, opts["quantize"]) if "quantize" in opts else cache


def full_answer(model, tok, record: list, prompt_ids: torch.Tensor, full_ids: torch.Tensor, sample,
                max_new: int) -> list[int]:
    """The full cache's greedy answer to ``sample`` (new token ids), from a :func:`record_prefill`
    record of ``prompt_ids``: the reference of :func:`eval.answers.answer_rows`."""
    from eval import answers

    cache = replay_cache(model, record, make_config("full", {}, 1.0), prompt_ids)
    return answers.greedy(model, tok, cache, full_ids, sample, max_new)[0]


def evaluate_sample(model, tok, sample, setting: str, chat: bool, max_new: int, todo: list, store, full_key: str,
                    decoding: str, counters: dict, prompt_ids: torch.Tensor, full_ids: torch.Tensor,
                    record: list) -> dict[str, dict]:
    """Score the rows ``todo`` (``(label, method, options, ratio, grid_ratio, key)``) of one sample in
    one setting, from ``record``, the recorded prefill of ``prompt_ids`` (:func:`record_prompts`;
    ``prompt_ids``, ``full_ids`` from :func:`sample_ids`): the full cache's greedy answer (the
    reference, cached under ``full_key`` with its tokens), then per ratio every row's cache replayed
    (scores shared across ratios, :func:`jacap_attn.routes.replay.compress_recorded`) and answered by
    :func:`eval.answers.answer_rows` (``decoding="fast"``) or one by one with ``generate``
    (``"one-by-one"``). Stores each result under its key, with its span recall (:func:`span_recall`;
    ``None`` for a sample without value spans or a row that compresses nothing); returns key ->
    result (``score``, ``span_recall``, ...)."""
    from eval import answers
    from eval import synthetic as T

    from jacap_attn.prompts import repeat_instruction_ids

    repeat_ids = (repeat_instruction_ids(tok, chat=chat) if any(repeats(item[2]) for item in todo)
                  else None)
    positions = value_positions(tok, sample, setting, chat)
    suffix = full_ids[:, prompt_ids.shape[1]:]
    done: dict[str, dict] = {}

    def put(key, tokens, how, seconds, recall=None) -> dict:
        text = tok.decode(tokens, skip_special_tokens=True)
        result = {"score": T.score(sample, text), "text": text, "tokens": tokens, "how": how,
                  "n_prompt": prompt_ids.shape[1], "seconds": seconds, "span_recall": recall}
        store.put(key, result)
        done[key] = result
        if how in counters:
            counters[how] += 1
        return result

    hit = store.get(full_key)
    if hit is None or "tokens" not in hit:
        t0 = time.time()
        hit = put(full_key, full_answer(model, tok, record, prompt_ids, full_ids, sample, max_new), "decoded",
                  time.time() - t0)
    done[full_key] = hit
    reference = hit["tokens"]
    parts: dict[str, dict] = {}  # label -> scores shared by its ratios
    observed: dict = {}  # the repeat passes' statistics (queries="repeat"), shared by the rows running the same pass
    for grid_ratio in dict.fromkeys(item[4] for item in todo):
        rows = [item for item in todo if item[4] == grid_ratio and item[5] not in done]
        rows = list({item[5]: item for item in rows}.values())  # one computation per key
        if not rows:
            continue
        t0 = time.time()
        caches = []
        for label, method, opts, r, _, _ in rows:
            caches.append(row_cache(model, record, prompt_ids, method, opts, r, repeat_ids,
                                    parts.setdefault(label, {}), observed))
        if decoding == "fast":
            results = answers.answer_rows(model, tok, caches, prompt_ids, full_ids, sample, max_new, reference)
        else:
            results = [(answers.greedy(model, tok, c, full_ids, sample, max_new)[0], "one-by-one") for c in caches]
        seconds = (time.time() - t0) / len(rows)
        for (label, method, opts, r, _, key), (tokens, how), cache in zip(rows, results, caches):
            put(key, tokens, how, seconds, span_recall(model, cache, suffix, positions))
    return done


def value_positions(tok, sample, setting: str, chat: bool) -> list[int] | None:
    """The prompt token positions of ``sample``'s expected values (every occurrence of each, pooled;
    :func:`eval.spans.value_token_positions` on the prompt :func:`sample_ids` encodes), or ``None``
    for a sample without ``meta["value_spans"]`` (:mod:`eval.synthetic`'s)."""
    from eval import spans
    from eval.ruler import task_prompt_parts

    meta = getattr(sample, "meta", None) or {}
    if not meta.get("value_spans"):
        return None
    head, tail = task_prompt_parts(sample, tok, chat=chat)
    prompt = head + tail if setting == "aware" else head
    start = len(head) - len(meta.get("separator", "")) - len(sample.context)  # the document ends the context part
    shifted = spans.prompt_spans(prompt, sample.context, meta["value_spans"], start=start)
    return sorted({p for value in spans.value_token_positions(tok, prompt, shifted, add_special_tokens=not chat)
                   for p in value})


def selected_layers(cache: JacapCache) -> list[int]:
    """The layers of ``cache`` its method selects in (:func:`jacap_attn.selection.scorer.scores_layer`: on
    Gemma under the default ``sliding="window"``, the full-attention ones); empty for ``full``."""
    from jacap_attn.selection.scorer import scores_layer

    return [i for i in range(len(cache.layers)) if scores_layer(cache.config, cache.layers, i)]


def span_recall(model, cache: JacapCache, suffix: torch.Tensor, positions: list[int] | None) -> float | None:
    """Span recall of a row's compressed ``cache`` (batch 1): the share of the values' prompt token
    ``positions`` it keeps, averaged over the layers its method compresses
    (:func:`jacap_attn.selection.scorer.scores_layer`: on Gemma under the default ``sliding="window"``, the
    full-attention layers; a sliding layer's window is not the method's choice) and their KV heads
    (:func:`eval.spans.kept_share`). A row with question-time reselection (route B) is measured
    after the question's forward ``suffix [1, q]`` cut it, as its answer reads it (``cache`` is
    consumed then). ``None`` without positions or for a row that compresses no layer (``full``)."""
    from eval import spans

    layers = selected_layers(cache)
    if not positions or not layers:
        return None
    if cache.config.reselect is not None:
        with torch.no_grad():
            model(input_ids=suffix, cache=cache, use_cache=True, logits_to_keep=1)
    return spans.kept_share(cache, positions, layers)


def fidelity(model, record, prefix_ids: torch.Tensor, cont_ids: torch.Tensor, config: JacapConfig,
             reference=None):
    """Teacher-force ``cont_ids [1, m+1]`` after the compressed ``prefix_ids``; returns the
    log-probs ``[m, V]`` predicting ``cont_ids[:, 1:]`` and, given ``reference`` log-probs, the
    mean KL(reference || these) and the NLL difference."""
    cache = replay_cache(model, record, config, prefix_ids)
    with torch.no_grad():
        logits = model(input_ids=cont_ids[:, :-1], cache=cache, use_cache=True).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    target = cont_ids[0, 1:]
    nll = float(-logp.gather(-1, target[:, None]).mean())
    if reference is None:
        return logp, nll, None
    ref_logp, ref_nll = reference
    kl = float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())
    return logp, nll, {"kl": kl, "nll": nll, "nll_increase": nll - ref_nll}


# --------------------------------------------------------------------------------------------
# Config, cache, driver
# --------------------------------------------------------------------------------------------


def load_config(path) -> dict:
    with open(path) as f:
        return json.load(f)


def config_path(args) -> pathlib.Path:
    """The config file of a run: ``--config``, else the quick or the published one (``quality.json``;
    the tables of 3 samples per task recorded before 2026-12-01 ran with ``quality_full.json``, then
    the default, and name it in their JSON)."""
    return pathlib.Path(args.config) if args.config else CONFIG_DIR / (
        "quality_quick.json" if args.quick else "quality.json")


def saved_argv(saved: dict) -> list[str]:
    """The arguments of a results JSON's recorded command, with the config it ran with made explicit
    (a command without ``--config`` ran with the default of its day, recorded as ``config``)."""
    argv = command_args(saved["command"])
    if "--config" not in argv and "--quick" not in argv and saved.get("config"):
        argv += ["--config", str(CONFIG_DIR / pathlib.Path(saved["config"]).name)]
    return argv


@dataclasses.dataclass(frozen=True)
class Grid:
    """What one model's run walks, from the config file with the command-line overrides: the task
    samples (``n`` per task, split ``seed``) of ``tasks`` x ``settings`` x ``ratios``, each task's
    answer length, and ``n_prose`` fidelity samples of ``prose_ctx`` + ``prose_tokens`` tokens."""

    model: str
    chat: bool
    ctx: int
    seed: int
    n: int
    ratios: list
    settings: list
    tasks: list
    max_new: dict
    n_prose: int
    prose_ctx: int
    prose_tokens: int
    variants: dict = dataclasses.field(default_factory=dict)

    def spec(self, task: str) -> tuple[str, dict]:
        """``(generator, options)`` of a task label: a config's ``task_variants`` entry (e.g.
        ``"multikey_8": {"task": "multikey_needle", "n_keys": 8}``) or a task of :mod:`eval.synthetic`
        or of :mod:`eval.ruler`."""
        options = dict(self.variants.get(task, {}))
        return options.pop("task", task), options

    def samples(self, task: str, tokenizer) -> list:
        """The ``n`` samples of task label ``task`` on this grid's split (either suite's generator,
        :func:`eval.ruler.generate_task`)."""
        from eval.ruler import generate_task

        base, options = self.spec(task)
        return generate_task(base, tokenizer, self.n, self.ctx, self.seed, **options)

    def sample_id(self, task: str, index: int) -> str:
        """``Sample.id`` of sample ``index`` of task label ``task`` (as :mod:`eval.synthetic` and
        :mod:`eval.ruler` name it), without generating it: the result-cache keys need only the id
        (and the task label)."""
        return f"{self.spec(task)[0]}-{self.seed}-{index}"


def resolve_grid(cfg: dict, args, model_name: str) -> Grid:
    """The :class:`Grid` of ``model_name`` under ``cfg`` and the parsed arguments ``args``."""
    mcfg, fcfg = cfg["models"][model_name], cfg.get("fidelity", {})
    ctx = int(mcfg["context_tokens"])
    tasks = args.tasks or mcfg.get("tasks", cfg["tasks"])
    n_prose = int(args.fidelity_n if args.fidelity_n is not None else fcfg.get("n", 4)) if args.fidelity else 0
    return Grid(model=model_name, chat=bool(mcfg.get("chat", False)), ctx=ctx,
                seed=cfg["splits"][args.split]["seed"],
                n=args.n if args.n is not None else int(cfg.get("n", 4)),
                ratios=args.ratios or cfg["ratios"], settings=args.settings or cfg.get("settings", ["aware"]),
                tasks=tasks,
                max_new={t: int(cfg.get("max_new_tokens", {}).get(t, DEFAULT_MAX_NEW.get(
                    dict(cfg.get("task_variants", {})).get(t, {}).get("task", t), 32))) for t in tasks},
                n_prose=max(n_prose, 0), prose_ctx=int(fcfg.get("context_tokens", ctx)),
                prose_tokens=int(fcfg.get("tokens", 64)), variants=dict(cfg.get("task_variants", {})))


def _resolved(method: str, options: dict, ratio: float, ctx: int | None = None) -> dict:
    """Every setting a row runs with (defaults included), so a changed default never hits stale
    cached results; ``ctx``: the prompts' length, if known (see :func:`_later_setting_matters`)."""
    original = options
    options, ratio = row_options(options, ratio)
    config = JacapConfig.from_options(ratio=ratio, method=method, **options)  # ValueError for a bad row
    if method not in _FLAT_OPTIONS:  # a method added since: its config as the library writes it
        return {**config.to_dict(), "chunk_mass": config.carries_mass}  # None (2026-12-07) runs as False
    resolved = _flat_config(method, options, ratio)
    for name, value in list(resolved.items()):
        if name in ("ratio", "method") or name in _FLAT_OPTIONS[method]:
            if name not in _V1_DEFAULTS and value is None:
                del resolved[name]
        elif name in _V1_DEFAULTS:
            resolved[name] = _V1_DEFAULTS[name]
        else:
            del resolved[name]
    if "budget" in resolved:  # the budget the row runs with (a method's default budget may change)
        resolved["budget"] = config.budget
    for name, before in _LATER_SETTINGS.items():
        # what the row runs: a prompt's chunked prefill (the harness never compresses through Document.compress)
        value = {"chunk_scores": config.chunk_scoring, "chunk_mass": config.carries_mass,
                 "chunk_budget": prompt_chunk_budget(config, config.chunk_size)}.get(name, getattr(config, name))
        if config.method.compresses and value != before and _later_setting_matters(name, config, ctx):
            resolved[name] = value
    # A method option whose default changed since: recorded where the row's value differs from what
    # the flat settings imply (the option given, else the default of that time), so a changed
    # default never reuses the old default's results, and a row giving the new default's values
    # explicitly shares its key.
    era = _FLAT_METHOD_DEFAULTS.get(method, {})
    # an option added since, whose default then changed (Jacap's carry, 2026-12-05): off the default of
    # its first results, so that today's default never reuses results of the earlier one
    defaults = {**{f.name: f.default for f in dataclasses.fields(type(config.method))},
                **OPTIONS_BEFORE.get(method, {})}
    for name, value in config.method.options().items():
        if name in _FLAT_OPTIONS[method] or name in era:
            if value != options.get(name, era.get(name, value)):
                resolved[name] = value
        elif value != defaults[name] and (name not in _CHUNKED_ONLY or config.chunk_size is not None):
            resolved[name] = value  # an option added since the flat settings: recorded off its default
    if method == "jacap":
        resolved["jacap_scoring"] = JACAP_SCORING_VERSION
    if original.get("quantize") is not None:  # answered from a saved and reloaded file
        resolved["file_quantize"] = original["quantize"]
    if original.get("chunk_prefix") is not None:  # chunks replayed over the exact prefill
        resolved["chunk_prefix"] = original["chunk_prefix"]
    if config.reselect is not None:
        resolved["reselect_version"] = RESELECT_VERSION
    if config.reselect is not None or config.chunk_size is not None:
        resolved["question_batching"] = QUESTION_BATCHING_VERSION
    if config.chunk_size is not None and config.chunk_scores is None and config.chunk_mass is None \
            and config.method.compresses and config.method.repeat_stats:
        resolved["repetitive_prompts"] = REPETITIVE_PROMPTS_VERSION
    if repeats(original) and "repeat_ids" in original:  # the row's own instruction, not the tokenizer's
        resolved["repeat_instruction"] = original["repeat_ids"]
    return resolved


def _flat_config(method: str, options: dict, ratio: float) -> dict:
    """The flat settings (:data:`_FLAT_DEFAULTS`) of a row of a method of that time, as that config's
    ``to_dict()`` gave them: the defaults, the row's options (numbers cast to the field's type), the
    budget a method fixes."""
    flat = {"ratio": float(ratio), "method": method, **_FLAT_DEFAULTS}
    for name, value in options.items():
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        flat[name] = (int(value) if name in _FLAT_INTS else float(value)) if numeric else value
    if method in _FLAT_FIXED_BUDGET:
        flat["budget"] = _FLAT_FIXED_BUDGET[method]
    return flat


def _spec(method: str, options: dict, ratio: float, ctx: int | None = None) -> dict:
    """What a row's cached results depend on: the resolved config, or the kvpress press spec."""
    if method == "kvpress":
        press, kwargs = KVPRESS[options["press"]]
        return {"kvpress": press, "kwargs": kwargs, "ratio": ratio}
    return _resolved(method, options, ratio, ctx)


def task_key(model_name, task, sample_id, setting, method, options, ratio, max_new, ctx, chat) -> str:
    return _key(model_name, task, sample_id, setting, _spec(method, options, ratio, ctx), max_new, ctx, chat)


def fidelity_key(model_name, index, split, method, options, ratio, ctx, m) -> str:
    return _key("fidelity", model_name, index, split, _spec(method, options, ratio, ctx), ctx, m)


def _key(*parts) -> str:
    blob = json.dumps([CACHE_VERSION, *parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


class ResultCache:
    def __init__(self, root=CACHE_DIR):
        self.root = pathlib.Path(root)  # created by the first put (--report-only writes nothing)
        self.writes = 0  # results computed (and stored) by this run

    def get(self, key):
        path = self.root / f"{key}.json"
        if path.exists():
            with open(path) as f:
                return json.load(f)
        return None

    def put(self, key, value):
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"{key}.json"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # one per process: two runs may share a cache folder
        with open(tmp, "w") as f:
            json.dump(value, f)
        os.replace(tmp, path)
        self.writes += 1


def _encode(tokenizer, text, special: bool) -> torch.Tensor:
    return torch.tensor([tokenizer.encode(text, add_special_tokens=special)], dtype=torch.long)


def sample_ids(tok, sample, setting: str, chat: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_ids [1, n], full_ids [1, n + q])`` of a task sample: the prompt that is compressed
    and the whole input ``generate`` gets. ``aware``: the question-aware prompt, all but its last
    token compressed; ``agnostic``: the context part compressed, the question suffix appended. The
    prompt is the library's layout, or RULER's for a RULER sample (:func:`eval.ruler.task_prompt_parts`)."""
    from eval.ruler import task_prompt_parts

    head, tail = task_prompt_parts(sample, tok, chat=chat)
    if setting == "aware":
        full_ids = _encode(tok, head + tail, not chat)
        return full_ids[:, :-1], full_ids
    prompt_ids = _encode(tok, head, not chat)
    suffix = _encode(tok, tail, False)
    return prompt_ids, torch.cat([prompt_ids, suffix], 1)


def prose_ids(tok, index: int, split: str, ctx: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fidelity sample ``index``: ``(prefix [1, ctx], continuation [1, m + 1])`` of held-out prose."""
    ids = _encode(tok, prose_text(index + 1000 * (split == "heldout"), int(ctx * 1.2) + 200), True)
    if ids.shape[1] < ctx + m + 1:
        raise RuntimeError("prose sample too short")
    return ids[:, :ctx], ids[:, ctx:ctx + m + 1]


def prose_text(index: int, min_words: int) -> str:
    """Held-out prose: consecutive corpus paragraphs (corpus order, unlike the shuffled task haystacks)
    starting at a position spread over the corpus by ``index``."""
    from jacap_attn.prose import haystack_paragraphs

    paras = haystack_paragraphs()
    start = (len(paras) * (2 * index + 1)) // 17 % len(paras)
    words, out, i = 0, [], start
    while words < min_words:
        text = " ".join(paras[i % len(paras)])
        out.append(text)
        words += len(text.split())
        i += 1
    return "\n\n".join(out)


def parse_shard(text: str) -> tuple[int, int]:
    """``--shard K/N``: ``(K, N)`` with ``0 <= K < N``; ``argparse.ArgumentTypeError`` naming the value."""
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes K/N (e.g. 0/2), got {text!r}") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"--shard K/N needs 0 <= K < N, got {text!r}")
    return k, n


def shard_of(samples: list, shard: tuple[int, int] | None) -> list:
    """The samples a ``--shard K/N`` process computes: every ``N``-th from index ``K`` (all without one)."""
    return samples if shard is None else samples[shard[0]::shard[1]]


def run_model(model_name: str, cfg: dict, args, variants: dict, log) -> tuple[list[dict], int]:
    """Compute what the result cache lacks of ``model_name``'s grid; ``(rows, results computed)``."""
    from tqdm import tqdm

    from jacap_attn.models import load_model

    grid = resolve_grid(cfg, args, model_name)
    model, tok = load_model(model_name)
    ensure_patched(model)
    chat, ctx = grid.chat, grid.ctx
    store = ResultCache(args.cache_dir)
    rows_raw = []  # (task, setting, label, ratio, sample_id, score, span recall or None)
    fid_raw = []  # (label, ratio, kl, nll_increase)
    t_start = time.time()
    counters = {"prefill_s": [], "sample_s": [], "shared": 0, "reference": 0, "decoded": 0}
    missing: dict[str, int] = {}  # kvpress rows are computed in their own venv (eval/kvpress)

    # Fidelity first (cheap); then per sample one recorded prefill shared by its settings (the
    # agnostic context part is a token prefix of the aware prompt, :func:`record_prompts`), replayed
    # for every (setting, ratio, row) not yet in the result cache (eval.answers: one batch per ratio).
    fid_raw += run_fidelity(model, tok, grid, args, variants, store)
    for task in grid.tasks:
        samples = shard_of(grid.samples(task, tok), args.shard)
        max_new = grid.max_new[task]
        for sample in tqdm(samples, desc=f"{model_name} {task}", file=sys.stderr):
            todo: dict[str, list] = {}
            for setting in grid.settings:
                for ratio in grid.ratios:
                    for label, (method, opts) in variants.items():
                        r = 1.0 if method == "full" else ratio
                        key = task_key(model_name, task, sample.id, setting, method, opts, r, max_new, ctx, chat)
                        hit = store.get(key)
                        if hit is not None:
                            rows_raw.append((task, setting, label, ratio, sample.id, hit["score"],
                                             hit.get("span_recall")))
                        elif method == "kvpress":
                            missing[label] = missing.get(label, 0) + 1
                        else:
                            todo.setdefault(setting, []).append((label, method, opts, r, ratio, key))
            if not todo:
                continue
            t0 = time.time()
            ids = {setting: sample_ids(tok, sample, setting, chat) for setting in todo}
            records = record_prompts(model, {setting: prompt for setting, (prompt, _) in ids.items()}, counters)
            for setting, rows in todo.items():
                full_key = task_key(model_name, task, sample.id, setting, "full", {}, 1.0, max_new, ctx, chat)
                done = evaluate_sample(model, tok, sample, setting, chat, max_new, rows, store, full_key,
                                       args.decoding, counters, *ids[setting], records.pop(setting))
                for label, method, opts, r, ratio, key in rows:
                    hit = done[key]
                    rows_raw.append((task, setting, label, ratio, sample.id, hit["score"], hit.get("span_recall")))
            counters["sample_s"].append(time.time() - t0)
        log(f"[{model_name}] task {task} done after {time.time() - t_start:.0f}s")
    if missing:
        log(f"[{model_name}] no kvpress results yet for {missing} samples: run `make bench-kvpress` "
            "(eval/kvpress/README.md) with the same arguments")
    rows = aggregate(rows_raw, fid_raw, model_name, args)
    if counters["prefill_s"]:
        log(f"[{model_name}] {len(counters['sample_s'])} samples computed ({len(counters['prefill_s'])} recorded "
            f"prefills, {counters['shared']} records cut out of another setting's): mean recorded prefill "
            f"{sum(counters['prefill_s']) / len(counters['prefill_s']):.2f}s, mean per sample (prefills, replays, answers) "
            f"{sum(counters['sample_s']) / len(counters['sample_s']):.2f}s; answers equal to the full cache's by the "
            f"teacher-forced check {counters['reference']}, decoded {counters['decoded']}")
    return rows, store.writes


def run_fidelity(model, tok, grid: Grid, args, variants, store) -> list:
    from tqdm import tqdm

    out = []
    ctx, m = grid.prose_ctx, grid.prose_tokens
    for i in tqdm(range(grid.n_prose), desc=f"{grid.model} fidelity", file=sys.stderr):
        prefix, cont = prose_ids(tok, i, args.split, ctx, m)
        todo = []
        for ratio in grid.ratios:
            for label, (method, opts) in variants.items():
                if method == "full":
                    continue
                key = fidelity_key(grid.model, i, args.split, method, opts, ratio, ctx, m)
                hit = store.get(key)
                if hit is not None:
                    out.append((label, ratio, hit["kl"], hit["nll_increase"]))
                elif method != "kvpress":
                    todo.append((label, method, opts, ratio, key))
        if not todo:
            continue
        record = record_prefill(model, prefix)
        ref_logp, ref_nll, _ = fidelity(model, record, prefix, cont, make_config("full", {}, 1.0))
        for label, method, opts, ratio, key in todo:
            _, _, res = fidelity(model, record, prefix, cont, make_config(method, opts, ratio), (ref_logp, ref_nll))
            store.put(key, res)
            out.append((label, ratio, res["kl"], res["nll_increase"]))
        del record
    return out


def cached_rows(model_name: str, cfg: dict, args, variants: dict) -> tuple[list[dict], int, int]:
    """``--report-only``: ``(rows, found, expected)`` from the per-sample result cache alone, for the
    grid :func:`run_model` walks (in its order), without loading the model or its tokenizer."""
    grid = resolve_grid(cfg, args, model_name)
    store = ResultCache(args.cache_dir)
    rows_raw, fid_raw, found, expected = [], [], 0, 0
    for i in range(grid.n_prose):
        for ratio in grid.ratios:
            for label, (method, opts) in variants.items():
                if method != "full":
                    expected += 1
                    hit = store.get(fidelity_key(grid.model, i, args.split, method, opts, ratio,
                                                 grid.prose_ctx, grid.prose_tokens))
                    if hit is not None:
                        found += 1
                        fid_raw.append((label, ratio, hit["kl"], hit["nll_increase"]))
    for setting in grid.settings:
        for task in grid.tasks:
            for index in range(grid.n):
                sid = grid.sample_id(task, index)
                for ratio in grid.ratios:
                    for label, (method, opts) in variants.items():
                        r = 1.0 if method == "full" else ratio
                        expected += 1
                        hit = store.get(task_key(model_name, task, sid, setting, method, opts, r,
                                                 grid.max_new[task], grid.ctx, grid.chat))
                        if hit is not None:
                            found += 1
                            rows_raw.append((task, setting, label, ratio, sid, hit["score"], hit.get("span_recall")))
    return aggregate(rows_raw, fid_raw, model_name, args), found, expected


def command_args(command: str) -> list[str]:
    """The arguments of a recorded ``command`` (``python -m eval.quality ...`` or, before the
    harness moved to ``eval/``, ``jacap bench quality ...``)."""
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word in ("quality", "eval.quality") or word.endswith(("eval/quality.py", "eval\\quality.py")):
            return words[i + 1:]
    raise ValueError(f"not a quality benchmark command: {command!r}")


def saved_labels(saved: dict) -> list[str]:
    """The row labels, in table order, of a results JSON: its ``labels``, or for results written
    before they were recorded, the rows its recorded ``command`` selects."""
    if "labels" in saved:
        return list(saved["labels"])
    args = build_parser().parse_args(saved_argv(saved))
    return list(resolve_variants(args, load_config(config_path(args))))


def render_saved(saved: dict) -> str:
    """The Markdown table of a results JSON (``<stem>.json`` as :func:`quality_main` writes it)."""
    return markdown_table(saved["rows"], saved["command"], saved["model"], saved["split"], saved["tasks"],
                          saved["ratios"], saved["n"], saved_labels(saved), saved.get("seconds"))


def _requested_n(n) -> int:
    """Samples per task requested by a run: ``n``, or the ``N`` of ``"2-3 (of N requested)"``."""
    match = re.search(r"of (\d+) requested", str(n))
    return int(match.group(1)) if match else int(n)


def same_grid(saved: dict, grid: Grid, split: str, labels: list) -> bool:
    """Whether a results JSON holds the table of ``grid`` (model, split, tasks, ratios, settings,
    samples, fidelity samples) with the row ``labels`` in this order."""
    tasks = [r for r in saved["rows"] if r["kind"] == "task"]
    prose = {r["n"] for r in saved["rows"] if r["kind"] == "fidelity"}
    return (saved["model"] == grid.model and saved["split"] == split and saved["tasks"] == grid.tasks
            and saved["ratios"] == grid.ratios and _requested_n(saved["n"]) == grid.n
            and {r["setting"] for r in tasks} == set(grid.settings)
            and prose == ({grid.n_prose} if grid.n_prose else set()) and saved_labels(saved) == labels)


def aggregate(rows_raw, fid_raw, model_name, args) -> list[dict]:
    """Table rows (:mod:`eval.quality_report`) from per-sample results: ``rows_raw`` holds
    ``(task, setting, label, ratio, sample_id, score[, span_recall])`` (a span recall of ``None``, or
    none given, for results without one: old cached results, rows that compress nothing, samples
    without value spans), ``fid_raw`` ``(label, ratio, kl, nll_increase)``. A task row carries
    ``span_recall`` (sample id -> recall) only where some sample has one."""
    from collections import defaultdict

    groups = defaultdict(dict)
    recalls = defaultdict(dict)
    for task, setting, label, ratio, sid, s, *recall in rows_raw:
        groups[(task, setting, label, ratio)][sid] = s
        if recall and recall[0] is not None:
            recalls[(task, setting, label, ratio)][sid] = recall[0]
    rows = []
    for (task, setting, label, ratio), by_sample in sorted(groups.items(), key=lambda kv: str(kv[0])):
        method, opts = variant(label)
        scores = list(by_sample.values())
        correct = sum(1 for s in scores if s >= 1.0)
        # accuracy: samples with every answer found (a binomial count, with its Wilson interval);
        # mean_score: the mean fraction of answers found (they differ on multi-answer tasks).
        rows.append({"kind": "task", "model": model_name, "split": args.split, "task": task, "setting": setting,
                     "label": label, "method": method, "options": opts,
                     "ratio": 1.0 if method == "full" else ratio, "grid_ratio": ratio,
                     "n": len(scores), "accuracy": correct / len(scores), "correct": correct,
                     "ci95": list(stats.wilson(correct, len(scores))), "mean_score": sum(scores) / len(scores),
                     "samples": dict(sorted(by_sample.items()))})
        if recalls.get((task, setting, label, ratio)):
            rows[-1]["span_recall"] = dict(sorted(recalls[(task, setting, label, ratio)].items()))
    fg = defaultdict(list)
    for label, ratio, kl, dnll in fid_raw:
        fg[(label, ratio)].append((kl, dnll))
    for (label, ratio), vals in sorted(fg.items(), key=lambda kv: str(kv[0])):
        method, opts = variant(label)
        rows.append({"kind": "fidelity", "model": model_name, "split": args.split, "label": label, "method": method,
                     "options": opts, "ratio": ratio, "n": len(vals),
                     "kl": sum(v[0] for v in vals) / len(vals), "nll_increase": sum(v[1] for v in vals) / len(vals)})
    return rows


ALL_VARIANTS = {**VARIANTS, **ABLATION}


def _option_value(text: str):
    for cast in (int, float):
        with contextlib.suppress(ValueError):
            return cast(text)
    return {"true": True, "false": False}.get(text.lower(), text)


def variant(label: str) -> tuple[str, dict]:
    """``(method, options)`` of a row label: a named row (:data:`ALL_VARIANTS`) or an ad-hoc
    ``method[option=value,...]``, e.g. ``jacap[ridge=1,pooling=max]``. Raises ``ValueError`` naming
    an unknown label, method or option (checked by :meth:`JacapConfig.from_options`)."""
    if label in ALL_VARIANTS:
        return ALL_VARIANTS[label]
    if label in KVPRESS:
        return "kvpress", {"press": label}
    match = re.fullmatch(r"([a-z_0-9]+)\[(.*)\]", label)
    if not match:
        raise ValueError(f"unknown method row {label!r}; known rows: {', '.join([*ALL_VARIANTS, *KVPRESS])}, "
                         "or method[option=value,...]")
    method, body = match.groups()
    options = {}
    for item in filter(None, body.split(",")):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"row {label!r}: expected option=value, got {item!r}")
        if name in ("ratio", "method") or name in options:
            raise ValueError(f"row {label!r}: {name!r} cannot be set {'twice' if name in options else 'in a row label'}")
        options[name] = _option_value(value.strip())
    JacapConfig.from_options(ratio=0.5, method=method, **row_options(options, 0.01 if "store" in options else 0.5)[0])
    return method, options


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CI smoke config (eval/configs/quality_quick.json)")
    p.add_argument("--config", help="config JSON (default eval/configs/quality.json)")
    p.add_argument("--split", choices=("tuning", "heldout"), default=None)
    p.add_argument("--models", nargs="+")
    p.add_argument("--tasks", nargs="+")
    p.add_argument("--methods", nargs="+", help=f"row labels: {', '.join(ALL_VARIANTS)}, or method[option=value,...]")
    p.add_argument("--ratios", nargs="+", type=float)
    p.add_argument("--settings", nargs="+", choices=("aware", "agnostic"))
    p.add_argument("--n", type=int, help="samples per task")
    p.add_argument("--fidelity-n", type=int, help="prose samples for the KL metric (0: skip)")
    p.add_argument("--no-fidelity", dest="fidelity", action="store_false")
    p.add_argument("--report-only", action="store_true",
                   help="compute nothing, load no model: tables and plots from the cached per-sample results, "
                        "or from the saved <stem>.json of the same grid when the cache lacks some")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="write no PNG plots")
    p.add_argument("--ablation", action="store_true", help="Jacap knobs one at a time (tuning split)")
    p.add_argument("--cache-dir", default=str(CACHE_DIR))
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decoding", choices=("fast", "one-by-one"), default="fast",
                   help="fast: teacher-forced check against the full cache's answer, batched greedy decoding of "
                        "the rest (eval/answers.py); one-by-one: generate per row (the same greedy answers)")
    p.add_argument("--tag", default="", help="suffix of the output file names (default: the config's `tag`, if any)")
    p.add_argument("--shard", type=parse_shard, metavar="K/N",
                   help="compute only every N-th sample of each task from index K, so that N processes (each with "
                        "its own --tag) share a run; then table it whole with --report-only and the run's arguments")
    return p


def check_grid_arguments(args, cfg: dict) -> None:
    """``SystemExit`` naming a ``--ratios`` value outside (0, 1] or a ``--tasks`` label that is neither a task of
    a suite nor one of the config's ``task_variants`` (checked before a model loads)."""
    from eval.ruler import known_tasks

    bad = [r for r in args.ratios or [] if not 0.0 < r <= 1.0]
    if bad:
        raise SystemExit(f"eval.quality: --ratios are kept fractions in (0, 1], got {bad}")
    known = [*known_tasks(), *cfg.get("task_variants", {})]
    unknown = [t for t in args.tasks or [] if t not in known]
    if unknown:
        raise SystemExit(f"eval.quality: unknown --tasks {unknown}; known: {', '.join(known)}")


def resolve_variants(args, cfg: dict) -> dict[str, tuple[str, dict]]:
    """The rows of a run, label -> ``(method, options)``, in table order."""
    if args.ablation:
        return {**ABLATION, "full": VARIANTS["full"]}
    return {label: variant(label) for label in args.methods or cfg["methods"]}


def quality_main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.shard is not None and args.report_only:
        parser.error("--shard splits the computation; --report-only computes nothing (table the whole run)")
    if args.shard is not None and not args.tag:  # else each shard would write its part over the run's table
        parser.error(f"--shard {args.shard[0]}/{args.shard[1]} needs its own --tag (e.g. --tag _s{args.shard[0]})")
    torch.set_num_threads(args.threads)
    command = "python -m eval.quality " + " ".join(shlex.quote(a) for a in argv)
    path = config_path(args)
    cfg = load_config(path)
    if args.quick and not args.tag:
        args.tag = "_quick"
    if not args.tag and cfg.get("tag"):  # a suite's config names its tables (configs/ruler.json: "_ruler")
        args.tag = cfg["tag"]
    if args.split is None:
        args.split = "tuning" if args.ablation else cfg.get("default_split", "heldout")
    try:
        variants = resolve_variants(args, cfg)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    labels = list(variants)
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    unknown = [m for m in args.models or [] if m not in cfg["models"]]
    if unknown:
        raise SystemExit(f"models {unknown} are not in {path}; it has: {', '.join(cfg['models'])}")
    check_grid_arguments(args, cfg)  # before any model loads
    for model_name in args.models or list(cfg["models"]):
        t0 = time.time()
        grid = resolve_grid(cfg, args, model_name)
        tasks, ratios, n = grid.tasks, grid.ratios, grid.n
        stem = out_dir / (f"ablation_{model_name}{args.tag}" if args.ablation
                          else f"quality_{model_name}_{args.split}{args.tag}")
        computed = 0
        if args.report_only:
            rows, found, expected = cached_rows(model_name, cfg, args, variants)
            saved_path = pathlib.Path(f"{stem}.json")
            saved = json.loads(saved_path.read_text()) if found < expected and saved_path.is_file() else None
            if saved is not None and same_grid(saved, grid, args.split, labels):
                # A fresh clone has no per-sample cache: the saved results are the table (and its command).
                log(f"[{model_name}] the result cache holds {found} of {expected} results: "
                    f"{stem}.md re-rendered from {saved_path}")
                md = render_saved(saved)
                write_atomically(f"{stem}.md", md.encode())
                pngs = plots(saved["rows"], saved["command"], model_name, saved["split"], saved["tasks"],
                             saved["ratios"], saved["n"], labels, str(stem)) if args.plots else []
                print(md)
                log(f"wrote {', '.join([f'{stem}.md', *pngs])}")
                continue
            if found < expected and saved is not None:  # never table part of a grid over another grid's file
                raise SystemExit(f"eval.quality: the result cache holds {found} of {expected} results of this grid and "
                                 f"{saved_path} holds another grid (its command: {saved.get('command')}): nothing "
                                 "written; run that command with --report-only, or write elsewhere with --tag")
            if not found:
                raise SystemExit(f"eval.quality: the result cache ({args.cache_dir}) holds none of the {expected} "
                                 f"results of this grid: nothing written to {stem}.json")
            if found < expected:
                log(f"[{model_name}] the result cache holds {found} of {expected} results: tabling what is cached")
        else:
            rows, computed = run_model(model_name, cfg, args, variants, log)
        counts = sorted({r["n"] for r in rows if r["kind"] == "task" and r["method"] != "full"})
        if counts and counts != [n]:
            n = f"{counts[0]}-{counts[-1]} (of {n} requested)" if len(counts) > 1 else f"{counts[0]} (of {n} requested)"
        for r in rows:
            r["command"] = command
        seconds = time.time() - t0
        if args.report_only or not computed:  # every result from the cache: its wall time is the computing run's
            previous = json.loads(pathlib.Path(f"{stem}.json").read_text()) if pathlib.Path(f"{stem}.json").is_file() else {}
            seconds = previous.get("seconds") if previous.get("command") == command else None
        if not any(r["kind"] == "task" for r in rows):  # a run that answered nothing never replaces a table
            raise SystemExit(f"eval.quality: no result to table for {model_name} (n={args.n}): nothing written to {stem}.json")
        write_atomically(f"{stem}.json", json.dumps(
            {"command": command, "config": str(path), "model": model_name, "split": args.split, "ratios": ratios,
             "tasks": tasks, "n": n, "labels": labels, "seconds": seconds, "threads": args.threads, "rows": rows},
            indent=1).encode())
        md = markdown_table(rows, command, model_name, args.split, tasks, ratios, n, labels, seconds)
        write_atomically(f"{stem}.md", md.encode())
        pngs = plots(rows, command, model_name, args.split, tasks, ratios, n, labels, str(stem)) if args.plots else []
        print(md)
        log(f"wrote {', '.join([f'{stem}.json', f'{stem}.md', *pngs])} ({time.time() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(quality_main())
