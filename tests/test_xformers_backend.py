"""The ``ragged`` layout and the xformers backend (jacap_attn.storage.xformers_backend), on CPU.

xformers' ``memory_efficient_attention`` has no CPU operator, so here: the ragged layout through
SDPA against the padded one (same tokens, logits within float32 tolerance, after a question, a
question-time reselection and decode steps); the xformers bias built from real cache layouts (per-head
budgets of the ``global`` policy, so heads differ) against the mask the SDPA path uses; and the
xformers code path itself (reshapes, the custom op, compiled with ``fullgraph=True``) with xformers'
kernel replaced by a dense reference that reads the same bias. The kernel on a GPU is measured by
``tools/gpu_bench.py`` (its ``jacap-xformers-*`` rows). The bias tests need the ``xformers`` package
(``pip install 'jacap-attn[cuda]'``; it installs beside the CPU torch) and are skipped without it.
"""

from __future__ import annotations

import torch
import pytest

import jacap_attn
from jacap_attn.storage import xformers_backend
from jacap_attn.storage.cache import JacapCache
from jacap_attn.config import JacapConfig
from jacap_attn.storage.layer import JacapLayer
from jacap_attn.storage.ragged import RaggedLayer
from conftest import DECODE_ATOL, DECODE_RTOL, random_ids, tiny_model

# Per-head budgets of the `global` policy: heads of a layer keep different counts (checked below).
OPTIONS = dict(ratio=0.25, budget="global", window=8)
PROMPT = 120


def needs_bias():
    return pytest.importorskip("xformers.ops.fmha.attn_bias", reason="xformers not installed (the [cuda] extra)")


def prefill(model, ids, layout, attention_mask=None, **cache_options):
    """``(cache, logits [b, 1, V])`` of a prefill of ``ids`` into a fresh cache of ``layout``."""
    cache = JacapCache(model, layout=layout, **cache_options)
    kwargs = {}
    if attention_mask is not None:
        kwargs = dict(attention_mask=attention_mask, position_ids=(attention_mask.cumsum(-1) - 1).clamp_min(0))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kwargs, **{model._jacap_state.cache_keyword: cache})
    return cache, out.logits


def forward(model, cache, ids):
    """Logits ``[b, q, V]`` of new tokens ``ids [b, q]`` over ``cache`` (appended, or reselected)."""
    pos = cache.layers[0].next_positions()[:, None] + torch.arange(ids.shape[1])
    with torch.no_grad():
        return model(input_ids=ids, position_ids=pos, use_cache=True, **{model._jacap_state.cache_keyword: cache}).logits


def continue_both(model, caches, question, steps=4):
    """The question's logits, then ``steps`` greedy steps, over each cache; returns per cache the list
    of logits and the tokens."""
    runs = []
    for cache in caches:
        logits = [forward(model, cache, question)]
        tokens = []
        for _ in range(steps):
            tok = logits[-1][:, -1:].argmax(-1)
            tokens.append(tok)
            logits.append(forward(model, cache, tok))
        runs.append((logits, torch.cat(tokens, -1)))
    return runs


def assert_same_runs(runs):
    (logits_a, tokens_a), (logits_b, tokens_b) = runs
    assert torch.equal(tokens_a, tokens_b)
    for a, b in zip(logits_a, logits_b):
        torch.testing.assert_close(a, b, atol=DECODE_ATOL, rtol=DECODE_RTOL)


def left_padded(batch=2, length=PROMPT, short=17):
    ids = random_ids(batch, length)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :short] = 0
    return ids, mask


@pytest.mark.parametrize("reselect", [None, 0.5])
def test_ragged_layout_gives_the_padded_layouts_outputs(reselect):
    model = jacap_attn.patch(tiny_model(), **OPTIONS, reselect=reselect)
    ids, mask = left_padded()
    padded, logits_p = prefill(model, ids, "padded", mask)
    ragged, logits_r = prefill(model, ids, "ragged", mask)
    torch.testing.assert_close(logits_p, logits_r)
    assert any(len(set(layer.kept_counts().flatten().tolist())) > 1 for layer in padded.layers)  # heads differ
    for p, r in zip(padded.layers, ragged.layers):
        assert isinstance(r, RaggedLayer) and type(p) is JacapLayer
        assert torch.equal(r.lengths, p.kept_counts()) and torch.equal(r.valid.sum(-1), r.lengths)
        assert torch.equal(r.valid, torch.arange(r.capacity) < r.lengths[..., None])  # a prefix per head
        assert int(r.write_pos) == int(r.lengths.max()) and r.capacity == p.capacity
        held_p, held_r = p.held_entries(), r.held_entries()
        for a, b in zip(held_p, held_r):  # the same entries, in the same order
            assert torch.equal(a[held_p[3]], b[held_r[3]])
    assert padded.kv_bytes() == ragged.kv_bytes() and padded.kept_bytes() == ragged.kept_bytes()
    question = random_ids(2, 6, seed=5)
    assert_same_runs(continue_both(model, [padded, ragged], question))
    for p, r in zip(padded.layers, ragged.layers):
        assert torch.equal(r.lengths, p.kept_counts())
        assert torch.equal(r.valid, torch.arange(r.capacity) < r.lengths[..., None])


