"""Issue 35, "Bugs users hit": a compiled forward, prompt masks with holes, a wrapper that kept the
caller's model patched, pickling, state shared across threads, and what a new user hit with the
README. One test (or a few) per case; each docstring names the kind of fault and the reference the
result is compared with (stock transformers, the same call alone, or the patched eager model).
"""

from __future__ import annotations

import copy
import io
import pickle
import re
import threading
import warnings

import pytest
import torch
from transformers.cache_utils import DynamicCache

import jacap_attn
from jacap_attn.storage.layer import COMPRESSED
from conftest import DECODE_ATOL, DECODE_RTOL, random_ids, tiny_model

GREEDY = dict(do_sample=False, max_new_tokens=8, min_new_tokens=8)


def _kept(cache):
    """Per layer, the held ``(positions, valid)`` of a compressed cache (what it selected)."""
    return [(layer.positions.clone(), layer.valid.clone()) for layer in cache.layers]


def _same_selection(a, b) -> bool:
    return all(torch.equal(pa[va], pb[vb]) and torch.equal(va.sum(-1), vb.sum(-1))
               for (pa, va), (pb, vb) in zip(_kept(a), _kept(b)))


# -- case 1: a user-compiled forward -----------------------------------------------------------------

def _compiled(model, how: str, backend: str):
    torch._dynamo.reset()
    if how == "forward":
        model.forward = torch.compile(model.forward, backend=backend)
    elif how == "layers":  # each decoder layer on its own: the route's per-layer hooks run outside its graph
        for layer in model.model.layers:
            layer.compile(backend=backend)
    else:
        model.compile(backend=backend)
    return model


@pytest.mark.parametrize("how", ["forward", "module", "layers"])
def test_compiled_forward_compresses_and_generates_as_eager(how):
    """Kind: hooks that branch on ``is_compiling()`` change what dynamo traces (pytorch #110765's kind).
    ``m.forward = torch.compile(m.forward)`` (or ``m.compile()``) after ``patch``: ``compress`` returned
    a cache left 'pending' and ``generate`` raised "prefill was never compressed". The prefill's work
    now runs eagerly outside the graph: the compiled model (backend ``eager``) selects the very
    entries of the eager one and generates its tokens; at ratio 1 it equals stock eager transformers
    (logits within 2e-5 / 1e-4, the same 8 tokens); a question over a document stored whole reselects
    as in eager mode (the route of a multi-token forward over a compressed cache)."""
    ids = random_ids(1, 120)
    stock = tiny_model("llama")
    with torch.no_grad():
        stock_logits = stock(ids).logits[:, -1]
    stock_tokens = stock.generate(ids, **GREEDY)

    eager = jacap_attn.patch(tiny_model("llama"), ratio=0.3)
    eager_cache = jacap_attn.compress(eager, ids)
    eager_tokens = eager.generate(ids, **GREEDY)
    question = random_ids(1, 12, seed=4)
    eager_doc = jacap_attn.Document.compress(eager, ids)
    eager_answer = eager_doc.generate(question, **GREEDY)

    model = _compiled(jacap_attn.patch(tiny_model("llama"), ratio=0.3), how, "eager")
    cache = jacap_attn.compress(model, ids)
    assert cache.state == COMPRESSED
    assert _same_selection(cache, eager_cache)
    assert torch.equal(model.generate(ids, **GREEDY), eager_tokens)
    doc = jacap_attn.Document.compress(model, ids)
    assert torch.equal(doc.generate(question, **GREEDY), eager_answer)
    reselected = doc.fresh_cache()
    model.generate(torch.cat([ids, question], 1), cache=reselected, max_new_tokens=1)
    assert reselected.layers[0].kept_counts().max() < ids.shape[1]  # the question reselected (R = 0.3)

    full = _compiled(jacap_attn.patch(tiny_model("llama"), ratio=1.0), how, "eager")
    with torch.no_grad():
        out = full(ids)
    assert out.cache.state == COMPRESSED
    torch.testing.assert_close(out.logits[:, -1], stock_logits, atol=DECODE_ATOL, rtol=DECODE_RTOL)
    assert torch.equal(full.generate(ids, **GREEDY), stock_tokens)


