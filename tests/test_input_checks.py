"""Checks of what a user gives before any work: an output path that is the command's own input, a
folder that holds no model, a safetensors file that is no jacap cache, ``Document.save``'s keywords,
and the flags an option's error lists (each failed, or failed unclearly, before 2026-12-07). Tiny
random-weight models; nothing loads where the arguments are wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import jacap_attn
from jacap_attn import cli
from jacap_attn.files.persist import CacheFileError, read_cache_metadata
from jacap_attn.models import check_model_path, load_model
from test_user_bugs_25 import _no_load, _saved_document


def test_force_never_replaces_the_prompt_file_with_its_cache(tmp_path, monkeypatch, capsys):
    """``jacap compress --prompt-file letter.txt --out letter.txt --force`` replaced the letter by its
    cache and exited 0 (``--force`` only waived the "not a cache file" refusal). A command's own input
    is never its output: refused before the model loads, the letter intact; likewise ``jacap run``."""
    letter = tmp_path / "letter.txt"
    letter.write_text("Dear Ada, the meeting is in London. " * 3)
    before = letter.read_bytes()
    _no_load(monkeypatch)
    for argv in (["compress", "--prompt-file", str(letter), "--out", str(letter), "--force"],
                 ["run", "--prompt-file", str(letter), "--cache-out", str(letter), "--force"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "same file as --prompt-file" in err and str(letter) in err, err
        assert letter.read_bytes() == before


def test_force_never_replaces_a_file_of_the_model_folder(tmp_path, monkeypatch, capsys):
    """``--out <model folder>/config.json --force`` would have replaced the model's own file; a jacap
    cache saved beside the model's files may still be replaced."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    letter = tmp_path / "letter.txt"
    letter.write_text("Dear Ada. " * 3)
    _no_load(monkeypatch)
    argv = ["compress", "--model", str(folder), "--prompt-file", str(letter), "--out", str(folder / "config.json"),
            "--force"]
    assert cli.main(argv) == 2
    assert "is a file of --model" in capsys.readouterr().err
    assert (folder / "config.json").read_text() == "{}"
    cache = folder / "doc.safetensors"
    _saved_document(cache)

    class Loading(Exception):
        """Raised where the model would load: every check has passed."""

    def load(name):
        raise Loading(name)

    monkeypatch.setattr(cli, "_load", load)
    with pytest.raises(Loading, match=str(folder)):
        cli.main([*argv[:-2], str(cache), "--force"])


@pytest.mark.parametrize("contents", [(), ("tokenizer.json",), ("notes.txt",)])
def test_a_folder_that_holds_no_model_is_named_before_anything_loads(tmp_path, monkeypatch, capsys, contents):
    """An empty folder as ``--model`` (or ``load_model``) reached the tokenizer's loading, whose error
    advised installing sentencepiece; now a ``ValueError`` names the folder and what it lacks."""
    folder = tmp_path / "m"
    folder.mkdir()
    for name in contents:
        (folder / name).write_text("{}")
    with pytest.raises(ValueError, match="neither a config.json .* nor a .gguf file"):
        check_model_path(folder)
    with pytest.raises(ValueError, match=str(folder)):
        load_model(folder)
    letter = tmp_path / "letter.txt"
    letter.write_text("Dear Ada. " * 3)
    _no_load(monkeypatch)
    assert cli.main(["compress", "--model", str(folder), "--prompt-file", str(letter),
                     "--out", str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jacap: error: --model '{folder}' is a folder with neither a config.json"), err
    check_model_path("smollm2")
    (folder / "config.json").write_text("{}")
    if "tokenizer.json" in contents:
        check_model_path(folder)  # a Hugging Face folder: its files are transformers' to read
        return
    # config.json without a tokenizer: once transformers' "Couldn't instantiate the backend tokenizer", which named
    # neither the missing files nor the .gguf beside them that a folder with a config.json is not read from
    (folder / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"holds a config.json but no tokenizer files .*m\.gguf is read only from a "
                                         r"folder without config.json"):
        check_model_path(folder)
    for name in ("spiece.model", "vocab.txt", "tokenizer_config.json"):  # other tokenizers' own files
        (folder / name).write_text("{}")
        check_model_path(folder)
        (folder / name).unlink()


@pytest.mark.parametrize("metadata,expected", [
    ({"format": "pt"}, "not a jacap cache file (a safetensors file with header fields 'format'"),
    (None, "not a jacap cache file (a safetensors file with no header fields"),
])
def test_a_safetensors_file_that_is_no_jacap_cache_is_called_so(tmp_path, metadata, expected):
    """A model's ``model.safetensors`` given as a cache said "field 'format' is 'pt', expected
    'jacap-cache'", and a file without metadata "field 'format' is None"."""
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2)}, str(path), metadata=metadata)
    for read in (read_cache_metadata, jacap_attn.files.persist.read_cache_file):
        with pytest.raises(CacheFileError, match=expected.replace("(", r"\(")):
            read(path)


