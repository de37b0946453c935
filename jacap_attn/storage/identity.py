"""What a cache knows of the model and prompt it was built for: the model's shape, a fingerprint of
all its weights, and the checksum of the prompt ids (docs/cache.md#misuse-errors).

This module imports nothing else from the package, so ``cache`` and ``persist`` can both use it.
"""

from __future__ import annotations

import hashlib
import json
import weakref

import torch

# Modulus of the weight folds: the Mersenne prime 2^31 - 1, so that every product of two residues
# fits in an int64 (exact integer arithmetic: the CPU and every GPU give the same numbers).
_P = (1 << 31) - 1
# Elements of one row chunk of a weight matrix: bounds the fold's temporary memory (16 MiB of int32
# products per chunk, whatever the matrix).
_CHUNK = 1 << 22
_ROW_SALTS = (0x2545F491, 0x4F6CDD1D)  # one row-weight vector per int64 number of a parameter
_COLUMN_SALT = 0x1B873593


def model_shape(model) -> dict:
    """The architecture facts a cache's buffers depend on (type, layers, KV heads, head dim)."""
    config = model.config
    return {
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": getattr(config, "num_key_value_heads", config.num_attention_heads),
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
    }


def ids_sha256(ids: torch.Tensor) -> str:
    """SHA-256 (hex) of token ids ``[b, n]``: the JSON shape list, then the int64 little-endian values.
    What a saved file's ``prompt_sha256`` holds (docs/cache.md#checksums)."""
    ids = ids.detach().to("cpu", torch.int64).contiguous()
    digest = hashlib.sha256(json.dumps(list(ids.shape)).encode())
    digest.update(ids.numpy().astype("<i8").tobytes())
    return digest.hexdigest()


def _mix(index: torch.Tensor, salt: int) -> torch.Tensor:
    """Fixed pseudo-random integers in [0, 2^31 - 1) for int64 ``index`` values (< 2^32): a degree-4
    polynomial of the index modulo :data:`_P`, exact in int64 on every device."""
    x = (index * 1103515245 + salt) % _P
    x = (x * x + 12345) % _P
    return (x * x + salt) % _P


