"""The *split* layout (:class:`SplitLayer`): each (batch row, KV head) of a layer in buffers of its own,
between the chunks of a chunked prefill (docs/architecture.md#chunked-prefill).

Under a budget that differs by head (the ``global`` policy, a method's per-head budgets) the padded
and ragged layouts pad every KV head of a layer to its largest head's count, so a chunked prefill's
buffers exceeded its bound, (budget + chunk + window) x bytes per token, by 6-13% on SmolLM2 at 8k
tokens (docs/results.md#chunked-prefill-2026-12-03) while the entries stayed within it. Between chunks
(:func:`jacap_attn.selection.steps.gather` with ``Cut.bucketed`` false) a layer whose heads (or left-padded
rows) keep different counts becomes a :class:`SplitLayer`: one :class:`~jacap_attn.storage.layer.JacapLayer`
of a single row and KV head per (row, head), each as long as its own entries plus the next chunk. The last cut
gives the layer back in the cache's layout (:attr:`SplitLayer.home`), which decode and the saved files
read. Same entries, the same attention over them (per cell, the GQA group's query heads over that head's
entries; equal to float rounding), the same selections: only the buffers' shape differs.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from .layer import COMPRESSED, JacapLayer
from .slots import kept_first, take_slots


class SplitLayer(JacapLayer):
    """A compressed layer held as one single-row, single-head :class:`JacapLayer` per (batch row, KV head)
    (:attr:`cells`, ``cells[r][j]`` ``[1, 1, capacity_rj, d]``). It answers the layout's methods by asking
    each cell and joining the answers along the KV-head and batch axes; where the cells' lengths differ
    (:meth:`held_entries`, :meth:`export`, the attention weights of :meth:`attend`) it pads to the
    longest, as a padded layer would be, in a transient tensor. ``home``: the layout class the layer
    returns to at the prefill's last cut and on :meth:`reset`."""

    def __init__(self, sliding_window: int | None = None, backend: str = "sdpa", home: type = JacapLayer):
        super().__init__(sliding_window, "sdpa")
        self.backend = backend  # the home layout's (the cells attend with SDPA)
        self.home = home
        self.cells: list[list[JacapLayer]] = []

    # -- state shared by the cells -----------------------------------------------------------------------
    @property
    def logical(self) -> torch.Tensor:
        return self.cells[0][0].logical

    @property
    def pads(self) -> torch.Tensor:
        return torch.cat([row[0].pads for row in self.cells])

    @property
    def capacity(self) -> int:
        """The largest cell's slots (what the generic mask is sized to)."""
        return max((cell.capacity for row in self.cells for cell in row), default=0)

    @capacity.setter
    def capacity(self, value: int) -> None:
        """Only :meth:`JacapLayer.__init__`'s 0 (an empty layer): the cells size themselves."""
        if value != 0:
            raise AttributeError(f"a SplitLayer's capacity is its cells' (set by compress), not {value}")

    def _join(self, parts: list[list[torch.Tensor]]) -> torch.Tensor:
        """Per-cell tensors ``[1, 1, ...]`` joined to ``[b, h, ...]``."""
        return torch.cat([torch.cat(row, dim=1) for row in parts], dim=0)

    # -- the layout's methods --------------------------------------------------------------------------
    def compress(self, keys, values, positions, kept, capacity, logical, pads) -> None:
        """As :meth:`JacapLayer.compress`, each (row, KV head) in buffers of its own kept count plus the
        room the cut asked for (``capacity`` minus the layer's largest kept count), its kept entries
        first in their order (stable), the rest dropped."""
        room = capacity - int(kept.sum(-1).max())
        order = kept_first(kept)  # [b, h, K]
        keys, values = take_slots(keys, order), take_slots(values, order)
        positions, kept = positions.gather(2, order), kept.gather(2, order)
        counts = kept.sum(-1).tolist()  # [b][h]
        # Where a padded layer of the same entries writes its first new token (its K slots, a cut's
        # fillers after each head's entries): the weights of attend(weights=True) are laid out so.
        self.front = kept.shape[-1]
        self.counts = counts
        self.cells = []
        for r, row in enumerate(counts):
            cells = []
            for j, count in enumerate(row):
                cell = JacapLayer(self.sliding_window)
                cell.lazy_initialization(keys, values)
                at = (slice(r, r + 1), slice(j, j + 1), slice(count))  # this cell's kept entries
                cell.compress(keys[at], values[at], positions[at], kept[at], count + room, logical, pads[r:r + 1])
                cells.append(cell)
            self.cells.append(cells)
        self.state = COMPRESSED

    def carry_mass(self, table: torch.Tensor | None) -> None:
        """:meth:`JacapLayer.carry_mass`: each cell reads its row's and KV head's part of ``table [b, h, L]``."""
        self.mass = table
        for r, row in enumerate(self.cells):
            for j, cell in enumerate(row):
                cell.carry_mass(None if table is None else table[r:r + 1, j:j + 1])

    def take(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pieces = [[cell.take(slots[r:r + 1, j:j + 1]) for j, cell in enumerate(row)] for r, row in enumerate(self.cells)]
        return self._join([[k for k, _ in row] for row in pieces]), self._join([[v for _, v in row] for row in pieces])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``key_states/value_states [b, h, q, d]`` to each cell (growing a cell that is full);
        returns them (the attention reads the layer through :meth:`attend`)."""
        for r, row in enumerate(self.cells):
            for j, cell in enumerate(row):
                cell.update(key_states[r:r + 1, j:j + 1], value_states[r:r + 1, j:j + 1])
        return key_states, value_states

    def attend(self, query: torch.Tensor, scaling: float, *, weights: bool = False):
        """:meth:`JacapLayer.attend` per cell, over the query heads of its KV head's GQA group: ``out
        [b, q, Hq, d]``; the weights (``weights=True``) in the padded layout's slot order (each cell's
        kept entries, zeros up to the layer's largest kept count at the cut, then the tokens written
        since), as a padded layer of the same entries returns them."""
        g = query.shape[1] // len(self.cells[0])
        results = [[cell.attend(query[r:r + 1, j * g:(j + 1) * g], scaling, weights=weights)
                    for j, cell in enumerate(row)] for r, row in enumerate(self.cells)]
        out = torch.cat([torch.cat([o for o, _ in row], dim=2) for row in results], dim=0)
        if not weights:
            return out, None

        def laid_out(a: torch.Tensor, count: int) -> torch.Tensor:  # the fillers a padded head holds
            gap = a.new_zeros(*a.shape[:-1], self.front - count)
            return torch.cat([a[..., :count], gap, a[..., count:]], dim=-1)

        return out, self._join([[laid_out(a, self.counts[r][j]) for j, (_, a) in enumerate(row)]
                                for r, row in enumerate(results)])

    def _padded(self, parts: list[list[tuple]], pad) -> tuple:
        width = max(p[0].shape[2] for row in parts for p in row)
        return tuple(self._join([[pad(p[i], width) for p in row] for row in parts]) for i in range(4))

    def held_entries(self):
        """:meth:`JacapLayer.held_entries` of each cell, each left-padded with unheld slots to the
        longest cell's: ``[b, h, E(, d)]``."""
        return self._padded([[cell.held_entries() for cell in row] for row in self.cells], _left_pad)

    def export(self):
        return self._padded([[cell.export() for cell in row] for row in self.cells], _right_pad)

    def slot_map(self, length: int):
        maps = [[cell.slot_map(length) for cell in row] for row in self.cells]
        return self._join([[s for s, _ in row] for row in maps]), self._join([[h for _, h in row] for row in maps])

    def _each(self):
        return (cell for row in self.cells for cell in row)

    def kv_heads(self) -> int:
        return len(self.cells[0]) if self.cells else 0

    def batch_size(self) -> int:
        return len(self.cells)

    def ensure_room(self, new_tokens: int) -> None:
        for cell in self._each():
            cell.ensure_room(new_tokens)

    def buffer_bytes(self) -> int:
        return sum(cell.buffer_bytes() for cell in self._each())

    def kept_bytes(self) -> int:
        return sum(cell.kept_bytes() for cell in self._each())

    def read_bytes(self) -> int:
        return sum(cell.read_bytes() for cell in self._each())

    def slot_bytes(self) -> int:
        return self.cells[0][0].slot_bytes()

    def kept_counts(self) -> torch.Tensor:
        return self._join([[cell.kept_counts() for cell in row] for row in self.cells])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.capacity, 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep batch rows ``indices`` (a row taken twice is copied: its cells are written apart)."""
        taken, cells, counts = set(), [], []
        for i in indices.tolist():
            cells.append(copy.deepcopy(self.cells[i]) if i in taken else self.cells[i])
            counts.append(self.counts[i])
            taken.add(i)
        self.cells, self.counts = cells, counts

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times."""
        self.batch_select_indices(torch.arange(len(self.cells)).repeat_interleave(repeats))

    def reset(self) -> None:
        """Back to an empty layer of the cache's own layout (:attr:`home`)."""
        sliding, backend, home = self.sliding_window, self.backend, self.home
        self.__class__ = home
        self.__dict__.clear()
        home.__init__(self, sliding, backend)


