"""Issue 25, "Bugs users hit": one test (or a few) per reported case; each docstring names the kind of
fault. The cases: 3 (a LoRA-merged model accepted the base model's cache), 5 (an empty prompt file
replaced a saved cache), 6 (`jacap compress` on a base model), 8 (errors that came late or crashed),
9 (a saved file's header was not checksummed), 10 (documents in a fresh process, one settings rule),
and the import cycle between `cache` and `persist`.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch

import jacap_attn
from jacap_attn.files.cache_file import padded_tensors
from jacap_attn.storage.identity import legacy_weights_fingerprint
from jacap_attn import cli, prompts
from jacap_attn.storage import identity
from jacap_attn.files import persist
from jacap_attn.files.persist import CacheFileError, read_cache_file, read_cache_metadata
from conftest import random_ids, tiny_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
GREEDY = dict(do_sample=False)


class _BaseTokenizer:
    """A base model's tokenizer: one id per character, no chat template (transformers' error if one
    is used anyway)."""

    chat_template = None
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": self.encode(text)}

    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) % 90 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + int(i) % 26) for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        if not self.chat_template:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")
        body = "".join(f"<{m['role']}>{m['content']}</turn>" for m in messages)
        return body + ("<assistant>" if add_generation_prompt else "")


class _ChatTokenizer(_BaseTokenizer):
    chat_template = "a template"


@pytest.fixture
def cli_models(monkeypatch):
    """`jacap`'s model loader replaced by fresh tiny models (seed 0, as a new process would load the same
    checkpoint), with a base tokenizer unless ``tokenizer`` is set; records the loads."""
    loads = []
    state = {"tokenizer": _BaseTokenizer()}

    def load(name):
        loads.append(name)
        return tiny_model("llama"), state["tokenizer"]

    monkeypatch.setattr(cli, "_load", load)
    state["loads"] = loads
    return state


def _no_load(monkeypatch):
    monkeypatch.setattr(cli, "_load", lambda name: pytest.fail("the model loaded before the arguments were checked"))


def _saved_document(path, *, text="An old document that someone saved. " * 3, tokenizer=None):
    """A document cache file as `jacap compress` writes it, from the seed-0 tiny model."""
    tokenizer = tokenizer or _BaseTokenizer()
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.3, window=8)
    prompt = prompts.format_prompt({"context": text, "question": ""}, tokenizer, question_position="none")
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    jacap_attn.Document.compress(model, ids, prompt_format={"chat": False}).save(path)
    return model, ids


# -- case 3: a LoRA-merged model accepts the base model's cache ------------------------------------

def _merge_lora(model, rank=4, scale=0.3, seed=5):
    """Add a rank-``rank`` ``up @ down`` to ``q_proj`` and ``v_proj`` of every layer, as merging a LoRA
    adapter does."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.v_proj):
                out, inp = proj.weight.shape
                up, down = torch.randn(out, rank, generator=gen), torch.randn(rank, inp, generator=gen)
                proj.weight += scale * (up @ down) / math.sqrt(inp)
    return model


