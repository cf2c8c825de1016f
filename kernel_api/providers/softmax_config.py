"""The softmax family's configuration and naming, shared by the providers that implement it.

The CuTe DSL kernels (``cutedsl/softmax/``) and the CUDA C++ kernels
(``cuda_src/kernels/softmax.py`` + ``softmax.cu``) map a row onto the machine the same ways,
the whole row held in registers:

- ``warp``: one warp per row, `WARPS_PER_CTA` rows per CTA; rows of up to `WARP_MAX_COLS`.
- ``block`` with 16 or 32 elements per thread (EPT): one CTA per row; rows of up to
  1024 threads x EPT elements (512 threads for the backward's EPT 32).

per dtype (bf16, f16, f32) and alignment (16-byte vectors, or single elements). Here are
those configurations (`configs`), the instances' names and metadata (`kernel_metadata`), and
the compile-time shape of one artifact for a row length (`register_bucket`), so that the
providers differ only in how they compile and launch. A provider may add strategies of its own
(the CUDA C++ one adds ``looped``, two passes over rows of any length).

Provider-neutral: no toolchain, no provider module (providers never import each other).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.dtypes import DataType
from ..metadata import KernelMetadata, RowReductionDesignMetadata, softmax_operands
from ..utils import next_pow2

#: Storage types (math is f32 for all).
DTYPES = (DataType.bf16, DataType.f16, DataType.f32)
#: The longest row the ``warp`` strategy holds (32 lanes x 32 elements).
WARP_MAX_COLS = 1024
#: Rows (one warp each) per CTA of the ``warp`` strategy.
WARPS_PER_CTA = 4
#: The oldest architecture the register kernels run on.
MIN_CC = 80


def block_threads_max(backward: bool, ept: int) -> int:
    """Threads per CTA (one row) of the ``block`` strategy with ``ept`` elements per thread."""
    # The backward holds two rows (dy and y) in registers: cap the CTA so that 32 elements
    # per thread of each still fit without spilling.
    return 512 if backward and ept >= 32 else 1024


def configs(backward: bool, extra_strategies: tuple[dict, ...] = ()) -> list[dict]:
    """The parameters of every register-resident instance, in generation order.

    Each is a dict with ``dtype`` (`DataType`), ``strategy`` ("warp" or "block"), ``vec``
    (elements per access: 16 bytes' worth, or 1 for unaligned operands), ``ept`` (block only)
    and ``max_cols`` (the longest row). ``extra_strategies`` (e.g. ``{"strategy": "looped",
    "max_cols": None}``) are appended for every dtype and alignment, after the shared ones.
    """
    found = []
    for dtype in DTYPES:
        for vec in (16 // dtype.bytes, 1):
            found.append(dict(dtype=dtype, strategy="warp", vec=vec, max_cols=WARP_MAX_COLS))
            for ept in ((16, 32) if vec > 1 else (16,)):
                found.append(dict(dtype=dtype, strategy="block", ept=ept, vec=vec,
                                  max_cols=block_threads_max(backward, ept) * ept))
            found.extend({"dtype": dtype, "strategy": extra["strategy"], "vec": vec, **extra}
                         for extra in extra_strategies)
    return found


def kernel_name(cls: type, params: dict) -> str:
    """``<Class>_<dtype>_<strategy>_a<alignment>``, as the GEMMs name theirs (class first, then
    types, design and alignment in elements), e.g. ``CudaSoftmaxForward_bf16_block_ept32_a8``."""
    strategy = params["strategy"] + (f"_ept{params['ept']}" if params["strategy"] == "block" else "")
    return f"{cls.__name__}_{params['dtype']}_{strategy}_a{params['vec']}"


def kernel_metadata(cls: type, params: dict, backward: bool, design: Any = None) -> KernelMetadata:
    """Metadata of the instance ``params`` of ``cls``; ``design`` defaults to the shared
    strategies' (a provider passes its own for strategies it adds)."""
    if design is None:
        vector_bytes = params["vec"] * params["dtype"].bytes
        if params["strategy"] == "warp":
            design = RowReductionDesignMetadata("warp", 32, vector_bytes, 1, params["max_cols"],
                                                extra=(("rows_per_cta", WARPS_PER_CTA),))
        else:
            design = RowReductionDesignMetadata("block", block_threads_max(backward, params["ept"]), vector_bytes, 1,
                                                params["max_cols"], extra=(("elements_per_thread", params["ept"]),))
    operands = softmax_operands(params["dtype"], params["vec"], backward=backward)
    return KernelMetadata(kernel_name(cls, params), cls, operands, design=design, min_cc=MIN_CC)


@dataclass(frozen=True)
class RowBucket:
    """The compile-time shape of one register-resident artifact: ``vec`` elements per access,
    ``nv`` accesses per thread, ``threads_per_row`` threads per row, ``rows_per_cta`` rows."""

    vec: int
    nv: int
    threads_per_row: int
    rows_per_cta: int

    @property
    def capacity(self) -> int:
        """The longest row the artifact handles."""
        return self.threads_per_row * self.nv * self.vec

    @property
    def cta_threads(self) -> int:
        return self.threads_per_row * self.rows_per_cta


def register_bucket(strategy: str, vec: int, ept: int, cols: int, backward: bool, warp_granular: bool = False) -> RowBucket:
    """The smallest bucket of a ``warp`` or ``block`` instance that holds rows of ``cols``.

    A ``block`` CTA has a power of two of threads (few artifacts serve every row length), or
    with ``warp_granular`` a multiple of 32: a row just past a power of two (4097 elements)
    then keeps ``ept`` elements per thread in flight instead of half as many in a CTA of
    twice the threads, whose occupancy caps the bytes in flight per SM. Its block reductions
    must then take any number of warps.
    """
    nvec = max(1, -(-max(cols, 1) // vec))
    if strategy == "warp":
        nv = min(next_pow2(-(-nvec // 32)), WARP_MAX_COLS // (32 * vec))
        return RowBucket(vec, nv, 32, WARPS_PER_CTA)
    nv = max(1, ept // vec)
    need = -(-nvec // nv)
    threads = 32 * -(-need // 32) if warp_granular else next_pow2(need)
    return RowBucket(vec, nv, min(max(32, threads), block_threads_max(backward, ept)), 1)


def rows_per_cta(strategy: str) -> int:
    """Rows one CTA of ``strategy`` handles (the grid covers rows / this)."""
    return WARPS_PER_CTA if strategy == "warp" else 1
