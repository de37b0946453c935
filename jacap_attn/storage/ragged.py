"""The ``ragged`` layout (:class:`RaggedLayer`): the padded layout's buffers with each KV head's
entries contiguous, read by xformers' fmha under ``backend="xformers"``
(:mod:`jacap_attn.storage.xformers_backend`; docs/architecture.md#decode). Registered in
:data:`jacap_attn.storage.layer.LAYOUTS` as ``"ragged"`` on import."""

from __future__ import annotations

import torch

from .layer import COMPRESSED, LAYOUTS, JacapLayer
from .slots import kept_first, take_slots


class RaggedLayer(JacapLayer):
    """The *ragged* layout: the padded layout's ``[b, h, capacity, d]`` buffers, but each (row, KV
    head) holds its entries as a prefix of its slots, ``lengths [b, h]`` int64 of them (kept prompt
    entries in ascending position, then the tokens appended, each head writing at its own
    ``lengths``); ``valid`` is ``slot < lengths``. ``write_pos`` is the largest length (the slots
    any head uses). The same bytes are held; what differs is what attention can skip: with
    ``backend="xformers"`` (:mod:`jacap_attn.storage.xformers_backend`, CUDA) a full-attention layer's decode
    reads only each head's ``lengths`` slots through a block-diagonal padded-keys bias, one sequence
    per (row, KV head); with ``"sdpa"`` (and on sliding-window layers, and for ``output_attentions``)
    it attends as the padded layout does, over every slot with :meth:`attention_mask`. The slot
    order of a head's entries is the padded layout's, so both give the same outputs (to float
    rounding) and :meth:`held_entries` / :meth:`export` the same entries.
    """

    backends = ("sdpa", "xformers")
    writes_in_order = False  # each head writes at its own length
    _STATIC = (*JacapLayer._STATIC, "lengths")
    _ROWS = (*JacapLayer._ROWS, "lengths")

    def compress(self, keys, values, positions, kept, capacity, logical, pads) -> None:
        """As :meth:`JacapLayer.compress`, each (row, KV head)'s kept entries first (stable: their
        order stays), the rest after them (invalid)."""
        order = kept_first(kept)  # [b, h, K]
        keys, values = take_slots(keys, order), take_slots(values, order)
        self.lengths = kept.detach().sum(-1).to(device=keys.device, dtype=torch.int64)  # [b, h]
        super().compress(keys, values, positions.gather(2, order), kept.gather(2, order), capacity, logical, pads)
        self.write_pos = self.lengths.max().clone()  # 0-d int64: the slots any head uses
        self._mark_static()

    def _write(self, key_states, value_states, new_pos) -> None:
        """Store the ``q`` new tokens at each head's slots ``lengths ..`` (scatter, static shapes)."""
        b, h, q, _ = key_states.shape
        slots = self.lengths[..., None] + torch.arange(q, device=self.device)  # [b, h, q]
        self.keys.scatter_(2, slots[..., None].expand(-1, -1, -1, self.keys.shape[-1]), key_states)
        self.values.scatter_(2, slots[..., None].expand(-1, -1, -1, self.values.shape[-1]), value_states)
        self.positions.scatter_(2, slots, new_pos[:, None, :].expand(b, h, q))
        self.valid.scatter_(2, slots, True)
        self.lengths.add_(q)

    def attend(self, query: torch.Tensor, scaling: float, *, weights: bool = False):
        """:meth:`JacapLayer.attend`; with ``backend="xformers"`` on a full-attention layer (and
        ``weights=False``) through :func:`jacap_attn.storage.xformers_backend.attend`, which reads each head's
        ``lengths`` slots only (not under a carried mass's bias, :meth:`carry_mass`). Same shapes and result."""
        if self.backend == "xformers" and not weights and self.sliding_window is None and self.mass is None:
            from .xformers_backend import attend

            return attend(query, self.keys, self.values, self.lengths, scaling), None
        return super().attend(query, scaling, weights=weights)

    def read_bytes(self) -> int:
        """K/V bytes one attention call reads now: with ``backend="xformers"`` on a full-attention
        layer each head's ``lengths`` slots (the held entries; the kernel reads them in blocks, so up
        to one block more per head); else every slot, as :meth:`JacapLayer.read_bytes`."""
        if self.state == COMPRESSED and self.backend == "xformers" and self.sliding_window is None:
            return int(self.lengths.sum()) * self.slot_bytes()
        return super().read_bytes()


LAYOUTS["ragged"] = RaggedLayer