def test_compiled_forward_with_inductor_generates_the_eager_tokens():
    """The same with inductor (the default backend): the compiled model's 8 greedy tokens and its
    selection are the eager patched model's."""
    ids = random_ids(1, 120)
    eager = jacap_attn.patch(tiny_model("llama"), ratio=0.3)
    eager_cache = jacap_attn.compress(eager, ids)
    eager_tokens = eager.generate(ids, **GREEDY)
    model = _compiled(jacap_attn.patch(tiny_model("llama"), ratio=0.3), "forward", "inductor")
    cache = jacap_attn.compress(model, ids)
    assert cache.state == COMPRESSED and _same_selection(cache, eager_cache)
    assert torch.equal(model.generate(ids, **GREEDY), eager_tokens)


def test_compress_never_returns_an_uncompressed_cache(monkeypatch):
    """``compress`` checks what it returns: a prefill that did not end compressed (here the route's
    cut skipped) is a ``RuntimeError``, never a cache left 'pending'."""
    from jacap_attn import hooks

    model = jacap_attn.patch(tiny_model("llama"), ratio=0.3)
    monkeypatch.setattr(hooks, "_finish", lambda model, cache, output: output)
    with pytest.raises(RuntimeError, match="not compressed"):
        jacap_attn.compress(model, random_ids(1, 80))


# -- case 2: a prompt mask with a hole -----------------------------------------------------------------

def _holed_prompt():
    ids = random_ids(1, 80)
    mask = torch.ones_like(ids)
    mask[0, 10:20] = 0
    return ids, mask


def test_a_prompt_mask_with_a_hole_is_refused_before_any_work():
    """Kind: a mask the library cannot serve accepted silently (transformers #14521's kind). An 80-token
    prompt with ``attention_mask[0, 10:20] = 0``: the masked tokens were counted as left padding, the
    tokens before them stored at negative positions (-10..-1; stock transformers gives them 0..9 and
    the tokens after the hole 10..69, from the mask's cumulative sum), and ``save`` wrote a file that
    ``load`` called corrupt. Holes are refused at the prefill, naming the row and positions, before a
    single layer runs (compress, Document.compress, generate, a plain forward); left padding is still
    served (the rows' own outputs equal stock's: tests/test_core.py)."""
    ids, mask = _holed_prompt()
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.3)
    ran = []
    model.model.embed_tokens.register_forward_hook(lambda *args: ran.append(1))
    for call in (lambda: jacap_attn.compress(model, ids, mask),
                 lambda: jacap_attn.Document.compress(model, ids, mask),
                 lambda: model.generate(ids, attention_mask=mask, **GREEDY),
                 lambda: model(ids, attention_mask=mask)):
        with pytest.raises(ValueError, match=r"row 0 is 0 at positions 10\.\.19.*hole"):
            call()
    assert ran == []  # refused in the pre-hook, before the embedding
    left = torch.ones_like(ids)
    left[0, :10] = 0  # left padding: served
    assert jacap_attn.compress(model, ids, left).state == COMPRESSED


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_save_refuses_what_load_would_reject(tmp_path, quantize):
    """Kind: the writer wrote what the reader rejects. A cache holding positions the loader refuses
    (here -10, what a hole used to store; and one at the logical length) is refused by ``save_cache``
    with the loader's own check and message, and nothing is written; the same tensors written anyway
    are refused by ``load_cache`` with that message."""
    from jacap_attn.files import persist

    model = jacap_attn.patch(tiny_model("llama"), ratio=0.3)
    ids = random_ids(1, 80)
    path = tmp_path / "doc.safetensors"
    for bad in (-10, 80):
        cache = jacap_attn.compress(model, ids)
        cache.layers[1].positions[0, 0, 0] = bad
        with pytest.raises(ValueError, match=r"refuses to write .*'layers\.1\.positions' holds positions from") as saving:
            jacap_attn.save_cache(cache, path, model=model, prompt_ids=ids, quantize=quantize)
        assert list(tmp_path.iterdir()) == []
    written = pytest.MonkeyPatch()
    written.setattr(persist, "check_positions", lambda *args: None)
    jacap_attn.save_cache(cache, path, model=model, prompt_ids=ids, quantize=quantize)
    written.undo()
    with pytest.raises(persist.CacheFileError) as loading:
        jacap_attn.load_cache(path, model)
    assert str(saving.value).split("'layers.1.positions' ")[1] == str(loading.value).split("'layers.1.positions' ")[1]


