"""KV heads shared by the ranks of a tensor-parallel model (docs/architecture.md#tensor-parallelism).

A model loaded with transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")`` under
``torchrun``) splits each layer's ``k_proj`` / ``v_proj`` by output columns: rank ``r`` of ``R``
computes, attends and caches KV heads ``[r * h, (r + 1) * h)`` of every layer (``h = H / R``), as plain
local tensors. Each rank compresses its own heads; every decision that compares heads or layers (the
``global`` budget, a method's per-head budgets, cross-layer consensus, special tokens, word spans)
must be the same on every rank, and the one a single process holding all ``H`` heads would make.

:class:`HeadGroup` is that agreement, kept out of the selection code: :meth:`HeadGroup.gather` turns
a rank's ``[b, h, ...]`` tensor into every head's ``[b, H, ...]`` (an all-gather over the group,
concatenated in rank order: the head order of the single-process model), each rank then computes the
same decision on all ``H`` heads, and :meth:`HeadGroup.local` slices its own heads back. A group of one
(:data:`SINGLE`, every model without tensor parallelism) is the identity: nothing is gathered, no
collective runs. A model whose heads are not split by its plan (Phi-3's fused ``qkv_proj`` is gathered
before attention) has a group with ``shards == 1``: every rank holds every head, gathers nothing, and
only :meth:`HeadGroup.is_writer` (rank 0 writes a saved file) tells the ranks apart.

This module imports nothing else from the package.
"""

from __future__ import annotations

import torch