def test_ragged_layout_grows_reorders_and_round_trips():
    model = jacap_attn.patch(tiny_model(), **OPTIONS)
    ids, mask = left_padded()
    padded, _ = prefill(model, ids, "padded", mask, max_length=PROMPT + 2)
    ragged, _ = prefill(model, ids, "ragged", mask, max_length=PROMPT + 2)
    for cache in (padded, ragged):
        cache.batch_select_indices(torch.tensor([1, 0, 1]))  # rows reordered (beam search)
        cache.ensure_room(40)  # grown to a larger bucket
    question = random_ids(3, 5, seed=6)
    assert_same_runs(continue_both(model, [padded, ragged], question, steps=3))
    # A saved cache's entries (export) read back into the other layout.
    entries = [layer.export() for layer in ragged.layers]
    logical, pads = int(ragged.layers[0].logical), ragged.pads
    back = JacapCache.from_kept(model, entries, logical=logical, pads=pads)
    assert back.layout == "padded"
    step = random_ids(3, 1, seed=7)
    torch.testing.assert_close(forward(model, back, step), forward(model, ragged, step),
                               atol=DECODE_ATOL, rtol=DECODE_RTOL)


def test_backend_option_is_validated_and_xformers_needs_cuda():
    with pytest.raises(ValueError, match=r"backend must be one of auto, sdpa, xformers; got backend='flash'"):
        JacapConfig(backend="flash")
    if not torch.cuda.is_available():
        assert JacapConfig().backend == "sdpa"  # "auto" where xformers cannot run at all is SDPA
    model = jacap_attn.patch(tiny_model(), ratio=0.25, backend="xformers")  # a setting: checked per cache
    with pytest.raises(ValueError, match=r"backend='xformers' cannot run here: the model is on cpu.*no CPU operator"):
        jacap_attn.compress(model, random_ids(1, 40))
    assert xformers_backend.resolve("auto", "cpu") == "sdpa"
    with pytest.raises(ValueError, match="layout JacapLayer runs backend 'sdpa', not backend='xformers'"):
        JacapLayer(None, "xformers")
    model = jacap_attn.patch(tiny_model(), ratio=0.25, method="full", backend="sdpa")  # `full` accepts it too
    assert jacap_attn.compress(model, random_ids(1, 40)).layout == "padded"


def test_read_bytes_padded_reads_every_slot_ragged_xformers_the_held_entries():
    model = jacap_attn.patch(tiny_model(), **OPTIONS)
    padded, _ = prefill(model, random_ids(2, PROMPT), "padded")
    ragged, _ = prefill(model, random_ids(2, PROMPT), "ragged")
    assert padded.read_bytes() == padded.kv_bytes() == ragged.read_bytes()
    for layer in ragged.layers:
        layer.backend = "xformers"
    assert ragged.read_bytes() == ragged.kept_bytes() < ragged.kv_bytes()


@pytest.mark.parametrize("q", [1, 3])
def test_xformers_bias_materializes_the_sdpa_mask(q):
    needs_bias()
    model = jacap_attn.patch(tiny_model(), **OPTIONS)
    ids, mask = left_padded()
    padded, _ = prefill(model, ids, "padded", mask)
    ragged, _ = prefill(model, ids, "ragged", mask)
    new = random_ids(2, q, seed=8)
    forward(model, padded, new)
    forward(model, ragged, new)
    for p, r in zip(padded.layers, ragged.layers):
        b, h, c = r.valid.shape
        n = b * h
        bias = xformers_backend.keys_bias(r.lengths.reshape(n), q, c, host=True)
        fast = xformers_backend.keys_bias(r.lengths.reshape(n), q, c)  # what the kernel gets: same tensors
        for field in ("seqstart", "seqlen"):
            assert torch.equal(getattr(bias.k_seqinfo, field), getattr(fast.k_seqinfo, field))
        assert torch.equal(bias.q_seqinfo.seqstart, fast.q_seqinfo.seqstart)
        dense = bias.materialize((n * q, n * c)).reshape(b, h, q, b, h, c) == 0  # allowed keys
        blocks = dense[torch.arange(b)[:, None], torch.arange(h)[None, :], :, torch.arange(b)[:, None],
                       torch.arange(h)[None, :]]  # [b, h, q, C], the diagonal blocks
        assert int(dense.sum()) == int(blocks.sum())  # nothing outside a (row, KV head)'s own block
        # The SDPA path's mask, expanded over the GQA group (2 query heads per KV head here) as
        # `attend` does before folding the group into the query axis: the bias's, for every head.
        expanded = r.attention_mask(q)[:, :, None].expand(b, h, 2, q, c)
        assert torch.equal(expanded, blocks[:, :, None].expand(b, h, 2, q, c))
        # And the same logical positions as the padded layout's mask attends.
        for row in range(b):
            for head in range(h):
                for i in range(q):
                    got = r.positions[row, head][blocks[row, head, i]].sort().values
                    want = p.positions[row, head][p.attention_mask(q)[row, head, i]].sort().values
                    assert torch.equal(got, want)