# -- case 4: pickling a compressed cache ---------------------------------------------------------------

def _round_trip(cache, how: str):
    if how == "pickle":
        return pickle.loads(pickle.dumps(cache))
    buffer = io.BytesIO()
    torch.save(cache, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)  # a cache object, as for stock DynamicCache


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_a_compressed_cache_round_trips_through_torch_save_and_pickle(how):
    """Kind: an object the user can keep with the stock cache but not with ours (pytorch #108829,
    transformers #30575): ``torch.save(compress(m, p), f)`` raised "cannot pickle
    'weakref.ReferenceType'" (the cache held ``weakref.ref(model)``). The model reference is no longer
    pickled; the next forward binds it again. Replayed against stock: a ``DynamicCache`` of the prompt
    round-trips and generates stock's 8 tokens; the unpickled compressed cache generates the original's
    tokens (ratio 0.3) and, at ratio 1, stock's; ``copy.deepcopy`` still shares the binding."""
    ids = random_ids(1, 80)
    full = torch.cat([ids, random_ids(1, 5, seed=3)], 1)
    stock = tiny_model("llama")
    stock_cache = DynamicCache(config=stock.config)
    with torch.no_grad():
        stock(ids, past_key_values=stock_cache, use_cache=True)
    stock_tokens = stock.generate(full, **GREEDY)
    assert torch.equal(stock.generate(full, past_key_values=_round_trip(stock_cache, how), **GREEDY), stock_tokens)

    for ratio in (0.3, 1.0):
        model = jacap_attn.patch(tiny_model("llama"), ratio=ratio)
        cache = jacap_attn.compress(model, ids)
        original = model.generate(full, cache=copy.deepcopy(cache), **GREEDY)
        loaded = _round_trip(cache, how)
        assert loaded._model() is None and copy.deepcopy(cache)._model() is model
        assert _same_selection(loaded, cache) and torch.equal(loaded.prompt_ids, ids)
        assert torch.equal(model.generate(full, cache=loaded, **GREEDY), original)
        assert loaded._model() is model  # bound again by the forward
        if ratio == 1.0:
            assert torch.equal(original, stock_tokens)


def test_a_deep_copy_of_a_patched_model_runs_its_own_modules_and_unpatches_alone():
    """``copy.deepcopy`` of a patched model is patched and runs its own modules: after its weights
    change it answers and selects as a fresh patch of a model with those weights; ``unpatch`` of the
    copy leaves the original patched and as it was. Before, the copy's bound forwards were closures over
    the original's modules (the copy attended with the original's weights), its state's weak reference
    named the original, and ``unpatch`` of the copy failed (``'object' object is not callable``)."""
    ids = random_ids(1, 80)
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.3, window=8)
    before = model.generate(ids, **GREEDY)
    twin = copy.deepcopy(model)
    assert jacap_attn.is_patched(twin) and twin._jacap_state.model() is twin
    reference = jacap_attn.patch(tiny_model("llama"), ratio=0.3, window=8)
    with torch.no_grad():
        for a, b in zip(twin.parameters(), reference.parameters()):
            a.mul_(1.5)
            b.mul_(1.5)
    got = twin.generate(ids, **GREEDY)
    assert torch.equal(got, reference.generate(ids, **GREEDY)) and not torch.equal(got, before)
    assert _same_selection(jacap_attn.compress(twin, ids), jacap_attn.compress(reference, ids))
    jacap_attn.unpatch(twin)
    assert not jacap_attn.is_patched(twin) and "forward" not in twin.model.__dict__
    assert jacap_attn.is_patched(model) and torch.equal(model.generate(ids, **GREEDY), before)
    stock = jacap_attn.unpatch(reference)
    assert torch.equal(twin.generate(ids, **GREEDY), stock.generate(ids, **GREEDY))


