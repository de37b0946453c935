"""`JacapCache`: the transformers cache contract over :class:`~jacap_attn.storage.layer.JacapLayer` storage,
plus the prefill's scratch state and the checks that a cache is reused with its own model and
prompt (docs/cache.md)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from . import ragged
from . import xformers_backend  # noqa: F401 - ragged registers the "ragged" layout
from ..math.budget import bucket, stock_entries
from .distributed import SINGLE, HeadGroup
from .masks import check_mask_shape, check_rows, refuse_holes, refuse_right_padding
from .identity import model_shape as _model_shape
from .identity import special_token_ids, weights_fingerprint
from .layer import COMPRESSED, EMPTY, LAYOUTS, PENDING, JacapLayer

__all__ = ["COMPRESSED", "EMPTY", "PENDING", "JacapCache", "JacapLayer", "PrefillState", "weights_fingerprint"]


@dataclass
class PrefillState:
    """Scratch state of one prefill, dropped once the cache is compressed.

    key_valid: ``[b, n]`` bool, False at left padding.
    parts: per layer index, what the method's ``score_parts`` returned (``"scores"`` ``[b, h, n]``
        float32 and any extra tensors its hooks read) plus what the budget policy reads
        (:func:`jacap_attn.selection.scorer.score_layer`). A route's own scratch (the repeat pass's deferred
        layers and statistics) lives on the route object (:mod:`jacap_attn.routes`).
    """

    key_valid: torch.Tensor
    parts: dict = field(default_factory=dict)


class _ModelRef:
    """A weak reference to the patched model a cache runs with (:meth:`JacapCache.bind`). Deep copies
    share it; pickling drops it (a model is not part of a cache's data, and ``weakref.ref`` cannot be
    pickled): an unpickled cache is bound again by the next forward's pre-hook."""

    __slots__ = ("_ref",)

    def __init__(self, model=None):
        self._ref = None if model is None else weakref.ref(model)

    def __call__(self):
        return None if self._ref is None else self._ref()

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (_ModelRef, ())


