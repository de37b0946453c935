"""The ``jacap`` command: ``run`` (the main job), ``compress``, ``ask``, ``inspect``. The benchmarks are not part of
the package: they live in the repository's ``eval/`` (``jacap bench`` says how to run them).

Every argument is checked before the model loads (a ``ValueError`` naming it, exit status 2), output
paths included, and a saved cache of another document is replaced only with ``--force``. Results go to
stdout, progress and logs to stderr; a closed stdout (``jacap inspect | head``) ends quietly, and so
does Ctrl-C (one line, exit status 130; files are written atomically, so none is half-written).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from .cli_checks import (DEMO_MIN_TOKENS, _check_context, _check_count, _check_demo_length, _check_file_settings,
                         _check_model_name, _check_out, _check_questions, _document_source, _read_document)
from .cli_support import (_add_method_arguments, _answer, _non_default, _check_config, _correct,  # noqa: F401
                          _encode, _method_options, _refuse_ignored_with_cache, _report, _report_answers,
                          _ms_per_token, _short_note, _store, _with_repeat_ids, cmd_bench, ROUTES)


def _load(name: str):
    from .models import ModelFetchError, load_model

    try:
        return load_model(name)
    except ModelFetchError as err:  # one `jacap: error:` line, as for a missing file
        raise OSError(f"model {name!r} could not be fetched: {err}") from None


def cmd_run(args) -> dict:
    """The main job: a long prompt with a hidden fact, answered with the full and the compressed
    cache; then the compressed document saved, reloaded and asked a second question."""
    import torch

    import jacap_attn
    from . import prompts
    from .models import cache_root
    from .files.persist import decode_budget, file_route

    # Every argument is checked before the model loads.
    _check_config(args)
    _check_model_name(args.model)
    _check_count("--max-new-tokens", args.max_new_tokens)
    _check_questions([args.question] if args.question is not None else [])
    if args.cache:
        return cmd_run_from_file(args)
    store = _store(args)
    _check_demo_length(args.context_tokens)
    text = _read_document(args.prompt_file) if args.prompt_file else None
    # What the saved document is made of, known before anything loads (the --cache-out check).
    source = _document_source(args.model, text=text, demo=None if text is not None else
                              {"seed": args.seed, "context_tokens": args.context_tokens})
    if args.cache_out:
        out_path, force, option = Path(args.cache_out), args.force, "--cache-out"
    else:  # the demo's own file, replaced at every run
        out_path, force, option = cache_root() / "demo-cache.safetensors", True, "the demo cache file"
        out_path.parent.mkdir(parents=True, exist_ok=True)
    inputs = {"--prompt-file": args.prompt_file, "--model": args.model}
    _check_out(out_path, force, option, source, inputs)
    model, tokenizer = _load(args.model)
    _check_context(model, args.context_tokens + args.max_new_tokens, "--context-tokens plus --max-new-tokens")
    doc = prompts.demo_document(tokenizer, context_tokens=args.context_tokens, seed=args.seed)
    prefix, suffixes, expected = doc.prefix, list(doc.suffixes), list(doc.answers)
    if text is not None:
        question = args.question or "Summarise the document in one sentence."
        sample = {"context": text, "question": question}
        prefix = prompts.format_prompt(sample, tokenizer, question_position="none")
        suffixes, expected = [prompts.format_question(sample, tokenizer)] * 2, [None, None]
    elif args.question:
        suffixes[0] = prompts.format_question({"context": "", "question": args.question}, tokenizer)
        expected[0] = None
    prefix_ids = _encode(tokenizer, prefix)
    ids = torch.cat([prefix_ids, _encode(tokenizer, suffixes[0])], dim=1)
    n = ids.shape[1]
    _check_context(model, n + args.max_new_tokens, "the document, its question and --max-new-tokens")
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elt = next(model.parameters()).element_size()
    kv_bytes_full = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * n * head_dim * elt

    answer_full, _, prefill_full, decode_full = _answer(model, tokenizer, ids, args.max_new_tokens)
    jacap_attn.patch(model, ratio=args.ratio, method=args.method,
                     **_with_repeat_ids(_method_options(args), tokenizer, doc.chat, args.method))
    answer_jacap, cache, prefill_jacap, decode_jacap = _answer(model, tokenizer, ids, args.max_new_tokens)
    kept = torch.stack([k.double().mean() for k in cache.prompt_kept])  # float64: no float32 digits in the JSON
    kv_bytes_jacap = cache.prompt_kept_bytes()
    result = {
        "model": args.model, "prompt_tokens": n, "ratio": args.ratio, "method": args.method,
        "options": _method_options(args), "seed": args.seed,
        "expected": expected[0], "answer_full": answer_full, "answer_jacap": answer_jacap,
        "correct_full": _correct(expected[0], answer_full), "correct_jacap": _correct(expected[0], answer_jacap),
        "kv_bytes_full": kv_bytes_full, "kv_bytes_jacap": kv_bytes_jacap,
        "kept_tokens_per_layer": {name: round(float(getattr(kept, name)()), 3) for name in ("min", "mean", "max")},
        "prefill_s_full": round(prefill_full, 3), "prefill_s_jacap": round(prefill_jacap, 3),
        "decode_ms_per_token_full": _ms_per_token(decode_full), "decode_ms_per_token_jacap": _ms_per_token(decode_jacap),
    }

    # The document alone (its question unknown), stored as Document.compress stores it by default.
    document = jacap_attn.Document.compress(model, prefix_ids, prompt_format={"chat": doc.chat, "source": source},
                                            store=store)
    try:
        _check_out(out_path, force, option, source, inputs)  # again: another run may have saved there since
        file_bytes = document.save(out_path)
    except (OSError, ValueError):
        _report_answers(result)  # what was computed is printed before the error
        print(json.dumps(result))
        raise
    stored = document.cache.config
    loaded, metadata = jacap_attn.Document.load_with_metadata(out_path, model)  # the file's settings, one read
    ids2 = torch.cat([prefix_ids, _encode(tokenizer, suffixes[1])], dim=1)
    answer_file, _, _, _ = _answer(model, tokenizer, ids2, args.max_new_tokens, cache=loaded.fresh_cache())

    result.update({
        "cache_file": str(out_path), "cache_file_bytes": file_bytes,
        "file_stored_ratio": stored.ratio, "file_kept_bytes": document.cache.prompt_kept_bytes(),
        "file_full_bytes": document.cache.full_bytes(),
        "file_selection_route": file_route(metadata),
        "file_decode_budget": decode_budget(loaded.cache.config),
        "file_quantization": metadata.get("quantization"),
        "question_from_file": doc.questions[1] if not args.prompt_file else args.question,
        "expected_from_file": expected[1], "answer_from_file": answer_file,
        "correct_from_file": _correct(expected[1], answer_file),
    })
    _report(result)
    return result


def cmd_run_from_file(args) -> dict:
    """Answer ``--question`` from a saved cache file (the model must be the one that wrote it)."""
    import torch

    import jacap_attn
    from . import prompts

    if not args.question:
        raise ValueError("jacap run --cache needs --question")
    _refuse_ignored_with_cache(args, vars(build_parser().parse_args(["run"])))
    metadata = _check_file_settings(args.cache, args.reselect, args.model)
    chat = json.loads(metadata.get("prompt_format", "{}")).get("chat")  # None: as the tokenizer has a template
    model, tokenizer = _load(args.model)
    # The unpatched model is patched with the file's settings; --reselect overrides its decode budget.
    loaded = jacap_attn.load_cache(args.cache, model, reselect=args.reselect)
    suffix = prompts.format_question({"context": "", "question": args.question}, tokenizer, chat=chat)
    ids = torch.cat([loaded.prompt_ids, _encode(tokenizer, suffix)], dim=1)
    _check_context(model, ids.shape[1] + args.max_new_tokens, "the stored document, --question and --max-new-tokens")
    answer, _, prefill, decode = _answer(model, tokenizer, ids, args.max_new_tokens, cache=loaded)
    result = {"model": args.model, "cache_file": args.cache, "question": args.question, "answer": answer,
              "prompt_tokens": int(metadata["logical_length"]), "decode_ms_per_token": _ms_per_token(decode)}
    print(f"answer: {answer}")
    print(json.dumps(result))
    return result


def cmd_compress(args) -> dict:
    """Compress a prompt file and save the cache."""
    from tqdm import tqdm

    import jacap_attn
    from . import prompts
    from .files.persist import decode_budget

    # Every argument is checked before the model loads, the output path and the document included.
    _check_config(args)
    _check_model_name(args.model)
    store = _store(args)
    quantize = None if args.quantize == "none" else args.quantize
    text = _read_document(args.prompt_file)
    source = _document_source(args.model, text=text, raw=args.raw)
    inputs = {"--prompt-file": args.prompt_file, "--model": args.model}
    _check_out(args.out, args.force, "--out", source, inputs)
    with tqdm(total=4, desc="jacap compress", unit="step") as bar:
        bar.set_postfix_str("loading model")
        model, tokenizer = _load(args.model)
        bar.update()
        bar.set_postfix_str("tokenizing")
        # The chat layout when the tokenizer has a chat template (an instruct model), else the plain one.
        chat = not args.raw and prompts._use_chat(tokenizer, None)
        prompt = text if args.raw else prompts.format_prompt({"context": text, "question": ""}, tokenizer,
                                                             question_position="none", chat=chat)
        ids = _encode(tokenizer, prompt)
        _check_context(model, ids.shape[1], f"--prompt-file {args.prompt_file}")
        bar.update()
        bar.set_postfix_str(f"prefill of {ids.shape[1]} tokens")
        jacap_attn.patch(model, ratio=args.ratio, method=args.method,
                         **_with_repeat_ids(_method_options(args), tokenizer, chat, args.method, document=True))
        doc = jacap_attn.Document.compress(model, ids, prompt_format={"chat": chat, "source": source}, store=store)
        bar.update()
        bar.set_postfix_str("saving")
        _check_out(args.out, args.force, "--out", source, inputs)  # again: another run may have saved there since
        size = doc.save(args.out, quantize=quantize)
        bar.update()
    cache = doc.cache
    result = {"out": str(args.out), "prompt_tokens": ids.shape[1], "file_bytes": size,
              "kept_bytes": cache.prompt_kept_bytes(), "full_bytes": cache.full_bytes(),
              "stored_ratio": cache.config.ratio if cache.config.method.compresses else 1.0,
              "decode_budget": decode_budget(cache.config),
              "quantization": quantize}
    result["held_fraction"] = result["kept_bytes"] / result["full_bytes"] if result["full_bytes"] else 1.0
    print(f"{args.out}: {size:,} bytes = {size / max(result['kept_bytes'], 1):.2f}x its kept entries "
          f"({result['kept_bytes']:,} bytes), {size / max(result['full_bytes'], 1):.2f}x the full cache "
          f"({result['full_bytes']:,} bytes); stored kept fraction {result['stored_ratio']} (configured; "
          f"{result['held_fraction']:.3f} of the full cache's entries held), decode budget "
          f"{result['decode_budget']}{', entries in ' + quantize if quantize else ''}", file=sys.stderr)
    print(json.dumps(result))
    return result


def cmd_inspect(args) -> dict:
    """Print a cache file's metadata and per-layer kept counts."""
    from .files.cache_file import FORMAT, read_cache_file, summary

    metadata, tensors = read_cache_file(args.path)
    facts = summary(metadata, tensors)
    info = {key: (json.loads(value) if key in ("model", "jacap_config", "prompt_format", "metadata_sha256") else value)
            for key, value in metadata.items()}
    info.update({k: int(info[k]) for k in ("format_version", "batch_size", "logical_length")  # header strings
                 if isinstance(info.get(k), str) and info[k].isdigit()})
    info.update(facts)
    info["selection_route"] = info.pop("route")
    info["file_bytes"] = Path(args.path).stat().st_size
    kept = info["kept_per_layer"]
    layers = range(len(kept))
    if args.json:
        print(json.dumps(info, indent=2))
        return info
    fp = info["model"]
    print(f"{args.path}: {FORMAT} v{info['format_version']} (jacap_attn {info['library_version']}), {info['file_bytes']:,} bytes")
    print(f"  model   : {fp['model_type']}, {fp['num_hidden_layers']} layers, {fp['num_key_value_heads']} KV heads, "
          f"head dim {fp['head_dim']}, {fp['dtype']}")
    print(f"  prompt  : {info['logical_length']} tokens x batch {info['batch_size']}, sha256 {info['prompt_sha256'][:16]}...")
    cfg = info["jacap_config"]
    print(f"  method  : {cfg['method']}, window {cfg.get('window')}, budget {cfg.get('budget')}")
    changed = _non_default(cfg)
    if changed:
        print(f"  options : {', '.join(f'{k}={v!r}' for k, v in changed.items())} (differing from patch()'s defaults in this version)")
    print(f"  stored  : kept fraction {info['stored_ratio']} of the prompt (configured), {info['held_fraction']:.3f} "
          f"of the full cache's entries held; decode budget {info['decode_budget']} "
          f"(what a question decodes over{', reselected per question' if cfg.get('reselect') is not None else ''}"
          f"{_short_note(info['logical_length'], cfg)})")
    print(f"  bytes   : file {info['file_bytes']:,}; kept entries {info['kept_bytes']:,} "
          f"(file {info['file_bytes'] / max(info['kept_bytes'], 1):.2f}x); full cache {info['full_bytes']:,} "
          f"(file {info['file_bytes'] / max(info['full_bytes'], 1):.2f}x of it); entries "
          f"{info.get('quantization') or 'in ' + fp['dtype']}")
    print(f"  route   : {info['selection_route']} ({ROUTES.get(info['selection_route'], '?')})")
    for i, counts in zip(layers, kept):
        print(f"  layer {i:3d}: kept per (batch, KV head) {counts}")
    return info