def test_a_patched_model_pickles_and_torch_saves_as_itself():
    """``pickle.dumps`` / ``torch.save`` of a patched model (a user's checkpoint of the whole object):
    the loaded model is patched, its state names it (not the original), it compresses and generates as
    the original, its weights fingerprint is its own (a weights change after loading is a new
    fingerprint), and ``unpatch`` of it leaves the original patched. Before, both failed with
    ``TypeError: cannot pickle 'weakref.ReferenceType' object`` (found by a new user)."""
    ids = random_ids(1, 80)
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.3, window=8)
    before = model.generate(ids, **GREEDY)
    selected = jacap_attn.compress(model, ids)  # also memoises the original's fingerprint
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for loaded in (pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False)):
        assert jacap_attn.is_patched(loaded) and loaded._jacap_state.model() is loaded
        assert _same_selection(jacap_attn.compress(loaded, ids), selected)
        assert torch.equal(loaded.generate(ids, **GREEDY), before)
        assert jacap_attn.compress(loaded, ids).weights_sha256 == selected.weights_sha256
        jacap_attn.unpatch(loaded)
        assert not jacap_attn.is_patched(loaded) and jacap_attn.is_patched(model)
    assert torch.equal(model.generate(ids, **GREEDY), before)
    changed = pickle.loads(pickle.dumps(model))  # the original's memo does not travel with it
    with torch.no_grad():
        for p in changed.parameters():
            p.mul_(1.5)
    assert jacap_attn.compress(changed, ids).weights_sha256 != selected.weights_sha256


# -- case 5: state shared across threads ---------------------------------------------------------------

class _Pause:
    """A logits processor that, at ``generate``'s first step, says it is inside ``generate`` and waits
    until the other thread is done: the other thread's calls then run while this ``generate`` runs."""

    def __init__(self):
        self.inside, self.release = threading.Event(), threading.Event()

    def __call__(self, input_ids, scores):
        if not self.inside.is_set():
            self.inside.set()
            assert self.release.wait(120), "the other thread never finished"
        return scores


def _outcome(call):
    """``("ok", tensor)`` or ``("refused", type, message)`` of ``call()``."""
    try:
        return "ok", call()
    except ValueError as err:
        return "refused", type(err), str(err)


def _same(a, b) -> bool:
    return a[0] == b[0] and (torch.equal(a[1], b[1]) if a[0] == "ok" else a[1:] == b[1:])


def test_a_plain_forward_in_another_thread_is_checked_as_when_alone():
    """Kind: per-call state kept on a shared object. While one thread's ``generate`` ran, a counter on
    the model (``PatchState.generating``) made every forward skip the prompt checks of a compressed
    cache, so another thread's plain forward that passed the prompt again (read twice) or started at
    another position was served. The counter is per thread now. Thread A generates 8 tokens; while it
    is inside ``generate`` thread B runs plain forwards over a compressed cache (the prompt repeated,
    positions that do not continue, a correct continuation) and a ``generate`` with another prompt's
    cache: each result and each refusal equals the same call made alone, and A's tokens equal its
    tokens alone."""
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.3)
    ids_a, doc = random_ids(1, 90, seed=11), random_ids(1, 80)
    new = random_ids(1, 4, seed=3)
    cache = jacap_attn.compress(model, doc)

    def forward(input_ids, position_ids=None):
        with torch.no_grad():
            return model(input_ids, position_ids=position_ids, cache=copy.deepcopy(cache)).logits

    calls = {
        "prompt repeated": lambda: forward(torch.cat([doc, new], 1)),
        "positions that do not continue": lambda: forward(new, torch.arange(4)[None]),
        "a continuation": lambda: forward(new, torch.arange(80, 84)[None]),
        "generate with another prompt": lambda: model.generate(torch.cat([ids_a[:, :80], new], 1),
                                                               cache=copy.deepcopy(cache), **GREEDY),
    }
    alone = {name: _outcome(call) for name, call in calls.items()}
    assert [alone[name][0] for name in calls] == ["refused", "refused", "ok", "refused"]
    a_alone = model.generate(ids_a, **GREEDY)

    pause, result = _Pause(), {}

    def thread_a():
        try:
            result["a"] = model.generate(ids_a, logits_processor=[pause], **GREEDY)
        except BaseException as err:  # noqa: BLE001 - reported below
            result["a"] = err

    a = threading.Thread(target=thread_a)
    a.start()
    try:
        assert pause.inside.wait(120), "thread A never reached generate's first step"
        together = {name: _outcome(call) for name, call in calls.items()}
    finally:
        pause.release.set()
        a.join(120)
    assert not a.is_alive()
    assert isinstance(result["a"], torch.Tensor), result["a"]
    assert torch.equal(result["a"], a_alone)
    for name in calls:
        assert _same(together[name], alone[name]), (name, together[name][:1], alone[name][:1])