def test_lora_merged_model_refuses_the_base_models_cache_in_memory_and_from_file(tmp_path):
    """Kind: a cache accepted by a model it was not made by (silently wrong answers). B is A plus a
    rank-4 adapter merged into q_proj and v_proj: the old fingerprint (an embedding slice and 1-D
    parameters) was equal, so B decoded over A's cache. Every weight is fingerprinted now."""
    a = tiny_model("llama")
    b = _merge_lora(copy.deepcopy(a))
    doc, q = random_ids(1, 80), random_ids(1, 5, seed=7)
    with torch.no_grad():  # the adapter changes the keys and values, so the answers
        assert not torch.allclose(a(doc).logits, b(doc).logits, atol=1e-3)
    jacap_attn.patch(a, ratio=0.3, window=8)
    jacap_attn.patch(b, ratio=0.3, window=8)
    assert identity.weights_fingerprint(a) != identity.weights_fingerprint(b)
    cache = jacap_attn.compress(a, doc)
    with pytest.raises(ValueError, match="weights_sha256"):
        b.generate(torch.cat([doc, q], 1), cache=copy.deepcopy(cache), max_new_tokens=2)
    path = tmp_path / "a.safetensors"
    jacap_attn.save_cache(cache, path, model=a, prompt_ids=doc)
    with pytest.raises(CacheFileError, match="weights_sha256"):
        jacap_attn.load_cache(path, b)
    # A deep copy of the *patched* A, then merged, computes its own fingerprint (not A's memo).
    c = _merge_lora(copy.deepcopy(a))
    with pytest.raises(CacheFileError, match="weights_sha256"):
        jacap_attn.load_cache(path, c)
    assert jacap_attn.load_cache(path, a).get_seq_length() == 80


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_fingerprint_covers_every_weight_and_is_dtype_and_chunk_independent(family, monkeypatch):
    """Kind: a cache accepted by a model it was not made by. One changed element of any parameter (a
    middle layer's MLP too) changes the fingerprint; a float32 model and its bfloat16 copy agree (as
    the docstring promises); the row chunks that bound memory do not change the value; each parameter
    is folded once, on its own device."""
    a = tiny_model(family)
    base = identity.weights_fingerprint(a)
    assert identity.weights_fingerprint(tiny_model(family, dtype=torch.bfloat16)) == base
    for name, param in a.named_parameters():
        other = copy.deepcopy(a)
        with torch.no_grad():
            target = dict(other.named_parameters())[name].view(-1)
            target[target.numel() // 2] += max(0.05, 0.1 * float(target[target.numel() // 2].abs()))
        assert identity.weights_fingerprint(other) != base, name
    monkeypatch.setattr(identity, "_CHUNK", 7)  # many row chunks per matrix
    assert identity.weights_fingerprint(a) == base
    folded = []
    original = identity._fold
    monkeypatch.setattr(identity, "_fold", lambda t: folded.append((t.data_ptr(), t.device)) or original(t))
    identity.weights_fingerprint(a)
    assert len(folded) == len(set(folded)) == len(list(a.parameters()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fingerprint_is_the_same_on_the_gpu():
    """Kind: a cache accepted by a model it was not made by (a device-dependent fingerprint would
    refuse the same model's file on another device)."""
    a = tiny_model("llama")
    assert identity.weights_fingerprint(copy.deepcopy(a).cuda()) == identity.weights_fingerprint(a)
    assert identity.weights_fingerprint(copy.deepcopy(a).to("cuda", torch.bfloat16)) == identity.weights_fingerprint(a)


# -- case 5: an empty prompt file destroys a saved cache -------------------------------------------

@pytest.mark.parametrize("content", ["", "  \n\t\n"])
def test_empty_prompt_file_is_refused_before_anything_is_loaded_or_written(tmp_path, monkeypatch, capsys, content):
    """Kind: data loss. An empty prompt file compressed to a 42-token chat template and silently
    replaced the cache file at --out; it is refused before the model loads, naming the file."""
    existing = tmp_path / "existing.safetensors"
    _saved_document(existing)
    before = existing.read_bytes()
    empty = tmp_path / "empty.txt"
    empty.write_text(content)
    _no_load(monkeypatch)
    for argv in (["compress", "--prompt-file", str(empty), "--out", str(existing)],
                 ["compress", "--prompt-file", str(empty), "--out", str(existing), "--raw", "--force"],
                 ["run", "--prompt-file", str(empty), "--cache-out", str(existing)]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "empty" in err and str(empty) in err
    assert existing.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["empty.txt", "existing.safetensors"]


def test_replacing_another_documents_cache_needs_force(tmp_path, cli_models, capsys):
    """Kind: data loss. `jacap compress --out` replaced any file: a cache of another document (or any
    other file) there is now kept unless --force, with a message naming it; recompressing the same
    document in place is allowed."""
    existing = tmp_path / "existing.safetensors"
    _saved_document(existing)
    before = existing.read_bytes()
    text = tmp_path / "new.txt"
    text.write_text("A different document, about something else entirely. " * 2)
    argv = ["compress", "--prompt-file", str(text), "--out", str(existing)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert str(existing) in err and "another document" in err and "--force" in err
    assert existing.read_bytes() == before
    assert cli.main(argv + ["--force"]) == 0
    capsys.readouterr()
    replaced = existing.read_bytes()
    assert replaced != before
    assert cli.main(argv + ["--ratio", "0.5"]) == 0  # the same document again: no --force needed
    capsys.readouterr()
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    loads = len(cli_models["loads"])
    assert cli.main(["compress", "--prompt-file", str(text), "--out", str(notes)]) == 2
    assert "not a jacap cache file" in capsys.readouterr().err and notes.read_text() == "my notes"
    assert len(cli_models["loads"]) == loads  # refused before the model loaded


# -- case 6: `jacap compress --model gemma3-270m` fails ----------------------------------------------

def test_compress_on_a_base_model_uses_the_plain_layout(tmp_path, cli_models, capsys):
    """Kind: a default that fails on valid input. `compress` forced the chat template unless --raw, so
    a base model (no chat template: gemma-3-270m) failed; it gets the plain layout by default, as
    `jacap run` does, and an instruct model the chat layout; `ask` and `run --cache` answer from it."""
    text = tmp_path / "doc.txt"
    text.write_text("The secret city is Oslo. " * 3)
    for tokenizer, chat in ((_BaseTokenizer(), False), (_ChatTokenizer(), True)):
        cli_models["tokenizer"] = tokenizer
        out = tmp_path / f"chat-{chat}.safetensors"
        assert cli.main(["compress", "--prompt-file", str(text), "--out", str(out)]) == 0
        capsys.readouterr()
        meta, tensors = read_cache_file(out)
        assert json.loads(meta["prompt_format"]) == {"chat": chat,
                                                     "source": cli._document_source("smollm2", text=text.read_text())}
        want = prompts.format_prompt({"context": text.read_text(), "question": ""}, tokenizer,
                                     question_position="none", chat=chat)
        assert tensors["prompt_ids"][0].tolist() == tokenizer(want)["input_ids"]
        assert cli.main(["ask", str(out), "--question", "Which city?", "--max-new-tokens", "2"]) == 0
        assert cli.main(["run", "--cache", str(out), "--question", "Which city?", "--max-new-tokens", "2"]) == 0
        capsys.readouterr()
    # A file without a prompt_format (saved by save_cache) is asked in the tokenizer's own layout.
    cli_models["tokenizer"] = _BaseTokenizer()
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.3, window=8)
    ids = random_ids(1, 40)
    bare = tmp_path / "bare.safetensors"
    jacap_attn.save_cache(jacap_attn.compress(model, ids), bare, model=model, prompt_ids=ids)
    assert cli.main(["run", "--cache", str(bare), "--question", "Where?", "--max-new-tokens", "2"]) == 0


# -- case 8: errors that come late or crash ------------------------------------------------------------

def test_generate_on_an_empty_prompt_is_a_clear_error():
    """Kind: a late, unclear error. `generate` on input_ids of shape [1, 0] raised IndexError deep in
    the cache; it is a ValueError naming the shape before any work (as `compress` already was)."""
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.3)
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(ValueError, match=r"input_ids has shape \(1, 0\)"):
        model.generate(empty, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"input_ids has shape \(1, 0\)"):
        model.generate(input_ids=empty, attention_mask=empty, max_new_tokens=2)
    with pytest.raises(ValueError, match="non-empty"):
        jacap_attn.compress(model, empty)
    with pytest.raises(ValueError, match=r"input_ids has shape \(1, 0\)"):  # a plain forward too
        model(input_ids=empty)
    assert model.generate(random_ids(1, 10), max_new_tokens=2, min_new_tokens=2, **GREEDY).shape == (1, 12)


def test_save_cache_names_a_missing_model_and_a_bad_path(tmp_path):
    """Kind: a crash instead of an error. `save_cache(..., model=None)` raised AttributeError; it is a
    ValueError naming `model`. A directory or a missing folder as the path is a ValueError naming the
    path before any work (it named a temporary file after the work)."""
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.3, window=8)
    ids = random_ids(1, 40)
    cache = jacap_attn.compress(model, ids)
    for bad in (None, tiny_model("llama")):
        with pytest.raises(ValueError, match="model="):
            jacap_attn.save_cache(cache, tmp_path / "c.safetensors", model=bad, prompt_ids=ids)
    for path, match in ((tmp_path, "is a directory"), (tmp_path / "nowhere" / "c.safetensors", "does not exist")):
        with pytest.raises(ValueError, match=match) as err:
            jacap_attn.save_cache(cache, path, model=model, prompt_ids=ids)
        assert str(path) in str(err.value) and ".jacap-" not in str(err.value)
    with pytest.raises(ValueError, match="cache file '': give a file name"):  # was a FileNotFoundError
        jacap_attn.Document(model, cache, ids).save("")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv,named", [
    (["compress", "--ratio", "0"], "ratio"), (["compress", "--ratio", "2"], "ratio"),
    (["compress", "--ratio", "nan"], "ratio"), (["compress", "--window", "0"], "window"),
    (["compress", "--reselect", "1.5"], "reselect"), (["compress", "--method", "h2o", "--reselect", "0.1"], "reselect"),
    (["compress", "--model", "no-such-model"], "no-such-model"),
    (["run", "--ratio", "0"], "ratio"), (["run", "--ratio", "nan"], "ratio"), (["run", "--reselect", "0"], "reselect"),
    (["run", "--max-new-tokens", "0"], "--max-new-tokens"), (["run", "--context-tokens", "0"], "--context-tokens"),
    (["run", "--context-tokens", "5"], "--context-tokens must be at least 64"),  # needles of 27 tokens: after loading
    (["run", "--question", "  "], "--question"), (["run", "--store", "2"], "--store"),
    (["run", "--cache", "{doc}", "--question", "Who?", "--reselect", "2"], "reselect"),
    (["run", "--cache", "{missing}", "--question", "Who?"], "missing.safetensors"),
    (["ask", "{doc}", "--question", "Who?", "--reselect", "0"], "reselect"),
    (["ask", "{doc}", "--question", ""], "--question"),
    (["ask", "{doc}", "--question", "Who?", "--max-new-tokens", "-1"], "--max-new-tokens"),
    (["ask", "{missing}", "--question", "Who?"], "missing.safetensors"),
])
def test_every_cli_argument_is_checked_before_the_model_loads(tmp_path, monkeypatch, capsys, argv, named):
    """Kind: a late error. --ratio 0, 2 or nan were refused after the model loaded (3.6 s), and
    `jacap run --ratio 0` after the full-cache answer (10 s); every argument is now checked first."""
    doc = tmp_path / "doc.safetensors"
    _saved_document(doc)
    text = tmp_path / "doc.txt"
    text.write_text("a document")
    argv = [a.format(doc=doc, missing=tmp_path / "missing.safetensors") for a in argv]
    if argv[0] == "compress":
        argv += ["--prompt-file", str(text), "--out", str(tmp_path / "out.safetensors")]
    _no_load(monkeypatch)
    assert cli.main(argv) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("command", ["compress", "run"])
