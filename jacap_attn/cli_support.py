"""Helpers of the ``jacap`` command (:mod:`jacap_attn.cli`): its shared arguments and their settings
(``--store``, the method's options), greedy answers with their timings, and the reports; the checks of what a
user gives are :mod:`jacap_attn.cli_checks`."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from .config import BUDGETS, CHUNK_BUDGETS, CHUNK_SCORES, GLOBAL_SCORES, QUERIES, SPANS
from .methods import names as method_names


def _add_method_arguments(parser):
    parser.add_argument("--model", default="smollm2",
                        help="embedded model name (smollm2, gemma3-270m), a local model folder or a .gguf file")
    parser.add_argument("--ratio", type=float, default=0.1, help="kept fraction of the prompt's KV entries, in (0, 1] (default 0.1)")
    parser.add_argument("--method", default="jacap", choices=method_names())
    parser.add_argument("--window", type=int, help="observation window (default 32)")
    parser.add_argument("--budget", choices=BUDGETS,
                        help="budget policy (default: the method's own: global for jacap, pyramid for pyramidkv, uniform "
                             "for the others)")
    parser.add_argument("--global-score", choices=GLOBAL_SCORES,
                        help="what the global budget ranks across layers and KV heads (default attention)")
    parser.add_argument("--head-floor", type=float,
                        help="per-head floor of the global budget, a fraction of the uniform budget (default 0.2)")
    parser.add_argument("--ridge", type=float, help="ridge factor rho (default 0.1)")
    parser.add_argument("--queries", choices=QUERIES,
                        help="queries that score the prompt: window (question-aware) or repeat (question-agnostic, "
                             "a teacher-forced repeat pass; default window)")
    parser.add_argument("--lookahead", type=int,
                        help="tokens the model writes before the cut whose queries score the prompt beside the "
                             "observation window's (default 0: the window alone)")
    parser.add_argument("--reselect", type=float,
                        help="select again when the question arrives: kept fraction of the tokens seen (default: off "
                             "for jacap run; for jacap compress --ratio when the document is stored whole)")
    parser.add_argument("--spans", choices=SPANS,
                        help="words: keep whitespace-delimited words whole; none: token by token (default: the "
                             "method's, words for jacap)")
    parser.add_argument("--max-span", type=int, help="longest word, in tokens, kept whole (default 64)")
    parser.add_argument("--chunk-size", type=int,
                        help="prefill in chunks of this many tokens, each cut to the running budget: memory bounded "
                             "by the kept entries plus one chunk (default: one exact prefill)")
    parser.add_argument("--chunk-scores", choices=CHUNK_SCORES,
                        help="how the chunk cuts before the last are scored: rescore (the chunk's observation "
                             "window, lookup ahead to the prompt's end; the default of jacap run), repeat (a repeat "
                             "pass of each chunk: question-agnostic, jacap compress's default for methods that read "
                             "it) or carry")
    parser.add_argument("--chunk-ratio", type=float,
                        help="running budget of the chunk cuts before the last, a kept fraction in [ratio, 1]: the "
                             "last cut, which sees the question, keeps ratio (default: ratio at every cut)")
    parser.add_argument("--chunk-budget", choices=CHUNK_BUDGETS,
                        help="what the chunk cuts before the last take their fraction of: seen (the tokens so far) or "
                             "final (never less than the prompt's final budget, ratio x its length); default: jacap "
                             "run's prompt final where ratio x chunk is below the slots a cut sets aside (window + "
                             "sinks + prompt lookup's free slots), else seen; jacap compress's document seen")
    parser.add_argument("--chunk-mass", action=argparse.BooleanOptionalAction, default=None,
                        help="carry each evicted entry's attention mass to the nearest held entry of its KV head "
                             "between the chunk cuts (chunk_mass=True), or not (--no-chunk-mass); default: not "
                             "for a prompt, for a document (jacap compress) the mass of near-duplicates (cosine "
                             ">= 0.95) where the cuts are repeat-scored")
    parser.add_argument("--mass-cosine", type=float,
                        help="with --chunk-mass: hand on only the evicted entries whose nearest held key has at least "
                             "this cosine similarity, in [-1, 1] (default -1: every one; 0.95 where jacap compress "
                             "sets the mass itself)")


def _store(args):
    """``--store`` for :meth:`jacap_attn.Document.compress`: a kept fraction (at least ``--ratio``), or ``None`` for ``--store ratio``."""
    from .document import STORE

    if args.store is None:
        return STORE
    if args.store == "ratio":
        return None
    try:
        store = float(args.store)
    except ValueError:
        store = float("nan")
    if not 0.0 < store <= 1.0:  # NaN fails too
        raise ValueError(f"--store must be a kept fraction in (0, 1] or 'ratio', got {args.store!r}")
    if store < args.ratio:  # Document.compress would store at --ratio: said, not done silently
        raise ValueError(f"--store {args.store} is below --ratio {args.ratio}: a file holds at least what a question "
                         "decodes over; give --store ratio (or a fraction of at least --ratio)")
    return store


_METHOD_FLAGS = ("window", "budget", "global_score", "head_floor", "ridge", "queries", "lookahead", "reselect", "spans",
                 "max_span", "chunk_size", "chunk_scores", "chunk_ratio", "chunk_budget",
                 "chunk_mass", "mass_cosine")


def _method_options(args) -> dict:
    return {name: getattr(args, name) for name in _METHOD_FLAGS if getattr(args, name, None) is not None}


_CHUNK_ONLY = ("chunk_scores", "chunk_ratio", "chunk_budget", "chunk_mass")  # read by a chunked prefill alone


def _check_config(args):
    """The :class:`~jacap_attn.JacapConfig` of the method arguments, validated before the model loads
    (``ValueError`` naming a bad ``--ratio``, ``--window``, ``--reselect``, ...). The repeat
    instruction's ids (``--queries repeat``) need the tokenizer and are added when patching."""
    from .config import JacapConfig

    options = _method_options(args)
    try:
        config = JacapConfig.from_options(ratio=args.ratio, method=args.method, **options)
    except ValueError as err:  # the library names its options; the command line names its flags
        raise ValueError(_as_flags(str(err), ("ratio", "method", *_METHOD_FLAGS))) from None
    alone = [name for name in _CHUNK_ONLY if options.get(name) is not None] if options.get("chunk_size") is None else []
    if alone:  # the Python API keeps them for a later generate(prefill_chunk_size=N); a command has no later prefill
        flags = ", ".join("--" + name.replace("_", "-") for name in alone)
        raise ValueError(f"{flags} set(s) the cuts of a chunked prefill, and none runs without --chunk-size: give "
                         "--chunk-size N, or leave them out")
    return config