def test_a_cache_header_without_its_version_names_the_field(tmp_path):
    """A damaged ``format_version`` key read "unknown format_version None"."""
    good = tmp_path / "doc.safetensors"
    _saved_document(good)
    from safetensors import safe_open

    with safe_open(str(good), "pt") as handle:
        metadata = dict(handle.metadata())
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    metadata["format_versioN"] = metadata.pop("format_version")
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=metadata)
    with pytest.raises(CacheFileError, match="field 'format_version' is missing"):
        read_cache_metadata(bad)


def test_document_save_names_its_own_keywords(tmp_path):
    """``Document.save(path, bogus=1)`` raised "save_cache() got an unexpected keyword argument",
    naming a function the user never called; ``prompt_format`` still defaults to the document's own."""
    model, _ = _saved_document(tmp_path / "a.safetensors")
    doc = jacap_attn.Document.load(tmp_path / "a.safetensors", model)
    with pytest.raises(TypeError, match=r"save\(\) got an unexpected keyword argument 'bogus'"):
        doc.save(tmp_path / "b.safetensors", bogus=1)
    doc.save(tmp_path / "b.safetensors", store_ids=False)
    meta = read_cache_metadata(tmp_path / "b.safetensors")
    assert json.loads(meta["prompt_format"]) == doc.prompt_format
    # Without its ids the error says "pass prompt_ids=", which Document.load once refused (TypeError)
    with pytest.raises(ValueError, match="pass prompt_ids="):
        jacap_attn.Document.load(tmp_path / "b.safetensors", model)
    again = jacap_attn.Document.load(tmp_path / "b.safetensors", model, prompt_ids=doc.prompt_ids)
    assert torch.equal(again.prompt_ids, doc.prompt_ids)
    with pytest.raises(ValueError, match="not the prompt"):
        jacap_attn.Document.load(tmp_path / "b.safetensors", model, prompt_ids=doc.prompt_ids.flip(-1))


