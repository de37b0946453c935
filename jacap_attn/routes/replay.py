"""The harness's replay: one exact prefill recorded, many selections (docs/architecture.md#evaluation-harness).

:func:`compress_recorded` feeds recorded per-layer prefill inputs (what a cache's ``on_prefill``
callback receives) to the prefill route a config names, as the attention function would, then lets
the route finish: the same scoring (:func:`jacap_attn.selection.scorer.score_layer`) and the same cut
(:func:`jacap_attn.selection.finalize_prefill`) as a patched prefill, without running the model
(except the repeat pass of ``queries="repeat"``, through the patched model's decoder stack).
"""

from __future__ import annotations

import torch

from .. import selection
from ..storage.cache import JacapCache
from ..config import JacapConfig
from . import prefill_route
from .repeat import RepeatRoute


def compress_recorded(model, records: list, config: JacapConfig, prompt_ids: torch.Tensor, *,
                      parts: dict | None = None, observed: dict | None = None) -> JacapCache:
    """The compressed cache a patched prefill of ``prompt_ids [b, n]`` (no padding) would make under
    ``config``, from recorded inputs: ``records[i] = (query, keys, values, scaling)`` of layer ``i``,
    as passed to a cache's ``on_prefill`` callback. Lets an evaluation run one exact prefill per
    prompt and replay the selection for many configurations. ``model`` must be patched.

    ``parts``: scores shared between calls with the same ``records`` and configs that differ only
    in ``ratio``. An empty dict is filled with this call's per-layer scores (before selection);
    a filled one is used (copied) instead of scoring again. Valid only when the method's scores do
    not depend on the ratio (``not config.method.reads_budget``, else ``ValueError``).

    ``observed`` (``queries="repeat"`` only): the repeat pass's statistics shared between calls with
    the same ``records``: an empty dict is filled by this call's pass, a filled one spares it.
    ``None``: this call runs its own pass."""
    if config.chunk_size is not None and prompt_ids.shape[1] > config.chunk_size:
        if parts is not None or observed is not None:
            raise ValueError("a chunked replay scores every chunk's cut afresh: parts= and observed= do not apply")
        return replay_chunks(model, records, config, prompt_ids)
    if parts is not None and config.method.reads_budget:
        raise ValueError(f"method {config.method.name!r} reads the budget: its scores cannot be reused across ratios")
    if observed is not None and config.queries != "repeat":
        raise ValueError(f"observed= holds repeat-pass statistics; this config has queries={config.queries!r}")
    cache = JacapCache(model, config=config)
    b, n = prompt_ids.shape
    cache.begin_prefill(None, n, b, prompt_ids.device)
    for layer, (_, keys, values, _) in zip(cache.layers, records):
        layer.update(keys, values)
    cache.prompt_ids = prompt_ids.detach().clone()  # as the patched model's pre-hook sets it
    cache.last_input = {"input_ids": prompt_ids[:, -1:]}
    route = RepeatRoute(shared={} if observed is None else observed) if config.queries == "repeat" \
        else prefill_route(config)()
    if parts:
        cache.prefill.parts = _copied(parts)  # the selection steps may change the scores in place
    else:
        cache.route = route
        for index, (query, keys, values, scaling) in enumerate(records):
            route.layer(cache, index, query, keys, values, scaling)
        route.complete(cache, model._jacap_state.forward_over(cache))
        cache.route = None
        if parts is not None:
            parts.update(_copied(cache.prefill.parts))
    selection.finalize_prefill(cache)
    return cache


def replay_chunks(model, records: list, config: JacapConfig, prompt_ids: torch.Tensor) -> JacapCache:
    """The chunk route (:mod:`jacap_attn.routes.chunk`) over recorded inputs: after each chunk of
    ``config.chunk_size`` prompt positions, the same cut as a chunked prefill's, scored by the chunk's
    observation window, but from the *exact* prefill's queries and keys: every chunk's entries were
    computed over the whole uncompressed prefix. That is how kvpress's ``BlockPress`` scores its blocks
    (kvpress #186), not a chunked prefill (whose later chunks attend only what earlier cuts kept): the
    evaluation harness runs it beside the real one, so that what an honest chunked prefill costs in
    accuracy is visible. ``records`` and ``prompt_ids [b, n]`` (no padding) as for
    :func:`compress_recorded`."""
    from .chunk import ChunkRoute, know_prompt

    cache = JacapCache(model, config=config)
    b, n = prompt_ids.shape
    chunk = config.chunk_size
    cache.prefill_until, cache.prefill_chunk = n, chunk
    know_prompt(cache, prompt_ids)
    forward = model._jacap_state.forward_over(cache)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        if start == 0:
            cache.begin_prefill(None, end, b, prompt_ids.device)
        cache.prompt_ids, cache.prompt_length = prompt_ids[:, :end].detach().clone(), end
        cache.last_input = {"input_ids": prompt_ids[:, end - 1:end]}
        route = cache.route = ChunkRoute()
        for index, (query, keys, values, scaling) in enumerate(records):
            layer = cache.layers[index]
            held_keys, held_values = layer.update(keys[:, :, start:end], values[:, :, start:end])
            route.layer(cache, index, query[:, :, start:end], held_keys, held_values, scaling)
        route.finish(cache, forward)
    return cache


def _copied(parts: dict) -> dict:
    return {index: {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in layer.items()}
            for index, layer in parts.items()}