def reference_fmha(query, key, value, bias, scale):
    """xformers' fmha on CPU for these tests: dense softmax attention (float32) under the bias the
    kernel reads, ``materialize()``d from its tensors (``seqlen``)."""
    q_len = bias.q_seqinfo.max_seqlen
    capacity = bias.k_seqinfo.padding
    dense = xformers_backend.keys_bias(bias.k_seqinfo.seqlen, q_len, capacity, host=True).materialize(
        (query.shape[1], key.shape[1]))
    logits = torch.einsum("mhd,nhd->hmn", query[0, :, 0].float(), key[0, :, 0].float()) * scale + dense
    out = torch.einsum("hmn,nhd->mhd", logits.softmax(-1), value[0, :, 0].float())
    return out[None, :, None].to(query.dtype)


def test_xformers_code_path_with_a_reference_kernel_matches_sdpa_eager_and_compiled(monkeypatch):
    needs_bias()
    from eval.speed import make_step

    calls = []
    monkeypatch.setattr(xformers_backend, "fmha_forward", lambda *args: calls.append(1) or reference_fmha(*args))
    model = jacap_attn.patch(tiny_model(), **OPTIONS)
    ids, mask = left_padded()
    padded, _ = prefill(model, ids, "padded", mask, max_length=PROMPT + 12)
    ragged, _ = prefill(model, ids, "ragged", mask, max_length=PROMPT + 12)
    for layer in ragged.layers:
        layer.backend = "xformers"
    question = random_ids(2, 4, seed=9)
    runs = continue_both(model, [padded, ragged], question, steps=2)
    assert_same_runs(runs)
    assert len(calls) == 3 * len(ragged.layers)  # the question and two steps, every layer: the xformers path
    # Compiled (fullgraph: the custom op is opaque to dynamo), against eager SDPA on the padded layout.
    torch._dynamo.reset()
    step = torch.compile(make_step(model, model._jacap_state.cache_keyword), fullgraph=True, dynamic=False)
    tok = runs[1][1][:, -1:].clone()
    start = ragged.layers[0].next_positions()[:, None]
    eager_tok = tok
    with torch.no_grad():
        for i in range(3):
            tok = step(tok, start + i, ragged).clone()
            eager_tok = forward(model, padded, eager_tok)[:, -1:].argmax(-1)
            assert torch.equal(tok, eager_tok)
    assert len(calls) == 6 * len(ragged.layers)
    torch._dynamo.reset()


@pytest.mark.skipif(xformers_backend.unavailable_reason("cuda" if torch.cuda.is_available() else "cpu") is not None,
                    reason="needs CUDA and xformers' kernels (tools/gpu_bench.py's machine)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_xformers_gives_sdpas_outputs(dtype):
    """GPU only: the real kernel, ragged + xformers against padded + SDPA (the question, decode steps,
    compiled ``generate``)."""
    model = jacap_attn.patch(tiny_model(dtype=dtype).cuda(), **OPTIONS)
    ids, mask = (t.cuda() for t in left_padded())
    padded, _ = prefill(model, ids, "padded", mask)
    ragged, _ = prefill(model, ids, "ragged", mask)
    assert ragged.backend == "xformers" and all(layer.backend == "xformers" for layer in ragged.layers)
    question = random_ids(2, 6, seed=5).cuda()
    runs = continue_both(model, [padded, ragged], question)
    if dtype == torch.float32:
        assert_same_runs(runs)
    else:  # bfloat16: the question's logits within its rounding (later tokens may part)
        torch.testing.assert_close(runs[0][0][0].float(), runs[1][0][0].float(), atol=5e-2, rtol=5e-2)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)  # compiled decode, auto
    assert out.shape == (2, PROMPT + 6)


def test_a_config_saved_with_xformers_reads_back_where_it_runs():
    data = JacapConfig(backend="sdpa").to_dict()
    assert data["backend"] == "sdpa" and JacapConfig.from_dict(data).backend == "sdpa"
    data["backend"] = "xformers"  # as saved on a GPU machine
    assert JacapConfig.from_dict(data).backend == JacapConfig(backend="auto").backend  # "sdpa" without CUDA
    model = jacap_attn.patch(tiny_model(), ratio=0.25)  # on the CPU
    assert JacapCache(model, config=JacapConfig.from_dict(data)).backend == "sdpa"
