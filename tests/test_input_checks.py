"""Checks of what a user gives before any work: an output path that is the command's own input, a
folder that holds no model, a safetensors file that is no jacap cache, ``Document.save``'s keywords,
and the flags an option's error lists (each failed, or failed unclearly, before 2026-12-07). Tiny
random-weight models; nothing loads where the arguments are wrong."""

from __future__ import annotations

import json
import re

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


def _edited(good, bad, **fields):
    """``good``'s file with header ``fields`` replaced and its header checksum recomputed (a deliberate edit)."""
    from safetensors import safe_open

    from jacap_attn.files import persist

    with safe_open(str(good), "pt") as handle:
        metadata = {**handle.metadata(), **fields}
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    metadata["metadata_sha256"] = persist.metadata_sha256(metadata)
    save_file(tensors, str(bad), metadata=metadata)
    return bad


@pytest.mark.parametrize("field, value, named", [
    ("model", json.dumps({"model_type": "llama"}), "'model'.num_hidden_layers"),
    ("model", "[1, 2]", "'model' is not a JSON object"),
    ("prompt_format", "{not json", "'prompt_format' is not a JSON object"),
    ("prompt_format", '"chat"', "'prompt_format' is not a JSON object"),
    ("batch_size", "0", "'batch_size' is '0'"),
    ("logical_length", "-5", "'logical_length' is '-5'"),
])
def test_a_malformed_header_field_is_named_even_when_its_checksum_was_recomputed(tmp_path, capsys, field, value, named):
    """An edited header whose checksum was recomputed gave a KeyError or AttributeError traceback (``jacap inspect``,
    ``jacap ask``, ``Document.load``), a JSON error naming no field, or was printed as it was (``batch_size 0``):
    every reader now gets a ``CacheFileError`` naming the field."""
    good = tmp_path / "doc.safetensors"
    _saved_document(good)
    bad = _edited(good, tmp_path / "bad.safetensors", **{field: value})
    with pytest.raises(CacheFileError, match=re.escape(named)):
        read_cache_metadata(bad)
    assert cli.main(["inspect", str(bad)]) == 2
    assert named in capsys.readouterr().err


def test_prompt_format_must_be_a_dict_where_it_is_given(tmp_path):
    """``Document.save(prompt_format="chat")`` was saved, then ``ask``, ``jacap ask`` and ``jacap run --cache`` failed
    with ``AttributeError`` tracebacks; a set inside it failed with json's bare ``TypeError``."""
    from conftest import random_ids, tiny_model

    model = jacap_attn.patch(tiny_model(), ratio=0.5, window=8)
    with pytest.raises(ValueError, match="prompt_format must be a dict"):
        jacap_attn.Document.compress(model, random_ids(1, 40), prompt_format=[1, 2])
    doc = jacap_attn.Document.compress(model, random_ids(1, 40))
    with pytest.raises(ValueError, match="prompt_format must be a dict"):
        doc.save(tmp_path / "a.safetensors", prompt_format="chat")
    with pytest.raises(ValueError, match="prompt_format must be JSON-able"):
        doc.save(tmp_path / "b.safetensors", prompt_format={"x": {1, 2}})
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="prompt_format must be JSON-able"):  # before the prefill, not at save
        jacap_attn.Document.compress(model, random_ids(1, 40), prompt_format={"x": {1, 2}})


def test_an_output_path_ending_in_a_separator_names_a_folder(tmp_path, monkeypatch, capsys):
    """``--out outdir/`` (and ``save_cache(c, "newdir/")``) wrote a file named ``outdir``, or replaced the file of that
    name; it is refused before any work."""
    letter = tmp_path / "letter.txt"
    letter.write_text("Dear Ada, the meeting is in London. " * 3)
    _no_load(monkeypatch)
    monkeypatch.chdir(tmp_path)
    for out in ("outdir/", "letter.txt/"):
        assert cli.main(["compress", "--prompt-file", str(letter), "--out", out]) == 2
        assert "ends in a separator: it names a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["letter.txt"]
    with pytest.raises(ValueError, match="names a directory"):
        _saved_document(str(tmp_path / "newdir") + "/")


