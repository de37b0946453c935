"""`JacapLayer`: one decoder layer's KV cache over compressed, static-shape storage.

Each layer goes through three states (docs/cache.md#layer-states):

1. *empty*: nothing seen;
2. *pending*: the prefill's ``update`` stored the full prompt K/V and returned it, so the prefill
   attention is exact; the route scores the layer (:mod:`jacap_attn.routes`);
3. *compressed*: after the cut (:func:`jacap_attn.selection.cut`) the layer holds only the kept
   entries in fixed buffers ``[batch, kv_heads, capacity, head_dim]`` with a validity mask and the
   logical (RoPE) position of every slot. New tokens are written by ``index_copy_`` at ``write_pos``;
   counters are 0-d tensors changed in place, so the decode step compiles without recompiles.

``get_seq_length()`` counts the tokens seen (as transformers' sliding-window layers), the slots are
fewer; :meth:`JacapLayer.attend` builds its own mask from ``valid`` and ``positions``.

The layout: this class stores a compressed layer *padded*, ``[b, h, capacity, d]`` buffers shared by
the KV heads of a layer (a head keeping fewer entries has invalid slots). Code outside this module
never reads the buffers' shapes: it goes through the layer's methods (:meth:`attend`,
:meth:`held_entries`, :meth:`slot_map`, :meth:`keep_slots`, :meth:`export`,
:meth:`ensure_room`, the byte counts), so another layout is one class implementing them, added to
:data:`LAYOUTS` (the cache builds its layers from that map).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import CacheLayerMixin

from ..math.budget import bucket
from ..math.masked import carried_bias, chunk_attention, grouped_attention, position_mask, split_point
from .slots import take_slots

EMPTY, PENDING, COMPRESSED = "empty", "pending", "compressed"


class JacapLayer(CacheLayerMixin):
    """One decoder layer's compressed KV cache.

    Parameters
    ----------
    sliding_window:
        ``None`` for a full-attention layer (compressed by the method); an int for a sliding-window
        layer (keeps the most recent ``sliding_window - 1`` prompt tokens and masks by distance).

    Attributes (compressed state)
    -----------------------------
    keys, values: ``[b, h, capacity, d]`` in the model dtype.
    valid: ``[b, h, capacity]`` bool; False for free slots, padding and per-head unused slots.
    positions: ``[b, h, capacity]`` int64 logical positions (RoPE positions of the kept tokens).
    write_pos, logical: 0-d int64 tensors: next free slot; tokens seen (padding included).
    pads: ``[b]`` int64 left-padding length of each sample (position = index - pads).
    mass: ``None``, or between a chunked prefill's cuts (``chunk_mass``) ``[b, h, L]`` float32 logit
        bias per prompt index (:meth:`carry_mass`).
    """

    is_compileable = True
    is_croppable = False
    # The backends this layout's `attend` can run (jacap_attn.storage.xformers_backend.BACKENDS, resolved).
    backends = ("sdpa",)
    # The tensors marked static (and replaced by normal copies after inference mode); of those, the
    # ones indexed by batch row (beam search, `num_return_sequences`).
    _STATIC = ("keys", "values", "positions", "valid", "write_pos", "logical", "pads")
    _ROWS = ("keys", "values", "positions", "valid", "pads")
    writes_in_order = True  # `_write` puts a forward's tokens at slots `write_pos ..` in order (masked.split_point)
    mass = None  # no carried mass (a layer pickled before the attribute existed reads this too)

    def __init__(self, sliding_window: int | None = None, backend: str = "sdpa"):
        super().__init__()
        if backend not in self.backends:
            raise ValueError(f"layout {type(self).__name__} runs backend {' or '.join(map(repr, self.backends))}, "
                             f"not backend={backend!r} (xformers needs each KV head's entries contiguous: "
                             "the 'ragged' layout)")
        self.sliding_window = sliding_window
        self.backend = backend
        self.state = EMPTY
        self.capacity = 0
        self.armed = False  # set by the patched attention forward just before it calls `update`

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store new K/V ``[b, h, q, d]``; returns the K/V the attention must read.

        In the prefill: the full prompt (exact attention). Afterwards: the whole buffers
        ``[b, h, capacity, d]``, to be read with :meth:`attention_mask`.
        """
        if self.state == EMPTY:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values, self.state = key_states, value_states, PENDING
            return key_states, value_states
        if self.state == PENDING:
            raise RuntimeError(
                "JacapCache: a second forward reached a layer whose prefill was never compressed; "
                "use the cache with a model patched by jacap_attn.patch()"
            )
        q = key_states.shape[-2]
        if not torch.compiler.is_compiling() and not torch.is_inference_mode_enabled():
            self._ensure_normal_tensors()
        if not torch.compiler.is_compiling() and int(self.write_pos) + q > self.capacity:
            self.grow(int(self.write_pos) + q)
        new_pos = (self.logical + torch.arange(q, device=self.device))[None, :] - self.pads[:, None]  # [b, q]
        self._write(key_states, value_states, new_pos)
        self.write_pos.add_(q)
        self.logical.add_(q)
        return self.keys, self.values

    def _write(self, key_states: torch.Tensor, value_states: torch.Tensor, new_pos: torch.Tensor) -> None:
        """Store ``q`` new tokens ``[b, h, q, d]`` at logical positions ``new_pos [b, q]``: here at the
        slots ``write_pos ..`` of every head (in place, static shapes)."""
        slots = self.write_pos + torch.arange(key_states.shape[-2], device=self.device)
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        self.positions.index_copy_(2, slots, new_pos[:, None, :].expand(-1, self.positions.shape[1], -1))
        self.valid.index_fill_(2, slots, True)

    def attention_mask(self, q_len: int, slots: int | None = None) -> torch.Tensor:
        """Bool mask ``[b, h, q_len, capacity]`` (``[.., slots]``: the first ``slots`` only) for the last
        ``q_len`` tokens written: valid slots at logical positions ``<=`` the query's (causal), within
        the sliding window if any."""
        q_pos = (self.logical - q_len + torch.arange(q_len, device=self.device))[None, :] - self.pads[:, None]
        return position_mask(self.positions[:, :, None, :slots], self.valid[:, :, None, :slots],
                             q_pos[:, None, :, None], self.sliding_window)

    def compress(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, kept: torch.Tensor,
                 capacity: int, logical: int, pads: torch.Tensor) -> None:
        """Enter the compressed state with kept entries ``keys/values [b, h, K, d]``,
        ``positions/kept [b, h, K]``, in fixed buffers of ``capacity >= K`` slots."""
        b, h, k, d = keys.shape
        # The buffers hold no autograd graph (a cache built with grad enabled stays copyable and
        # usable under no_grad / inference_mode, and does not keep the prefill's graph alive).
        keys, values, positions, kept = keys.detach(), values.detach(), positions.detach(), kept.detach()
        self.keys = keys.new_zeros(b, h, capacity, d)
        self.values = values.new_zeros(b, h, capacity, values.shape[-1])
        self.positions = torch.zeros(b, h, capacity, dtype=torch.int64, device=keys.device)
        self.valid = torch.zeros(b, h, capacity, dtype=torch.bool, device=keys.device)
        self.keys[:, :, :k] = keys
        self.values[:, :, :k] = values
        self.positions[:, :, :k] = positions
        self.valid[:, :, :k] = kept
        self.write_pos = torch.tensor(k, dtype=torch.int64, device=keys.device)
        self.logical = torch.tensor(logical, dtype=torch.int64, device=keys.device)
        self.pads = pads.to(device=keys.device, dtype=torch.int64)
        self.capacity, self.state, self.mass = capacity, COMPRESSED, None
        self._mark_static()

    def grow(self, needed: int) -> None:
        """Reallocate to the next capacity bucket holding ``needed`` slots (eager only; a new
        bucket means a new compiled graph)."""
        capacity = bucket(needed)
        extra = capacity - self.capacity
        pad4, pad3 = (0, 0, 0, extra), (0, extra)
        self.keys = torch.nn.functional.pad(self.keys, pad4)
        self.values = torch.nn.functional.pad(self.values, pad4)
        self.positions = torch.nn.functional.pad(self.positions, pad3)
        self.valid = torch.nn.functional.pad(self.valid, pad3)
        self.capacity = capacity
        self._mark_static()

    def _mark_static(self):
        for name in self._STATIC:
            torch._dynamo.mark_static_address(getattr(self, name))

    def _ensure_normal_tensors(self) -> None:
        """Replace inference tensors (buffers made under ``torch.inference_mode``: a cache built,
        grown or reordered there) by normal copies, so the in-place writes of :meth:`update` work
        outside inference mode too. A no-op when no buffer is an inference tensor."""
        inference = [name for name in self._STATIC if getattr(self, name).is_inference()]
        for name in inference:
            setattr(self, name, getattr(self, name).clone())
        if inference:
            self._mark_static()

    # -- the layout's methods: everything outside this class reads a layer through them ---------------

    def pending_entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The full prompt K/V ``[b, h, n, d]`` of a pending layer (what the prefill stored)."""
        return self.keys, self.values

    def pending_with(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """The prompt's K/V followed by ``key_states/value_states [b, h, c, d]``, nothing stored: what
        a forward of the repeat pass attends (docs/method.md#question-agnostic-scoring)."""
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)

    def keep_slots(self, slots: torch.Tensor, kept: torch.Tensor, positions: torch.Tensor, capacity: int,
                   logical: int, pads: torch.Tensor, *, grow: bool = True) -> None:
        """Hold only the entries at ``slots [b, h, K]`` of this layer's storage (the prompt's index of a
        pending layer; a written slot of a compressed one, :meth:`slot_map`), ``kept [b, h, K]`` True for
        the real selections (the rest filler), at logical (RoPE) ``positions [b, h, K]``, in buffers of
        ``capacity >= K`` slots (``grow=False``: never more than the layer has now); ``logical`` tokens
        seen (padding included), ``pads [b]`` left padding. The one way a cut
        (:func:`jacap_attn.selection.cut`) changes a layer's entries."""
        if not grow and self.state == COMPRESSED:
            capacity = max(min(capacity, self.capacity), slots.shape[-1])
        keys, values = self.take(slots)
        self.compress(keys, values, positions, kept, capacity, logical, pads.to(slots.device))

    def take(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values ``[b, h, K, d]`` at ``slots [b, h, K]`` of this layer's storage (a pending
        layer's prompt index, a compressed one's slot: :meth:`slot_map`), copied."""
        return take_slots(self.keys, slots), take_slots(self.values, slots)

    def slot_map(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each prompt index lives: ``(slots, held)``, both ``[b, h, length]`` (``length`` the
        tokens seen, padding included): ``held`` whether the (row, KV head) holds index ``t`` (logical
        position ``t - pads``), ``slots`` the storage slot holding it (0 where not held). A pending layer
        holds every index at its own slot."""
        if self.state == PENDING:
            b, h, n = self.keys.shape[:3]
            slots = torch.arange(n, device=self.keys.device).expand(b, h, n)
            return slots, torch.ones(b, h, n, dtype=torch.bool, device=self.keys.device)
        end = int(self.write_pos)
        valid = self.valid[:, :, :end]
        index = torch.where(valid, self.positions[:, :, :end] + self.pads[:, None, None], length)  # spare column
        b, h = valid.shape[:2]
        slots = torch.zeros(b, h, length + 1, dtype=torch.int64, device=valid.device)
        slots.scatter_(2, index, torch.arange(end, device=valid.device).expand(b, h, end))
        held = torch.zeros(b, h, length + 1, dtype=torch.bool, device=valid.device).scatter_(2, index, valid)
        return slots[..., :length], held[..., :length]

    def attend(self, query: torch.Tensor, scaling: float, *, weights: bool = False):
        """Attention of ``query [b, Hq, q, d]`` (the last ``q`` tokens written) over the held entries,
        with :meth:`attention_mask`; the GQA group is folded into the query axis (K/V never repeated to
        query heads). Several tokens on the CPU read the held entries and then themselves causally, with
        no mask over them (:func:`jacap_attn.math.masked.chunk_attention`, where ``split_point`` allows).
        Returns ``(out, attention)``: ``out [b, q, Hq, d]`` (the layout transformers expects);
        ``attention`` ``None`` (SDPA), or with ``weights=True`` (the eager implementation,
        ``output_attentions``) the softmax weights ``[b, Hq, q, S]`` in the query's dtype over the slots
        written so far (``S`` the write position, in slot order: kept prompt positions ascending, then
        the appended tokens; 0 at slots a head does not hold), computed as eager attention does.
        Under ``torch.compile`` ``S`` is the capacity (static shapes)."""
        b, hq, q, d = query.shape
        h, c = self.keys.shape[1], self.keys.shape[2]
        g = hq // h
        bias = None if self.mass is None else carried_bias(self.mass, self.positions, self.valid, self.pads)
        if not weights and (q > 1 or bias is not None):  # a chunk, a question: one SDPA per GQA group member
            held = split_point(query, self.write_pos, self.logical, self.pads, self.sliding_window, bias) \
                if self.writes_in_order else None
            if held is None:
                return grouped_attention(query, self.keys, self.values, self.attention_mask(q), scaling, bias), None
            # Its held part, then its own tokens causally, no mask over them (every held entry precedes them)
            allowed = self.valid[:, :, None, :held] if self.sliding_window is None else self.attention_mask(q, held)
            return chunk_attention(query, self.keys[:, :, :held + q], self.values[:, :, :held + q], held, allowed,
                                   scaling, None if bias is None else bias[..., :held]), None
        folded = query.reshape(b, h, g * q, d)
        mask = self.attention_mask(q)[:, :, None].expand(b, h, g, q, c).reshape(b, h, g * q, c)
        if not weights:
            out = F.scaled_dot_product_attention(folded, self.keys, self.values, attn_mask=mask, scale=scaling)
            return out.reshape(b, hq, q, self.values.shape[-1]).transpose(1, 2).contiguous(), None
        logits = torch.matmul(folded, self.keys.transpose(-1, -2)) * scaling
        logits = logits if bias is None else logits + bias[:, :, None, :].to(logits.dtype)
        probs = torch.softmax(logits.masked_fill(~mask, float("-inf")).float(), dim=-1).to(query.dtype)
        out = torch.matmul(probs, self.values)
        attention = probs.reshape(b, hq, q, c)
        if not torch.compiler.is_compiling():
            attention = attention[..., : int(self.write_pos)]
        return out.reshape(b, hq, q, self.values.shape[-1]).transpose(1, 2).contiguous(), attention

    def carry_mass(self, table: torch.Tensor | None) -> None:
        """Bias the attention of later forwards by ``table [b, h, L]`` float32, ``log(1 + m)`` per prompt
        index (:func:`jacap_attn.math.masked.carried_bias`), or stop (``None``): a chunked prefill's
        ``chunk_mass`` between its cuts (:mod:`jacap_attn.selection.mass`). A new cut's buffers start without."""
        self.mass = table

    def held_entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values, positions, valid)`` of every written slot, ``[b, h, end(, d)]``, reordered
        per (row, KV head) so that the slots holding nothing come first and the held entries follow
        in slot order (kept positions ascending, then the tokens appended): each head reads as a
        left-padded sequence of its own entries (question-time reselection scores it so)."""
        end = int(self.write_pos)
        valid = self.valid[:, :, :end]
        if bool(valid.all()):  # every written slot held (a document stored whole): already in that order
            return self.keys[:, :, :end], self.values[:, :, :end], self.positions[:, :, :end], valid
        order = torch.sort(valid.to(torch.int8), dim=-1, stable=True).indices  # [b, h, end]
        keys = self.keys[:, :, :end].gather(2, order[..., None].expand(-1, -1, -1, self.keys.shape[-1]))
        values = self.values[:, :, :end].gather(2, order[..., None].expand(-1, -1, -1, self.values.shape[-1]))
        return keys, values, self.positions[:, :, :end].gather(2, order), valid.gather(2, order)

    def seen_before(self, new_tokens: int) -> torch.Tensor:
        """``[b]`` int64 real tokens the layer had seen before its last ``new_tokens`` ones."""
        return self.logical - new_tokens - self.pads

    def next_positions(self) -> torch.Tensor:
        """``[b]`` int64 logical (RoPE) position of each row's next token."""
        return self.logical - self.pads

    def export(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values, positions, valid)`` of the written slots, ``[b, h, K(, d)]`` on the layer's
        device (what a saved file holds; :meth:`jacap_attn.storage.cache.JacapCache.from_kept` reads it back)."""
        used = int(self.write_pos)
        return tuple(getattr(self, name)[:, :, :used] for name in ("keys", "values", "positions", "valid"))

    def kv_heads(self) -> int:
        """KV heads of the layer (0 while empty)."""
        return 0 if self.state == EMPTY else self.keys.shape[1]

    def batch_size(self) -> int:
        """Rows the layer holds (0 while empty)."""
        return 0 if self.state == EMPTY else self.keys.shape[0]

    def ensure_room(self, new_tokens: int) -> None:
        """Grow a compressed layer so that ``new_tokens`` more tokens fit (before a compiled decode
        loop, which cannot grow the buffers)."""
        if self.state == COMPRESSED and int(self.write_pos) + new_tokens > self.capacity:
            self.grow(int(self.write_pos) + new_tokens)

    def buffer_bytes(self) -> int:
        """Bytes of the K/V buffers held (every slot; 0 for an empty layer)."""
        if self.state == EMPTY:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def valid_bytes(self) -> int:
        """Bytes of the entries the layer holds now, in any state: every prompt entry of a pending
        layer, the valid slots of a compressed one (0 while empty)."""
        if self.state == PENDING:
            return self.buffer_bytes()
        return self.kept_bytes()

    def kept_bytes(self) -> int:
        """Bytes of the valid K/V entries of a compressed layer (what a packed layout would hold)."""
        return int(self.valid.sum()) * self.slot_bytes() if self.state == COMPRESSED else 0

    def read_bytes(self) -> int:
        """K/V bytes one attention call over the compressed layer reads now (0 otherwise): SDPA reads
        every slot of the ``[b, h, capacity, d]`` buffers, the padding of heads below the layer's
        largest and the free room included (the mask's ``valid``/``positions`` come on top: 9 bytes per
        slot and head)."""
        return self.buffer_bytes() if self.state == COMPRESSED else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Not possible (assisted generation and other rollback decoding need a croppable cache): ``ValueError``."""
        raise ValueError("a JacapCache cannot be cropped (assisted generation, prompt lookup and other "
                         "decoding modes that roll the cache back are not supported on a patched model)")

    def get_seq_length(self) -> int:
        if self.state == EMPTY:
            return 0
        if self.state == PENDING:
            return self.keys.shape[-2]
        return self.logical if torch.compiler.is_compiling() else int(self.logical)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.state != COMPRESSED:
            return self.get_seq_length() + query_length, 0
        # Ignored for compressed layers (attend builds its own). The static capacity, as StaticLayer's: `generate`
        # builds a compileable cache's 4D mask before every step; a growing size would recompile every step.
        return self.capacity, 0

    def get_max_length(self) -> int:
        return -1

    def slot_bytes(self) -> int:
        """Bytes of one slot's key plus value (one token, one KV head)."""
        return self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * self.values.element_size()

    def kept_counts(self) -> torch.Tensor:
        """Valid slots per (batch, KV head), ``[b, h]`` int64 (0 before compression)."""
        if self.state != COMPRESSED:
            return torch.zeros(0, dtype=torch.int64)
        return self.valid.sum(-1)

    def reset(self) -> None:
        self.__init__(self.sliding_window, self.backend)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep batch rows ``indices`` (beam search, contrastive search)."""
        if self.state != COMPRESSED:
            raise RuntimeError("JacapLayer: batch reordering is only possible after the prefill")
        idx = indices.to(self.keys.device)
        for name in self._ROWS:
            setattr(self, name, getattr(self, name).index_select(0, idx))
        self._mark_static()

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times (``num_return_sequences``)."""
        idx = torch.arange(self.keys.shape[0], device=self.keys.device).repeat_interleave(repeats)
        self.batch_select_indices(idx)


# The layouts a cache can build its layers with (JacapCache(layout=...)); jacap_attn.storage.ragged adds
# "ragged" (jacap_attn.storage.cache imports it).
LAYOUTS: dict[str, type[JacapLayer]] = {"padded": JacapLayer}
