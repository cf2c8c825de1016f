"""`VectorAddArguments`: the operands of ``out = x + y``, validated and summarised once.

This is the arguments side of the operation (see docs/adding-an-operation.md): it checks the
tensors, records per operand a `TensorAttributes` (element type, stride pattern, alignment) and
a hashable ``signature`` that discovery, support checks and compile caches key on.
"""

from __future__ import annotations

import torch

from kernel_api import Arguments, TensorAttributes
from kernel_api.dtypes import from_torch

_MAX_DIVISIBILITY = 128  # as kernel_api's own arguments: alignments are recorded up to 128 elements
_UNIT = (1,)  # the stride pattern of a 1-D tensor whose one mode is contiguous


def _alignment(t: torch.Tensor) -> int:
    """The largest power of two (capped) dividing the data pointer (in elements) and the length:
    what a kernel's vectorised accesses need of both."""
    bits = t.data_ptr() // t.element_size() | t.numel()
    return min(bits & -bits, _MAX_DIVISIBILITY) if bits else _MAX_DIVISIBILITY


def _check_operand(name: str, t: object, like: torch.Tensor | None) -> torch.Tensor:
    """A 1-D contiguous tensor (with ``like``'s shape, dtype and device when given), or an
    exception naming the operand and what is wrong."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"operand {name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"operand {name}: expected a 1-D tensor, got shape {tuple(t.shape)} (flatten it with .view(-1))")
    if t.numel() > 1 and t.stride(0) != 1:
        raise ValueError(f"operand {name}: must be contiguous, got stride {t.stride(0)} (call .contiguous())")
    if t.is_neg():  # a lazy negation that kernels reading raw memory would not see
        raise ValueError(f"operand {name}: has torch's lazy negative bit set; call .resolve_neg() first")
    if like is None:
        try:
            from_torch(t.dtype)
        except ValueError as exc:
            raise TypeError(f"operand {name}: {exc}") from None
    else:
        if t.shape != like.shape:
            raise ValueError(f"operand {name}: shape {tuple(t.shape)} must equal x's {tuple(like.shape)}")
        if t.dtype != like.dtype:
            raise TypeError(f"operand {name}: dtype {t.dtype} must equal x's {like.dtype}")
        if t.device != like.device:
            raise ValueError(f"operand {name}: on {t.device} but x is on {like.device}")
    return t


class VectorAddArguments(Arguments):
    """``out = x + y`` for 1-D contiguous tensors of one length, dtype and device.

    ``n`` is the length. ``out`` may be ``x`` or ``y`` itself (each element is read before it
    is written by the same thread), but no other view overlapping them (`check_memory`).
    """

    # Every attribute lives in a slot (Arguments declares its own: tensor_attributes, signature,
    # device, device_index and the two that Kernel.run keeps its state in).
    __slots__ = ("x", "y", "out", "n")
    output_names = ("out",)  # what kernel_api.ops.call returns

    def __init__(self, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> None:
        _check_operand("x", x, None)
        _check_operand("y", y, x)
        _check_operand("out", out, x)
        self.x, self.y, self.out = x, y, out
        self.n = x.numel()
        self.device = x.device
        self.device_index = x.get_device()  # -1 for CPU and meta tensors
        # Kernel.run's state on these arguments (its support verdicts and its bound launch):
        # None until a kernel runs them.
        self._verdicts = self._binding = None
        # Operand name -> attributes, in the order the kernels take the tensors.
        self.tensor_attributes = {name: TensorAttributes(from_torch(t.dtype), _UNIT, _alignment(t))
                                  for name, t in (("x", x), ("y", y), ("out", out))}
        # Everything a metadata check depends on, and the device last (choices are per device).
        self.signature = ("vector_add", *(a.key() for a in self.tensor_attributes.values()), self.device_index)

    def check_memory(self) -> None:
        """ValueError when ``out`` partly overlaps ``x`` or ``y`` (threads would read elements
        other threads already overwrote); ``out`` being one of them exactly is fine."""
        size = self.out.element_size() * self.n
        start = self.out.data_ptr()
        for name in ("x", "y"):
            other = getattr(self, name).data_ptr()
            if size and other != start and other < start + size and start < other + size:
                raise ValueError(f"operand out: overlaps operand {name} without being it; write the result to a "
                                 f"separate tensor (or to {name} itself)")

    def __repr__(self) -> str:
        return f"VectorAddArguments(n={self.n}, dtype={self.tensor_attributes['x'].dtype}, device={self.device})"