def cmd_ask(args) -> dict:
    """Answer every ``--question`` from a saved document file, each over a fresh copy of it.

    stdout: ``Q: <question>`` and ``A: <answer>`` lines per question, printed as each is answered, or
    with ``--json`` one JSON object alone (the answers with their timings, the file's route and decode
    budget); logs and progress go to stderr."""
    import jacap_attn
    from .files.persist import file_route

    # Every argument is checked before the model loads.
    _check_model_name(args.model)
    _check_count("--max-new-tokens", args.max_new_tokens)
    _check_questions(args.question)
    metadata = _check_file_settings(args.path, args.reselect, args.model)
    model, tokenizer = _load(args.model)
    # The unpatched model is patched with the file's settings; --reselect overrides its decode budget.
    doc = jacap_attn.Document.load(args.path, model, reselect=args.reselect)
    reselect = doc.cache.config.reselect
    answers = []
    for question in args.question:
        start = time.perf_counter()
        answer = doc.ask(question, tokenizer, max_new_tokens=args.max_new_tokens)
        answers.append({"question": question, "answer": answer, "seconds": round(time.perf_counter() - start, 3)})
        if not args.json:
            print(f"Q: {question}\nA: {answer}", flush=True)
    result = {"model": args.model, "cache_file": args.path, "prompt_tokens": doc.length,
              "selection_route": file_route(metadata), "reselect": reselect, "answers": answers}
    if args.json:
        print(json.dumps(result))
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jacap", description="Jacap KV-cache compression for transformers models",
                                     allow_abbrev=False)
    # Options are matched whole: an abbreviation (`--chunk` for `--chunk-size`) would change meaning
    # whenever an option sharing its prefix is added, so it is an unrecognized argument here.
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False))
    run = sub.add_parser("run", help="the main job: answer a long prompt with the full and the compressed cache")
    _add_method_arguments(run)
    run.add_argument("--seed", type=int, default=0, help="seed of the hidden facts (default 0)")
    run.add_argument("--context-tokens", type=int, default=1400,
                     help=f"document length in tokens, at least {DEMO_MIN_TOKENS} (default 1400)")
    run.add_argument("--prompt-file", help="use this text file as the document instead of the generated one")
    run.add_argument("--question", help="question to ask (with --cache: required)")
    run.add_argument("--cache", help="answer --question from this saved cache file instead, with its own settings")
    run.add_argument("--cache-out", help="the .safetensors file the demo saves the document to (default: in the cache dir)")
    run.add_argument("--force", action="store_true", help="replace a --cache-out file that holds another document")
    run.add_argument("--store", help="kept fraction of the saved document (default 1: whole, reselected to --ratio "
                                     "by the later question); 'ratio': stored at --ratio")
    run.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated per answer (default 24)")
    run.set_defaults(func=cmd_run)
    comp = sub.add_parser("compress", help="compress a prompt file and save the cache to .safetensors", description=(
        "Compress a prompt file and save its cache: a summary of its bytes on stderr, the same as a JSON line on stdout."))
    _add_method_arguments(comp)
    comp.add_argument("--prompt-file", required=True, help="the document: a text file")
    comp.add_argument("--out", required=True, help="the cache file to write (its folder must exist)")
    comp.add_argument("--force", action="store_true", help="replace an --out file that holds another document")
    comp.add_argument("--raw", action="store_true", help="use the file's text as is (no instruction, no chat template)")
    comp.add_argument("--store", help="kept fraction stored in the file (default 1: the document whole, reselected "
                                      "to --ratio by each question); 'ratio': store at --ratio (smaller file)")
    comp.add_argument("--quantize", choices=("int8", "none"), default="int8",
                      help="int8 (default): the entries in 8 bits, keys per channel, values per token (about 0.27 "
                           "of float32's bytes); none: in the model's dtype, exact")
    comp.set_defaults(func=cmd_compress)
    ask = sub.add_parser("ask", help="answer questions from a saved document cache (each on a fresh copy)")
    ask.add_argument("path")
    ask.add_argument("--question", action="append", required=True, help="a question (repeat for more)")
    ask.add_argument("--model", default="smollm2", help="the model that wrote the file (default smollm2)")
    ask.add_argument("--reselect", type=float,
                     help="select again per question: kept fraction of the document's tokens (default: the "
                          "file's setting, which `jacap compress` sets to its --ratio for a document stored whole)")
    ask.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per answer (default 32)")
    ask.add_argument("--json", action="store_true",
                     help="print one JSON object (answers, timings, the file's settings) instead of Q:/A: lines "
                          "(an answer may span lines: programs should read --json)")
    ask.set_defaults(func=cmd_ask)
    insp = sub.add_parser("inspect", help="show a saved cache's metadata and kept counts")
    insp.add_argument("path")
    insp.add_argument("--json", action="store_true")
    insp.set_defaults(func=cmd_inspect)
    bench = sub.add_parser("bench", help="removed: the benchmarks are `make bench` / `python -m eval.speed` ... "
                                          "(run `jacap bench` for the commands)", add_help=False)
    bench.set_defaults(func=None)
    parser.subcommands = sub.choices  # main() names a subcommand's unknown arguments with its own usage
    return parser


def _terminated(signum, frame):
    """SIGTERM (``kill``, a job scheduler) ends a command as Ctrl-C does: through every ``finally``, so a
    cache file being written is removed, not left as a temporary file beside the old one."""
    raise KeyboardInterrupt


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return cmd_bench(argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse's own error, but with the subcommand's usage line, not the top-level one
        parser.subcommands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    on_main = threading.current_thread() is threading.main_thread()  # signal handlers are set from there only
    previous = signal.getsignal(signal.SIGTERM) if on_main else None
    if on_main:
        signal.signal(signal.SIGTERM, _terminated)
    try:
        args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:  # stdout closed by the reader (`jacap inspect f | head`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush then goes nowhere
        return 0
    except (ValueError, OSError) as err:
        print(f"jacap: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: files are written atomically, so none is left half-written
        print("jacap: interrupted", file=sys.stderr)
        return 130
    finally:
        if on_main and previous is not None:  # None: a handler not set from Python, left as it is
            signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
