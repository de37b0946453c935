"""Scoring one layer: the one function every route calls (docs/architecture.md#scoring-a-layer).

A route (:mod:`jacap_attn.routes`) says where the queries come from and when the cut happens; this
module does the rest, the same way for all of them: which layers the method scores
(:func:`scores_layer`), what they can still attend and their budget (:func:`layer_inputs`), then
:func:`score_layer`: the :class:`~jacap_attn.types.PrefillInputs`, the method's ``score_parts``
(compiled on CUDA), the check of what it returned, and the extra per-layer tensors the budget
policies read (``"need"`` for ``capacity``, the observation peak for ``global``).
"""

from __future__ import annotations

import torch

from ..math import budget as budgets
from . import global_budget
from .heads import group_of
from ..math import scoring, share
from ..config import JacapConfig
from ..methods import Method
from ..storage.distributed import SINGLE, HeadGroup
from ..types import PrefillInputs

_COMPILED: dict = {}


def sliding_compressed(config: JacapConfig, layers) -> bool:
    """Whether the method scores and selects the sliding-window layers among ``layers``: under
    ``sliding="compress"``, and always on a model whose layers all slide (Mistral, Phi3 with
    ``sliding_window`` set), which has no other layer to compress (docs/method.md#sliding-window-layers)."""
    return config.sliding == "compress" or all(layer.is_sliding for layer in layers)


def scores_layer(config: JacapConfig, layers, index: int) -> bool:
    """Whether the method selects layer ``index`` of ``layers`` (a cache's layers), at prefill and at
    question time alike: a compressing method (any ratio: a document stored whole, ``ratio=1``, is
    still reselected), and a full-attention layer or a sliding one under :func:`sliding_compressed`.
    The one rule every route reads (a prefill also needs :func:`compresses_prompt`)."""
    if not config.method.compresses:
        return False
    return not layers[index].is_sliding or sliding_compressed(config, layers)


def compresses_prompt(config: JacapConfig, n: int) -> bool:
    """Whether a prefill of ``n`` positions (padding included) evicts anything: the method
    compresses, ``ratio < 1``, and not every row is shorter than ``min_tokens``."""
    return config.compresses and n >= config.min_tokens


def cut_evicts(config: JacapConfig, seen: torch.Tensor, held: torch.Tensor, ratio: float | None = None) -> bool:
    """Whether a cut at kept fraction ``ratio`` (default ``config.ratio``) of ``seen [b]`` real tokens
    can evict any of ``held [b]`` (the most entries any layer and KV head of the row holds): some row
    has at least ``min_tokens`` tokens and a mean layer budget
    (:func:`jacap_attn.math.budget.layer_budget`, the window its floor) below ``held``. Every budget
    policy splits a total of that mean budget times the heads, each head at most its candidates, so
    when this is ``False`` every entry is kept whatever the scores (a pass that only changes scores,
    such as a lookahead, can be skipped)."""
    if not config.compresses:
        return False
    ratio = config.ratio if ratio is None else ratio
    seen, held = seen.cpu().to(torch.int64), held.cpu().to(torch.int64)
    budget = budgets.layer_budget(seen, ratio, config.window)
    return bool(((seen >= config.min_tokens) & (budget < held)).any())


def reach(layer, key_valid: torch.Tensor) -> torch.Tensor:
    """``[b, n]`` bool: the real prompt tokens ``layer`` can attend again after the prompt: all of
    them for full attention, the last ``sliding_window - 1`` positions for a sliding window (the
    decode mask hides the others for ever)."""
    if not layer.is_sliding:
        return key_valid
    n = key_valid.shape[-1]
    return key_valid & (torch.arange(n, device=key_valid.device) >= n - (layer.sliding_window - 1))


def sliding_budget(cfg: JacapConfig, n_valid: torch.Tensor, reach_valid: torch.Tensor, all_sliding: bool,
                   ratio: float | None = None):
    """``[b]`` budget of a scored sliding-window layer (docs/method.md#sliding-window-layers) at kept
    fraction ``ratio`` (default ``cfg.ratio``)."""
    ratio = cfg.ratio if ratio is None else ratio
    if all_sliding:  # as on any model: ceil(ratio * n), at most what the window can use
        return torch.minimum(budgets.layer_budget(n_valid, ratio, cfg.window), reach_valid)
    return budgets.layer_budget(reach_valid, ratio, cfg.window)  # ratio of what the window holds


