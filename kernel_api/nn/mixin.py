"""`adopt`: the same module, with a kernel_api forward in front of its class.

A patched layer is an object of a class made from a kernel_api mixin and the layer's own class
(``KernelApiLlamaRMSNorm(RMSNorm, LlamaRMSNorm)``), holding the original's Parameter, buffer
and child objects: ``isinstance``, ``state_dict`` and ``extra_repr`` stay the original's, and
the mixin's forward reaches the original one through `forward_behind` (what ``super().forward``
gives, looked up by class).
"""

from __future__ import annotations

from typing import Any

import torch

from ..core import tracing
from ..ops import dispatch as _dispatch
from .lowering import keeps_op

_classes: dict[tuple[type, type], type] = {}
# Each class made with a front class: the class behind the front, whose forward the front's
# ``super().forward`` reaches (read at call time: a forward replaced on that class is followed).
_behind: dict[type, type] = {}


def adopted_class(mixin: type, cls: type) -> type:
    """``cls`` with ``mixin`` in front, made once per pair."""
    found = _classes.get((mixin, cls))
    if found is None:
        found = _classes[(mixin, cls)] = type(f"KernelApi{cls.__name__}", (mixin, cls), {
            "__module__": mixin.__module__,
            "__doc__": f"{cls.__module__}.{cls.__qualname__} with {mixin.__qualname__}'s forward "
                       f"(kernel_api.nn.patch)."})
        declare_behind(found, cls)
    return found


def declare_behind(made: type, cls: type) -> None:
    """Record that ``made`` puts a front class before ``cls``: `forward_behind` then gives
    ``cls.forward`` for its objects."""
    _behind[made] = cls


def forward_behind(module: torch.nn.Module, front: type) -> Any:
    """The forward ``super(front, module).forward`` reaches (unbound): the class's behind the
    front mixin, from a table keyed by the made class. Under Dynamo ``super()`` guards the
    class's method order at every layer on every call; a table lookup guards once per class."""
    # (``__class__``, not ``type()``: Dynamo guards type() of an object with a Python lambda)
    found = _behind.get(module.__class__)
    return found.forward if found is not None else super(front, module).forward.__func__


def adopt(mixin: type, module: torch.nn.Module) -> Any:
    """An object of ``adopted_class(mixin, type(module))`` with ``module``'s state: the same
    Parameter, buffer and child objects and hooks, in dictionaries of its own (so that swapping
    a child of one does not reach the other)."""
    cls = adopted_class(mixin, type(module))
    new = cls.__new__(cls)
    new.__dict__.update({key: value.copy() if isinstance(value, dict) else value
                         for key, value in module.__dict__.items()})
    return new


def ops_take(*tensors: torch.Tensor) -> bool:
    """Whether kernel_api's ops launch on these tensors: all on one device type the front door
    launches on (`ops.dispatch.LAUNCH_DEVICE_TYPES`) or on the meta device, in one dtype. The
    patched layers run their original forward on anything else (a CPU model, mixed dtypes)."""
    first = tensors[0]
    kind, dtype = first.device.type, first.dtype
    if kind != "meta" and kind not in _dispatch.LAUNCH_DEVICE_TYPES:
        return False
    for t in tensors[1:]:  # (a loop: Dynamo, tracing it in every patched layer, traces a generator as a frame)
        if t.device.type != kind or t.dtype != dtype:
            return False
    return True


def op_here(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` (a kernel_api layer of a memory-bound operation) calls kernel_api's op
    here: always in eager code; under Dynamo only when its ``compile_lowering`` says
    "kernel_api" (`kernel_api.nn.lowering.keeps_op`), otherwise its torch forward runs, for
    Inductor to generate and fuse with its neighbours."""
    return not tracing.is_dynamo_compiling() or keeps_op(layer)