# -- case 6: what a new user hit with the README -------------------------------------------------------

from jacap_attn import cli  # noqa: E402
from test_user_bugs_25 import _BaseTokenizer, _no_load, _saved_document, cli_models  # noqa: E402,F401


@pytest.mark.parametrize("command", ["compress", "run"])
def test_another_documents_cache_at_out_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys, command):
    """Kind: a check that came too late. After the README's Python example had saved ``doc.safetensors``,
    ``jacap compress --prompt-file doc.txt --out doc.safetensors`` loaded the model, tokenized, and
    only then refused the file (it holds another document). The document's source (``--model`` and
    the text, or the demo's settings) is known before anything loads and is stored in the file, so
    the refusal comes first now; the file is untouched."""
    existing = tmp_path / "doc.safetensors"
    _saved_document(existing)  # as Document.save writes it (the README's Python example)
    before = existing.read_bytes()
    text = tmp_path / "doc.txt"
    text.write_text("A letter about something else entirely. " * 3)
    _no_load(monkeypatch)
    argv = (["compress", "--prompt-file", str(text), "--out", str(existing)] if command == "compress"
            else ["run", "--prompt-file", str(text), "--cache-out", str(existing)])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert str(existing) in err and "another document" in err and "--force" in err
    assert existing.read_bytes() == before


@pytest.mark.parametrize("flags,named", [(["--chunk-size", "0"], "--chunk-size=0"),
                                         (["--chunk-ratio", "0.05"], "--chunk-ratio=0.05"),
                                         (["--max-span", "0"], "--max-span=0"), (["--ratio", "2"], "--ratio=2.0"),
                                         (["--lookahead", "-1"], "--lookahead=-1")])