def _left_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x [b, 1, E(, d)]`` with ``width - E`` zero (False) slots before its own along axis 2."""
    extra = width - x.shape[2]
    return x if extra == 0 else F.pad(x, (0, 0, extra, 0) if x.dim() == 4 else (extra, 0))


def _right_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x [b, 1, E(, d)]`` with ``width - E`` zero (False) slots after its own along axis 2."""
    extra = width - x.shape[2]
    return x if extra == 0 else F.pad(x, (0, 0, 0, extra) if x.dim() == 4 else (0, extra))


def layout_for(layer: JacapLayer, kept: torch.Tensor, between_chunks: bool) -> type:
    """The layout class ``layer`` keeps ``kept [b, h, K]`` (bool) in after a cut: between the chunks of a
    chunked prefill (``between_chunks``: the cut is not bucketed and the cache is not tensor-parallel)
    :class:`SplitLayer` when its (row, KV head) pairs keep different counts, so that the held buffers
    stay within the prefill's bound (docs/architecture.md#chunked-prefill); else the cache's own layout
    (``layer``'s, or its :attr:`SplitLayer.home`). A sliding-window layer keeps the cache's own."""
    home = getattr(layer, "home", type(layer))
    if not between_chunks or layer.is_sliding:
        return home
    counts = kept.sum(-1)  # [b, h]
    return SplitLayer if bool((counts != counts.max()).any()) else home


def holding(layout: type, layer: JacapLayer, slots: torch.Tensor, kept: torch.Tensor, positions: torch.Tensor,
            capacity: int, logical: int, pads: torch.Tensor) -> JacapLayer:
    """A new compressed layer of class ``layout`` holding ``layer``'s entries at ``slots [b, h, K]``
    (:meth:`JacapLayer.take`), as :meth:`JacapLayer.keep_slots` would keep them in ``layer``: how a cut
    moves a layer into another layout (:func:`jacap_attn.selection.steps.gather`). A new
    :class:`SplitLayer` remembers ``layer``'s class as its home."""
    init = {"home": type(layer)} if layout is SplitLayer else {}
    new = layout(layer.sliding_window, layer.backend, **init)
    keys, values = layer.take(slots)
    new.lazy_initialization(keys, values)
    new.compress(keys, values, positions, kept, capacity, logical, pads.to(slots.device))
    return new
