"""What the pointwise kernels (gated activations, RoPE) share: their instances (`PointwiseKernel`)
and their recorded launches, kept per instance (`RecordedLaunches`).

A pointwise launch is fixed by the artifact, the grid, the block and the constants after the
operand pointers (sizes and strides). `RecordedLaunches` makes the C launch function of each
once (`kernel_api.native.cuda_launch`) and hands it out again for every later call with equal
constants: ``_run`` launches through it (one C call, instead of converting every parameter in
Python), and ``_launcher`` returns it for `Kernel.run`'s binding, so a new arguments object of a
known shape costs a dictionary lookup, not a new function.
"""

from __future__ import annotations

import threading
from typing import Any

from .... import native
from ....core.dtypes import DataType
from ....launcher import Launcher
from ....metadata import KernelMetadata
from ..kernel import CudaSourceKernel

#: Recorded launches kept per kernel instance (all dropped past this: shapes of one model are few).
LIMIT = 512


class PointwiseKernel(CudaSourceKernel):
    """A pointwise family's instances: one per dtype (f32, f16, bf16) and vector width (16-byte
    vectors, or single elements for operands of any alignment), named ``<class>_<dtype>_v<vec>``;
    every kernel parameter is a pointer or a 64-bit int, passed as a Python int."""

    convert_arguments = False
    min_cc = 80  # cvt.rn.{bf16,f16}x2.f32
    backward = False
    _operands_type: Any = None
    #: The element types, in the order instances are generated.
    DTYPES = (DataType.f32, DataType.f16, DataType.bf16)

    def __init__(self, metadata: KernelMetadata, params: dict) -> None:
        super().__init__(metadata, params)
        self.dtype: DataType = params["dtype"]
        self.vec: int = params["vec"]

    @classmethod
    def variant_params(cls) -> list[dict]:
        return [dict(dtype=dt, vec=v) for dt in cls.DTYPES for v in (16 // dt.bytes, 1)]

    @classmethod
    def instance_name(cls, params: dict) -> str:
        return f"{cls.__name__}_{params['dtype']}_v{params['vec']}"


class RecordedLaunches:
    """``get(artifact, grid, block, n_tensors, constants)`` -> a `Launcher` of the C launch of
    ``artifact``'s kernel, its tensors first, then ``constants`` as 64-bit values; None where
    the native module or a CUDA driver is missing (callers then launch through Python)."""

    def __init__(self) -> None:
        self._found: dict[tuple, tuple[Any, Launcher | None]] = {}
        self._lock = threading.Lock()

    def get(self, artifact: Any, grid: tuple[int, int, int], block: tuple[int, int, int], n_tensors: int,
            constants: tuple[int, ...]) -> Launcher | None:
        key = (id(artifact), grid, block, constants)
        found = self._found.get(key)
        if found is not None:
            return found[1]
        parameters = tuple([(native.TENSOR, i) for i in range(n_tensors)] + [(8, int(c)) for c in constants])
        function = native.cuda_launch(int(artifact.compiled_obj.kernel.handle), n_tensors, grid, block, 0, parameters)
        launcher = None if function is None else Launcher(function)
        with self._lock:
            if len(self._found) >= LIMIT:
                self._found.clear()
            self._found[key] = (artifact, launcher)  # (the artifact kept alive: its id is in the key)
        return launcher
