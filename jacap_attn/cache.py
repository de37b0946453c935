"""`JacapCache` / `JacapLayer`: the transformers cache contract over compressed, static-shape storage.

Each layer goes through three states (docs/cache.md#layer-states):

1. *empty*: nothing seen;
2. *pending*: the prefill's ``update`` stored the full prompt K/V and returned it, so the prefill
   attention is exact; the attention function adds the layer's scores;
3. *compressed*: after :func:`jacap_attn.selection.finalize_prefill` the layer holds only the kept
   entries in fixed buffers ``[batch, kv_heads, capacity, head_dim]`` with a validity mask and the
   logical (RoPE) position of every slot. New tokens are written by ``index_copy_`` at ``write_pos``;
   counters are 0-d tensors changed in place, so the decode step compiles without recompiles.

Logical vs physical length: ``get_seq_length()`` is the number of tokens seen (the prompt length
plus what was appended), as in transformers' sliding-window layers; the physical slots are fewer.
The generic transformers mask is not used for compressed layers: the attention function builds its
own from ``valid`` and ``positions`` (:meth:`JacapLayer.attention_mask`).
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .budget import bucket

EMPTY, PENDING, COMPRESSED = "empty", "pending", "compressed"


@dataclass
class PrefillState:
    """Scratch state of one prefill, dropped once the cache is compressed.

    key_valid: ``[b, n]`` bool, False at left padding.
    parts: per layer index, what the method's ``score_parts`` returned (``"scores"`` ``[b, h, n]``
        float32 and any extra tensors its hooks read) plus ``"need"`` ``[b]`` for ``capacity`` budgets.
    """

    key_valid: torch.Tensor
    parts: dict = field(default_factory=dict)


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
    """

    is_compileable = True
    is_croppable = False

    def __init__(self, sliding_window: int | None = None):
        super().__init__()
        self.sliding_window = sliding_window
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
        slots = self.write_pos + torch.arange(q, device=self.device)
        new_pos = (self.logical + torch.arange(q, device=self.device))[None, :] - self.pads[:, None]  # [b, q]
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        self.positions.index_copy_(2, slots, new_pos[:, None, :].expand(-1, self.positions.shape[1], -1))
        self.valid.index_fill_(2, slots, True)
        self.write_pos.add_(q)
        self.logical.add_(q)
        return self.keys, self.values

    def attention_mask(self, q_len: int) -> torch.Tensor:
        """Bool mask ``[b, h, q_len, capacity]`` for the last ``q_len`` tokens written: valid slots at
        logical positions ``<=`` the query's (causal), within the sliding window if any."""
        q_pos = (self.logical - q_len + torch.arange(q_len, device=self.device))[None, :] - self.pads[:, None]
        q_pos = q_pos[:, None, :, None]  # [b, 1, q, 1]
        kv_pos = self.positions[:, :, None, :]  # [b, h, 1, C]
        mask = self.valid[:, :, None, :] & (kv_pos <= q_pos)
        if self.sliding_window is not None:
            mask = mask & (q_pos - kv_pos < self.sliding_window)
        return mask

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
        self.capacity = capacity
        self.state = COMPRESSED
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
        for t in (self.keys, self.values, self.positions, self.valid, self.write_pos, self.logical, self.pads):
            torch._dynamo.mark_static_address(t)

    def _ensure_normal_tensors(self) -> None:
        """Replace inference tensors (buffers made under ``torch.inference_mode``: a cache built,
        grown or reordered there) by normal copies, so the in-place writes of :meth:`update` work
        outside inference mode too. A no-op when no buffer is an inference tensor."""
        names = ("keys", "values", "positions", "valid", "write_pos", "logical", "pads")
        if not any(getattr(self, name).is_inference() for name in names):
            return
        for name in names:
            tensor = getattr(self, name)
            if tensor.is_inference():
                setattr(self, name, tensor.clone())
        self._mark_static()

    def crop(self, tokens_to_remove: int) -> None:
        """Not possible: a compressed layer cannot drop its last tokens (assisted generation and
        the other rollback-based decoding modes need a croppable cache). Raises ``ValueError``."""
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
        # The generic mask is ignored for compressed layers (the attention function builds its own
        # from `valid`). Its size is the static capacity, as StaticLayer's is: `generate` builds the
        # 4D mask of a compileable cache eagerly before every step, and a size growing per step
        # would recompile the decode step (and re-record its CUDA graph) at every step.
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
        self.__init__(self.sliding_window)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep batch rows ``indices`` (beam search, contrastive search)."""
        if self.state != COMPRESSED:
            raise RuntimeError("JacapLayer: batch reordering is only possible after the prefill")
        idx = indices.to(self.keys.device)
        for name in ("keys", "values", "positions", "valid", "pads"):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        self._mark_static()

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times (``num_return_sequences``)."""
        idx = torch.arange(self.keys.shape[0], device=self.keys.device).repeat_interleave(repeats)
        self.batch_select_indices(idx)


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

    Raises
    ------
    ValueError
        If ``model`` was not patched.
    """

    def __init__(self, model, *, max_length: int | None = None, config=None, on_prefill=None):
        state = getattr(model, "_jacap_state", None)
        if state is None:
            raise ValueError("JacapCache needs a model patched by jacap_attn.patch(model, ...)")
        self.config = config if config is not None else state.config
        self.max_length = max_length
        self.on_prefill = on_prefill
        self.prefill: PrefillState | None = None  # scratch state while the prefill runs
        self.prompt_ids = None  # [b, n] ids of the compressed prompt, checked by `generate`
        self.prompt_kept = None  # per layer, [b, h] prompt entries kept at the prefill
        self.prompt_length = None  # n, tokens of the compressed prompt (padding included)
        self.prompt_sha256 = None  # SHA-256 of the prompt ids (a cache loaded from a file without them)
        self.model_shape = _model_shape(model)
        self.weights_sha256 = weights_fingerprint(model)  # the model (weights) this cache is for
        self.bind(model)
        super().__init__(layers=[JacapLayer(window) for window in state.sliding_windows])

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
        room = cache.config.reserve if max_length is None else max(max_length - logical, 1)
        capacity = bucket(max(entry[0].shape[2] for entry in layers) + room)
        for layer, (keys, values, positions, valid) in zip(cache.layers, layers):
            if not keys.shape[:3] == values.shape[:3] == positions.shape == valid.shape:
                raise ValueError(f"from_kept: keys {tuple(keys.shape)}, values {tuple(values.shape)}, positions "
                                 f"{tuple(positions.shape)} and valid {tuple(valid.shape)} disagree")
            layer.lazy_initialization(keys, values)
            layer.compress(keys, values, positions.to(keys.device), valid.to(keys.device), capacity, logical, pads)
        cache.prompt_ids = None if prompt_ids is None else prompt_ids.detach().clone()
        cache.prompt_kept = [layer.kept_counts().cpu() for layer in cache.layers]
        cache.prompt_length = logical
        return cache

    def bind(self, model) -> None:
        """Remember (weakly) the patched model that runs this cache's next forward."""
        self._model = weakref.ref(model)

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
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

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

        Raises ``ValueError`` for right padding: the observation window must be the last positions.
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
        elif tuple(attention_mask.shape) != (batch, seq_len):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; the prompt is {(batch, seq_len)}")
        else:
            key_valid = attention_mask.to(device=device, dtype=torch.bool)
        if not bool(key_valid[:, -1].all()):
            raise ValueError(
                "jacap_attn needs left padding at prefill (a padded row ends with a pad token, or a row "
                "is all padding); set tokenizer.padding_side = 'left'"
            )
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
        """Raise ``ValueError`` unless ``input_ids`` ``[b, m]`` starts with the prompt this cache holds
        (a cache answers only continuations of its own prompt) and is longer than what it holds.

        The prompt is known by its ids (a cache made by :func:`~jacap_attn.compress` or ``generate``,
        or loaded from a file that stores them), else by their SHA-256 (``prompt_sha256`` of a file
        saved with ``store_ids=False``; once matched, the ids are kept); a cache with neither (a
        prefill from ``inputs_embeds``) is checked for length only."""
        if self.state == EMPTY:
            return
        n = self.prompt_ids.shape[1] if self.prompt_ids is not None else self.prompt_length
        same = None  # cannot tell (neither ids nor hash): the length checks below still apply
        if n is not None:
            same = self._matches_prompt(input_ids[:, :n]) if input_ids.shape[1] >= n else False
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

    def _matches_prompt(self, ids: torch.Tensor):
        """Whether ``ids`` ``[b, n]`` are the prompt this cache holds; ``None`` if it cannot tell."""
        if self.prompt_ids is not None:
            prompt = self.prompt_ids.to(ids.device)
            return tuple(ids.shape) == tuple(prompt.shape) and torch.equal(ids, prompt)
        if self.prompt_sha256 is not None:
            from .persist import ids_sha256

            return ids_sha256(ids) == self.prompt_sha256
        return None

    def check_forward(self, input_ids, position_ids) -> None:
        """Checks of a plain forward over this compressed cache, whose inputs are the new tokens only
        (transformers' convention): ``ValueError`` if ``input_ids`` start with the whole prompt the
        cache already holds (it would be read twice), or if ``position_ids`` do not continue at the
        cache's length. A forward cannot see which prompt its new tokens follow; to check that, call
        :meth:`check_prompt` with the full ids (``generate`` does)."""
        if self.state != COMPRESSED:
            return
        n = self.prompt_ids.shape[1] if self.prompt_ids is not None else self.prompt_length
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and n is not None and input_ids.shape[1] >= n \
                and self._matches_prompt(input_ids[:, :n]):
            raise ValueError(
                f"input_ids start with the {n}-token prompt this cache already holds: a forward over a given "
                "cache takes only the new tokens (input_ids[:, n:]); generate takes the full ids")
        if isinstance(position_ids, torch.Tensor) and position_ids.dim() in (1, 2) and position_ids.numel():
            layer = self.layers[0]
            expected = (layer.logical - layer.pads).cpu()  # [b] next logical position of each row
            first = position_ids.reshape(-1, position_ids.shape[-1])[:, 0].cpu()
            if first.shape[0] not in (1, expected.shape[0]) or bool((first != expected).any()):
                raise ValueError(
                    f"position_ids start at {first.tolist()}, but this cache holds {int(layer.logical)} tokens "
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
        total = 0
        for layer in self.layers:
            if layer.state != EMPTY:
                total += layer.keys.numel() * layer.keys.element_size()
                total += layer.values.numel() * layer.values.element_size()
        return total

    def kept_bytes(self) -> int:
        """Bytes of the valid K/V entries (what a perfectly packed cache would hold)."""
        return sum(int(layer.valid.sum()) * layer.slot_bytes() for layer in self.layers if layer.state == COMPRESSED)

    def ensure_room(self, new_tokens: int) -> None:
        """Grow every compressed layer so that ``new_tokens`` more tokens fit (call before a
        compiled decode loop, which cannot grow the buffers)."""
        for layer in self.layers:
            if layer.state == COMPRESSED and int(layer.write_pos) + new_tokens > layer.capacity:
                layer.grow(int(layer.write_pos) + new_tokens)


def _model_shape(model) -> dict:
    config = model.config
    return {
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": getattr(config, "num_key_value_heads", config.num_attention_heads),
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
    }


def weights_fingerprint(model) -> str:
    """SHA-256 of a few fixed small slices of ``model``'s weights: 16 rows (256 columns) from the
    middle of the input embedding, and the first 4096 entries of every 1-D parameter (norms, biases)
    outside the middle decoder layers, i.e. of the first and last layers and the final norm.

    Two checkpoints of the same architecture (base and instruct, two seeds) differ there. Values are
    rounded to bfloat16 before hashing, so a float32 model and its bfloat16 copy agree. Only the slices
    are moved to the CPU (a few tens of KB even for an 8B model). Memoised on the patch state: computed
    once per patched model (weights changed in place afterwards are not noticed).
    """
    state = getattr(model, "_jacap_state", None)
    if getattr(state, "weights_sha256", None) is not None:
        return state.weights_sha256
    if state is not None:
        adapter = state.adapter
    else:
        from .patches import get_adapter

        adapter = get_adapter(model.config.model_type)
    layers = list(adapter.decoder_layers(model))
    middle = {id(p) for layer in layers[1:-1] for p in layer.parameters()}
    embed = model.get_input_embeddings().weight
    row = embed.shape[0] // 2
    parts = [("embed", embed[row:row + 16, :256])]
    parts += [(name, p[:4096]) for name, p in model.named_parameters() if p.dim() == 1 and id(p) not in middle]
    digest = hashlib.sha256()
    for name, tensor in parts:
        tensor = tensor.detach()
        digest.update(f"{name}:{tuple(tensor.shape)};".encode())
        if tensor.device.type == "meta":
            continue
        if tensor.is_floating_point():
            data = tensor.to(torch.bfloat16).cpu().float().numpy().astype("<f4")
        else:
            data = tensor.cpu().to(torch.int64).numpy().astype("<i8")
        digest.update(data.tobytes())
    value = digest.hexdigest()
    if state is not None:
        state.weights_sha256 = value
    return value