def test_a_file_saved_without_its_prompt_ids_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """``jacap run --cache`` on a ``store_ids=False`` file failed with a ``TypeError`` traceback, and ``jacap ask``
    gave Python advice once the model had loaded; both now refuse from the header."""
    from conftest import random_ids, tiny_model

    model = jacap_attn.patch(tiny_model(), ratio=0.5, window=8)
    path = tmp_path / "noids.safetensors"
    jacap_attn.Document.compress(model, random_ids(1, 40), prompt_format={"chat": False}).save(path, store_ids=False)
    _no_load(monkeypatch)
    for argv in (["ask", str(path), "--question", "Where?"], ["run", "--cache", str(path), "--question", "Where?"]):
        assert cli.main(argv) == 2
        assert "saved without its prompt ids (store_ids=False)" in capsys.readouterr().err


def test_force_never_replaces_a_file_of_an_embedded_models_folder(tmp_path, monkeypatch, capsys):
    """``--model smollm2 --out <its converted folder>/model.safetensors --force`` replaced the model's weights with a
    cache (the next load ran with random weights): an embedded model's folder is protected as a given folder is."""
    from jacap_attn.models import model_dir

    monkeypatch.setenv("JACAP_HOME", str(tmp_path / "home"))
    weights = model_dir("smollm2") / "model.safetensors"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"weights")
    letter = tmp_path / "letter.txt"
    letter.write_text("Dear Ada. " * 3)
    _no_load(monkeypatch)
    assert cli.main(["compress", "--prompt-file", str(letter), "--out", str(weights), "--force"]) == 2
    assert "is a file of --model" in capsys.readouterr().err
    assert weights.read_bytes() == b"weights"


def test_store_below_ratio_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """``--store 0.05 --ratio 0.25`` stored at 0.25 and said nothing."""
    letter = tmp_path / "letter.txt"
    letter.write_text("Dear Ada. " * 3)
    _no_load(monkeypatch)
    assert cli.main(["compress", "--prompt-file", str(letter), "--out", str(tmp_path / "o.safetensors"),
                     "--store", "0.05", "--ratio", "0.25"]) == 2
    assert "--store 0.05 is below --ratio 0.25" in capsys.readouterr().err


