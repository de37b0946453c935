"""Several devices on a CPU-only machine, for testing that tensors follow the layer they serve
(tests/test_device_map.py; docs/architecture.md#sharded-layers).

:class:`OnDevice` wraps a CPU tensor and reports another device (``lazy:0``, ``lazy:1``, ...: a device type
that a CPU build of torch has a device guard for, and not ``meta``, which the library treats as weights
not loaded); :class:`Devices` (a dispatch mode) runs every
aten op on the wrapped CPU tensors, so the numbers are the CPU's, and enforces what a machine with
several accelerators enforces: the tensors of one op must be on one device (a plain CPU tensor of 0
dims excepted; ``to`` / ``copy_`` move between devices; a CPU index may index another device's
tensor), factory functions create on the device they are given (``device=`` a fake one: wrapped) or
on the CPU. :func:`place` puts a model's modules on fake devices as ``device_map`` does, with
accelerate's rule of moving every tensor argument of a decoder layer to the layer's device.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

FAKE = "lazy"  # the device type the wrapped tensors report
_MOVES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}
_INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default}


class OnDevice(torch.Tensor):
    """A CPU tensor ``elem`` that reports ``device`` (a fake one)."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor, device):
        out = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), dtype=elem.dtype,
                                                  device=torch.device(device), requires_grad=False)
        out.elem = elem
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with Devices():
            return func(*args, **(kwargs or {}))

    def __repr__(self):
        return f"OnDevice({self.elem!r}, device={self.device})"


class DeviceMismatch(RuntimeError):
    """Tensors of two devices met in one op."""


class Devices(TorchDispatchMode):
    """Run every op on the CPU tensors inside :class:`OnDevice`, with the device rules of several
    accelerators (see the module docstring); :class:`DeviceMismatch` names the op and the devices."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        destination = args[0] if args else None
        seen = set()

        def unwrap(x, index=False):
            if isinstance(x, OnDevice):
                seen.add(x.device)
                return x.elem
            if isinstance(x, torch.Tensor) and x.dim() and not index:
                seen.add(x.device)
            return x

        if func in _INDEXING:  # a CPU index may index another device's tensor
            args = (unwrap(args[0]), tree_map(lambda x: unwrap(x, index=True), args[1]),
                    *tree_map(unwrap, tuple(args[2:])))
            kwargs = tree_map(unwrap, kwargs)
        else:
            args, kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        target = kwargs.get("device")
        if target is not None:
            kwargs["device"] = torch.device("cpu")
        if len(seen) > 1 and func not in _MOVES:
            raise DeviceMismatch(f"{func}: tensors on {sorted(map(str, seen))}")
        out = func(*args, **kwargs)
        if func is torch.ops.aten.copy_.default:  # in place: the destination, on its own device
            return destination
        device = torch.device(target) if target is not None else next(iter(seen), torch.device("cpu"))
        if device.type != FAKE:
            return out
        return tree_map(lambda x: OnDevice(x, device) if isinstance(x, torch.Tensor) else x, out)


class TensorsOnDevices(TorchFunctionMode):
    """``torch.tensor`` / ``torch.as_tensor`` with a fake ``device=`` (built below the dispatch mode's
    reach): built on the CPU, then moved through :class:`Devices`; ``tolist`` of a fake device's tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.tolist and isinstance(args[0], OnDevice):  # as an accelerator's tensor does
            return args[0].elem.tolist()
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            device = torch.device(kwargs.pop("device"))
            if device.type == FAKE:
                return func(*args, **kwargs).to(device)
            kwargs["device"] = device
        return func(*args, **kwargs)


class fake_devices:
    """Context manager: both modes (the devices exist only inside it)."""

    def __enter__(self):
        self.modes = (Devices(), TensorsOnDevices())
        for mode in self.modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self.modes):
            mode.__exit__(*exc)


def place(model, devices: dict) -> None:
    """Put ``model``'s modules on fake devices (inside :class:`fake_devices`): ``devices`` maps a module
    name (``"model.layers.1"``) to a device (``"lazy:1"``), a module's submodules going with it, as a
    ``device_map`` does; every decoder layer and the final norm get a pre-hook moving their tensor
    arguments to their device (accelerate's ``AlignDevicesHook``; the cache object passes as it is)."""
    for name, module in model.named_modules():
        device = None
        for prefix, where in devices.items():
            if name == prefix or name.startswith(prefix + "."):
                device = torch.device(where)
        if device is None:
            continue
        for key, param in list(module._parameters.items()):
            if param is not None and not isinstance(param, OnDevice):
                module._parameters[key] = torch.nn.Parameter(OnDevice(param.data, device), requires_grad=False)
        for key, buffer in list(module._buffers.items()):
            if buffer is not None and not isinstance(buffer, OnDevice):
                module._buffers[key] = OnDevice(buffer, device)
        if name in devices:
            module.register_forward_pre_hook(_mover(device), with_kwargs=True)


def _mover(device):
    def move(x):
        return x.to(device) if isinstance(x, torch.Tensor) else x

    def hook(module, args, kwargs):
        return tree_map(move, args), {k: v if k in ("past_key_values", "cache") else tree_map(move, v)
                                      for k, v in kwargs.items()}

    return hook