def test_the_command_line_names_its_flags_in_a_bad_setting(tmp_path, monkeypatch, capsys, flags, named):
    """The library's ValueError names ``chunk_size=0``; the command line's names the flag the user typed,
    before the model loads."""
    text = tmp_path / "doc.txt"
    text.write_text("A short letter. " * 3)
    _no_load(monkeypatch)
    assert cli.main(["compress", "--prompt-file", str(text), "--out", str(tmp_path / "x.safetensors"), *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and "_" not in err.split("got", 1)[1], err


@pytest.mark.parametrize("command,flag", [("compress", "--rat"), ("compress", "--chunk-s"), ("run", "--max-new"),
                                          ("ask", "--quest"), ("inspect", "--js")])
def test_the_command_line_takes_options_whole_not_abbreviated(tmp_path, monkeypatch, capsys, command, flag):
    """argparse's prefix matching took ``--rat`` for ``--ratio``: a script's abbreviation would change
    meaning (or become an error) whenever an option sharing its prefix is added. Options are matched
    whole: an abbreviation is an unrecognized argument, exit status 2, before anything loads."""
    text = tmp_path / "doc.txt"
    text.write_text("A short letter. " * 3)
    _no_load(monkeypatch)
    args = {"compress": ["--prompt-file", str(text), "--out", str(tmp_path / "x.safetensors")],
            "run": [], "ask": [str(tmp_path / "x.safetensors"), "--question", "Who?"], "inspect": [str(text)]}[command]
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, *args, flag, "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"jacap {command}: error: unrecognized arguments: {flag}" in err
    assert err.startswith(f"usage: jacap {command} ")  # the subcommand's usage (was: the top-level one's)


def test_the_command_line_names_as_flags_the_settings_a_message_advises_too(tmp_path, monkeypatch, capsys):
    """``--queries repeat --chunk-size 8``: the advice names ``--chunk-scores``, a flag the user did not
    type, as a flag too (before: "use --chunk-size=None with it, or chunk_scores='repeat'", neither of
    which the command line takes; found by a new user)."""
    text = tmp_path / "doc.txt"
    text.write_text("A short letter. " * 3)
    _no_load(monkeypatch)
    argv = ["compress", "--prompt-file", str(text), "--out", str(tmp_path / "x.safetensors"), "--queries", "repeat",
            "--chunk-size", "8"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--chunk-scores='repeat'" in err and "without --chunk-size" in err and "_" not in err, err


def test_document_ask_refuses_an_empty_question(tmp_path):
    """Kind: an input accepted silently. ``Document.ask("")`` answered (the CLI refuses an empty
    question); it is a ``ValueError`` naming the question, before anything is generated."""
    model, ids = _saved_document(tmp_path / "doc.safetensors")
    doc = jacap_attn.Document.load(tmp_path / "doc.safetensors", model)
    model.generate = lambda *args, **kwargs: pytest.fail("generate ran on an empty question")
    for question in ("", "   \n"):
        with pytest.raises(ValueError, match=re.escape(f"question {question!r} is empty")):
            doc.ask(question, _BaseTokenizer())
    with pytest.raises(ValueError, match="must be a string"):
        doc.ask(None, _BaseTokenizer())


def test_a_missing_cache_file_has_one_message(tmp_path, monkeypatch, capsys):
    """Kind: unclear errors that disagree. ``jacap inspect missing.safetensors`` and ``load_cache`` gave a
    raw "[Errno 2] No such file or directory"; ``jacap ask`` its own text. One message now, from
    ``load_cache``, ``Document.load`` and every command (before any model loads), still a
    ``FileNotFoundError`` (errno ENOENT)."""
    import errno

    missing = tmp_path / "missing.safetensors"
    expected = f"no cache file at {str(missing)!r}"
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.3)
    for call in (lambda: jacap_attn.load_cache(missing, model), lambda: jacap_attn.Document.load(missing, model),
                 lambda: jacap_attn.files.persist.read_cache_metadata(missing)):
        with pytest.raises(FileNotFoundError) as raised:
            call()
        assert str(raised.value).startswith(expected) and raised.value.errno == errno.ENOENT
    _no_load(monkeypatch)
    lines = set()
    for argv in (["inspect", str(missing)], ["ask", str(missing), "--question", "Who?"],
                 ["run", "--cache", str(missing), "--question", "Who?"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "Errno" not in err
        lines.add(err.strip())
    assert lines == {f"jacap: error: {raised.value}"}


def test_a_folder_given_as_a_cache_file_is_named_as_a_folder(tmp_path, monkeypatch, capsys):
    """Kind: an unclear error. ``Document.load(".")`` said "not a readable cache file (truncated or
    corrupted?): No such device (os error 19)". Every reader now says the path is a folder, an
    ``IsADirectoryError`` (errno EISDIR), and so does every command, before any model loads."""
    import errno

    expected = f"{str(tmp_path)!r} is a folder, not a cache file"
    model = jacap_attn.patch(tiny_model("llama"), ratio=0.3)
    for call in (lambda: jacap_attn.load_cache(tmp_path, model), lambda: jacap_attn.Document.load(tmp_path, model),
                 lambda: jacap_attn.files.persist.read_cache_metadata(tmp_path),
                 lambda: jacap_attn.files.cache_file.read_cache_file(tmp_path)):
        with pytest.raises(IsADirectoryError) as raised:
            call()
        assert str(raised.value).startswith(expected) and raised.value.errno == errno.EISDIR
    _no_load(monkeypatch)
    for argv in (["inspect", str(tmp_path)], ["ask", str(tmp_path), "--question", "Who?"]):
        assert cli.main(argv) == 2
        assert capsys.readouterr().err.strip() == f"jacap: error: {raised.value}"


def test_patch_says_when_it_switches_the_attention_implementation():
    """Kind: a silent change of the user's setting. ``patch`` on a model loaded with
    ``attn_implementation="flex_attention"`` switched it to SDPA without a word; it warns, naming both,
    and ``unpatch`` puts flex_attention back. SDPA and eager models get no warning."""
    model = tiny_model("llama", attn="flex_attention")
    with pytest.warns(UserWarning, match=r"attn_implementation='flex_attention'.*'sdpa'"):
        jacap_attn.patch(model, ratio=0.3)
    assert model.config._attn_implementation == "jacap_sdpa"
    jacap_attn.unpatch(model)
    assert model.config._attn_implementation == "flex_attention"
    for attn in ("sdpa", "eager"):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="attn_implementation")
            jacap_attn.patch(tiny_model("llama", attn=attn), ratio=0.3)


def test_ctrl_c_during_compress_exits_quietly_with_status_130(tmp_path, cli_models, monkeypatch, capsys):
    """Kind: a raw traceback for an ordinary action. Ctrl-C during ``jacap compress`` printed a
    ``KeyboardInterrupt`` traceback; it prints one line and exits with 130, the file at ``--out`` intact
    and no temporary file left, wherever the interrupt lands (the prefill, or the write itself)."""
    from jacap_attn.files import paths as files

    text = tmp_path / "doc.txt"
    text.write_text("The secret city is Oslo. " * 3)
    out = tmp_path / "doc.safetensors"
    assert cli.main(["compress", "--prompt-file", str(text), "--out", str(out)]) == 0
    before = out.read_bytes()
    capsys.readouterr()

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    for target, name in ((jacap_attn.Document, "compress"), (files.os, "replace")):
        with monkeypatch.context() as patched:
            patched.setattr(target, name, interrupt)
            try:
                status = cli.main(["compress", "--prompt-file", str(text), "--out", str(out), "--ratio", "0.5"])
            except KeyboardInterrupt:  # caught here, or it would stop the whole test session
                pytest.fail("Ctrl-C escaped jacap's main() as a KeyboardInterrupt traceback")
            assert status == 130
        err = capsys.readouterr().err
        assert err.strip().endswith("jacap: interrupted") and "Traceback" not in err and "KeyboardInterrupt" not in err
        assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["doc.safetensors", "doc.txt"]


def test_sigterm_while_a_cache_file_is_written_leaves_no_temporary_file(tmp_path, monkeypatch, capsys):
    """A ``kill`` (SIGTERM) that lands while ``jacap`` writes a cache file ends it as Ctrl-C does: the
    old file intact, no ``.jacap-*.tmp`` left beside it (it stayed there, 12 MB, before), status 130,
    and the process's own SIGTERM handler back afterwards."""
    import argparse
    import os
    import signal

    from jacap_attn.files import paths as files

    out = tmp_path / "doc.safetensors"
    out.write_bytes(b"the old document")
    received = []
    ours = lambda signum, frame: received.append(signum)  # noqa: E731: without jacap's own, the test lives on
    old_handler = signal.signal(signal.SIGTERM, ours)
    fsync = os.fsync

    def killed_while_writing(fd):
        os.kill(os.getpid(), signal.SIGTERM)
        fsync(fd)

    def write(args):
        with monkeypatch.context() as patched:
            patched.setattr(files.os, "fsync", killed_while_writing)
            files.write_atomically(out, b"a new document")

    parser = argparse.ArgumentParser()
    parser.set_defaults(func=write)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    try:
        status = cli.main([])
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, old_handler)
    assert (status, received) == (130, []), "SIGTERM did not end the command"
    assert capsys.readouterr().err.strip().endswith("jacap: interrupted")
    assert out.read_bytes() == b"the old document" and [p.name for p in tmp_path.iterdir()] == ["doc.safetensors"]


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_ctrl_c_in_a_jacap_process_exits_130(tmp_path, signame):
    """The same through a real SIGINT (or a ``kill``'s SIGTERM): a ``jacap compress`` process interrupted
    while its model loads prints ``jacap: interrupted`` and no traceback, and exits with 130."""
    import signal
    import subprocess
    import sys

    from conftest import child_env

    text = tmp_path / "doc.txt"
    text.write_text("Some text. " * 5)
    script = ("import sys, time\nfrom jacap_attn import cli\n"
              "def load(name):\n    print('loading', flush=True)\n    time.sleep(120)\n"
              "cli._load = load\n"
              f"sys.exit(cli.main(['compress', '--prompt-file', {str(text)!r}, '--out', {str(tmp_path / 'o.safetensors')!r}]))\n")
    env = child_env(PYTHONPATH=str(pytest.importorskip("jacap_attn").__file__).rsplit("/jacap_attn/", 1)[0])
    # A shell without job control starts background jobs with SIGINT ignored, and Python keeps an
    # ignored SIGINT ignored: the child gets the default disposition, as a terminal's process has.
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "loading"
        proc.send_signal(getattr(signal, signame))
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().endswith("jacap: interrupted") and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.txt"]


def _gguf_model(folder, gguf_file="tiny.gguf"):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32,
                                                    local_files_only=True).eval()
    finally:
        hf_logging.enable_progress_bar()


def _same_tables(found, tokenizer) -> bool:
    from jacap_attn.selection.spans import special_table, word_starts

    return found is not None and torch.equal(found[0], word_starts(tokenizer)) and \
        torch.equal(found[1], special_table(tokenizer, len(tokenizer)))


def test_a_model_loaded_from_a_gguf_file_keeps_words_whole(tmp_path):
    """Kind: a default silently off. A model loaded straight from a GGUF file
    (``from_pretrained(folder, gguf_file=...)``) found no tokenizer (the folder holds none), so Jacap's
    default word spans were off with only a warning. The tokenizer is now read from the GGUF file the
    model came from (transformers records it: ``config.quantization_config.gguf_file``): the word
    tables equal those of ``AutoTokenizer.from_pretrained(folder, gguf_file=...)``, for a file named
    relative to its folder or by an absolute path, and for a folder holding that one file when the
    record is gone; ``jacap_attn.models.load_model`` and the CLI load a ``.gguf`` path."""
    from transformers import AutoTokenizer

    from conftest import write_tiny_gguf
    from jacap_attn import models

    folder = tmp_path / "gguf"
    folder.mkdir()
    write_tiny_gguf(folder / "tiny.gguf")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="tiny.gguf")
    for name in ("tiny.gguf", str(folder / "tiny.gguf")):
        model = jacap_attn.patch(_gguf_model(folder, name), ratio=0.3)
        assert _same_tables(model._jacap_state.spans, tokenizer)
    del model.config.quantization_config  # no record: the folder's one GGUF file
    jacap_attn.unpatch(model)
    assert _same_tables(jacap_attn.patch(model, ratio=0.3)._jacap_state.spans, tokenizer)

    for given in (folder / "tiny.gguf", folder):
        loaded, loaded_tokenizer = models.load_model(given)
        assert loaded.config.model_type == "llama" and len(loaded_tokenizer) == len(tokenizer)
        assert _same_tables(jacap_attn.patch(loaded, ratio=0.3)._jacap_state.spans, tokenizer)
    text = tmp_path / "doc.txt"
    text.write_text("the cat sat on the mat and the hat " * 6)  # within the tiny model's 256 positions
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["compress", "--model", str(folder / "tiny.gguf"), "--prompt-file", str(text),
                         "--out", str(tmp_path / "doc.safetensors"), "--raw"]) == 0
    assert not [w for w in caught if "spans='words'" in str(w.message)]


def test_a_gguf_model_from_the_hugging_face_cache_keeps_words_whole(tmp_path, monkeypatch):
    """The same for a hub id whose GGUF file is in the local Hugging Face cache (offline; the cache laid
    out as huggingface_hub lays it out, in a temporary folder)."""
    from huggingface_hub import constants
    from transformers import AutoTokenizer

    from conftest import write_tiny_gguf

    repo = tmp_path / "hub" / "models--jacap--tiny-GGUF"
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    write_tiny_gguf(repo / "snapshots" / ("0" * 40) / "tiny.gguf")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model = _gguf_model("jacap/tiny-GGUF")
    assert model.name_or_path == "jacap/tiny-GGUF"
    tokenizer = AutoTokenizer.from_pretrained("jacap/tiny-GGUF", gguf_file="tiny.gguf")
    assert _same_tables(jacap_attn.patch(model, ratio=0.3)._jacap_state.spans, tokenizer)