def _as_flags(message: str, names) -> str:
    """``message`` with each option name of ``names`` written as its flag (``chunk_size=0`` ->
    ``--chunk-size=0``; ``ratio`` alone stays, it is also a word)."""
    head, sep, accepted = message.partition("; it accepts: ")
    for name in sorted(set(names), key=len, reverse=True):
        head = re.sub(rf"(?<![\w-]){name}(?==)", "--" + name.replace("_", "-"), head)
        if "_" in name:
            head = re.sub(rf"(?<![\w-]){name}\b", "--" + name.replace("_", "-"), head)
    if not sep:
        return head
    # The library's list of a method's options: the command line's flags among them, the others named as
    # what they are (settings of the Python API, which the command line does not take).
    options = accepted.split(", ")
    flags = [f"--{name.replace('_', '-')}" for name in options if name in names]
    others = [name for name in options if name not in names]
    return (f"{head}; with this method the command line takes {', '.join(flags) or 'none of its method flags'}"
            + (f" (in Python also: {', '.join(others)})" if others else ""))


def _with_repeat_ids(options: dict, tokenizer, chat: bool, method: str, document: bool = False) -> dict:
    """Add the repeat instruction's ids when a repeat pass will run (``--queries repeat``, or a chunked
    prefill whose cuts it scores: ``--chunk-scores repeat``, a ``document``'s default for the methods
    that read it)."""
    from .methods import get_method
    from .prompts import repeat_instruction_ids
    from .route_settings import chunk_scoring

    chunk_repeat = options.get("chunk_size") is not None and \
        chunk_scoring(options.get("chunk_scores"), get_method(method), document) == "repeat"
    if options.get("queries") == "repeat" or chunk_repeat:
        options = {**options, "repeat_ids": repeat_instruction_ids(tokenizer, chat=chat)}
    return options