def test_compress_reports_the_decode_budget_of_method_full(tmp_path, monkeypatch, capsys):
    """``jacap compress --method full --ratio 0.1`` reported a decode budget of 0.1; a question reads the whole
    document (``jacap inspect``: 1.0)."""
    from conftest import tiny_model
    from test_user_bugs_25 import _BaseTokenizer

    monkeypatch.setattr(cli, "_load", lambda name: (tiny_model("llama"), _BaseTokenizer()))
    letter = tmp_path / "letter.txt"
    letter.write_text("Dear Ada, the meeting is in London. " * 10)
    out = tmp_path / "o.safetensors"
    assert cli.main(["compress", "--raw", "--method", "full", "--ratio", "0.1", "--prompt-file", str(letter),
                     "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["decode_budget"] == 1.0 and result["stored_ratio"] == 1.0


def test_a_run_finding_another_documents_cache_at_its_out_when_it_saves_refuses(tmp_path, monkeypatch, capsys):
    """Two ``jacap compress`` runs to one ``--out``: the ownership check ran only before the model loaded, so the run
    that finished last replaced the other's document silently. It runs again right before the save."""
    from conftest import tiny_model
    from test_user_bugs_25 import _BaseTokenizer

    out, theirs = tmp_path / "o.safetensors", []

    def load(name):  # another run saves its document to --out while this one loads
        _saved_document(out, text="Another document entirely, saved by another run. " * 3)
        theirs.append(out.read_bytes())
        return tiny_model("llama"), _BaseTokenizer()

    monkeypatch.setattr(cli, "_load", load)
    letter = tmp_path / "letter.txt"
    letter.write_text("Dear Ada, the meeting is in London. " * 10)
    assert cli.main(["compress", "--raw", "--prompt-file", str(letter), "--out", str(out)]) == 2
    assert "holds the cache of another document" in capsys.readouterr().err
    assert out.read_bytes() == theirs[0]  # the other run's document is still there


def test_an_empty_model_name_is_refused():
    """``--model ''`` was read as the current folder (and would load a model found there)."""
    from jacap_attn.models import check_model_path

    for name in ("", "  "):
        with pytest.raises(ValueError, match="is empty"):
            check_model_path(name)


def test_a_model_folder_of_another_type_is_refused_before_it_loads(tmp_path, monkeypatch, capsys):
    """``jacap ask doc.st --model <a Gemma folder>`` loaded Gemma before refusing a Llama cache; the folder's
    ``config.json`` names its ``model_type`` first."""
    path = tmp_path / "doc.safetensors"
    _saved_document(path)  # a Llama's
    folder = tmp_path / "gemma"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    (folder / "tokenizer.json").write_text("{}")
    _no_load(monkeypatch)
    assert cli.main(["ask", str(path), "--model", str(folder), "--question", "Where?"]) == 2
    assert "field 'model_type' is 'llama'" in capsys.readouterr().err


def test_jacap_run_says_when_a_short_prompt_was_kept_whole(capsys):
    """``jacap run --context-tokens 50`` printed ``kept ratio=0.1`` beside ``1.0x smaller`` with no word of why."""
    from jacap_attn.cli_support import _report_answers

    r = {"model": "m", "prompt_tokens": 60, "method": "jacap", "ratio": 0.1, "expected": "1", "answer_full": "1",
         "correct_full": True, "answer_jacap": "1", "correct_jacap": True,
         "kept_tokens_per_layer": {"min": 60.0, "mean": 60.0, "max": 60.0}, "kv_bytes_full": 100, "kv_bytes_jacap": 100,
         "prefill_s_full": 0.1, "prefill_s_jacap": 0.1, "decode_ms_per_token_full": 1.0, "decode_ms_per_token_jacap": 1.0}
    _report_answers(r)
    assert "nothing evicted (a prompt under min_tokens" in capsys.readouterr().out
    _report_answers({**r, "prompt_tokens": 600, "kept_tokens_per_layer": {"min": 60.0, "mean": 60.0, "max": 60.0}})
    assert "nothing evicted" not in capsys.readouterr().out


def test_token_ids_outside_the_vocabulary_are_named_before_the_prefill():
    """An id past the embedding's rows (or a negative one) raised torch's ``IndexError: index out of range in self``
    from inside the prefill, from ``compress``, a patched ``generate`` and ``Document``'s questions alike."""
    from conftest import random_ids, tiny_model

    model = jacap_attn.patch(tiny_model(), ratio=0.5, window=8)
    rows = model.get_input_embeddings().num_embeddings
    ids = random_ids(1, 40)
    bad = ids.clone()
    bad[0, 7] = rows + 10
    with pytest.raises(ValueError, match=rf"input_ids\[0, 7\] is {rows + 10}, outside the model's vocabulary"):
        jacap_attn.compress(model, bad)
    with pytest.raises(ValueError, match=r"input_ids\[0, 7\] is"):
        jacap_attn.Document.compress(model, bad)
    with pytest.raises(ValueError, match=r"input_ids\[0, 7\] is"):
        model.generate(bad, max_new_tokens=2, do_sample=False)
    doc = jacap_attn.Document.compress(model, ids)
    with pytest.raises(ValueError, match=r"question_ids\[0, 1\] is -1, outside"):
        doc.generate(torch.tensor([3, -1]), max_new_tokens=2)
    assert doc.generate(torch.tensor([3, rows - 1]), max_new_tokens=2).shape[-1] >= 1  # the last row is valid


def test_jacap_run_with_one_new_token_writes_valid_json(tmp_path, monkeypatch, capsys):
    """``jacap run --max-new-tokens 1`` (no decode step to time) printed ``"decode_ms_per_token_full": NaN``, which
    is not JSON (strict parsers, ``jq`` and JavaScript refuse it), and ``decode : full nan ms/token``."""
    from test_user_bugs_25 import _BaseTokenizer
    from conftest import tiny_model

    monkeypatch.setattr(cli, "_load", lambda name: (tiny_model("llama"), _BaseTokenizer()))

    def strict(line):
        return json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in the JSON line"))

    out = tmp_path / "doc.safetensors"
    assert cli.main(["run", "--context-tokens", "200", "--max-new-tokens", "1", "--cache-out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = strict(printed.strip().splitlines()[-1])
    assert result["decode_ms_per_token_full"] is None and result["decode_ms_per_token_jacap"] is None
    assert "no decode step timed (one new token)" in printed and "nan" not in printed
    assert cli.main(["run", "--cache", str(out), "--question", "Where?", "--max-new-tokens", "1"]) == 0
    assert strict(capsys.readouterr().out.strip().splitlines()[-1])["decode_ms_per_token"] is None
    assert cli.main(["run", "--cache", str(out), "--question", "Where?", "--max-new-tokens", "3"]) == 0
    assert strict(capsys.readouterr().out.strip().splitlines()[-1])["decode_ms_per_token"] > 0


def test_document_store_below_the_ratio_is_refused_as_the_cli_refuses_it(tmp_path):
    """``Document.compress(model, ids, store=0.1)`` under ``ratio=0.25`` stored the document at 0.25 without a word,
    while ``jacap compress --store 0.1 --ratio 0.25`` is refused."""
    from conftest import random_ids, tiny_model

    model = jacap_attn.patch(tiny_model(), ratio=0.25, window=8, min_tokens=0)
    with pytest.raises(ValueError, match=r"store=0.1 is below the patched ratio=0.25"):
        jacap_attn.Document.compress(model, random_ids(1, 60), store=0.1)
    for store in (None, 0.25, 0.5):  # at the patched settings, and above them (reselected per question)
        stored = jacap_attn.Document.compress(model, random_ids(1, 60), store=store).cache.config.ratio
        assert stored == (0.25 if store is None else store)


@pytest.mark.parametrize("flags", [["--chunk-mass"], ["--chunk-scores", "repeat"], ["--chunk-ratio", "0.5"],
                                   ["--chunk-budget", "final"]])
@pytest.mark.parametrize("command", ["run", "compress"])
def test_chunk_flags_without_chunk_size_are_refused_before_the_model_loads(command, flags, tmp_path, monkeypatch,
                                                                          capsys):
    """``jacap run --chunk-mass`` without ``--chunk-size`` echoed ``chunk_mass: true`` and chunked nothing (the Python
    API keeps such settings for a later ``generate(prefill_chunk_size=N)``; a command has no later prefill)."""
    text = tmp_path / "doc.txt"
    text.write_text("A document. " * 20)
    _no_load(monkeypatch)
    argv = [command, *flags, "--prompt-file", str(text)] + (["--out", str(tmp_path / "o.safetensors")]
                                                            if command == "compress" else [])
    assert cli.main(argv) == 2
    assert f"{flags[0]} set(s) the cuts of a chunked prefill, and none runs without --chunk-size" in capsys.readouterr().err
    assert not (tmp_path / "o.safetensors").exists()


def test_generate_and_compress_name_malformed_ids_and_masks():
    """A patched ``generate`` with a mask of the wrong length failed inside the model (``RuntimeError: The size of
    tensor a (45) must match ...``), with 1-D ids in transformers (``IndexError: tuple index out of range``), and
    ``compress(model, ids.tolist())`` said ``got list ()``."""
    from conftest import random_ids, tiny_model

    model = jacap_attn.patch(tiny_model(), ratio=0.5, window=8)
    ids = random_ids(1, 40)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 35\); the prompt is \(1, 40\)"):
        model.generate(ids, attention_mask=torch.ones(1, 35, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"input_ids has shape \(40,\): generate needs \[batch, tokens\]"):
        model.generate(ids[0], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"got a list \(torch.tensor\(ids\) makes one\)"):
        jacap_attn.compress(model, ids.tolist())
    with pytest.raises(ValueError, match=r"got Tensor of shape \(40,\), dtype torch.int64"):
        jacap_attn.compress(model, ids[0])
    assert model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False).shape == (1, 42)