def _fold(tensor: torch.Tensor, offset: tuple | None = None, shape: tuple | None = None) -> torch.Tensor:
    """Two numbers in [0, 2^31 - 1) (int64 ``[2]`` on ``tensor``'s device) that change with any element
    of ``tensor`` (seen as ``[rows, columns]``, 1-D as one row), computed on its own device, one row
    chunk at a time.

    Floating-point values are rounded to bfloat16 and read as their int16 bits ``w``; integer values
    are taken modulo 2^16. With fixed pseudo-random column weights ``b_c`` in [1, 2^15] and row
    weights ``a_kr`` in [1, 2^31 - 2], number ``k`` is ``sum_r a_kr * (sum_c b_c * w_rc mod P) mod P``
    (``P = 2^31 - 1``): the products fit int32 and the sums int64, so no step overflows or rounds.

    ``tensor`` may be one block of a larger tensor of ``shape`` starting at ``offset`` (per dimension:
    one rank's shard of a tensor-parallel weight): the rows and columns are then weighted by their
    indices in the whole tensor, so the sum of every block's numbers modulo ``P`` is the whole tensor's
    (both numbers are linear in the values modulo ``P``)."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    device = tensor.device
    local = tuple(tensor.shape)
    shape = local if shape is None else tuple(shape)
    offset = (0,) * len(shape) if offset is None else tuple(offset)
    if len(shape) < 2:  # one row; its columns are the elements
        matrix = tensor.reshape(1, -1)
        row_index = torch.zeros(1, dtype=torch.int64, device=device)
        cols = torch.arange(matrix.shape[1], device=device, dtype=torch.int64) + (offset[0] if shape else 0)
    else:
        matrix = tensor.flatten(1)
        row_index = torch.arange(local[0], device=device, dtype=torch.int64) + offset[0]
        cols = torch.zeros((), dtype=torch.int64, device=device)
        stride = 1
        for dim in range(len(shape) - 1, 0, -1):  # the flattened index of each element in the whole tensor
            index = torch.arange(local[dim], device=device, dtype=torch.int64) + offset[dim]
            cols = cols + index.reshape(-1, *([1] * (len(shape) - 1 - dim))) * stride
            stride *= shape[dim]
        cols = cols.reshape(-1)
    rows, columns = matrix.shape
    b = (_mix(cols, _COLUMN_SALT) % (1 << 15) + 1).to(torch.int32)
    totals = torch.zeros(len(_ROW_SALTS), dtype=torch.int64, device=device)
    step = max(1, _CHUNK // max(columns, 1))
    for start in range(0, rows, step):
        chunk = matrix[start:start + step]
        if chunk.is_floating_point():
            bits = chunk.to(torch.bfloat16).view(torch.int16).to(torch.int32)
        else:
            bits = (chunk.to(torch.int64) % (1 << 16) - (1 << 15)).to(torch.int32)
        residues = (bits.mul_(b).sum(dim=1, dtype=torch.int64) % _P)  # [chunk rows], each < 2^31
        index = row_index[start:start + chunk.shape[0]]
        for k, salt in enumerate(_ROW_SALTS):
            a = _mix(index, salt) % (_P - 1) + 1
            totals[k] = (totals[k] + (residues * a % _P).sum()) % _P
    return totals


def _fold_parameter(param: torch.Tensor):
    """``(numbers, group)``: :func:`_fold` of a parameter and the process group over which the ranks'
    numbers must be summed (``None``: they are the whole tensor's already). A tensor-parallel weight
    (a ``DTensor`` split by one ``Shard`` placement on a 1-D mesh) folds its local shard at its place
    in the whole tensor; a replicated one its local copy; any other layout is gathered whole first
    (``full_tensor``, a collective)."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # pragma: no cover - a torch without distributed support
        return _fold(param), None
    if not isinstance(param, DTensor):
        return _fold(param), None
    placements = tuple(param.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return _fold(param.to_local()), None
    if param.device_mesh.ndim == 1 and isinstance(placements[0], Shard):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, placements)
        return _fold(param.to_local(), offset, tuple(param.shape)), param.device_mesh.get_group()
    return _fold(param.full_tensor()), None


def unwrapped(model):
    """The module a ``torch.compile(model)`` wrapper (``OptimizedModule``) compiles, else ``model``: the one whose
    parameters, names and patch state are the model's own (the wrapper's names gain an ``_orig_mod.`` prefix)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return model._orig_mod if isinstance(model, OptimizedModule) else model


def weights_fingerprint(model) -> str:
    """SHA-256 (hex) of every parameter of ``model``: each name and shape, and two numbers folded from
    all its values (:func:`_fold`), so any change of a weight that changes the keys or values (a merged
    LoRA adapter, a fine-tuned or other checkpoint of the same shape) changes it, short of changes
    below bfloat16 resolution (values are rounded to bfloat16 first).

    Device- and dtype-independent: exact integer arithmetic gives the same value on the CPU and on any
    GPU, and a float32 model and its bfloat16 copy agree (a float16 copy may not: its values round
    twice). Cost: every parameter is read once, on its own device, in row chunks of 4M elements (at
    most 16 MiB of temporaries; no copy to the CPU, only two int64 numbers per parameter come back):
    one pass over the weights, a few elementwise integer kernels per chunk, e.g. about 0.5 s for
    SmolLM2-135M on one CPU core; for an 8B model about 16 GB of bfloat16 reads on its GPU.

    A tensor-parallel model's weights (``DTensor`` shards, ``from_pretrained(..., tp_plan=...)``) give the
    value of the same weights in one process: each rank folds its shard at its place in the whole
    tensor (:func:`_fold_parameter`) and one all-reduce per process group sums the numbers, so every
    rank must compute it (the cache does, on every rank alike); nothing is gathered.

    Memoised on the patch state (``model._jacap_state.weights_sha256``): computed once per patched
    model (a deep copy of a patched model computes its own). Weights changed in place afterwards
    (an adapter merged into the patched model) are not noticed: ``unpatch`` and ``patch`` again. An
    unpatched model is fingerprinted at each call.
    """
    model = unwrapped(model)
    state = getattr(model, "_jacap_state", None)
    owner = getattr(state, "weights_owner", None)
    if getattr(state, "weights_sha256", None) is not None and owner is not None and owner() is model:
        return state.weights_sha256
    digest = hashlib.sha256()
    with torch.no_grad():
        folds, groups = [], {}  # per parameter; the parameters whose shards are summed over a group
        for name, param in model.named_parameters():
            numbers, group = (None, None) if param.device.type == "meta" else _fold_parameter(param.detach())
            folds.append((name, tuple(param.shape), numbers))
            if group is not None:
                groups.setdefault(group, []).append(len(folds) - 1)
        for group, indices in groups.items():  # one all-reduce per tensor-parallel group
            import torch.distributed as dist

            stacked = torch.stack([folds[i][2] for i in indices])
            dist.all_reduce(stacked, group=group)
            for i, numbers in zip(indices, stacked % _P):
                folds[i] = (*folds[i][:2], numbers)
        for name, shape, numbers in folds:
            digest.update(f"{name}:{shape};".encode())
            if numbers is not None:
                digest.update(json.dumps(numbers.tolist()).encode())
    value = digest.hexdigest()
    if state is not None:
        # The owner (a weak reference, which a deep copy shares) tells a copy's state from the model's own.
        state.weights_sha256, state.weights_owner = value, weakref.ref(model)
    return value


def legacy_weights_fingerprint(model, layers) -> str:
    """The weights fingerprint that cache files of formats 1 and 2 hold: SHA-256 of fixed small slices
    (16 rows x 256 columns from the middle of the input embedding, the first 4096 entries of every 1-D
    parameter outside the middle decoder layers), rounded to bfloat16. Weaker than
    :func:`weights_fingerprint` (a merged low-rank adapter leaves it unchanged); used only to check
    older files, so that they keep loading with the model that made them. ``layers``: the model's
    decoder layers, in order (its adapter's ``decoder_layers(model)``)."""
    layers = list(layers)
    middle = {id(p) for layer in layers[1:-1] for p in layer.parameters()}
    embed = _whole(model.get_input_embeddings().weight)
    row = embed.shape[0] // 2
    parts = [("embed", embed[row:row + 16, :256])]
    parts += [(name, _whole(p)[:4096]) for name, p in model.named_parameters() if p.dim() == 1 and id(p) not in middle]
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
    return digest.hexdigest()


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel parameter (a ``DTensor``) gathered whole (a collective); any other as it is."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch without distributed support
        return tensor
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def special_token_ids(model) -> list[int]:
    """The model's special token ids: ``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` (ints or
    lists) of its ``generation_config`` and its ``config`` (the ids ``keep_special`` keeps in a short
    prompt, docs/method.md#short-prompts)."""
    ids = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(source, name, None)
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
                    ids.add(item)
    return sorted(ids)
