"""Interface of the CUDA C++ decode attention kernels (implementation: attention_decode.cu beside
this file).

`CudaAttentionDecode` (`AttentionArguments`) serves decoding against a KV cache: up to
`MAX_SEQLEN_Q` queries per sequence, head dims 64 and 128, f16 / bf16, causal (bottom-right
aligned) or not, MHA / GQA / MQA, with any strides whose head_dim is contiguous and whose other
strides and pointers are 16-byte multiples, so a KV cache view such as ``k_cache[:, :length]``
runs as it is. One instance per dtype, head dim and layout, named
``CudaAttentionDecode_<dtype>_d<head_dim>`` (dense) and ``..._varlen`` (variable length: the
kernel reads the sequence offsets on the device; a launch whose offsets are no operand is not
recorded, so every varlen call goes through `_run`). The dense instances also take a KV cache of
per-row lengths (`AttentionArguments`' ``cache_seqlens``): the kernel reads each row's length on
the device and splits that row's keys alone, so the launch depends on the cache's size, never on
the lengths; the lengths are the recorded launch's fifth tensor, so a decode loop's repeated
calls replay it with whichever lengths tensor they pass. Batches of up to 128 such rows run
longest first (the CTAs rank the lengths on the device), so short rows fill the last wave.

Flash-decoding: each CTA takes one (batch, KV head, row block, key split); the rows of a KV head
are its group's queries (seqlen_q x heads_q / heads_kv of them), so one read of K and V serves
all of them. The splits of one row block form a thread-block cluster that merges its partial
results through distributed shared memory: one launch, no workspace, so a launch is recorded
(`_launcher`, a ``kernel_api.native.cuda_launch`` function) and repeated calls replay it from C.
`plan` picks the row block (16, 32 or 64 rows: ``MW`` tensor-core tiles), the splits (1, 2, 4
or 8: ``CL``) and the `Tiling` (keys per chunk, chunks in the ring, CTAs per SM) from the shape;
all are template parameters, so the compile key holds them through the name expression.

The limit is HBM bandwidth: every key's K and V rows are read once (a 64-key chunk of K and V is
32 KB at d128 in bf16), and the tensor-core work per byte (16 FLOP at one row, padded to a
16-row tile) stays far below the mma.sync rate.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import torch

from .... import native
from ....arguments.attention import LAYOUTS, AttentionArguments
from ....core.arch import planning_sm_count
from ....core.dtypes import DataType
from ....core.status import Reason, Status
from ....core.streams import stream_handle
from ....core.tensor_attributes import TensorAttributes
from ....cost.units import GEMM_COST_UNITS_PER_SECOND
from ....launcher import Launcher
from ....metadata import BLASDesignMetadata, KernelMetadata
from ....metadata.attention import AttentionOperandsMetadata
from ....utils import MAX_GRID_X
from .. import CudaSourceProvider
from ..kernel import CudaSourceKernel

_TYPES = {DataType.bf16: "ka_attn::BF16", DataType.f16: "ka_attn::F16"}
HEAD_DIMS = (128, 64)
#: The most queries per sequence (a decode step, or a few speculative tokens).
MAX_SEQLEN_Q = 16
#: Threads per CTA (as attention_decode.cu has them).
THREADS = 128
#: Cluster sizes (key splits per row block; portable clusters hold at most 8 CTAs).
SPLITS = (1, 2, 4, 8)
#: Splits are added while the grid still has at most a CTA per SM, and only while each split keeps at least
#: `MIN_CHUNKS_PER_SPLIT` chunks: each split costs a cluster merge and CTAs of their own, and on
#: an H200 (benchmarks/attention_decode.py --sweep, bf16 d128, 32/8 heads) batch 64 ran fastest
#: unsplit (243 us at 4096 keys against 250 with 2 splits, 39 against 46 us at 512), batch 8 with 2
#: splits (15.9 us at 1024 keys; 17.9 unsplit, 23.6 with 8) and batch 1 with 8 (13.5 us at 4096;
#: 49 unsplit).
MIN_CHUNKS_PER_SPLIT = 2
#: CTAs an SM holds by registers (ptxas: 248 registers a thread at d128, 158 at d64, with no
#: `Tiling.min_ctas` asked), by head dim.
CTAS_PER_SM = {128: 2, 64: 3}
#: Shared memory an SM gives its CTAs (sm_90: 228 KB, 1 KB of it reserved per CTA) and what a CTA
#: declares statically (the merge's row statistics, the ranked lengths) beside the ring.
SM_SHARED_BYTES, CTA_RESERVED_BYTES, STATIC_SHARED_BYTES = 228 << 10, 1 << 10, 6 << 10
#: A grid of one to one and a half waves is split once more when every split keeps
#: `LONG_SPLIT_CHUNKS` chunks (the default tiling at d64, batch 64 x 8 KV heads, 4096 keys: 130 us
#: with 2 splits, 144 unsplit); past two waves the ragged last one costs less than the merge (32/32
#: heads, 4096 keys: 468 us unsplit, 478 with 2 splits).
LONG_SPLIT_CHUNKS = 16
#: The elements of one 16-byte copy: every pointer and stride but head_dim's is a multiple.
_VECTOR = 8
#: Cost model: the K/V streaming rate (an H200 measured 4.2-4.5 TB/s from 134 MB of K and V up,
#: bf16 d128 at batch 64; 1.9-3.0 TB/s at 34 MB), a launch's fixed time and the mma.sync rate
#: for the padded rows (nominal).
BYTES_PER_SECOND = 4.2e12
FIXED_SECONDS = 3e-6
MMA_FLOPS_PER_SECOND = 4e14
#: Where the cache lengths' pointer sits among `CudaAttentionDecode._launch`'s parameters (after
#: the two sequence offsets' pointers).
_LENGTHS_AT = 2
#: Recorded launches kept per instance (a decode loop's lengths grow by one per step).
_RECORDED_LIMIT = 256
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Tiling:
    """How a CTA streams the keys: ``block_keys`` per chunk, ``stages`` chunks in the cp.async
    ring, and ``min_ctas`` CTAs an SM must hold (registers capped by ``__launch_bounds__`` to
    fit them; 1: as many as the registers ptxas uses allow)."""

    block_keys: int
    stages: int
    min_ctas: int = 1

    def __post_init__(self) -> None:
        # (the kernel's static_asserts, named before a compile: each warp takes whole 16-key
        # tiles of a chunk, at most 4 warps along its keys; a ring holds at least two chunks)
        for name, value, low in (("block_keys", self.block_keys, 64), ("stages", self.stages, 2),
                                 ("min_ctas", self.min_ctas, 1)):
            if type(value) is not int or value < low:
                raise ValueError(f"Tiling: {name} must be an int >= {low}, got {value!r}")
        if self.block_keys % 64:
            raise ValueError(f"Tiling: block_keys must be a multiple of 64 (whole 16-key tiles for each of 4 "
                             f"warps), got {self.block_keys}")


#: 64-key chunks in a 3-deep ring (96 KB at d128, 48 KB at d64): every head dim's tiling but d64's.
DEFAULT_TILING = Tiling(64, 3)
#: d64 with one row tile a block (decode's GQA and MHA): a grid of up to two CTAs per SM (small
#: batches, split) or a long one-wave grid streams 128-key chunks (32 KB of K and V, as d128's
#: 64-key ones), two CTAs per SM; a one-wave grid of short rows takes four CTAs per SM (registers
#: capped at 128; 12 bytes spilled outside the loop), its whole grid resident from the start; a
#: grid of several waves a 4-deep ring of 64-key chunks. Measured on an H200, bf16, against the
#: default tiling (`benchmarks/attention_decode.py --tilings`; docs/performance.md), us: batch 64 x
#: 32/8 heads 24.3 against 26.9 at 512 keys, 38.8 / 44.4 at 1024, 67.8 / 73.1 at 2048, 125.5 /
#: 130.2 at 4096; 32/32 heads 126.3 / 129.0 at 1024; batch 8, 4096 keys 23.2 / 25.4.
D64_SHORT_ONE_WAVE, D64_LONG, D64_MANY_WAVES = Tiling(64, 3, 4), Tiling(128, 3), Tiling(64, 4)
#: Keys up to which a one-wave d64 grid takes `D64_SHORT_ONE_WAVE`.
D64_SHORT_KEYS = 1024


def shared_bytes(head_dim: int, tiling: Tiling = DEFAULT_TILING) -> int:
    """Dynamic shared memory of a CTA: the ring of K and V chunks."""
    return tiling.stages * 2 * tiling.block_keys * head_dim * 2


def resident_ctas(head_dim: int, tiling: Tiling) -> int:
    """CTAs one SM holds: the registers' limit (`CTAS_PER_SM`, or ``min_ctas`` when asked for)
    and the shared memory's."""
    by_registers = max(tiling.min_ctas, CTAS_PER_SM.get(head_dim, 2))
    per_cta = shared_bytes(head_dim, tiling) + STATIC_SHARED_BYTES + CTA_RESERVED_BYTES
    return max(1, min(by_registers, SM_SHARED_BYTES // per_cta))


def choose_tiling(head_dim: int, mw: int, base: int, seqlen_k: int, sms: int) -> Tiling:
    """The tiling for ``head_dim``, ``mw`` row tiles a block and ``base`` CTAs before any split,
    on a GPU of ``sms`` SMs."""
    if head_dim != 64 or mw != 1:
        return DEFAULT_TILING
    if base <= 2 * sms:
        return D64_LONG
    if base <= 4 * sms:
        return D64_SHORT_ONE_WAVE if seqlen_k <= D64_SHORT_KEYS else D64_LONG
    return D64_MANY_WAVES


@dataclass(frozen=True)
class DecodePlan:
    """How a problem maps onto CTAs: ``mw`` 16-row tiles per row block, ``cl`` key splits (the
    cluster size; the kernel cuts each batch row's keys into ``cl`` runs of whole chunks),
    ``row_blocks`` per KV head, the ``grid``, and the `Tiling`."""

    mw: int
    cl: int
    row_blocks: int
    grid: int
    tiling: Tiling = DEFAULT_TILING


def row_tiles(rows: int) -> int:
    """16-row tensor-core tiles per row block for ``rows`` rows per KV head (1, 2 or 4)."""
    return 1 if rows <= 16 else 2 if rows <= 32 else 4


def plan(args: AttentionArguments, sms: int, splits: int | None = None, mw: int | None = None,
         tiling: Tiling | None = None) -> DecodePlan:
    """The launch of ``args`` on a GPU of ``sms`` SMs.

    Args:
        args: the arguments (the longest sequences, or the cache's size, stand for all rows).
        sms: the SMs to fill.
        splits: a fixed cluster size (`SPLITS`), or None to choose: the most that leave the grid
            at most a CTA per SM while every split keeps `MIN_CHUNKS_PER_SPLIT` chunks, doubled
            once for a grid of one to one and a half waves of long splits (`LONG_SPLIT_CHUNKS`).
        mw: fixed row tiles per block, or None for `row_tiles`.
        tiling: a fixed `Tiling`, or None for `choose_tiling`.

    Returns:
        The `DecodePlan`.
    """
    rows = args.seqlen_q * (args.heads_q // args.heads_kv)
    mw = row_tiles(rows) if mw is None else mw
    row_blocks = max(1, -(-rows // (16 * mw)))
    base = args.batch * args.heads_kv * row_blocks
    tiling = choose_tiling(args.head_dim, mw, base, args.seqlen_k, sms) if tiling is None else tiling
    chunks = -(-args.seqlen_k // tiling.block_keys)
    if splits is None:
        splits = 1
        while (splits < SPLITS[-1] and 2 * base * splits <= sms
               and chunks >= 2 * splits * MIN_CHUNKS_PER_SPLIT):
            splits *= 2
        waves = base * splits / (sms * resident_ctas(args.head_dim, tiling))
        if (1 < waves < 1.5 and splits < SPLITS[-1]
                and chunks >= 2 * splits * LONG_SPLIT_CHUNKS):
            splits *= 2
    return DecodePlan(mw, splits, row_blocks, base * splits, tiling)


def _scale_bits(scale: float) -> int:
    """scale * log2(e) as the bits of a double, as the kernel takes it."""
    return struct.unpack("<q", struct.pack("<d", scale * _LOG2E))[0]


@dataclass(frozen=True)
class _Build:
    """An artifact's ``extra``: the template it was compiled for."""

    mw: int
    cl: int
    tiling: Tiling


@CudaSourceProvider.register
class CudaAttentionDecode(CudaSourceKernel):
    """Decode attention (flash-decoding) in CUDA C++: seqlen_q up to 16, head dims 64 / 128,
    f16 / bf16, GQA / MQA / MHA, causal or not, strided KV caches with per-row lengths or
    without, dense or variable length; tensor cores, f32 softmax."""

    supported_args_type = AttentionArguments
    source_file = "attention_decode.cu"
    convert_arguments = False  # every parameter is a pointer or a 64-bit int, passed as Python int
    workspace_free = True
    performance_hint = 1.0
    min_cc = 90  # thread-block clusters

    def __init__(self, metadata: KernelMetadata, params: dict) -> None:
        super().__init__(metadata, params)
        self.dtype: DataType = params["dtype"]
        self.head_dim: int = params["head_dim"]
        self.varlen: bool = params["layout"] == "varlen"
        #: A fixed split count (`SPLITS`) or None to let `plan` choose: settable for benchmarks.
        self.splits: int | None = None
        #: A fixed `Tiling` or None to let `plan` choose: settable for benchmarks.
        self.tiling: Tiling | None = None

    # ---- generation ---------------------------------------------------------------------------
    @classmethod
    def variant_params(cls) -> list[dict]:
        return [dict(dtype=dt, head_dim=d, layout=layout) for layout in LAYOUTS for dt in _TYPES for d in HEAD_DIMS]

    @classmethod
    def instance_name(cls, params: dict) -> str:
        layout = "" if params["layout"] == "dense" else f"_{params['layout']}"
        return f"{cls.__name__}_{params['dtype']}_d{params['head_dim']}{layout}"

    @classmethod
    def check_definition(cls) -> None:
        pass  # names come from name_expression, not kernel_name

    @classmethod
    def make_metadata(cls, params: dict) -> KernelMetadata:
        dt, d = params["dtype"], params["head_dim"]
        attrs = TensorAttributes(dt, LAYOUTS[params["layout"]], _VECTOR)
        operands = AttentionOperandsMetadata(attrs, attrs, attrs, attrs, head_dims=(d,),
                                             cache_seqlens=params["layout"] == "dense")
        design = BLASDesignMetadata((16, DEFAULT_TILING.block_keys, d), stages=DEFAULT_TILING.stages,
                                    schedule="split-kv",
                                    extra=(("max_seqlen_q", MAX_SEQLEN_Q), ("splits", SPLITS)))
        return KernelMetadata(cls.instance_name(params), cls, operands, design=design, min_cc=cls.min_cc)

    # ---- support ------------------------------------------------------------------------------
    def _supports(self, args: AttentionArguments) -> Status:
        if args.device.type == "cpu":  # (meta tensors plan and compile like CUDA ones)
            return Status.fail("operand q: on the CPU; the kernel runs on CUDA tensors", operand="q")
        if args.seqlen_q > MAX_SEQLEN_Q:
            return Status.fail(f"operand q: seqlen_q={args.seqlen_q} above the decode kernel's {MAX_SEQLEN_Q} (a "
                               f"prefill kernel serves it)", kind=Reason.SHAPE, operand="q",
                               actual=args.seqlen_q, required=MAX_SEQLEN_Q)
        if self._plan(args).grid > MAX_GRID_X:
            return Status.fail(f"operand q: batch={args.batch:,} x {args.heads_kv} KV heads need more CTAs than the "
                               f"grid's x limit of 2^31-1", kind=Reason.SHAPE, operand="q")
        return Status.success()

    # ---- compile: the template for this shape ------------------------------------------------
    def _plan(self, args: AttentionArguments) -> DecodePlan:
        return plan(args, planning_sm_count(args.device), self.splits, tiling=self.tiling)

    def name_expression(self, args: AttentionArguments) -> str:
        p = self._plan(args)
        t = _TYPES[self.dtype]
        tiling = f"{p.tiling.block_keys}, {p.tiling.stages}, {p.tiling.min_ctas}"
        if p.cl == 1:
            return f"ka_attn::decode<{t}, {self.head_dim}, {p.mw}, {tiling}>"
        return f"ka_attn::decode_split<{t}, {self.head_dim}, {p.mw}, {p.cl}, {tiling}>"

    def launch_plan(self, args: AttentionArguments, launcher: Any) -> _Build:
        p = self._plan(args)
        return _Build(p.mw, p.cl, p.tiling)

    def launch_config(self, args: AttentionArguments) -> tuple:
        p = self._plan(args)
        return (p.grid, THREADS, shared_bytes(self.head_dim, p.tiling))

    def estimated_cost(self, args: AttentionArguments, sm_count: int) -> float:
        """K and V read once at `BYTES_PER_SECOND` (q and out beside them), or the padded rows'
        tensor-core work, whichever is longer, plus a launch's `FIXED_SECONDS`."""
        element = self.dtype.bytes
        d = args.head_dim
        moved = element * d * args.batch * (2 * args.seqlen_k * args.heads_kv + 2 * args.seqlen_q * args.heads_q)
        p = plan(args, sm_count, self.splits, tiling=self.tiling)
        flops = 4.0 * args.batch * args.heads_kv * p.row_blocks * 16 * p.mw * args.seqlen_k * d
        seconds = FIXED_SECONDS + max(moved / BYTES_PER_SECOND, flops / MMA_FLOPS_PER_SECOND)
        return seconds * GEMM_COST_UNITS_PER_SECOND

    # ---- launch -------------------------------------------------------------------------------
    def _launch(self, args: AttentionArguments, artifact: Any) -> tuple[int, tuple[int, ...]] | None:
        """The grid and the parameters after q, k, v and out (the sequence offsets' pointers, 0
        for the dense layout, the cache lengths' pointer or 0, then the sizes and strides); None
        when there is nothing to do."""
        if args.batch == 0 or args.seqlen_q == 0:
            return None
        build = artifact.extra
        p = plan(args, planning_sm_count(args.device), build.cl, build.mw, build.tiling)
        q, k, v, o = args.q, args.k, args.v, args.out
        cu = (args.cu_seqlens_q.data_ptr(), args.cu_seqlens_k.data_ptr()) if args.varlen else (0, 0)
        lengths = 0 if args.cache_seqlens is None else args.cache_seqlens.data_ptr()
        strides = [t.stride()[:3] if not args.varlen else (0, *t.stride()[:2]) for t in (q, k, v, o)]
        params = (*cu, lengths, args.heads_kv, args.heads_q // args.heads_kv, args.seqlen_q, args.seqlen_k,
                  p.row_blocks, int(args.causal), _scale_bits(args.scale),
                  *strides[0], *strides[1], *strides[2], *strides[3])
        return p.grid, params

    def _run(self, args: AttentionArguments, artifact: Any, stream: Any, workspace: Any = None) -> None:
        launch = self._launch(args, artifact)
        if launch is None:
            return
        grid, params = launch
        device = args.device.index
        if device is None:
            device = torch.cuda.current_device()
        pointers = (args.q.data_ptr(), args.k.data_ptr(), args.v.data_ptr(), args.out.data_ptr())
        artifact.compiled_obj.launch(stream_handle(stream, device), device, grid, THREADS,
                                     shared_bytes(self.head_dim, artifact.extra.tiling), pointers + params)

    def _launcher(self, args: AttentionArguments, artifact: Any) -> Launcher | None:
        # (varlen offsets are no operand of a recorded launch: those calls run `_run`; cache
        # lengths are its tensor 4, after q, k, v and out, as in `tensor_attributes`)
        launch = None if args.varlen else self._launch(args, artifact)
        if launch is None:
            return None
        grid, params = launch
        lengths = args.cache_seqlens is not None
        if lengths:
            params = params[:_LENGTHS_AT] + (0,) + params[_LENGTHS_AT + 1:]  # (its pointer is no constant)
        key = (id(artifact), grid, params, lengths)
        recorded = self.__dict__.setdefault("_recorded", {})
        found = recorded.get(key)
        if found is None:
            device = args.device.index
            if device is None:
                device = torch.cuda.current_device()
            smem = shared_bytes(self.head_dim, artifact.extra.tiling)
            # (allows the kernel its dynamic shared memory on this device, as a Python launch does)
            artifact.compiled_obj.max_coresident(device, THREADS, smem)
            layout = [(native.TENSOR, i) for i in range(4)] + [(8, int(value)) for value in params]
            if lengths:
                layout[4 + _LENGTHS_AT] = (native.TENSOR, 4)
            function = native.cuda_launch(int(artifact.compiled_obj.kernel.handle), 4 + lengths, (grid, 1, 1),
                                          (THREADS, 1, 1), smem, tuple(layout))
            if function is None:
                return None
            if len(recorded) >= _RECORDED_LIMIT:
                recorded.clear()
            # (the artifact kept alive with its launcher: its id stays unique while recorded)
            found = recorded[key] = (Launcher(function), artifact)
        return found[0]


__all__ = ["CudaAttentionDecode", "DecodePlan", "MAX_SEQLEN_Q", "Tiling", "plan"]