class HeadGroup:
    """The ranks that share a model's KV heads, or one process holding them all.

    Parameters
    ----------
    group: a ``torch.distributed`` process group (the model's tensor-parallel group), or ``None`` (one
        process: :data:`SINGLE`).
    shards: how many ranks split each layer's KV heads: 1 (every rank holds every head) or the group's
        size.

    Attributes: ``size`` and ``rank`` (this process in ``group``; 1 and 0 without one).

    Raises ``ValueError`` for ``shards`` other than 1 or the group's size.
    """

    def __init__(self, group=None, shards: int = 1):
        self.group = group
        if group is None:
            self.size, self.rank = 1, 0
        else:
            import torch.distributed as dist

            self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if shards not in (1, self.size):
            raise ValueError(f"shards must be 1 or the group's size {self.size}, got shards={shards!r}")
        self.shards = shards

    def __repr__(self) -> str:
        return f"HeadGroup(size={self.size}, rank={self.rank}, shards={self.shards})"

    def __deepcopy__(self, memo):  # a process group is shared, never copied
        return self

    @property
    def distributed(self) -> bool:
        """Whether more than one process runs the model (the collectives of saving run)."""
        return self.size > 1

    @property
    def split(self) -> bool:
        """Whether the ranks hold different KV heads (the cut gathers them)."""
        return self.shards > 1

    def is_writer(self) -> bool:
        """Whether this process writes the files of the group (rank 0)."""
        return self.rank == 0

    def for_heads(self, local: int, total: int) -> "HeadGroup":
        """The group of a layer of which this rank holds ``local`` KV heads out of the model's ``total``:
        split when ``local * size == total`` (and ``local < total``), replicated when ``local == total``.
        Raises ``ValueError`` naming both counts otherwise (a plan that splits heads unevenly, or a
        mid-head split: jacap_attn needs whole KV heads per rank)."""
        if local == total:
            return self if self.shards == 1 else HeadGroup(self.group, 1)
        if self.group is not None and local * self.size == total:
            return self if self.shards == self.size else HeadGroup(self.group, self.size)
        raise ValueError(f"a rank holds {local} of the model's {total} KV heads in a group of {self.size} "
                         f"process(es): jacap_attn needs the KV heads split evenly over the tensor-parallel ranks "
                         f"(num_key_value_heads divisible by the world size) or not split at all")

    def offset(self, local: int) -> int:
        """Index, among the model's KV heads, of this rank's first head (``local`` heads per rank)."""
        return self.rank * local if self.split else 0

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` (the KV head axis) in rank order: ``[b, h, ...]``
        to ``[b, h * shards, ...]``, the same tensor on every rank (bool travels as uint8); ``x`` itself
        when the heads are not split. Every rank must call it (a collective) with the same shape and dtype."""
        if not self.split:
            return x
        if x.dtype == torch.bool:  # not every backend sends bool
            return self.gather(x.to(torch.uint8), dim).bool()
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def gather_many(self, tensors: list[torch.Tensor], dim: int = 1) -> list[torch.Tensor]:
        """:meth:`gather` of several tensors sharing their first ``dim + 1`` sizes (``[b, h, ...]``), in
        one all-gather per dtype and device (their trailing sizes flattened and concatenated)."""
        if not self.split or not tensors:
            return list(tensors)
        lead = tensors[0].shape[:dim + 1]
        out: list = [None] * len(tensors)
        groups: dict = {}
        for i, t in enumerate(tensors):
            if t.shape[:dim + 1] != lead:
                raise ValueError(f"gather_many: tensor {i} has shape {tuple(t.shape)}, the first has "
                                 f"{tuple(tensors[0].shape)}; they must share their first {dim + 1} sizes")
            groups.setdefault((t.dtype, t.device), []).append(i)
        for indices in groups.values():
            flat = [tensors[i].reshape(*lead, -1) for i in indices]
            widths = [f.shape[-1] for f in flat]
            whole = self.gather(torch.cat(flat, dim=-1) if len(flat) > 1 else flat[0], dim)
            for i, piece in zip(indices, whole.split(widths, dim=-1)):
                out[i] = piece.reshape(*whole.shape[:dim + 1], *tensors[i].shape[dim + 1:])
        return out

    def gather_padded(self, tensors: list[torch.Tensor], length: int = 2, dim: int = 1) -> list[torch.Tensor]:
        """:meth:`gather_many` of tensors whose size along ``length`` may differ between the ranks (a
        layer's held slots): each is padded with zeros (``False``) to the largest over the ranks first,
        so the padding must mean nothing (slots marked invalid)."""
        if not self.split or not tensors:
            return list(tensors)
        import torch.distributed as dist

        width = torch.tensor([tensors[0].shape[length]], dtype=torch.int64, device=tensors[0].device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=self.group)
        padded = []
        for t in tensors:
            extra = int(width) - t.shape[length]
            if extra:
                t = torch.cat([t, t.new_zeros(*t.shape[:length], extra, *t.shape[length + 1:])], dim=length)
            padded.append(t)
        return self.gather_many(padded, dim)

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of every head's ``x`` along ``dim`` (``[b, H, ...]`` to ``[b, H / shards, ...]``);
        ``x`` itself when the heads are not split."""
        if not self.split:
            return x
        width = x.shape[dim] // self.shards
        return x.narrow(dim, self.rank * width, width)

    def any(self, x: torch.Tensor) -> torch.Tensor:
        """Bool ``x`` OR-ed over the ranks (the same on every rank); ``x`` itself when the heads are not split."""
        if not self.split:
            return x
        import torch.distributed as dist

        y = x.to(torch.uint8).contiguous()
        dist.all_reduce(y, op=dist.ReduceOp.MAX, group=self.group)
        return y.bool()

    def share(self, value, src: int = 0):
        """``value`` of rank ``src`` on every rank (a picklable Python object; ``broadcast_object_list``);
        ``value`` itself without a group."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, group_src=src, group=self.group)
        return box[0]

    def agree(self, value, what: str) -> None:
        """Raise ``ValueError`` on every rank unless every rank of the group passes an equal ``value`` (picklable;
        a dict's differing keys are named): ranks that disagree would make other cuts, or wait for ever in a
        collective the others skip. A no-op without a group."""
        if not self.distributed:
            return
        import torch.distributed as dist

        values = [None] * self.size
        dist.all_gather_object(values, value, group=self.group)
        if all(v == values[0] for v in values[1:]):
            return
        if all(isinstance(v, dict) for v in values):
            keys = sorted({k for v in values for k in v if any(w.get(k) != v.get(k) for w in values)}, key=str)
            values = [{k: v.get(k) for k in keys} for v in values]
        raise ValueError(f"the ranks of this tensor-parallel model disagree on {what}: "
                         f"{'; '.join(f'rank {i}: {v!r}' for i, v in enumerate(values))}; every rank must make the "
                         "same calls with the same arguments")

    def raise_any(self, error: BaseException | None) -> None:
        """Raise, on every rank, the first rank's ``error`` that is not ``None`` (each rank passes its own): a rank
        that failed alone would leave the others waiting in the next collective. A no-op without a group."""
        if not self.distributed:
            if error is not None:
                raise error
            return
        import torch.distributed as dist

        errors = [None] * self.size
        dist.all_gather_object(errors, error, group=self.group)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first


SINGLE = HeadGroup()


def tensor_parallel_group(model):
    """The process group of ``model``'s tensor parallelism, or ``None``: the device mesh of its first
    DTensor parameter split by a ``Shard`` placement (what ``from_pretrained(..., tp_plan=...)`` makes),
    its ``"tp"`` dimension if the mesh has several; else the model's own ``_device_mesh`` if it has a
    ``"tp"`` dimension. ``None`` without ``torch.distributed``, when no process group is running, and
    for a model whose transformers tensor-parallel size (``_tp_size``) is 1 (FSDP shards weights too,
    but every rank runs its own inputs: nothing is shared). Raises ``ValueError`` for a mesh of several
    dimensions none of which is named ``"tp"``."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    tp_size = getattr(model, "_tp_size", None)
    if tp_size is not None and tp_size <= 1:  # sharded another way (FSDP: every rank its own data)
        return None
    from torch.distributed.tensor import DTensor, Shard

    mesh = None
    for param in model.parameters():
        if isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements):
            mesh = param.device_mesh
            break
    if mesh is None:
        mesh = getattr(model, "_device_mesh", None)
        if mesh is None or "tp" not in (getattr(mesh, "mesh_dim_names", None) or ()):
            return None
    if mesh.ndim > 1:
        names = getattr(mesh, "mesh_dim_names", None) or ()
        if "tp" not in names:
            raise ValueError(f"the model's device mesh has dimensions {names}, none named 'tp': jacap_attn finds "
                             "the tensor-parallel group by that name")
        mesh = mesh["tp"]
    return mesh.get_group() if mesh.size() > 1 else None


def head_group(model) -> HeadGroup:
    """The :class:`HeadGroup` of ``model``: its tensor-parallel group (:func:`tensor_parallel_group`) with
    the heads split over its ranks or not, as transformers sizes a tensor-parallel model's caches
    (``get_kv_heads_per_rank`` of the model's ``tp_plan``: split when ``k_proj`` is ``colwise``; when
    transformers has no such function, split); :data:`SINGLE` without one. The cut checks each layer's
    heads against it (:meth:`HeadGroup.for_heads`).

    Raises ``ValueError`` when the plan splits the KV heads unevenly over the ranks."""
    group = tensor_parallel_group(model)
    if group is None:
        return SINGLE
    import torch.distributed as dist

    size = dist.get_world_size(group)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    total = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    try:
        from transformers.distributed.tensor_parallel import get_kv_heads_per_rank
    except ImportError:  # older transformers: the heads of a tensor-parallel model are split
        return HeadGroup(group, size)
    local = get_kv_heads_per_rank(dict(getattr(model, "tp_plan", None) or {}), total, size)
    if not isinstance(local, int):
        raise ValueError(f"the model's tensor-parallel plan cannot split its {total} KV heads evenly over {size} "
                         "ranks: jacap_attn needs num_key_value_heads divisible by the world size")
    return HeadGroup(group, 1 if local == total else size)