class JacapCache(Cache):
    """KV cache of a model patched by :func:`jacap_attn.patch`; pass it as ``cache=`` or let
    ``generate`` create it.

    Parameters
    ----------
    model:
        A patched model (its Jacap settings and layer kinds are used).
    max_length:
        Expected total length (prompt + new tokens), used to size the free room after the prompt;
        ``generate`` sets it. ``None``: ``config.reserve`` free slots (the cache grows when full).
    layout:
        How compressed layers store their entries, a key of :data:`jacap_attn.storage.layer.LAYOUTS`:
        ``"padded"`` (:class:`~jacap_attn.storage.layer.JacapLayer`) or ``"ragged"``
        (:class:`~jacap_attn.storage.ragged.RaggedLayer`). ``None`` (default): ``"ragged"`` when the config's
        ``backend`` resolves to xformers on the model's device, else ``"padded"``.

    Attributes: ``backend``, the attention backend the layers run (``"sdpa"`` or ``"xformers"``:
    :func:`jacap_attn.storage.xformers_backend.resolve` of ``config.backend`` on the model's device).

    Raises
    ------
    ValueError
        If ``model`` was not patched, ``layout`` is not a key of :data:`jacap_attn.storage.layer.LAYOUTS`,
        ``backend="xformers"`` cannot run on the model's device (the reason named), or the layout
        cannot run the backend (``"padded"`` with xformers).
    """

    def __init__(self, model, *, max_length: int | None = None, config=None, on_prefill=None,
                 layout: str | None = None):
        state = getattr(model, "_jacap_state", None)
        if state is None:
            raise ValueError("JacapCache needs a model patched by jacap_attn.patch(model, ...)")
        if layout is not None and layout not in LAYOUTS:
            raise ValueError(f"unknown layout={layout!r}; layouts: {', '.join(LAYOUTS)}")
        self.config = config if config is not None else state.config
        device = next(model.parameters()).device
        self.backend = xformers_backend.resolve(getattr(self.config, "backend", "sdpa"), device)
        layout = layout or ("ragged" if self.backend == "xformers" else "padded")
        self.max_length = max_length
        self.on_prefill = on_prefill
        self._forget_prompt()
        # What the cut reads of the model, given once instead of reached for (docs/architecture.md#the-cut):
        # the special token ids (keep_special), the vocabulary tables of word spans (spans="words") and
        # the repeat instruction of the tokenizer given to patch (a repeat pass without repeat_ids).
        self.special_ids = special_token_ids(model)
        self.span_tables = getattr(state, "spans", None)
        self.repeat_instruction = getattr(state, "repeat_ids", None)  # the patch tokenizer's (routes.repeat)
        self.model_shape = _model_shape(model)
        # global_score="output": per layer, each query head's W_O^T W_O ([h, g, d, d]; global_budget.output_grams)
        self.output_grams = state.grams() if self.config.global_score == "output" and "global" in (
            self.config.budget, self.config.reselect_budget) else None
        self.weights_sha256 = weights_fingerprint(model)  # the model (weights) this cache is for
        self.bind(model)
        self.layout = layout
        super().__init__(layers=[LAYOUTS[layout](window, self.backend) for window in state.sliding_windows])

    def reset(self) -> None:
        """Empty every layer (transformers' ``Cache.reset``) and forget the prompt and any prefill under
        way, so that the next forward prefills a new prompt (an interrupted chunked prefill included)."""
        super().reset()
        self._forget_prompt()

    def _forget_prompt(self) -> None:
        """The state of one prompt and its prefill, as a new cache has it (nothing)."""
        self.prefill: PrefillState | None = None  # scratch state while the prefill runs
        self.route = None  # the route (jacap_attn.routes) of the forward under way, else None
        self.prompt_ids = None  # [b, n] ids of the compressed prompt, checked by `generate`
        self.forward_ids = None  # [b, q] input ids of the forward under way (a question's, read by prompt lookup)
        self.last_input = None  # {"input_ids": [b, 1]} or {"inputs_embeds": [b, 1, d]}: a lookahead replays it
        self.prompt_kept = None  # per layer, [b, h] prompt entries kept at the prefill
        self.prompt_length = None  # n, tokens of the compressed prompt (padding included)
        self.prompt_sha256 = None  # SHA-256 of the prompt ids (a cache loaded from a file without them)
        # A chunked prefill under way (jacap_attn.routes.chunk): the tokens (padding included) at which it ends, the
        # chunk size (room kept between chunks), under chunk_scores="carry" the last cut's scores, a split forward's
        # earlier chunks' hidden states, (ids [b, n], valid [b, n]) of the whole prompt for lookup_ahead; else None.
        self.prefill_until = self.prefill_chunk = None  # int | None each
        self.chunk_scores = self.leading_hidden = self.prompt_ahead = None

    def output_gram(self, index: int) -> torch.Tensor | None:
        """Layer ``index``'s ``[h, g, d, d]`` output grams under ``global_score="output"``, else ``None``."""
        grams = getattr(self, "output_grams", None)
        return None if grams is None or self.config.global_score != "output" else grams[index]

    @classmethod
    def from_kept(cls, model, layers: list, *, logical: int, pads: torch.Tensor, config=None,
                  prompt_ids: torch.Tensor | None = None, max_length: int | None = None) -> "JacapCache":
        """A compressed cache holding given kept entries (a loaded file, a replayed selection).

        ``layers``: one ``(keys, values, positions, valid)`` per decoder layer, ``keys/values``
        ``[b, h, K_i, d]`` (any device, the model dtype), ``positions`` ``[b, h, K_i]`` int64 logical
        (RoPE) positions, ``valid`` ``[b, h, K_i]`` bool; ``logical`` the prompt length (padding
        included); ``pads`` ``[b]`` int64 left padding; ``prompt_ids`` ``[b, logical]`` (optional,
        checked by ``generate``). Free room after the prompt as for a prefill (``config.reserve``, or
        up to ``max_length``). Raises ``ValueError`` if the layer count or shapes disagree.
        """
        cache = cls(model, config=config, max_length=max_length)
        if len(layers) != len(cache.layers):
            raise ValueError(f"from_kept got {len(layers)} layers, the model has {len(cache.layers)}")
        room = cache.room(logical)
        for layer, (keys, values, positions, valid) in zip(cache.layers, layers):
            if not keys.shape[:3] == values.shape[:3] == positions.shape == valid.shape:
                raise ValueError(f"from_kept: keys {tuple(keys.shape)}, values {tuple(values.shape)}, positions "
                                 f"{tuple(positions.shape)} and valid {tuple(valid.shape)} disagree")
            layer.lazy_initialization(keys, values)
            capacity = bucket(keys.shape[2] + room)  # per layer, as a prefill sizes it
            layer.compress(keys, values, positions.to(keys.device), valid.to(keys.device), capacity, logical, pads)
        cache.prompt_ids = None if prompt_ids is None else prompt_ids.detach().clone()
        cache.prompt_kept = [layer.kept_counts().cpu() for layer in cache.layers]
        cache.prompt_length = logical
        return cache

    def room(self, logical: int) -> int:
        """Free slots a layer keeps after ``logical`` tokens: up to ``max_length`` when it is known (at
        least 1), else ``config.reserve`` (the layer grows when full)."""
        return self.config.reserve if self.max_length is None else max(int(self.max_length) - int(logical), 1)

    def bind(self, model) -> None:
        """Remember (weakly) the patched model that runs this cache's next forward; not pickled
        (``torch.save`` / ``pickle`` of a cache keep its tensors and settings, and the next forward
        binds it again)."""
        self._model = _ModelRef(model)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Like :meth:`transformers.Cache.update`; raises ``RuntimeError`` if the model running the
        forward is no longer patched (after ``unpatch`` its stock attention would read the static
        buffers without the validity mask and silently give wrong outputs). Eager check only."""
        if not torch.compiler.is_compiling():
            model = self._model()
            # `armed`: the call comes through a patched attention forward (not from another model's
            # stock attention, which would read the static buffers without the validity mask).
            layer = self.layers[layer_idx]
            armed, layer.armed = getattr(layer, "armed", False), False
            if model is None or getattr(model, "_jacap_state", None) is None or not armed:
                raise RuntimeError("JacapCache used by a model that is not patched (was jacap_attn.unpatch "
                                   "called, or is it another model than the one the cache was built for?): "
                                   "patch the model again, or use a transformers cache")
        if self.route is not None:  # a route running forwards of its own may attend without storing
            attended = self.route.update(self.layers[layer_idx], key_states, value_states)
            if attended is not None:
                return attended
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def heads(self) -> HeadGroup:
        """The ranks sharing the KV heads of the model this cache runs with (its tensor-parallel group,
        :mod:`jacap_attn.storage.distributed`), :data:`~jacap_attn.storage.distributed.SINGLE` for a model in
        one process or no model bound (an unpickled cache before its next forward)."""
        state = getattr(self._model(), "_jacap_state", None)
        return getattr(state, "heads", None) or SINGLE

    @property
    def chunk_in_force(self) -> int | None:
        """The chunk size in force: a chunked prefill's (generate's ``prefill_chunk_size``), else ``config.chunk_size``."""
        return self.config.chunk_size if self.prefill_chunk is None else self.prefill_chunk

    @property
    def batch_size(self) -> int:
        """Rows the cache holds (0 while empty)."""
        return self.layers[0].batch_size()

    @property
    def pads(self) -> torch.Tensor:
        """``[b]`` int64 left padding of each row of a compressed cache (logical position = index - pads)."""
        return self.layers[0].pads

    @property
    def state(self) -> str:
        """``empty``, ``pending`` (prefill under way) or ``compressed``."""
        return self.layers[0].state

    def begin_prefill(self, attention_mask, seq_len: int, batch: int, device) -> None:
        """Record which prompt positions are real tokens.

        ``attention_mask``: the model's mask argument: ``None``, a 2D ``[b, n]`` mask (1 = token), or
        the prepared 4D mask(s) ``generate`` may pass instead (a tensor, full-attention or sliding, or
        a dict by layer type, of which the full-attention one is read when there is one): a key is a
        real token when its own query row attends to it and not to the next key (a padding row sees
        nothing, or, after SDPA's fix for fully masked rows, everything). The last row alone would
        miss the real tokens beyond a sliding window (Mistral, Phi3 pass only a sliding mask).

        Raises ``ValueError`` for right padding (the observation window must be the last positions) and
        for a mask with a hole (0 after a real token: :func:`~jacap_attn.storage.masks.refuse_holes`), before any work.
        """
        if isinstance(attention_mask, dict):
            masks = attention_mask
            attention_mask = masks["full_attention"] if "full_attention" in masks else next(iter(masks.values()), None)
        if attention_mask is None:
            key_valid = torch.ones(batch, seq_len, dtype=torch.bool, device=device)
        elif attention_mask.dim() == 4:
            grid = attention_mask[:, 0, -seq_len:, -seq_len:]
            allowed = grid if grid.dtype == torch.bool else grid == 0
            itself = allowed.diagonal(dim1=-2, dim2=-1)
            ahead = torch.nn.functional.pad(allowed.diagonal(offset=1, dim1=-2, dim2=-1), (0, 1))
            key_valid = (itself & ~ahead).to(device).expand(batch, seq_len).clone()
        else:
            check_mask_shape(attention_mask, (batch, seq_len))
            key_valid = attention_mask.to(device=device, dtype=torch.bool)
        if not bool(key_valid[:, -1].all()):
            empty = [int(i) for i in torch.nonzero(~key_valid.any(-1)).flatten()]
            if empty:  # named as such: padding_side would not fix it
                if self.prefill_until is not None:
                    raise ValueError(f"batch rows {empty} are all padding in the first chunk of a chunked prefill "
                                     f"(its {seq_len} tokens): a chunk (chunk_size, or generate's prefill_chunk_size) "
                                     "must be longer than every row's left padding")
                raise ValueError(f"batch rows {empty} of the prompt are all padding (attention_mask all 0): "
                                 "give every row at least one token")
            refuse_right_padding(key_valid)
        refuse_holes(key_valid)
        self.prefill = PrefillState(key_valid)
        self.prompt_length = seq_len

    def check_model(self, model) -> None:
        """Raise ``ValueError`` if this cache was built for a model of another shape, or for another
        model of the same shape (other weights: :func:`weights_fingerprint` differs)."""
        if _model_shape(model) != self.model_shape:
            raise ValueError(f"this JacapCache was built for a model with {self.model_shape}, "
                             f"not {_model_shape(model)}")
        if self.weights_sha256 is not None and not torch.compiler.is_compiling():
            current = weights_fingerprint(model)
            if current != self.weights_sha256:
                raise ValueError(
                    f"this JacapCache was built for another model: its weights fingerprint (weights_sha256 "
                    f"{self.weights_sha256[:16]}...) differs from this model's ({current[:16]}...); a cache "
                    "answers only with the model (the same weights) that made it")

    def check_prompt(self, input_ids: torch.Tensor) -> None:
        """Raise ``ValueError`` unless ``input_ids`` ``[b, m]`` has the cache's ``b`` rows, starts with the prompt
        this cache holds (a cache answers only continuations of its own prompt) and is longer than what it holds.

        The prompt is known by its ids (a cache made by :func:`~jacap_attn.compress` or ``generate``,
        or loaded from a file that stores them), else by their SHA-256 (``prompt_sha256`` of a file
        saved with ``store_ids=False``; once matched, the ids are kept); a cache with neither (a
        prefill from ``inputs_embeds``) is checked for length only."""
        if self.state == EMPTY:
            return
        check_rows(self.batch_size, input_ids.shape[0], "input_ids")
        n, same = self.starts_with_prompt(input_ids)  # same None: cannot tell; the length checks below still apply
        if same is False:
            how = "ids" if self.prompt_ids is not None else "SHA-256 (prompt_sha256)"
            raise ValueError(
                f"input_ids (shape {tuple(input_ids.shape)}) do not start with the {n}-token prompt this cache "
                f"was built from (compared by its {how}); pass torch.cat([prompt_ids, new_ids], dim=1)"
            )
        if same and self.prompt_ids is None:  # matched by hash: keep the ids for later checks
            self.prompt_ids = input_ids[:, :n].detach().clone()
        seen = self.get_seq_length()
        n = n if n is not None else seen
        if input_ids.shape[1] <= seen:
            raise ValueError(
                f"this cache already holds {seen} tokens (its {n}-token prompt plus {seen - n} appended), "
                f"input_ids have {input_ids.shape[1]}: a cache answers one continuation; give each "
                "question its own copy.deepcopy(cache) of the prompt cache"
            )

    def starts_with_prompt(self, ids: torch.Tensor) -> tuple[int | None, bool | None]:
        """``(n, same)``: the prompt's length ``n`` (``None`` if unknown) and whether ``ids`` ``[b, m]`` start
        with the prompt this cache was built from (``None``: it cannot tell; ``False`` if ``m < n``)."""
        n = self.prompt_ids.shape[1] if self.prompt_ids is not None else self.prompt_length
        if n is None:
            return None, None
        return n, self._matches_prompt(ids[:, :n]) if ids.shape[1] >= n else False

    def _matches_prompt(self, ids: torch.Tensor):
        """Whether ``ids`` ``[b, n]`` are the prompt this cache holds; ``None`` if it cannot tell."""
        if self.prompt_ids is not None:
            prompt = self.prompt_ids.to(ids.device)
            return tuple(ids.shape) == tuple(prompt.shape) and torch.equal(ids, prompt)
        if self.prompt_sha256 is not None:
            from .identity import ids_sha256

            return ids_sha256(ids) == self.prompt_sha256
        return None

    def check_forward(self, input_ids, position_ids) -> None:
        """Checks of a plain forward over this compressed cache, whose inputs are the new tokens only
        (transformers' convention): ``ValueError`` if ``input_ids`` have other rows than the cache, start
        with the whole prompt the cache already holds (it would be read twice), or if ``position_ids`` do
        not continue at the cache's length. A forward cannot see which prompt its new tokens follow; to
        check that, call :meth:`check_prompt` with the full ids (``generate`` does)."""
        if self.state != COMPRESSED:
            return
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
            check_rows(self.batch_size, input_ids.shape[0], "input_ids")
            n, same = self.starts_with_prompt(input_ids)
            if same:
                raise ValueError(
                    f"input_ids start with the {n}-token prompt this cache already holds: a forward over a given "
                    "cache takes only the new tokens (input_ids[:, n:]); generate takes the full ids")
        if isinstance(position_ids, torch.Tensor) and position_ids.dim() in (1, 2) and position_ids.numel():
            layer = self.layers[0]
            expected = layer.next_positions().cpu()  # [b] next logical position of each row
            first = position_ids.reshape(-1, position_ids.shape[-1])[:, 0].cpu()
            if first.shape[0] not in (1, expected.shape[0]) or bool((first != expected).any()):
                raise ValueError(
                    f"position_ids start at {first.tolist()}, but this cache holds {layer.get_seq_length()} tokens "
                    f"(next positions {expected.tolist()}): a forward over a given cache continues its sequence "
                    "(another prompt's cache, or the prompt passed again?)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times (each layer and the prompt record): what
        ``generate`` does to its inputs for ``num_return_sequences`` and ``num_beams``."""
        super().batch_repeat_interleave(repeats)
        if self.prompt_ids is not None:
            self.prompt_ids = self.prompt_ids.repeat_interleave(repeats, dim=0)
        self.prompt_sha256 = None  # a hash of the rows before repeating; the ids (if any) identify them now
        if self.prompt_kept is not None:
            self.prompt_kept = [kept.repeat_interleave(repeats, dim=0) for kept in self.prompt_kept]

    def prompt_kept_bytes(self) -> int:
        """Bytes of the prompt's kept K/V entries (what a packed cache of the prompt holds)."""
        return sum(int(kept.sum()) * layer.slot_bytes() for layer, kept in zip(self.layers, self.prompt_kept or []))

    def kv_bytes(self) -> int:
        """Bytes of the K/V buffers actually held (all slots, all layers)."""
        return sum(layer.buffer_bytes() for layer in self.layers)

    def full_bytes(self) -> int:
        """Bytes of the whole uncompressed K/V cache of this cache's prompt (every position of a
        full-attention layer, ``min(n, sliding_window - 1)`` of a sliding one, as a stock cache holds),
        in this cache's dtype: the reference a compressed cache and its file are compared with."""
        n = self.prompt_length or 0
        return sum(self.batch_size * layer.kv_heads() * layer.slot_bytes()
                   * stock_entries(n, layer.sliding_window if layer.is_sliding else None)
                   for layer in self.layers if layer.state != "empty")

    def kept_bytes(self) -> int:
        """Bytes of the valid K/V entries (what a perfectly packed cache would hold)."""
        return sum(layer.kept_bytes() for layer in self.layers)

    def read_bytes(self) -> int:
        """K/V bytes one decode step reads from the cache now, all layers
        (:meth:`jacap_attn.storage.layer.JacapLayer.read_bytes`: every slot under SDPA, the held entries
        under xformers)."""
        return sum(layer.read_bytes() for layer in self.layers)

    def ensure_room(self, new_tokens: int) -> None:
        """Grow every compressed layer so that ``new_tokens`` more tokens fit (call before a
        compiled decode loop, which cannot grow the buffers)."""
        for layer in self.layers:
            layer.ensure_room(new_tokens)
