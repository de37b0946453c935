"""The pieces of tensor parallelism that one process can check (docs/architecture.md#tensor-parallelism):
the weights fingerprint folded shard by shard, and the head group of one process (the identity)."""

from __future__ import annotations

import pytest
import torch

from jacap_attn.storage import identity
from jacap_attn.storage.distributed import SINGLE, HeadGroup


def _blocks(tensor: torch.Tensor, dim: int, pieces: int):
    """``(block, offset)`` of ``tensor`` split along ``dim`` as ``torch.chunk`` (DTensor's ``Shard``) does."""
    start = 0
    for block in tensor.chunk(pieces, dim=dim):
        offset = [0] * tensor.dim()
        offset[dim] = start
        start += block.shape[dim]
        yield block, tuple(offset)


@pytest.mark.parametrize("shape, dim, pieces", [((10, 7), 0, 2), ((10, 7), 1, 2), ((9, 6), 0, 4), ((13,), 0, 3),
                                                ((4, 5, 6), 1, 2), ((4, 5, 6), 2, 4), ((6, 4), 0, 1)])
def test_shard_folds_sum_to_the_whole_tensors_fold(shape, dim, pieces):
    """What a tensor-parallel rank folds of its shard, summed over the ranks modulo P, is the single
    process's number: the fingerprint of a sharded model is the unsharded one's."""
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape) + dim))
    whole = identity._fold(tensor)
    parts = [identity._fold(block, offset, shape) for block, offset in _blocks(tensor, dim, pieces)]
    assert torch.equal(torch.stack(parts).sum(0) % identity._P, whole)
    changed = tensor.clone()
    changed.view(-1)[3] += 1.0
    assert not torch.equal(identity._fold(changed), whole)


def test_one_process_head_group_is_the_identity():
    x = torch.arange(24).reshape(2, 3, 4)
    flags = torch.tensor([True, False])
    assert SINGLE.gather(x) is x and SINGLE.local(x) is x and SINGLE.any(flags) is flags
    assert SINGLE.gather_many([x, flags]) == [x, flags] and SINGLE.gather_padded([x]) == [x]
    assert not SINGLE.split and not SINGLE.distributed and SINGLE.is_writer() and SINGLE.offset(3) == 0
    assert SINGLE.share({"a": 1}) == {"a": 1}
    assert SINGLE.for_heads(3, 3) is SINGLE


def test_heads_split_unevenly_are_refused_by_name():
    with pytest.raises(ValueError, match="holds 2 of the model's 8 KV heads in a group of 1"):
        SINGLE.for_heads(2, 8)
    with pytest.raises(ValueError, match="shards must be 1 or the group's size 1, got shards=2"):
        HeadGroup(None, 2)