def _encode(tokenizer, text: str):
    import torch

    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


class _StepTimer:
    """A logits processor that timestamps every generation step: the first call follows the prefill."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def _answer(model, tokenizer, ids, max_new_tokens: int, cache=None):
    """Greedy answer text, the cache used, prefill seconds and mean decode seconds per token (``None`` when only one
    token was generated: no decode step to time)."""
    from transformers import LogitsProcessorList

    timer = _StepTimer()
    extra = {} if cache is None else {"cache": cache}
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=max_new_tokens, do_sample=False,
                         logits_processor=LogitsProcessorList([timer]), return_dict_in_generate=True,
                         pad_token_id=tokenizer.pad_token_id, **extra)
    end = time.perf_counter()
    new = out.sequences[0, ids.shape[1]:]
    steps = len(timer.stamps)
    prefill = timer.stamps[0] - start if steps else end - start
    decode = (end - timer.stamps[0]) / (steps - 1) if steps > 1 else None  # one token: no decode step timed
    used = getattr(out, "cache", None) or out.past_key_values
    return tokenizer.decode(new, skip_special_tokens=True).strip(), used, prefill, decode


def _ms_per_token(decode: float | None) -> float | None:
    """Mean decode milliseconds per token for the JSON line (``None``, JSON's ``null``, when none was timed)."""
    return None if decode is None else round(1000 * decode, 2)


def _correct(expected, answer) -> bool | None:
    return None if expected is None else expected.lower() in answer.lower()


def _report_answers(r: dict) -> None:
    print(f"model {r['model']}: prompt of {r['prompt_tokens']} tokens, method={r['method']}, kept ratio={r['ratio']}")
    print(f"  expected answer     : {'(not known: your own question)' if r['expected'] is None else r['expected']}")
    print(f"  full cache          : {r['answer_full']!r}  (correct: {r['correct_full']})")
    print(f"  jacap cache         : {r['answer_jacap']!r}  (correct: {r['correct_jacap']})")
    k = r["kept_tokens_per_layer"]
    # the JSON's own numbers, unrounded again: the text and the JSON line never disagree
    print(f"  kept tokens / layer : min {k['min']}, mean {k['mean']}, max {k['max']} (per KV head, mean over heads)")
    print(f"  KV cache bytes      : full {r['kv_bytes_full']:,} -> kept {r['kv_bytes_jacap']:,} "
          f"({r['kv_bytes_full'] / max(r['kv_bytes_jacap'], 1):.1f}x smaller)"
          + (" : nothing evicted (a prompt under min_tokens, 256 by default, is kept whole)"
             if k["min"] >= r["prompt_tokens"] else ""))
    print(f"  prefill             : full {r['prefill_s_full']} s, jacap {r['prefill_s_jacap']} s")
    full, jacap = r["decode_ms_per_token_full"], r["decode_ms_per_token_jacap"]
    print("  decode              : " + ("no decode step timed (one new token)" if full is None or jacap is None
                                       else f"full {full} ms/token, jacap {jacap} ms/token"))


def _report(r: dict) -> None:
    _report_answers(r)
    print(f"  saved document cache: {r['cache_file']} ({r['cache_file_bytes']:,} bytes = "
          f"{r['cache_file_bytes'] / max(r['file_full_bytes'], 1):.2f}x the document's full cache, "
          f"{r['file_full_bytes']:,}; "
          f"stored kept fraction {r['file_stored_ratio']}, route {r['file_selection_route']}, "
          f"decode budget {r['file_decode_budget']}, entries {r['file_quantization'] or 'exact'})")
    print(f"  from file, asked    : {r['question_from_file']!r}")
    print(f"  answer from file    : {r['answer_from_file']!r}  (expected {r['expected_from_file']}, correct: {r['correct_from_file']})")
    print(json.dumps(r))


def _non_default(cfg: dict) -> dict:
    """The settings of a saved config ``cfg`` (``JacapConfig.to_dict``) that differ from a fresh config of the
    same ratio and method in this version, method options included (``jacap inspect``); ``{}`` if the
    method is unknown here."""
    from .config import JacapConfig

    try:
        base = JacapConfig.from_options(cfg["ratio"], cfg["method"]).to_dict()
    except (KeyError, ValueError, TypeError):
        return {}
    shown = ("ratio", "method", "window", "budget", "options")
    out = {k: v for k, v in cfg.items() if k not in shown and k in base and base[k] != v}
    defaults = base.get("options") or {}
    out.update({k: v for k, v in (cfg.get("options") or {}).items() if k in defaults and defaults[k] != v})
    return out


# `jacap run --cache` answers from the file with the file's own settings: these options are the ones it reads.
RUN_FROM_FILE_OPTIONS = ("cache", "question", "model", "reselect", "max_new_tokens", "func", "command")


def _refuse_ignored_with_cache(args, defaults: dict) -> None:
    """``jacap run --cache``: ``ValueError`` naming every option of ``args`` (an ``argparse.Namespace``) given a
    value other than its default in ``defaults`` (``run``'s, ``{dest: value}``) that answering from a file does
    not read (:data:`RUN_FROM_FILE_OPTIONS`), so that none is silently ignored (before 2026-12-07 ``--cache-out``
    was never written, ``--prompt-file`` never read, and the exit status 0)."""
    ignored = [f"--{dest.replace('_', '-')}" for dest, default in defaults.items()
               if dest not in RUN_FROM_FILE_OPTIONS and getattr(args, dest, default) != default]
    if ignored:
        raise ValueError(f"jacap run --cache does not read {', '.join(ignored)} (it answers with the file's own "
                         "settings; jacap compress writes a new file)")


ROUTES = {  # selection routes as `jacap inspect` describes them (files.cache_file.selection_route)
          "window": "scored by the observation window: question-aware if the question ended the prompt",
          "lookahead": "scored by the observation window and the tokens the model writes next: question-aware "
                       "if the question ended the prompt",
          "repeat": "scored by a repeat pass: question-agnostic",
          "chunked": "a chunked prefill, each cut scored by its chunk's observation window: question-aware at the "
                     "last cut only, if the question ended the prompt",
          "chunked-repeat": "a chunked prefill, the cuts before the last scored by a repeat pass (question-agnostic), "
                            "the last by the prompt's end",
          "whole": "nothing evicted: for question-time reselection"}


def _short_note(length, cfg: dict) -> str:
    """``jacap inspect``'s note on a document shorter than ``min_tokens``, which every cut keeps whole."""
    short = isinstance(length, int) and length < cfg.get("min_tokens", 0)
    return f"; but under min_tokens={cfg['min_tokens']} this {length}-token document is kept whole" if short else ""


BENCH_MOVED = """jacap bench: the benchmarks moved out of the installed package into the repository's eval/.
From the repository root (a checkout of the project, with its .venv):
  make bench           = python -m eval.speed [options]     speed: prefill, selection, decode, memory
  make bench-quality   = python -m eval.quality [options]   quality: --quick, --report-only, --models ...
  make ablation        = python -m eval.quality --ablation --models smollm2 ...
  make bench-kvpress   kvpress side by side (eval/kvpress/README.md)
See eval/README.md."""


def cmd_bench(argv: list[str]) -> int:
    """``jacap bench ARGS`` is gone: print the commands that replace it and return 2."""
    print(BENCH_MOVED, file=sys.stderr)
    module = {"speed": "eval.speed", "quality": "eval.quality"}.get(argv[0] if argv else None)
    if module:
        print(f"instead of `jacap bench {' '.join(argv)}`, run: python -m {' '.join([module, *argv[1:]])}",
              file=sys.stderr)
    return 2
