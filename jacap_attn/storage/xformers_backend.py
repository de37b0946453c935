"""Decode attention through xformers' fmha over per-head variable lengths (``backend="xformers"``).

The :class:`~jacap_attn.storage.ragged.RaggedLayer` layout holds each (row, KV head)'s entries as a prefix of
its ``capacity`` slots (``lengths [b, h]``). Its buffers ``[b, h, C, d]`` read, without a copy, as
``b * h`` key sequences padded to ``C``; one attention call over them with xformers'
:class:`~xformers.ops.fmha.attn_bias.BlockDiagonalCausalWithOffsetPaddedKeysMask` (one block per
(row, KV head), ``q`` queries each, keys ``[s * C, s * C + lengths[s])``, causal from the bottom
right: query ``i`` of ``q`` sees the first ``lengths - q + i + 1`` keys) reads only the held entries,
not the padding of heads below their layer's largest nor the free room. The GQA group is the head
axis of xformers' ``BMGHK`` form (``G = 1``, ``H = g``, keys expanded along it with stride 0, as
xformers documents for MQA/GQA): K/V are never repeated.

The mask equals the SDPA path's (:meth:`JacapLayer.attention_mask` of the ragged layout, expanded
over the group as :meth:`JacapLayer.attend` does): its held entries are all at logical positions
before the new tokens, which follow in order (``tests/test_xformers_backend.py`` checks
``materialize()`` against it on CPU). xformers has no CPU operator, so the backend needs CUDA.

Installing: the optional extra ``pip install 'jacap-attn[cuda]'`` (``xformers==0.0.35``, a 3.2 MB
wheel, torch >= 2.10, no CUDA libraries pulled). For a machine without a package index:
``pip download xformers==0.0.35 --no-deps -d wheels/`` here, carry ``wheels/`` with the working
tree; ``tools/gpu_bench.py`` installs it there into a temporary folder (``pip install --no-deps
--target``), nothing else touched.

Compilation: :func:`attend` calls the custom op ``torch.ops.jacap.xformers_attention`` (opaque to
dynamo, with a fake implementation), so the decode step compiles with ``fullgraph=True``; inside it
the bias is built from device tensors only (no host synchronisation), so CUDA graphs can record it.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

import torch

BACKENDS = ("auto", "sdpa", "xformers")
INSTALL_HINT = "pip install 'jacap-attn[cuda]' (xformers==0.0.35)"


def installed() -> bool:
    """Whether the ``xformers`` package can be imported (not imported here)."""
    return importlib.util.find_spec("xformers") is not None


@functools.lru_cache(maxsize=None)
def _probe(device: str) -> str | None:
    """``None`` if :func:`xformers_attention` runs on ``device`` (one tiny call: 2 sequences of 8 slots,
    a GQA group of 2, bfloat16), else why not."""
    try:
        q = torch.randn(1, 2, 1, 2, 64, device=device, dtype=torch.bfloat16)
        kv = torch.randn(1, 16, 1, 1, 64, device=device, dtype=torch.bfloat16)
        torch.ops.jacap.xformers_attention(q, kv, kv, torch.tensor([3, 8], device=device), 0.125)
        return None
    except Exception as error:  # noqa: BLE001 - no operator, no kernels for this GPU, import failure
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why the xformers backend cannot run on ``device`` (``None`` if it can): not CUDA, xformers not
    installed, or its fmha refusing a tiny call there (checked once per device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the model is on {device.type}, and xformers' memory_efficient_attention has no CPU operator"
    if not installed():
        return f"xformers is not installed ({INSTALL_HINT})"
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _probe(str(device))


def resolve(backend: str, device: torch.device | str) -> str:
    """The backend a cache on ``device`` runs: ``"sdpa"`` or ``"xformers"``. ``"auto"`` is xformers when
    it can run there (CUDA, xformers' kernels present), SDPA otherwise.

    Raises ``ValueError`` for a name not in :data:`BACKENDS`, or ``backend="xformers"`` where it
    cannot run (the reason named; no silent fallback). ``"auto"`` on CUDA with xformers installed
    but refusing the probe call warns once (``RuntimeWarning``, the reason) and runs SDPA."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got backend={backend!r}")
    if backend == "sdpa":
        return backend
    reason = unavailable_reason(device)
    if reason is None:
        return "xformers"
    if backend == "auto":
        if torch.device(device).type == "cuda" and installed():  # installed, yet refusing: say so once
            _warn_once(f"jacap_attn: backend='auto' uses SDPA: xformers is installed but cannot run here ({reason})")
        return "sdpa"
    raise ValueError(f"backend='xformers' cannot run here: {reason}; use backend='auto' (SDPA where xformers "
                     "cannot run) or backend='sdpa'")


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def keys_bias(lengths: torch.Tensor, q_len: int, capacity: int, *, host: bool = False):
    """The xformers bias of ``n`` sequences (one per (row, KV head), flattened row-major): ``q_len``
    queries each, keys padded to ``capacity`` of which the first ``lengths [n]`` are used, causal
    from the bottom right (:class:`~xformers.ops.fmha.attn_bias.BlockDiagonalCausalWithOffsetPaddedKeysMask`).

    Built from the device tensor ``lengths`` without reading it on the host: the Python-side
    lengths (``seqlen_py``) are the upper bound ``capacity``, and the kernels read the tensor.
    ``host=True`` reads them (a synchronisation) so that ``materialize()`` (testing) shows the real
    mask; the tensors are the same either way. Raises ``ImportError`` without xformers."""
    from xformers.ops.fmha.attn_bias import (BlockDiagonalCausalWithOffsetPaddedKeysMask, _PaddedSeqLenInfo,
                                             _SeqLenInfo)

    n, device = lengths.shape[0], lengths.device
    starts = torch.arange(n + 1, device=device, dtype=torch.int32)
    seqlen = lengths.to(torch.int32)
    seqlen_py = [int(x) for x in lengths.tolist()] if host else [capacity] * n
    q_info = _SeqLenInfo(seqstart=starts * q_len, max_seqlen=q_len, min_seqlen=q_len,
                         seqstart_py=list(range(0, n * q_len + 1, q_len)))
    k_info = _PaddedSeqLenInfo(seqstart=starts * capacity, max_seqlen=max(seqlen_py, default=0),
                               min_seqlen=min(seqlen_py, default=0), seqstart_py=list(range(0, n * capacity + 1, capacity)),
                               seqlen=seqlen, seqlen_py=seqlen_py, padding=capacity)
    return BlockDiagonalCausalWithOffsetPaddedKeysMask(q_seqinfo=q_info, k_seqinfo=k_info)