@pytest.mark.parametrize("where", ["directory", "missing folder", "read-only folder"])
def test_output_path_is_checked_before_any_work_and_named(tmp_path, monkeypatch, capsys, command, where):
    """Kind: a late error naming the wrong thing. A read-only or missing output folder failed after
    compression with a message naming a temporary file, and so did --out a directory; the path is now
    checked before the model loads and the message names the user's path."""
    text = tmp_path / "doc.txt"
    text.write_text("a document")
    out = {"directory": tmp_path, "missing folder": tmp_path / "nowhere" / "doc.safetensors",
           "read-only folder": tmp_path / "doc.safetensors"}[where]
    if where == "read-only folder":  # the tests may run as root, whom chmod does not stop
        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied", os.path.join(str(tmp_path), ".jacap-x.tmp"))
        monkeypatch.setattr(tempfile, "mkstemp", refuse)
    _no_load(monkeypatch)
    option = "--out" if command == "compress" else "--cache-out"
    argv = [command, "--prompt-file", str(text), option, str(out)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert str(out) in err and option in err and ".jacap-" not in err


def test_run_prints_its_answers_when_the_cache_cannot_be_saved(tmp_path, cli_models, monkeypatch, capsys):
    """Kind: computed results lost. `jacap run --cache-out` into a read-only folder printed nothing and
    lost the answers; the path is checked first, and a save that fails anyway (here: the rename)
    prints the answers before the error, which names the user's path."""
    out = tmp_path / "doc.safetensors"
    real_replace = os.replace

    def replace(src, dst):
        if str(dst) == str(out):
            raise PermissionError(13, "Permission denied", src)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    assert cli.main(["run", "--context-tokens", "200", "--max-new-tokens", "2", "--cache-out", str(out)]) == 2
    captured = capsys.readouterr()
    assert "full cache" in captured.out and "jacap cache" in captured.out
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert {"answer_full", "answer_jacap", "expected"} <= set(result)
    assert str(out) in captured.err and ".jacap-" not in captured.err
    assert os.listdir(tmp_path) == []  # no temporary file left behind


def test_inspect_into_a_closed_pipe_is_quiet(tmp_path):
    """Kind: a crash at the end of a good run. `jacap inspect f | head` ended with a BrokenPipeError
    traceback; a reader that closes stdout early now ends the command quietly."""
    path = tmp_path / "doc.safetensors"
    _saved_document(path)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from jacap_attn import cli; sys.exit(cli.main())",
                             "inspect", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    proc.stdout.close()  # before the command prints anything: every write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0
    assert "BrokenPipe" not in err and "Traceback" not in err and "Exception ignored" not in err


def test_ask_has_a_clean_stdout_contract(tmp_path, cli_models, capsys):
    """Kind: output that a program cannot read. `jacap ask` printed the answers and then a JSON line on
    stdout; stdout is now the Q:/A: lines alone, or with --json one JSON object alone."""
    path = tmp_path / "doc.safetensors"
    _saved_document(path)
    questions = ["--question", "Who?", "--question", "Where?", "--max-new-tokens", "2"]
    assert cli.main(["ask", str(path), *questions]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line[:3] for line in lines] == ["Q: ", "A: ", "Q: ", "A: "]
    assert lines[0] == "Q: Who?" and lines[2] == "Q: Where?"
    assert cli.main(["ask", str(path), *questions, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [item["answer"] for item in result["answers"]] == [lines[1][3:], lines[3][3:]]
    assert result["selection_route"] == "whole" and result["reselect"] == 0.3


# -- case 9: a saved file's header is not covered by its checksum -------------------------------------

def _edit_header(path, out, old: bytes, new: bytes):
    """Replace ``old`` by ``new`` (same length) in the file's bytes, as a hand edit would: the header
    stays valid JSON and the tensor data and its checksum are untouched."""
    raw = path.read_bytes()
    assert len(old) == len(new) and raw.count(old) == 1
    out.write_bytes(raw.replace(old, new))
    return out


def test_edited_header_field_is_refused_naming_it(tmp_path, capsys):
    """Kind: silent corruption. A file whose `selection_route` was edited from "window" to "repeat"
    (same length) loaded silently; the header's fields are checksummed (`metadata_sha256`), and an
    edited, added or removed field is a CacheFileError naming it, in load_cache, Document.load, the
    header reader and `jacap inspect`. Files of format 2 (no header checksum) still load."""
    from safetensors.torch import save_file

    model = jacap_attn.patch(tiny_model("llama"), ratio=0.3, window=8)
    ids = random_ids(1, 60)
    path = tmp_path / "doc.safetensors"
    jacap_attn.save_cache(jacap_attn.compress(model, ids), path, model=model, prompt_ids=ids)
    assert read_cache_metadata(path)["selection_route"] == "window"
    route = _edit_header(path, tmp_path / "route.safetensors", b'"selection_route":"window"', b'"selection_route":"repeat"')
    ratio = _edit_header(path, tmp_path / "ratio.safetensors", b'\\"ratio\\": 0.3', b'\\"ratio\\": 0.9')
    for bad, field in ((route, "selection_route"), (ratio, "jacap_config")):
        for load in (lambda p: jacap_attn.load_cache(p, model), lambda p: jacap_attn.Document.load(p, model),
                     read_cache_metadata, read_cache_file):
            with pytest.raises(CacheFileError, match=f"field '{field}' was edited"):
                load(bad)
        assert cli.main(["inspect", str(bad)]) == 2
        assert field in capsys.readouterr().err
    meta, tensors = read_cache_file(path)
    for name, edit, match in (("removed", lambda m: m.pop("library_version"),
                               "field 'library_version' was removed"),
                              ("added", lambda m: m.update(note="hi"), "field 'note' was added"),
                              ("no checksum", lambda m: m.pop("metadata_sha256"), "field 'metadata_sha256' is missing")):
        edited = dict(meta)
        edit(edited)
        save_file(tensors, tmp_path / f"{name}.safetensors", metadata=edited)
        with pytest.raises(CacheFileError, match=match):
            jacap_attn.load_cache(tmp_path / f"{name}.safetensors", model)
    old = dict(meta, format_version="2")
    del old["metadata_sha256"]
    old, padded = padded_tensors(old, tensors)  # format 2 was padded
    old["weights_sha256"] = legacy_weights_fingerprint(model, model.model.layers)  # with the fingerprint of its time
    save_file(padded, tmp_path / "v2.safetensors", metadata=old)
    assert jacap_attn.load_cache(tmp_path / "v2.safetensors", model).get_seq_length() == 60


# -- case 10: documents ----------------------------------------------------------------------------------

def test_document_loads_in_a_fresh_process_as_a_user_writes_it(tmp_path):
    """Kind: a documented use that fails. `Document.load` on an unpatched model (a second process, as
    the README shows it) failed ("load_cache needs a patched model"); an unpatched model is patched
    with the file's settings and answers as in the first process. A failed load leaves it unpatched."""
    first = jacap_attn.patch(tiny_model("llama"), ratio=0.25, window=8)
    ids, q = random_ids(1, 80), random_ids(1, 6, seed=3)
    doc = jacap_attn.Document.compress(first, ids)
    want = doc.generate(q, max_new_tokens=4, **GREEDY)
    path = tmp_path / "doc.safetensors"
    doc.save(path, quantize=None)  # exact entries
    fresh = tiny_model("llama")  # the same checkpoint, loaded in a new process, never patched
    again = jacap_attn.Document.load(path, fresh)
    assert jacap_attn.is_patched(fresh) and fresh._jacap_state.config == again.cache.config == doc.cache.config
    assert torch.equal(again.generate(q, max_new_tokens=4, **GREEDY), want)
    fresh2 = tiny_model("llama")
    assert torch.equal(fresh2.generate(torch.cat([ids, q], 1), cache=jacap_attn.load_cache(path, fresh2),
                                       max_new_tokens=4, **GREEDY)[:, 86:], want)
    other = tiny_model("llama", seed=1)
    with pytest.raises(CacheFileError, match="weights_sha256"):
        jacap_attn.Document.load(path, other)
    assert not jacap_attn.is_patched(other)


def test_load_cache_and_document_load_follow_one_settings_rule(tmp_path):
    """Kind: inconsistent rules, a setting ignored silently. `load_cache` took the patched model's
    `reselect`, `Document.load` the file's, and the patched ratio was then ignored silently (patched at
    0.9 or 0.1, a file compressed at 0.1 answered the same). Both now answer with the file's settings
    and say so when the patched ones differ; the patched settings apply to new prefills; an explicit
    `reselect=` overrides in both."""
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.1, window=8)
    ids, q = random_ids(1, 120), random_ids(1, 6, seed=4)
    path = tmp_path / "doc.safetensors"
    jacap_attn.Document.compress(model, ids, store=0.5).save(path)  # stored at 0.5, reselected to 0.1
    saved = jacap_attn.load_cache(path, model).config  # patched as the file was made: no warning
    assert (saved.ratio, saved.reselect) == (0.5, 0.1)
    answers = {}
    for ratio in (0.9, 0.1):
        jacap_attn.patch(model, ratio=ratio, window=8, reselect=ratio, budget="uniform")
        with pytest.warns(UserWarning, match="file's settings") if ratio == 0.9 else _no_warning():
            by_load = jacap_attn.load_cache(path, model)
            by_document = jacap_attn.Document.load(path, model)
        assert by_load.config == by_document.cache.config == saved
        answers[ratio] = by_document.generate(q, max_new_tokens=3, **GREEDY)
        assert int(jacap_attn.compress(model, ids).layers[0].kept_counts().max()) == math.ceil(ratio * 120)
        explicit = jacap_attn.load_cache(path, model, reselect=0.2).config
        assert explicit.reselect == jacap_attn.Document.load(path, model, reselect=0.2).cache.config.reselect == 0.2
    assert torch.equal(answers[0.9], answers[0.1])  # the file's settings, whatever the patch


@contextlib.contextmanager
def _no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# -- the import cycle ------------------------------------------------------------------------------

def test_cache_does_not_import_persist():
    """Kind: an import cycle (`cache` imported `persist`, which imports `cache`). `ids_sha256` lives in
    `identity`, which imports nothing of the package; `persist.ids_sha256` is still importable."""
    tree = ast.parse((ROOT / "jacap_attn" / "storage" / "cache.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "persist" not in imported and "identity" in imported
    identity_tree = ast.parse((ROOT / "jacap_attn" / "storage" / "identity.py").read_text())
    assert not [n for n in ast.walk(identity_tree) if isinstance(n, ast.ImportFrom) and n.level > 0]
    assert persist.ids_sha256 is identity.ids_sha256
    ids = random_ids(2, 7)
    assert identity.ids_sha256(ids) == identity.ids_sha256(ids.to(torch.int32))


def test_a_missing_prompt_file_is_named_by_its_option(tmp_path, monkeypatch, capsys):
    """Kind: an unclear error. A missing --prompt-file said only "[Errno 2] No such file or directory";
    it now names the option, as the empty-file message does, before the model loads."""
    _no_load(monkeypatch)
    missing = tmp_path / "missing.txt"
    assert cli.main(["compress", "--prompt-file", str(missing), "--out", str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"--prompt-file {str(missing)!r}: no such file or directory" in err
    assert sorted(os.listdir(tmp_path)) == []


def test_inspect_json_gives_the_headers_integers_as_integers(tmp_path, capsys):
    """Kind: a wrong type. `jacap inspect --json` printed "batch_size": "1" beside integer byte counts."""
    path = tmp_path / "doc.safetensors"
    _saved_document(path)
    assert cli.main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["format_version"], info["batch_size"]) == (3, 1) and isinstance(info["logical_length"], int)


def test_run_text_shows_the_json_numbers(capsys):
    """Kind: a report that disagrees with itself. ``jacap run`` printed its kept tokens, prefill and
    decode times rounded again (``mean 146.0`` beside ``146.042`` in the JSON line, ``0.94 s`` beside
    ``0.936``); the text now shows the JSON's numbers as they are."""
    from jacap_attn.cli_support import _report_answers

    r = {"model": "m", "prompt_tokens": 10, "method": "jacap", "ratio": 0.1, "expected": "1", "answer_full": "1",
         "correct_full": True, "answer_jacap": "1", "correct_jacap": True,
         "kept_tokens_per_layer": {"min": 95.333, "mean": 146.042, "max": 255.667},
         "kv_bytes_full": 100, "kv_bytes_jacap": 10, "prefill_s_full": 0.936, "prefill_s_jacap": 1.004,
         "decode_ms_per_token_full": 69.47, "decode_ms_per_token_jacap": 62.04}
    _report_answers(r)
    out = capsys.readouterr().out
    for value in (95.333, 146.042, 255.667, 0.936, 1.004, 69.47, 62.04):
        assert str(value) in out


def test_ask_with_another_embedded_model_is_refused_before_it_is_fetched(tmp_path, monkeypatch, capsys):
    """``jacap ask file --model gemma3-270m`` on a Llama file fetched and converted the 250 MB Gemma first and
    refused only then; the file's header names its ``model_type``, checked with the other arguments."""
    path = tmp_path / "doc.safetensors"
    _saved_document(path)
    _no_load(monkeypatch)
    assert cli.main(["ask", str(path), "--model", "gemma3-270m", "--question", "Who?"]) == 2
    assert "field 'model_type' is 'llama', --model gemma3-270m is 'gemma3_text'" in capsys.readouterr().err
    assert cli.main(["run", "--cache", str(path), "--model", "gemma3-270m", "--question", "Who?"]) == 2
    assert "cache is for another model" in capsys.readouterr().err


def test_inspect_says_a_document_under_min_tokens_is_kept_whole(tmp_path, capsys):
    """``jacap inspect`` gave a 68-token document a decode budget of 0.1 "reselected per question" while every
    cut keeps a document shorter than ``min_tokens`` whole (81 of 82 entries held after a question)."""
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.1, min_tokens=256)
    jacap_attn.Document.compress(model, random_ids(1, 68)).save(tmp_path / "short.safetensors")
    assert cli.main(["inspect", str(tmp_path / "short.safetensors")]) == 0
    assert "but under min_tokens=256 this 68-token document is kept whole" in capsys.readouterr().out
