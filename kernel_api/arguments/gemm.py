"""`GemmArguments`, and the summaries that let repeated operands skip recomputing it.

A plain GemmArguments (no epilogue) is remembered by `kernel_api.native` under its operands'
raw metadata (dtypes, shapes, strides, pointer alignment, devices); a later construction with
equal metadata recalls the summary (a `GemmSummary`) in C instead of recomputing it in Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .. import native
from ..core.dtypes import _FLOATS, _FROM_TORCH, DataType, to_dtype
from ..core.tensor_attributes import TensorAttributes
from .base import STORAGELESS_TYPES, Arguments, _matrix_attributes, _require_tensor, _shares_memory
from .epilogue import EpilogueArguments

# kernel_api.native's recall/remember once its CPython entry points load (see _use_native);
# until then (or without a C++ compiler) arguments are summarised in Python every time.
_recall: Any = None
_remember: Any = None
_GEMM_SUMMARY = 0x67656D6D  # the tag of GemmArguments' summaries with the default accumulator
# The tag of summaries made with an explicit accumulator, per accumulator: a summary is only ever
# recalled for the accumulator it was made with.
_SUMMARY_TAG = {dt: _GEMM_SUMMARY + 1 + i for i, dt in enumerate(DataType)}
# accumulator_type as callers spell it (torch.float32, "f32", ...) -> its tag, learnt the first
# time each spelling is resolved; spellings that are not hashable are summarised in Python.
_ACCUMULATOR_TAGS: dict[Any, int] = {}
_ACCUMULATOR_SPELLINGS_LIMIT = 64


@dataclass(frozen=True, slots=True)
class GemmSummary:
    """What a plain `GemmArguments` remembers under its operands' raw metadata, and a later
    construction with equal metadata recalls (`kernel_api.native`'s remember/recall keep it as
    an opaque object): the arguments' own attributes."""

    L: int
    M: int
    N: int
    K: int
    accumulator_type: DataType
    device: torch.device
    device_index: int
    #: copied by each recall: every arguments object owns its dict
    tensor_attributes: dict[str, TensorAttributes]
    signature: tuple
    #: The fields above in their order: the recall hit unpacks this tuple, which costs less than
    #: reading nine attributes (or unpacking a NamedTuple, which skips the exact-tuple fast path).
    values: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(getattr(self, f.name) for f in fields(self) if f.init))


def _use_native(entry: Any) -> None:
    global _recall, _remember
    _remember, _recall = entry.remember, entry.recall


native.when_entry_loads(_use_native)


