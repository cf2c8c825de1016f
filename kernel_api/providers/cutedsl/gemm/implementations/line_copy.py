"""`copy_lines`: the copies `Sm90RealignedGemm` stages its operands with (``line_copy.cu``).

A line is a row of a row-major operand or a column of a column-major one, the unit TMA needs
16-byte aligned. ``copy_lines(dst, src, row_major, stream, device)`` copies every line of
``src`` into ``dst`` (same shape, dtype and majorness) whatever either side's alignment, at
close to the device's copy rate; it declines (returns False, copying nothing) what it does not
take, and the caller then uses torch's ``copy_``. The kernel is compiled with NVRTC once per
process (the disk cache keeps the cubin), by `prepare` or on first use.
"""

from __future__ import annotations

import os
import threading

import torch

from .....nvrtc import CudaLauncher, compile_cuda

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "line_copy.cu")
THREADS = 256  # line_copy.cu's THREADS (its launch bounds)
#: The kernel's units of work, (threads, vectors per thread): a warp's for short lines (several
#: lines per CTA) and a CTA's. (Two warps of 8 vectors each, half the threads per 512 vectors,
#: ran 2.2 TB/s on 8 KB lines against the CTA's 2.9 on an H200.)
UNITS = ((32, 4), (256, 4))
#: Lines of fewer destination vectors than this take warp units (several lines per CTA).
WARP_UNITS_BELOW = 512
_ELEMENT_SIZES = (2, 4)
_launchers: dict[tuple[int, int, int], CudaLauncher] = {}
_lock = threading.Lock()


def _launcher(element_size: int, unit: tuple[int, int]) -> CudaLauncher:
    key = (element_size, *unit)
    found = _launchers.get(key)
    if found is None:
        with _lock:
            found = _launchers.get(key)
            if found is None:
                with open(_SOURCE) as f:
                    source = f.read()
                keys = [(size, g, u) for size in _ELEMENT_SIZES for g, u in UNITS]
                names = [f"ka_line_copy::line_copy<{size}, {g}, {u}>" for size, g, u in keys]
                compiled = compile_cuda(source, cc=90, name_expressions=names, source_name="line_copy.cu",
                                        toolkit_headers=False)
                for k, name in zip(keys, names):
                    _launchers[k] = CudaLauncher(compiled, name, f"line_copy<{k[0]}, {k[1]}, {k[2]}>",
                                                 convert_args=False)
                found = _launchers[key]
    return found


def prepare() -> None:
    """Compile (or load from the disk cache) the kernel now, not at the first copy: the realigned
    GEMM's compile calls this, so precompiles and compile workers cover it, and under
    `kernel_api.kernel.compile_from_cache_only` a cubin missing from the cache raises there."""
    _launcher(_ELEMENT_SIZES[0], UNITS[0])


def line_geometry(t: torch.Tensor, row_major: bool) -> tuple[int, int, int, int, int] | None:
    """(batches, lines, line elements, line pitch, batch stride) of ``t`` in elements, or None
    when its lines are not contiguous (a stride other than 1 along them)."""
    rank = t.dim()
    if rank not in (2, 3):
        return None
    unit, line_mode = (rank - 1, rank - 2) if row_major else (rank - 2, rank - 1)
    if t.shape[unit] > 1 and t.stride(unit) != 1:
        return None
    batches = t.shape[0] if rank == 3 else 1
    return batches, t.shape[line_mode], t.shape[unit], t.stride(line_mode), t.stride(0) if rank == 3 else 0


def copy_lines(dst: torch.Tensor, src: torch.Tensor, row_major: bool, stream: int, device: int,
               unit: tuple[int, int] | None = None) -> bool:
    """Copy ``src`` into ``dst`` on the raw ``stream`` handle of ``device``; False (nothing
    copied) unless both are CUDA tensors of one 2- or 4-byte dtype and shape, with contiguous
    lines, and ``dst``'s lines and batches do not overlap. ``src`` may overlap itself (an
    expanded operand). ``unit``: one of `UNITS` (None: by the line length)."""
    size = src.element_size()
    if (size not in _ELEMENT_SIZES or dst.dtype != src.dtype or dst.shape != src.shape or not src.is_cuda
            or not dst.is_cuda):
        return False
    s, d = line_geometry(src, row_major), line_geometry(dst, row_major)
    if s is None or d is None:
        return False
    batches, lines, width, s_pitch, s_batch = s
    _, _, _, d_pitch, d_batch = d
    if batches == 0 or lines == 0 or width == 0:
        return True
    if (lines > 1 and d_pitch < width) or (batches > 1 and d_batch < lines * d_pitch):
        return False  # dst's lines overlap: not a copy this kernel may reorder
    slots = (width * size + 30) // 16  # destination vectors of a line at any alignment
    if unit is None:
        unit = UNITS[1] if slots >= WARP_UNITS_BELOW else UNITS[0]
    group, unroll = unit
    upl = -(-slots // (group * unroll))
    units = batches * lines * upl
    grid = -(-units // (THREADS // group))
    if grid >= 2**31:
        return False
    _launcher(size, unit).launch(stream, device, (grid, 1, 1), (THREADS, 1, 1), 0,
                                 (src.data_ptr(), dst.data_ptr(), width * size, lines, s_pitch * size,
                                  d_pitch * size, s_batch * size, d_batch * size, upl, units))
    return True