def test_an_option_of_another_method_lists_the_flags_the_command_line_takes(tmp_path, monkeypatch, capsys):
    """``jacap compress --method snapkv --ridge 0.3`` listed what the method accepts as a mix of flags
    (``--chunk-size``) and Python names without a flag (``backend``, ``compile``) or written as words
    (``budget``, ``window``): now the flags, then the Python-only settings named as such."""
    letter = tmp_path / "letter.txt"
    letter.write_text("Dear Ada. " * 3)
    _no_load(monkeypatch)
    assert cli.main(["compress", "--method", "snapkv", "--ridge", "0.3", "--prompt-file", str(letter),
                     "--out", str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err
    flags, _, python = err.partition("with this method the command line takes ")[2].partition(" (in Python also: ")
    assert "--ridge=0.3" in err and "--window" in flags.split(", ") and "--budget" in flags.split(", ")
    assert all(flag.startswith("--") for flag in flags.split(", ")), flags
    assert "backend" in python and "compile" in python and "--" not in python
    from jacap_attn.cli import build_parser

    parser_flags = {o for action in build_parser()._subparsers._group_actions[0].choices["compress"]._actions
                    for o in action.option_strings}
    assert set(flags.split(", ")) <= parser_flags


@pytest.mark.parametrize("call", ["generate", "forward"])
def test_more_rows_than_the_cache_holds_are_named(call):
    """Two rows over a one-row compressed cache: a ``ValueError`` naming both row counts, before any layer
    runs (was: "input_ids do not start with the prompt" from ``generate``, whose ids did start with it, and a
    bare ``index_copy_`` shape error from a forward)."""
    from conftest import tiny_model

    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.25, chunk_size=40, min_tokens=0)
    prompt = torch.randint(3, 96, (1, 120), generator=torch.Generator().manual_seed(0))
    out = model.generate(prompt, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    more = torch.cat([out.sequences, torch.randint(3, 96, (1, 20))], 1).repeat(2, 1)
    with pytest.raises(ValueError, match="input_ids have 2 rows but this cache holds 1"):
        if call == "generate":
            model.generate(more, cache=out.cache, max_new_tokens=2)
        else:
            model(more[:, out.sequences.shape[1]:], cache=out.cache)
    assert out.cache.get_seq_length() == 124  # untouched: the prompt and four decoded tokens written
    one = model.generate(more[:1], cache=out.cache, max_new_tokens=2, num_return_sequences=2, do_sample=True)
    assert one.shape[0] == 2  # generate still repeats a one-row cache's row itself
    jacap_attn.unpatch(model)


def test_run_from_a_file_names_the_options_it_would_ignore(tmp_path, monkeypatch, capsys):
    """``jacap run --cache F --question Q`` answers with the file's own settings: an option it does not read
    (``--cache-out``, ``--prompt-file``, ``--store``, ``--method``, ``--chunk-size``, ...) is named, exit status 2,
    before the model loads (was: ignored, ``--cache-out`` never written, exit status 0)."""
    cache = tmp_path / "doc.safetensors"
    _saved_document(cache)
    letter = tmp_path / "letter.txt"
    letter.write_text("Dear Ada. " * 3)
    _no_load(monkeypatch)
    base = ["run", "--cache", str(cache), "--question", "Who?"]
    extra = ["--cache-out", str(tmp_path / "new.safetensors"), "--prompt-file", str(letter), "--store", "0.5",
             "--method", "snapkv", "--chunk-size", "16"]
    assert cli.main([*base, *extra]) == 2
    err = capsys.readouterr().err
    named = err.partition("does not read ")[2].partition(" (")[0].split(", ")
    assert sorted(named) == sorted(["--cache-out", "--prompt-file", "--store", "--method", "--chunk-size"])
    assert not (tmp_path / "new.safetensors").exists()
    for one in (["--seed", "3"], ["--ratio", "0.25"], ["--force"]):
        assert cli.main([*base, *one]) == 2
        assert one[0] in capsys.readouterr().err


def test_a_document_longer_than_the_models_context_is_refused_after_loading(tmp_path, monkeypatch, capsys):
    """``jacap run --context-tokens 10000000`` built the document and ran out of memory in its prefill, and a
    prompt file or question past the model's context ran where positions mean nothing: each is refused once
    the model has loaded (its context known), before the document is built or any prefill runs."""
    from conftest import tiny_model
    from test_user_bugs_25 import _BaseTokenizer

    from jacap_attn import prompts

    model = tiny_model("llama")  # max_position_embeddings 1024
    monkeypatch.setattr(cli, "_load", lambda name: (model, _BaseTokenizer()))
    monkeypatch.setattr(prompts, "demo_document", lambda *a, **k: pytest.fail("the document was built"))
    assert cli.main(["run", "--context-tokens", "10000000"]) == 2
    err = capsys.readouterr().err
    assert "--context-tokens plus --max-new-tokens: 10,000,024 tokens, beyond the model's context of 1,024" in err
    letter = tmp_path / "letter.txt"
    letter.write_text("x" * 2000)  # 2,000 tokens of the one-id-per-character tokenizer
    monkeypatch.setattr(jacap_attn.Document, "compress", lambda *a, **k: pytest.fail("the prefill ran"))
    assert cli.main(["compress", "--raw", "--prompt-file", str(letter), "--out", str(tmp_path / "c.safetensors")]) == 2
    assert f"--prompt-file {letter}: 2,000 tokens, beyond the model's context of 1,024" in capsys.readouterr().err
    assert not (tmp_path / "c.safetensors").exists()


def test_document_ask_refuses_a_question_past_the_models_context():
    """``Document.ask`` over a document near the context: the document, the question and ``max_new_tokens``
    past ``max_position_embeddings`` are refused before generating; within it, answered."""
    from conftest import random_ids, tiny_model
    from test_user_bugs_25 import _BaseTokenizer

    model = jacap_attn.patch(tiny_model("llama", max_position_embeddings=128), ratio=0.5, window=8)
    doc = jacap_attn.Document.compress(model, random_ids(1, 90), prompt_format={"chat": False})
    with pytest.raises(ValueError, match=r"exceed the model's context of 128 tokens"):
        doc.ask("Where is the meeting held this year?", _BaseTokenizer(), max_new_tokens=4)
    assert isinstance(doc.ask("Where?", _BaseTokenizer(), max_new_tokens=4), str)


def test_the_context_limit_follows_the_config():
    """:func:`jacap_attn.models.context_limit`: ``max_position_embeddings`` (a Gemma 3 model's text config's),
    none under dynamic RoPE, which stretches past it."""
    from conftest import tiny_model

    from jacap_attn.models import context_limit

    assert context_limit(tiny_model("llama", max_position_embeddings=300)) == 300
    dynamic = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert context_limit(dynamic) is None
    assert context_limit(object()) is None