class GemmArguments(Arguments):
    """``out = A @ B`` (plus an optional fused epilogue).

    A is (L, M, K) or (M, K), B (L, K, N) or (K, N), out (L, M, N) or (M, N), all of one
    rank and on one device. ``accumulator_type`` (torch dtype, CuTe DSL type or name)
    defaults to f64 for f64 operands and f32 otherwise. A trivial epilogue (alpha=1,
    beta=0, no bias, no activation) is dropped so plain kernels stay eligible; otherwise
    ``epilogue`` is the epilogue resolved against ``out`` (a copy whose bias is 1-D and whose
    ``bias_kind`` is known; the one passed in is left unchanged) and ``epilogue_signature`` its
    `EpilogueSignature`.
    """

    __slots__ = ("A", "B", "out", "accumulator_type", "epilogue", "epilogue_signature", "L", "M", "N", "K")
    output_names = ("out",)

    def __init__(self, A: torch.Tensor, B: torch.Tensor, out: torch.Tensor, accumulator_type: Any = None,
                 epilogue: EpilogueArguments | None = None) -> None:
        if _recall is not None and epilogue is None and (
                type(A) is torch.Tensor or not isinstance(A, STORAGELESS_TYPES)):
            # Operands with the raw metadata (dtypes, shapes, strides, pointer alignment, devices)
            # of earlier arguments without epilogue and with this accumulator have their summary:
            # found in C, without recomputing it. (Not for fake tensors: C reads data pointers.)
            if accumulator_type is None:
                tag = _GEMM_SUMMARY
            else:
                try:
                    tag = _ACCUMULATOR_TAGS.get(accumulator_type, 0)
                except TypeError:  # not hashable
                    tag = 0
            found = _recall(tag, A, B, out) if tag else None
            if found is not None:  # a GemmSummary
                (self.L, self.M, self.N, self.K, self.accumulator_type, self.device, self.device_index,
                 attributes, self.signature) = found.values
                self.A, self.B, self.out = A, B, out
                self.epilogue = self.epilogue_signature = None
                self._verdicts = self._binding = None
                self.tensor_attributes = attributes.copy()
                return
            plain = (A, B, out)
        else:
            plain = None
        if type(A) is not torch.Tensor:
            _require_tensor(A, "A")
        if type(B) is not torch.Tensor:
            _require_tensor(B, "B")
        if type(out) is not torch.Tensor:
            _require_tensor(out, "out")
        try:
            sa, sb, so = A.shape, B.shape, out.shape
        except RuntimeError:  # a nested tensor has no shape (checked here, off the common path)
            for name, t in (("A", A), ("B", B), ("out", out)):
                _require_tensor(t, name)
            raise
        rank = len(sa)
        if rank not in (2, 3):
            raise ValueError(f"operand A: rank {rank}, expected (L, M, K) or (M, K)")
        if len(sb) != rank:
            raise ValueError(f"operand B: rank {len(sb)} but A has rank {rank}; expected (L, K, N) or (K, N) to match")
        if len(so) != rank:
            raise ValueError(f"operand out: rank {len(so)} but A has rank {rank}; expected (L, M, N) or (M, N) to match")
        M, K = sa[-2], sa[-1]
        N = sb[-1]
        if sb[-2] != K:
            raise ValueError(f"operand B: K mismatch (K dimension: A has {K}, B has {sb[-2]}; "
                             f"A is {tuple(sa)}, B is {tuple(sb)})")
        if so[-2] != M:
            raise ValueError(f"operand out: M mismatch (M dimension: A has {M}, out has {so[-2]}; "
                             f"A is {tuple(sa)}, out is {tuple(so)})")
        if so[-1] != N:
            raise ValueError(f"operand out: N mismatch (N dimension: B has {N}, out has {so[-1]}; "
                             f"B is {tuple(sb)}, out is {tuple(so)})")
        L = 1
        if rank == 3:
            L = sa[0]
            if sb[0] != L:
                raise ValueError(f"operand B: batch mismatch (batch dimension L: A has {L}, B has {sb[0]})")
            if so[0] != L:
                raise ValueError(f"operand out: batch mismatch (batch dimension L: A has {L}, out has {so[0]})")
        device_index = A.get_device()
        if B.get_device() != device_index or (device_index < 0 and B.device != A.device):
            raise ValueError(f"operand B: on {B.device} but A is on {A.device}")
        if out.get_device() != device_index or (device_index < 0 and out.device != A.device):
            raise ValueError(f"operand out: on {out.device} but A is on {A.device}")
        device = A.device
        A, a = _matrix_attributes(A, "A", sa)
        B, b = _matrix_attributes(B, "B", sb)
        out, o = _matrix_attributes(out, "out", so, True)
        if accumulator_type is None:
            acc = DataType.f64 if a.dtype is DataType.f64 else DataType.f32
        else:
            acc = _FROM_TORCH.get(accumulator_type) if isinstance(accumulator_type, torch.dtype) else None
            if acc is None:
                acc = to_dtype(accumulator_type, "accumulator_type")
            if acc not in _FLOATS:
                raise ValueError(f"accumulator_type: {acc} is not a floating-point type")
        epilogue_signature = None
        if epilogue is not None:
            if not isinstance(epilogue, EpilogueArguments):
                raise TypeError(f"epilogue: expected EpilogueArguments, got {type(epilogue).__name__}")
            if epilogue.is_trivial:
                epilogue = None
            else:
                epilogue, epilogue_signature = epilogue._for_output(out, M, N)
        self.A, self.B, self.out = A, B, out
        self.L, self.M, self.N, self.K = L, M, N, K
        self.accumulator_type = acc
        self.epilogue = epilogue
        self.epilogue_signature = epilogue_signature
        self.device = device
        self.device_index = device_index
        self._verdicts = self._binding = None
        self.tensor_attributes = {"A": a, "B": b, "out": o}
        self.signature = ("gemm", rank, a._key, b._key, o._key, acc, epilogue_signature, device_index)
        if plain is not None and plain[0] is A and plain[1] is B and plain[2] is out:  # no re-strided views
            if accumulator_type is None:
                tag = _GEMM_SUMMARY
            else:
                tag = _SUMMARY_TAG[acc]
                try:
                    if len(_ACCUMULATOR_TAGS) < _ACCUMULATOR_SPELLINGS_LIMIT:
                        _ACCUMULATOR_TAGS[accumulator_type] = tag
                except TypeError:  # not hashable: never recalled
                    return
            # (its own dict: one this object's owner might change is never handed to later arguments)
            _remember(tag, GemmSummary(L=L, M=M, N=N, K=K, accumulator_type=acc, device=device,
                                       device_index=device_index, tensor_attributes=dict(self.tensor_attributes),
                                       signature=self.signature), A, B, out)

    @property
    def problem_shape(self) -> tuple[int, int, int, int]:
        """(M, N, K, L)."""
        return (self.M, self.N, self.K, self.L)

    def check_memory(self) -> None:
        # A kernel would overwrite operands it still reads (torch refuses this too).
        for name in ("A", "B"):
            if _shares_memory(self.out, getattr(self, name)):
                raise ValueError(f"operand out: shares memory with operand {name}; write the result to a separate tensor")

    def problem_key(self) -> tuple:
        """The signature with (M, N, K, L): everything a GEMM kernel's choice depends on."""
        return (self.signature, self.M, self.N, self.K, self.L)

    def __repr__(self) -> str:
        a, b, o = (self.tensor_attributes[n] for n in ("A", "B", "out"))
        return (f"GemmArguments(M={self.M}, N={self.N}, K={self.K}, L={self.L}, "
                f"{a.dtype}{a.layout}*{b.dtype}{b.layout}->{o.dtype}{o.layout}, acc={self.accumulator_type}"
                f"{'' if self.epilogue is None else ', ' + repr(self.epilogue)}, device={self.device})")