def fmha_forward(query, key, value, bias, scale: float) -> torch.Tensor:
    """xformers' ``memory_efficient_attention_forward`` (``BMGHK``; the tests replace it by a dense
    reference on CPU)."""
    from xformers.ops import fmha

    return fmha.memory_efficient_attention_forward(query, key, value, attn_bias=bias, scale=scale)


@torch.library.custom_op("jacap::xformers_attention", mutates_args=())
def xformers_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """``query [1, n * q, 1, g, d]``, ``key/value [1, n * C, 1, 1, d]``, ``lengths [n]`` ->
    ``[1, n * q, 1, g, dv]``: :func:`fmha_forward` with :func:`keys_bias`, K/V expanded along ``g``
    here (stride 0: xformers' GQA form; done inside the op so that the compiler never copies it)."""
    n, g = lengths.shape[0], query.shape[3]
    bias = keys_bias(lengths, query.shape[1] // n, key.shape[1] // n)
    key, value = key.expand(-1, -1, -1, g, -1), value.expand(-1, -1, -1, g, -1)
    return fmha_forward(query, key, value, bias, scale).contiguous()


@xformers_attention.register_fake
def _(query, key, value, lengths, scale):
    return query.new_empty(*query.shape[:-1], value.shape[-1])


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
           scaling: float) -> torch.Tensor:
    """Attention of ``query [b, Hq, q, d]`` (the last ``q`` tokens written) over a ragged layer's
    buffers ``keys/values [b, h, C, d]`` (contiguous) of which each (row, KV head) uses the first
    ``lengths [b, h]`` slots; query head ``j`` reads KV head ``j // (Hq // h)``. Returns
    ``[b, q, Hq, dv]`` in the query's dtype (the layout transformers expects), as
    :meth:`jacap_attn.storage.layer.JacapLayer.attend` does. CUDA only (xformers)."""
    b, hq, q, d = query.shape
    h, c = keys.shape[1], keys.shape[2]
    g, dv = hq // h, values.shape[-1]
    n = b * h
    folded = query.reshape(b, h, g, q, d).transpose(2, 3).reshape(1, n * q, 1, g, d)
    k, v = keys.reshape(1, n * c, 1, 1, d), values.reshape(1, n * c, 1, 1, dv)
    out = torch.ops.jacap.xformers_attention(folded, k, v, lengths.reshape(n), scaling)  # [1, n*q, 1, g, dv]
    return out.reshape(b, h, q, g, dv).transpose(1, 2).reshape(b, q, hq, dv)
