"""The cut: one selection over candidate entries, the only one (docs/architecture.md#the-cut).

A cut keeps, in every layer it is given, a budget of that layer's *candidate entries*: the whole
prompt of a prefill (pending layers), or what a compressed layer holds plus what the forward just
added (a chunk of a chunked prefill, a new turn under a running budget, a question reselecting a
stored document). The routes (:mod:`jacap_attn.routes`) score the layers and build one
:class:`~jacap_attn.types.LayerPlan` per layer (:func:`prefill_plans`, :func:`held_plans`); :func:`cut`
then runs the named steps, whatever the route:

1. :func:`assign_layer_budgets`: tokens per layer under the budget policy (``ratio * seen``), per
   layer and KV head under ``global`` (:func:`jacap_attn.selection.global_budget.global_budgets`); sliding-window
   layers within their window; rows shorter than ``min_tokens`` keep everything;
2. :func:`assign_head_budgets`: tokens per KV head (the method's hook, e.g. Ada-KV; else equal),
   never more than a head's candidates;
3. the method's ``across_layers`` hook (e.g. Jacap's consensus and sinks), its plans first given the
   labels of units larger than a word when the method reads them
   (:func:`jacap_attn.selection.units.label_units`, e.g. ``Jacap(units="clauses")``);
4. :func:`keep_special_tokens`: in a short row, the model's special tokens are kept too;
5. :func:`close_spans`: under ``spans="words"``, every token ranks as the best of its word;
6. :func:`gather`: top-k per head, the kept entries moved into each layer's static buffers.

Every plan is laid out in the index space of the tokens seen so far (index ``t`` = logical position
``t - pads``), so the steps that compare layers (the global ranking, the consensus) and the ones that
read token ids (special tokens, word spans) see the same token at the same index in every layer and
head, whichever entries each head still holds.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..math import budget as budgets, scoring, share
from . import global_budget, heads, mass, scorer, spans, units
from ..storage.cache import PENDING, JacapCache
from ..storage import split
from ..config import JacapConfig
from ..storage.identity import special_token_ids  # noqa: F401 - re-exported
from ..types import LayerPlan

KINDS = ("prefill", "chunk", "question")


@dataclass(frozen=True)
class Cut:
    """What one cut keeps (docs/architecture.md#the-cut).

    kind: ``"prefill"`` (a whole prompt, pending layers), ``"chunk"`` (after a chunk of a chunked
        prefill, or a new turn under a running budget) or ``"question"`` (question-time reselection).
    seen: ``[b]`` int64, the real tokens the kept fraction is taken of (all seen so far; at question
        time those before the question).
    ratio: the kept fraction of ``seen``.
    floor: each compressed head keeps at least ``min(floor, seen)`` of the fraction (the observation
        window; 1 at question time).
    extra: tokens kept on top of the fraction (at question time: the new tokens, all kept).
    window: the newest indices every compressed layer and head keeps by force.
    room: free slots each layer keeps after the cut.
    key_valid: ``[b, T]`` bool over the index space: the real tokens some layer and head can keep.
    policy: the budget policy (``uniform``, ``pyramid``, ``capacity``, ``global``): the config's
        ``budget``, at question time its ``reselect_budget``.
    bucketed: each layer's capacity rounded up to its bucket (:func:`jacap_attn.math.budget.bucket`, shapes a
        compiled decode reuses); ``False`` between the chunks of a chunked prefill: exactly the largest
        kept count plus ``room``.
    """

    kind: str
    seen: torch.Tensor
    ratio: float
    floor: int
    extra: int
    window: int
    room: int
    key_valid: torch.Tensor
    policy: str
    bucketed: bool = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Cut kind must be one of {KINDS}, got {self.kind!r}")


def prefill_plans(cache: JacapCache) -> list[LayerPlan]:
    """A plan per pending layer of a prefill. Layers the method does not select rank by recency (a sliding-window
    layer kept unscored keeps its window; without compression every token)."""
    key_valid = cache.prefill.key_valid
    n = key_valid.shape[-1]
    plans = []
    for index, layer in enumerate(cache.layers):
        if layer.state != PENDING:
            continue
        keys = layer.pending_entries()[0]
        device, h = keys.device, keys.shape[1]
        parts = dict(cache.prefill.parts.get(index, {}))
        scores = parts.pop("scores", None)
        scored = scores is not None and scorer.compresses_prompt(cache.config, n) \
            and scorer.scores_layer(cache.config, cache.layers, index)
        if not scored:
            scores = torch.arange(n, device=device, dtype=torch.float32).expand(key_valid.shape[0], h, n)
        window = 0 if layer.is_sliding and not scored else cache.config.window
        valid = scorer.reach(layer, key_valid.to(device)) if scored else key_valid.to(device)
        plans.append(LayerPlan(index, layer, scores, valid, window, parts, compressed=scored))
    return plans


def held_plans(cache: JacapCache, parts: dict, indices, window: int) -> tuple[list[LayerPlan], torch.Tensor]:
    """The plans of the compressed layers ``indices`` over what each holds now (its earlier entries and the ones
    the forward added), and the cut's ``key_valid [b, T]`` (the indices some layer and KV head of them holds).
    ``parts[index]``: the method's parts of a layer it scored, in the index space (:func:`.scorer.score_held`);
    a layer without parts keeps by recency (a sliding window, no compression: every index it can attend)."""
    indices = list(indices)
    length = cache.layers[indices[0]].get_seq_length()
    maps = {index: cache.layers[index].slot_map(length) for index in indices}
    device = maps[indices[0]][1].device
    key_valid = torch.stack([held.any(dim=1).to(device) for _, held in maps.values()]).any(dim=0)
    key_valid = heads.group_of(cache, maps[indices[0]][1].shape[1]).any(key_valid)  # held by any rank's heads
    plans = []
    for index, (slots, held) in maps.items():
        layer = cache.layers[index]
        b, h = held.shape[:2]
        layer_parts = parts.get(index)
        if layer_parts is None:
            scores = torch.arange(length, device=held.device, dtype=torch.float32).expand(b, h, length)
            plans.append(LayerPlan(index, layer, scores, key_valid.to(held.device), 0 if layer.is_sliding else window,
                                   compressed=False, held=held, slots=slots))
            continue
        layer_parts = dict(layer_parts)
        scores = layer_parts.pop("scores")
        valid = scorer.reach(layer, key_valid.to(held.device))
        plans.append(LayerPlan(index, layer, scores, valid, window, layer_parts, compressed=True, held=held,
                               slots=slots))
    return plans, key_valid


def assign_layer_budgets(plans: list[LayerPlan], cfg: JacapConfig, cut: Cut) -> None:
    """Step 1: ``head_budgets [b, h]`` (and ``budget [b]``) of every plan (docs/method.md#budgets).

    The policy's per-layer budgets of ``cut.ratio * cut.seen`` (plus ``cut.extra``) go to the
    compressed full-attention layers, or, on a model whose layers all slide (and at question time),
    to every compressed layer (each clipped to ``min(n, sliding_window - 1)`` by its candidates); a
    compressed sliding layer of a mixed model keeps ``ceil(ratio * min(n, sliding_window - 1))`` (at
    least the window); a layer the method does not select keeps what it can attend: every token,
    ``min(n, sliding_window - 1)`` for a sliding window. A row with fewer than ``cfg.min_tokens``
    real tokens seen keeps, in every layer, what it can attend. No head keeps more than its candidates
    (:meth:`LayerPlan.candidates`); under ``pyramid``/``capacity`` a layer's share beyond them goes to the others."""
    compressed = [p for p in plans if p.compressed]
    all_sliding = bool(plans) and all(p.layer.is_sliding for p in plans)
    policy = compressed if all_sliding or cut.kind == "question" else [p for p in compressed if not p.layer.is_sliding]
    count, seen = len(policy), cut.seen
    per_head = {}  # the `global` policy's [b, h] budgets, by plan
    if not count:
        per_layer = seen[:, None].expand(-1, 0)
    elif cut.policy in ("uniform", "global"):
        per_layer = budgets.uniform_budgets(seen, cut.ratio, cut.floor, count)
    else:  # each layer capped at what its every head can keep, the surplus to the others (none lost)
        cap = torch.stack([p.candidates().sum(-1).amin(-1).cpu() for p in policy], dim=-1) - cut.extra
        cap = torch.maximum(torch.minimum(cap, seen[:, None]), seen.clamp(max=cut.floor)[:, None])
        if cut.policy == "pyramid":
            per_layer = budgets.pyramid_budgets(seen, cut.ratio, cut.floor, count, cfg.pyramid_beta, cap)
        else:
            need = torch.stack([p.parts["need"].to(seen.device).mean(-1) for p in policy], dim=-1)  # [b, h] -> [b]
            per_layer = budgets.capacity_budgets(need, seen, cut.ratio, cut.floor, cfg.capacity_alpha, cap)
    per_layer = per_layer + cut.extra
    column = {id(plan): i for i, plan in enumerate(policy)}
    if count and cut.policy == "global":
        uniform = torch.stack([torch.minimum(per_layer[:, i], p.key_valid.sum(-1).cpu()) for i, p in enumerate(policy)],
                              dim=-1)
        per_head = dict(zip(map(id, policy), global_budget.global_budgets(policy, cfg, uniform)))
    short = seen < cfg.min_tokens
    for plan in plans:
        h = plan.scores.shape[1]
        can = plan.candidates().sum(-1).cpu()  # [b, h]
        if not plan.compressed:
            can = torch.minimum(can, _attendable(plan.layer, seen)[:, None])
        if id(plan) in per_head:
            keep, plan.global_heads = per_head[id(plan)].cpu(), True
            plan.budget = per_layer[:, column[id(plan)]]
        elif id(plan) in column:  # a sliding layer's within its reach (a method's head budgets then fit)
            budget = per_layer[:, column[id(plan)]]
            plan.budget = torch.minimum(budget, plan.key_valid.sum(-1).cpu()) if plan.layer.is_sliding else budget
            keep = plan.budget[:, None].expand(-1, h)
        elif plan.compressed:
            plan.budget = scorer.sliding_budget(cfg, seen, plan.key_valid.sum(-1).cpu(), all_sliding)
            keep = plan.budget[:, None].expand(-1, h)
        else:
            keep = can
        keep = torch.minimum(torch.where(short[:, None], can, keep), can)
        plan.head_budgets = keep.to(plan.scores.device)


def _attendable(layer, n_valid: torch.Tensor) -> torch.Tensor:
    """``[b]`` real tokens ``layer`` can attend again: ``n``, or ``min(n, sliding_window - 1)``."""
    return torch.clamp(n_valid, max=layer.sliding_window - 1) if layer.is_sliding else n_valid


def assign_head_budgets(plans: list[LayerPlan], cfg: JacapConfig, window: int | None = None,
                        short: torch.Tensor | None = None) -> None:
    """Step 2: the method's per-head budgets (same total per layer), where it defines them (e.g. Ada-KV's,
    at question time too), then no head above its candidates. ``window``: the newest indices every head
    keeps (default ``cfg.window``; at question time the new tokens). Rows ``short [b]`` (under ``min_tokens``)
    and rows whose budget reaches every index (at a question, above what the prefill kept) keep step 1's
    budgets, all they can attend. Under ``global`` the heads' budgets are the policy's, no hook called."""
    window = cfg.window if window is None else window
    for plan in plans:
        if plan.compressed and not plan.global_heads and plan.budget is not None:
            n_valid, budget = plan.key_valid.sum(-1).to(plan.scores.device), plan.budget.to(plan.scores.device)
            whole, total = budget >= n_valid, torch.minimum(budget, n_valid)
            split = cfg.method.head_budgets(plan.scores, total, plan.key_valid, window)
            if split is not None:
                checked = torch.minimum(_checked_head_budgets(cfg, plan, split, total, window),
                                        plan.candidates().sum(-1).to(plan.scores.device))
                keep = whole if short is None else whole | short.to(whole.device)  # rows that keep step 1's budgets
                plan.head_budgets = torch.where(keep[:, None], plan.head_budgets.to(checked.device), checked)


def keep_special_tokens(cache: JacapCache, plans: list[LayerPlan], cut: Cut, ids: torch.Tensor | None) -> None:
    """Step 4 (``keep_special``, docs/method.md#short-prompts): in every row whose budget is no more
    than the observation window (``ceil(ratio * seen) <= window``: the window alone would be kept),
    the indices holding one of the cache's special ids (:func:`jacap_attn.storage.identity.special_token_ids`) are
    kept too, in every compressed layer and head that holds them, on top of the budget. Not at question
    time, and not without the index space's token ids (``ids`` ``[b, T]`` from :func:`_ids_over`; ``None``
    from ``inputs_embeds``)."""
    cfg: JacapConfig = cache.config
    compressed = [p for p in plans if p.compressed]
    if not cfg.keep_special or not compressed or cut.kind == "question" or ids is None:
        return
    key_valid = cut.key_valid
    short = torch.ceil(cut.seen.double() * cut.ratio).to(torch.int64) <= cut.window  # [b]
    special_ids = getattr(cache, "special_ids", None) or []
    if not special_ids or not bool(short.any()):
        return
    prompt = ids.to(key_valid.device)
    special = torch.isin(prompt, torch.tensor(special_ids, device=prompt.device)) & key_valid \
        & short[:, None].to(key_valid.device)
    if not bool(special.any()):
        return
    for plan in compressed:
        n = plan.key_valid.shape[-1]
        candidates = plan.candidates()
        keep = special.to(candidates.device)[:, None, :] & candidates  # [b, h, n]
        outside = keep & (torch.arange(n, device=keep.device) < n - min(plan.window, n))
        extra = outside.sum(-1).to(plan.head_budgets.device)
        cap = candidates.sum(-1).to(plan.head_budgets.device)
        plan.scores = plan.scores.masked_fill(keep.to(plan.scores.device), float("inf"))
        plan.head_budgets = torch.minimum(plan.head_budgets + extra, cap)


def _ids_over(cache: JacapCache, cut: Cut) -> torch.Tensor | None:
    """``[b, T]`` token ids of the cut's index space (the prompt's ids, grown by each chunk; at question
    time followed by the question's, ``cache.forward_ids``), or ``None`` when they are not all known
    (``inputs_embeds``, a file saved without its ids, tokens appended after the prompt)."""
    ids = cache.prompt_ids
    new = getattr(cache, "forward_ids", None)
    if ids is not None and cut.kind == "question" and new is not None:
        ids = torch.cat([ids, new.to(ids.device)], dim=1)
    return None if ids is None or tuple(ids.shape) != tuple(cut.key_valid.shape) else ids


def _checked_head_budgets(cfg: JacapConfig, plan: LayerPlan, split, total: torch.Tensor, window: int) -> torch.Tensor:
    """A method's per-head budgets, checked: integer ``[b, h]``, each head between the window and the
    row's real tokens, the heads summing to ``h * budget`` (else a ``ValueError`` naming the method)."""
    b, h, _ = plan.scores.shape
    n_valid = plan.key_valid.sum(-1).to(plan.scores.device)
    ok = isinstance(split, torch.Tensor) and tuple(split.shape) == (b, h) and not split.is_floating_point()
    if ok:
        split = split.to(plan.scores.device, torch.int64)
        low = n_valid.clamp(max=window)[:, None]
        ok = bool(((split >= low) & (split <= n_valid[:, None])).all()) and torch.equal(
            split.sum(-1), total.to(split.device) * h)
    if not ok:
        raise ValueError(f"method {cfg.method.name!r}: head_budgets must be int64 [b, h] = {[b, h]}, each in "
                         f"[window, real tokens], summing to h * budget per row; got {split!r}")
    return split


def span_labels(cache: JacapCache, length: int, evicts: bool = True) -> torch.Tensor | None:
    """``[b, length]`` int64 word-span labels of the index space (:func:`jacap_attn.selection.spans.span_ids` of the
    cache's prompt ids; every index past them, a question's or a turn's token, a label of its own), or
    ``None`` when spans are off: ``spans="none"``, no vocabulary tables on the cache, or no prompt ids
    (``inputs_embeds``, a file saved without them; then a cut that ``evicts`` warns)."""
    tables = getattr(cache, "span_tables", None)
    ids = cache.prompt_ids
    if cache.config.spans == "words" and tables is not None and ids is None and evicts:
        warnings.warn("spans='words' needs the prompt's token ids; this cut has none (a prefill from "
                      "inputs_embeds, or a file saved without its ids): its words are cut token by token. "
                      "Prefill with input_ids for word spans.", UserWarning, stacklevel=2)
    if cache.config.spans != "words" or tables is None or ids is None or ids.shape[1] > length:
        return None
    labels = spans.span_ids(ids, tables[0], tables[1])
    extra = length - ids.shape[1]
    if extra:
        own = labels[:, -1:] + 1 + torch.arange(extra, device=labels.device)
        labels = torch.cat([labels, own], dim=1)
    return labels


def close_spans(cache: JacapCache, plans: list[LayerPlan], cut: Cut) -> None:
    """Step 5 (``spans="words"``, docs/method.md#d8-answers-kept-whole): in every compressed layer and
    KV head, each token's score becomes the largest of its word's among the entries the head can keep
    (:func:`jacap_attn.selection.spans.pool_spans`), so a word that is kept is kept whole (a word cut only where
    the budget ends). Forced tokens (consensus, sinks, special ids) lend their rank to their word; the
    budgets stay as they are."""
    # Only a cut without prompt ids warns, and only if it evicts: no work (nor host sync) on any other cut.
    evicts = cache.prompt_ids is None and any(
        plan.compressed and bool((plan.head_budgets.cpu() < plan.candidates().sum(-1).cpu()).any()) for plan in plans)
    labels = span_labels(cache, cut.key_valid.shape[-1], evicts)
    if labels is None or tuple(labels.shape) != tuple(cut.key_valid.shape):
        return
    for plan in plans:
        if plan.compressed:
            candidates = plan.candidates().to(plan.scores.device)
            scores = plan.scores.float().masked_fill(~candidates, scoring.NEG_INF)  # padding lends no score
            plan.scores = spans.pool_spans(scores, labels, cache.config.max_span)


def gather(cache: JacapCache, plans: list[LayerPlan], cut: Cut) -> None:
    """Step 6: top-k per (row, KV head) of its candidates, the window always kept; each layer keeps those entries
    (:meth:`JacapLayer.keep_slots`) in storage of its own capacity, the largest kept count of the layer plus
    ``cut.room`` (docs/cache.md#capacity-buckets-and-growth; at question time never more than it had): a layer whose
    heads keep few tokens does not pad to the layer that keeps most (``global`` budgets differ by layer)."""
    length = cut.key_valid.shape[-1]
    between = not cut.bucketed and not cache.heads.distributed  # between chunks: the split layout
    carrying = mass.carries(cache.config, cut.kind, cut.bucketed)  # chunk_mass (docs/method.md#carried-mass)
    for plan in plans:
        layer = plan.layer  # left padding: a pending layer's from the prompt's validity, a compressed layer's its own
        pads = length - cut.key_valid.sum(-1).cpu() if layer.state == PENDING else layer.pads.cpu()
        candidates = plan.candidates()
        if layer.state != PENDING and bool((plan.head_budgets >= candidates.sum(-1)).all()) \
                and (plan.held is None or not bool((plan.held & ~candidates).any())) \
                and type(layer) is split.layout_for(layer, candidates, between):
            # a compressed layer keeping every candidate and holding nothing else (a sliding layer's entries out of
            # reach go) stays as it is, no copy, with the cut's free room (a compiled layer cannot grow while it writes)
            if cut.kind != "question":
                layer.ensure_room(cut.room)
            if not carrying:  # it evicts nothing, so keeps what it carries only between chunks
                layer.carry_mass(None)
            continue
        indices, kept = scoring.select_indices(plan.scores, plan.head_budgets, candidates, plan.window)
        slots = indices if plan.slots is None else plan.slots.to(indices.device).gather(2, indices)
        capacity = int(kept.sum(-1).max()) + cut.room
        capacity = budgets.bucket(capacity) if cut.bucketed else capacity
        positions = indices - pads.to(indices.device)[:, None, None]
        table = mass.carried(plan, indices, kept, slots, cache.config.mass_cosine) \
            if carrying and plan.compressed and not layer.is_sliding else None
        layout = split.layout_for(layer, kept, between)
        if type(layer) is layout:
            layer.keep_slots(slots, kept, positions, capacity, length, pads, grow=cut.kind != "question")
        else:  # into the split layout between chunks, back to the cache's own at the last cut
            cache.layers[plan.index] = plan.layer = split.holding(layout, layer, slots, kept, positions, capacity,
                                                                  length, pads)
        plan.layer.carry_mass(table)  # none after the last cut: the decode reads the entries unbiased


def cut(cache: JacapCache, plans: list[LayerPlan], request: Cut) -> None:
    """Cut every layer of ``plans`` by ``request``: the named steps of this module, in order. On a tensor-parallel
    model steps 1-5 run on every rank over the plans of every KV head (:func:`.heads.full_plans`), so all ranks make
    the decision one process holding every head would make; step 6 keeps each rank's own heads (:func:`.heads.keep_local`)."""
    cfg = cache.config
    local = plans
    group = heads.group_of(cache, plans[0].scores.shape[1]) if plans else None
    plans = heads.full_plans(group, plans) if plans else plans
    assign_layer_budgets(plans, cfg, request)
    assign_head_budgets(plans, cfg, request.window, request.seen < cfg.min_tokens)
    compressed = [p for p in plans if p.compressed]
    ids = _ids_over(cache, request)  # the index space's token ids, read by steps 3b and 4
    if compressed:
        units.label_units(cache, compressed, request)  # a method's units larger than a word (issue 34)
        units.label_lookup(cache, compressed, request, ids)  # prompt lookup (issue 34)
        cfg.method.across_layers(compressed, request.key_valid, request.window)
        sinks = cfg.method.forced_sinks
        if sinks and request.kind != "prefill":  # over held entries the row's first tokens are the sinks
            for p in compressed:
                p.scores = scoring.keep_sinks(p.scores, request.key_valid.to(p.scores.device), sinks)
        for p in compressed:  # lookahead_share: the window's own share first, then the lookahead's ranking
            if share.SUMMED in p.parts:
                p.scores = share.share_ranking(p.scores, p.parts[share.SUMMED], p.head_budgets,
                                               request.key_valid, request.window, cfg.lookahead_share)
    keep_special_tokens(cache, plans, request, ids)
    close_spans(cache, plans, request)
    if local:
        heads.keep_local(group, local, plans)
    gather(cache, local, request)


def finalize_prefill(cache: JacapCache, *, room: int | None = None, bucketed: bool = True,
                     ratio: float | None = None) -> None:
    """Cut every pending layer of ``cache`` after the prefill's last layer (:func:`cut` over :func:`prefill_plans`):
    ``ratio`` (default ``cache.config.ratio``) of the prompt's real tokens, the window kept, ``room`` free slots
    after it (default: :meth:`JacapCache.room`), ``bucketed`` as :class:`Cut`'s."""
    if cache.prefill is None or not any(layer.state == PENDING for layer in cache.layers):
        return
    cfg = cache.config
    key_valid = cache.prefill.key_valid
    ratio = cfg.ratio if ratio is None else ratio
    request = Cut("prefill", key_valid.sum(-1).cpu(), ratio, cfg.window, 0, cfg.window,
                  cache.room(key_valid.shape[-1]) if room is None else room, key_valid, cfg.budget, bucketed)
    cut(cache, prefill_plans(cache), request)
    cache.prompt_kept = [layer.kept_counts().cpu() for layer in cache.layers]
    cache.prefill = None