def layer_inputs(cfg: JacapConfig, layers, index: int, key_valid: torch.Tensor, device,
                 ratio: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``key_valid [b, n]`` on ``device`` (the prompt tokens layer ``index`` can still attend,
    :func:`reach`, from the prompt's validity ``key_valid``) and the layer's mean budget ``[b]`` at
    kept fraction ``ratio`` (default ``cfg.ratio``; a chunked prefill's running budget before its
    last cut is ``cfg.chunk_ratio``)."""
    layer = layers[index]
    ratio = cfg.ratio if ratio is None else ratio
    valid = reach(layer, key_valid.to(device))
    n_valid = key_valid.sum(-1).cpu()
    if layer.is_sliding:
        budget = sliding_budget(cfg, n_valid, valid.sum(-1).cpu(), all(x.is_sliding for x in layers), ratio)
    else:
        budget = budgets.layer_budget(n_valid, ratio, cfg.window)
    return valid, budget


def compiled_scorer(method: Method, *, fullgraph: bool = False):
    """``method.score_parts`` under ``torch.compile`` with a dynamic sequence length, memoised per
    method instance. The compiled code is the method's own ``score`` (or its own ``score_parts``),
    so methods never share a code object, nor its recompile budget. ``fullgraph=True`` makes a graph
    break an error (the tests compile every registered method so); the default falls back to eager
    if torch gives up (e.g. past its recompile limit after many option values)."""
    key = (method, fullgraph)
    fn = _COMPILED.get(key)
    if fn is None:
        if type(method).score_parts is Method.score_parts:
            score = torch.compile(method.score, dynamic=True, fullgraph=fullgraph)
            fn = lambda inputs: {"scores": score(inputs)}  # noqa: E731
        else:
            fn = torch.compile(method.score_parts, dynamic=True, fullgraph=fullgraph)
        _COMPILED[key] = fn
    return fn


def checked_parts(method: Method, parts, shape: tuple) -> dict:
    """The method's output, checked: a dict whose ``"scores"`` is a real floating tensor of ``shape``
    ``[b, h, n]`` (else a ``ValueError`` naming the method), as float32, NaN ranked last (a NaN never
    displaces the window or another token)."""
    name = method.name or type(method).__qualname__
    if not isinstance(parts, dict) or "scores" not in parts:
        raise ValueError(f"method {name!r}: score_parts must return a dict with 'scores', got {type(parts).__name__}")
    scores = parts["scores"]
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point() or tuple(scores.shape) != shape:
        got = f"{type(scores).__name__} {tuple(getattr(scores, 'shape', ()))} {getattr(scores, 'dtype', '')}"
        raise ValueError(f"method {name!r}: score must return a float tensor [b, h, n] = {list(shape)}, got {got}")
    scores = scores.float()
    return {**parts, "scores": torch.nan_to_num(scores, nan=float("-inf"))}


def prefill_inputs(cfg: JacapConfig, index: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scaling: float, key_valid: torch.Tensor, budget: torch.Tensor, *, observed: dict | None = None,
                   all_queries: torch.Tensor | None = None, extras: bool = True,
                   adaptive: bool | None = None, policy: str | None = None,
                   heads: HeadGroup = SINGLE, probs: torch.Tensor | None = None) -> tuple[PrefillInputs, torch.Tensor | None]:
    """The :class:`~jacap_attn.types.PrefillInputs` of one layer (arguments as :func:`score_layer`) and
    the window attention ``[b, h, g, w, n]`` when the method or the budget policy reads it (else
    ``None``; ``probs``, when given, is that attention already computed, as
    :func:`jacap_attn.math.scoring.window_attention` returns it)."""
    method = cfg.method
    policy = cfg.budget if policy is None else policy
    ranks = extras and global_budget.ranks_attention(cfg, policy)
    want_probs = observed is None and (method.needs_window_attention or (extras and policy == "capacity")
                                       or (ranks and not method.needs_all_queries))
    if not want_probs:
        probs = None
    elif probs is None:
        probs = scoring.window_attention(queries, keys, scaling, key_valid)
    row_valid = key_valid if key_valid.dim() == 2 else key_valid[:, 0]
    inputs = PrefillInputs(
        queries=queries, keys=keys, values=values, key_valid=row_valid, scaling=float(scaling), layer_index=index,
        budget=budget, adaptive=policy != "uniform" if adaptive is None else adaptive,
        probs=probs if method.needs_window_attention else None,
        all_queries=all_queries if method.needs_all_queries else None, observed=observed, heads=heads)
    return inputs, probs


def score_layer(cfg: JacapConfig, index: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                scaling: float, key_valid: torch.Tensor, budget: torch.Tensor, *, observed: dict | None = None,
                all_queries: torch.Tensor | None = None, extras: bool = True, adaptive: bool | None = None,
                policy: str | None = None, heads: HeadGroup = SINGLE, window_observed: dict | None = None,
                probs: torch.Tensor | None = None, gains: torch.Tensor | None = None) -> dict:
    """Score one layer with ``cfg.method``; returns the checked parts (``"scores"`` ``[b, h, n]``
    float32 and the method's extra tensors) plus, when ``extras``, what the budget policy reads:
    ``"need"`` ``[b, h]`` (``capacity``: each head's demand, averaged by the cut) and :data:`jacap_attn.selection.global_budget.GLOBAL_ATTENTION` ``[b, h, n]``
    (``global`` with the attention score).

    queries: ``[b, h, g, w, d]`` the observation window's queries (post-RoPE, grouped by KV head);
    keys, values: ``[b, h, n, d]`` the scored entries; key_valid: ``[b, n]`` bool (or ``[b, h, n]`` per
    head for the window attention; the method then receives a single head, ``h == 1``); budget:
    ``[b]`` int64; observed: the repeat pass's statistics (``queries="repeat"``: no window attention
    is computed, the statistics stand in for it); all_queries: ``[b, h, g, n, d]`` for a method that
    reads every prompt query; adaptive: ``PrefillInputs.adaptive`` (default: the budget policy is not
    ``uniform``); policy: the budget policy of the cut these scores serve (default ``cfg.budget``; at
    question time ``cfg.reselect_budget``); heads: the :class:`~jacap_attn.storage.distributed.HeadGroup` of the
    layer's KV heads (``PrefillInputs.heads``: a tensor-parallel rank's ``h`` heads are its slice of the
    model's). On CUDA with ``compile=True`` a compilable method's scoring runs under
    :func:`compiled_scorer` (not on heads split over ranks); the repeat route's stays eager.
    window_observed: with ``cfg.lookahead_share`` and ``observed`` a lookahead's summed statistics, the
    window's own statistics: every part is scored from them, and the part
    :data:`jacap_attn.math.share.SUMMED` holds the scores from ``observed``, which rank after the
    window's own share at the cut (:func:`jacap_attn.math.share.share_ranking`).
    probs: the window attention ``[b, h, g, w, n]`` if the caller already computed it
    (:func:`held_window_attention`; ignored with ``observed``). gains: ``global_score="output"``'s
    :func:`jacap_attn.selection.global_budget.output_gains` ``[b, h, g, n]`` (``None``: unweighted).
    Raises ``ValueError`` naming the method if it returns anything but float ``[b, h, n]`` scores.
    """
    if window_observed is not None and cfg.lookahead_share is not None:
        common = dict(all_queries=all_queries, adaptive=adaptive, policy=policy, heads=heads)
        own = score_layer(cfg, index, queries, keys, values, scaling, key_valid, budget, observed=window_observed,
                          extras=extras, gains=gains, **common)
        summed = score_layer(cfg, index, queries, keys, values, scaling, key_valid, budget, observed=observed,
                             extras=False, **common)
        own[share.SUMMED] = summed["scores"]  # ranked after the window's own share at the cut
        return own
    method = cfg.method
    policy = cfg.budget if policy is None else policy
    inputs, probs = prefill_inputs(cfg, index, queries, keys, values, scaling, key_valid, budget, observed=observed,
                                   all_queries=all_queries, extras=extras, adaptive=adaptive, policy=policy,
                                   heads=heads, probs=probs)
    use_compiled = observed is None and cfg.compile and keys.device.type == "cuda" and method.compilable \
        and not heads.split
    parts = checked_parts(method, (compiled_scorer(method) if use_compiled else method.score_parts)(inputs),
                          tuple(keys.shape[:3]))
    if extras and policy == "capacity":
        weights = parts.get("weights")
        demand = weights if weights is not None else (observed["mass"] if observed is not None else probs.sum(dim=(2, 3)))
        parts["need"] = budgets.capacity_need_heads(demand, inputs.key_valid)  # [b, h]: averaged at the cut
    if extras and global_budget.ranks_attention(cfg, policy):  # [b, h, n] only: the [b, h, g, w, n] attention is not kept
        parts[global_budget.GLOBAL_ATTENTION] = global_budget.ranked_attention(inputs, probs, method, observed, gains)
    return parts


def output_of(cache, index: int, kv_heads: int | None = None) -> tuple | None:
    """``(gram, group)`` of layer ``index`` under ``global_score="output"`` (``JacapCache.output_gram`` and
    the :class:`HeadGroup` of its ``kv_heads`` local KV heads, default the layer's), else ``None``."""
    gram = cache.output_gram(index)
    if gram is None:
        return None
    return gram, group_of(cache, cache.layers[index].kv_heads() if kv_heads is None else kv_heads)


def prefill_gains(cache, index: int, values: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor | None:
    """At a prefill's cut, layer ``index``'s :func:`jacap_attn.selection.global_budget.output_gains` over the
    prompt's ``values [b, h, n, d]`` under ``global_score="output"`` with the global policy, else ``None``."""
    return _gains(cache.config, None, values, key_valid, output_of(cache, index, values.shape[1]))


def _gains(cfg: JacapConfig, policy: str | None, values: torch.Tensor, key_valid: torch.Tensor,
           output: tuple | None) -> torch.Tensor | None:
    """:func:`jacap_attn.selection.global_budget.output_gains` ``[b, h, g, n]`` of ``values [b, h, n, d]``
    where the cut's ``policy`` (default ``cfg.budget``) ranks the attention and ``output`` (:func:`output_of`)
    is given, else ``None``."""
    if output is None or not global_budget.ranks_attention(cfg, policy):
        return None
    return global_budget.output_gains(values, key_valid, *output)


def window_queries(query: torch.Tensor, kv_heads: int, window: int) -> torch.Tensor:
    """The last ``min(window, n)`` queries of ``query [b, Hq, n, d]``, grouped by KV head:
    ``[b, h, g, w, d]`` (GQA group ``g = Hq / h``)."""
    b, hq, n, d = query.shape
    w = min(window, n)
    return query[:, :, n - w:].reshape(b, kv_heads, hq // kv_heads, w, d)


def held_window_attention(cfg: JacapConfig, layer, query: torch.Tensor, scaling: float) -> tuple[tuple, torch.Tensor]:
    """The window attention of compressed ``layer``'s held entries, as :func:`score_held` scores them:
    ``(held, probs)``, ``held`` what :meth:`~jacap_attn.storage.layer.JacapLayer.held_entries` returns
    (``keys, values [b, h, E, d]``, ``positions, valid [b, h, E]``) and ``probs [b h, 1, g, w, E]``
    float32 (each (row, KV head) folded into the batch; ``w = min(window, q)`` the last new tokens of
    ``query [b, Hq, q, d]``, post-RoPE). With ``q <= window`` these are the probabilities of the
    layer's whole attention over what it holds, so ``probs @ values`` is its output
    (question-time reselection computes it so, :class:`jacap_attn.routes.reselect.ReselectRoute`)."""
    keys, values, positions, valid = held = layer.held_entries()
    b, h, end, d = keys.shape
    probs = scoring.window_attention(_folded_window(query, h, cfg.window), keys.reshape(b * h, 1, end, d), scaling,
                                     valid.reshape(b * h, end))
    return held, probs


def _folded_window(query: torch.Tensor, kv_heads: int, window: int) -> torch.Tensor:
    """:func:`window_queries` with each (row, KV head) folded into the batch, as held entries are
    scored: ``[b h, 1, g, w, d]``."""
    queries = window_queries(query, kv_heads, window)
    b, h, g, w, d = queries.shape
    return queries.reshape(b * h, 1, g, w, d)


def score_held(cfg: JacapConfig, layers, index: int, query: torch.Tensor, scaling: float, budget: torch.Tensor, *,
               policy: str, observed: dict | None = None, window_observed: dict | None = None,
               window: tuple | None = None, output: tuple | None = None) -> dict:
    """Score compressed layer ``index`` of ``layers`` (a cache's) over everything it holds now, its
    earlier entries and the ones the forward under way just wrote, with the last ``window`` new tokens'
    queries as the observation window (``query [b, Hq, q, d]`` post-RoPE; a chunk's, a turn's, a
    question's). Each (row, KV head) is scored as a row of its own over exactly its own held entries
    (:meth:`~jacap_attn.storage.layer.JacapLayer.held_entries`: a left-padded sequence in position order), all
    of them in one call (the heads folded into the batch). ``budget`` ``[b, h]`` int64 the tokens each
    head is expected to keep (what a method that reads its budget picks); ``policy`` the cut's budget
    policy (the extra parts it reads); ``observed``: a repeat pass's statistics over the held entries
    (``{name: [b, h, E]}`` in the order of ``held_entries``,
    :func:`jacap_attn.routes.repeat.held_repeat_statistics`), which stand in for the window's attention;
    ``window_observed``: with a lookahead's ``observed``, the window's own statistics (as
    :func:`score_layer` reads them under ``lookahead_share``); ``window``: the ``(held, probs)`` of
    :func:`held_window_attention` if already computed for this forward (not with ``observed``);
    ``output``: :func:`output_of` (``global_score="output"``'s grams and head group), or ``None``.

    Returns the parts laid out in the index space of the tokens seen (:func:`jacap_attn.math.scoring.spread`):
    ``"scores"`` ``[b, h, T]`` float32 (``-inf`` where the head holds nothing), the method's other
    per-token parts (0 there), ``"need"`` ``[b, h]`` for the ``capacity`` policy (each head's; the cut
    averages them)."""
    layer = layers[index]
    b = query.shape[0]
    held, probs = window if window is not None else (layer.held_entries(), None)
    keys, values, positions, valid = held
    h, end = keys.shape[1], keys.shape[2]
    gains = _gains(cfg, policy, values, valid, output)  # [b, h, g, end], each row's mean over its heads
    folded = score_layer(cfg, index, _folded_window(query, h, cfg.window),
                         keys.reshape(b * h, 1, end, keys.shape[-1]), values.reshape(b * h, 1, end, values.shape[-1]),
                         scaling, valid.reshape(b * h, end), budget.reshape(b * h).cpu(),
                         adaptive=policy != "uniform", policy=policy,
                         observed=None if observed is None else {k: v.reshape(b * h, 1, end) for k, v in observed.items()},
                         window_observed=None if window_observed is None else
                         {k: v.reshape(b * h, 1, end) for k, v in window_observed.items()}, probs=probs,
                         gains=None if gains is None else gains.reshape(b * h, 1, -1, end))
    length = layer.get_seq_length()
    at = torch.where(valid, positions + layer.pads.to(positions.device)[:, None, None], length)  # [b, h, end]
    parts = {}
    for name, x in folded.items():
        if isinstance(x, torch.Tensor) and tuple(x.shape) == (b * h, 1, end):
            fill = scoring.NEG_INF if name in ("scores", share.SUMMED) else 0.0
            parts[name] = scoring.spread(x.reshape(b, h, end), at, length, fill)
        elif name == "need":
            parts[name] = x.reshape(b, h).float()
    return parts
