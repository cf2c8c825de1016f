"""Interface of kernel_api's Hopper attention forward (implementation:
implementations/sm90_attention_impl.py).

`Sm90Attention` (`AttentionArguments`) runs prefill attention on sm_90a in the dense layout
``(batch, seqlen, heads, head_dim)`` and in the variable-length one (packed ``(total_tokens,
heads, head_dim)`` tensors with int32 offsets ``cu_seqlens_q`` / ``cu_seqlens_k``): head dims 64
and 128, bf16 and f16, causal (bottom-right aligned per sequence, as FlashAttention's) or full,
MHA / GQA / MQA, any sequence lengths (the query and key lengths may differ, a sequence may be
empty or have no keys), any strides whose head dim is contiguous and whose other strides and
pointers are 16-byte multiples (expanded operands, with a stride 0, are declined), scales from
2^-126 to 2^127, and the row log-sum-exp when it is asked for. KV caches of per-row lengths
(``cache_seqlens``) are declined (the decode kernels and torch's serve them). One instance per
layout, dtype and head dim, named ``Sm90Attention_<dtype>_d<head_dim>`` (dense) and
``..._varlen``.

A CTA is a producer warpgroup that loads the Q tile once and streams K and V tiles through
rings of shared-memory stages with TMA, and two or three consumer warpgroups that each own 64
query rows, computing ``S = Q K^T`` with wgmma from shared memory, the online softmax in
registers, and ``O += P V`` with P from registers, the two GEMMs of consecutive key blocks
overlapped. `plan` picks the query tile (128 rows, or 192 at head dim 64 but for short causal
problems) and whether the launch is persistent (one CTA per SM looping over tiles: full
attention, and short causal problems) from the problem; the mask, the lse and the plan are
compile-time, shapes and strides run-time values, so one artifact serves every size of a plan.

Variable length is the layout of the instance, so compile-time too: tiles run over the query
blocks of the longest sequence (``max_seqlen_q``, which `plan` goes by) x heads x sequences, and
a tile reads its sequence's offsets and lengths on the device (a query block past its sequence's
end does nothing); Q/K/V are loaded by TMA from the sequence's first row of the packed tensors,
and the output's rows (and the lse's) are stored only below the sequence's length. Key rows
read past a sequence's end (the next sequence's) are masked to P = 0, so they must be finite: a
NaN or infinite value there makes the row NaN. The offsets are trusted (as `AttentionArguments`
says): the kernel clamps each sequence to the packed tensors, so offsets past their ends or
decreasing give wrong rows but no access outside them. The offsets are no operand of a recorded
launch, so variable-length calls go through `_run`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ....arguments.attention import LAYOUTS, AttentionArguments, expanded_dim
from ....core.arch import planning_sm_count
from ....core.artifact import CompiledArtifact
from ....core.dtypes import DataType
from ....core.status import Reason, Status
from ....core.streams import stream_context
from ....core.tensor_attributes import TensorAttributes
from ....cost.attention import attention_cost
from ....launcher import Launcher
from ....metadata import BLASDesignMetadata, KernelMetadata
from ....metadata.attention import AttentionOperandsMetadata
from ....utils import to_cuda_stream
from .. import CuTeDSLProvider
from ..kernel import CuteDslKernel, fake_tensor, fake_tensor_like

HEAD_DIMS = (128, 64)
#: Keys per block (the CTA tile's N).
TILE_N = 128
#: Causal problems of up to this many queries are "short": at head dim 64 a 192-row tile wastes
#: rows on the diagonal there, and a persistent launch balances the blocks' unequal work. H200,
#: bf16, b16 h16 s1024 d64 causal: 275 TFLOP/s with 128 rows persistent, 253 with 192 persistent,
#: 207 with 192 one CTA per tile; b4 h32 s4096 d128 causal: 611 one CTA per tile, 515 persistent.
SHORT_CAUSAL_SEQLEN = 1024
#: Elements of a 16-byte access: every stride but the head dim's, and every pointer, is a multiple.
_VECTOR = 8
INT32_MAX = 2**31 - 1
#: The fewest query rows of a tile (`plan`'s short causal and head dim 128 tiles).
SMALLEST_TILE_M = 128
#: Extents and tile indices are 32-bit values in the compiled function (strides are 64-bit): an
#: extent rounded up to a tile, and a tile index plus a launch's stride (at most the tile count),
#: stay below 2^31.
MAX_EXTENT = INT32_MAX - 192
MAX_TILES = INT32_MAX // 2
#: K/V ring depth per head dim: three stages fit 192-row d64 tiles' shared memory, two d128's.
STAGES = {64: 3, 128: 2}
#: FlashAttention-3's pingpong between consumer warpgroups (`scheduler_barrier`) is off: it
#: measured -11 % to +5 % on the H200 (612 against 687 TFLOP/s at b4 h32 s4096 d128).
PINGPONG = False
#: The smallest and largest scales whose float32 value, times log2(e), is a normal finite number:
#: the kernel scales scores in base 2 and masks with -inf, so a scale that rounds to 0 or to
#: infinity would make -inf * 0 or inf - inf.
MIN_SCALE, MAX_SCALE = 2.0**-126, 2.0**127
#: The compiled function's variable-length arguments (``cu_seqlens_q, cu_seqlens_k,
#: max_seqlen_q``) in a dense layout's call: a TVM-FFI function takes every parameter.
NO_LENGTHS = (None, None, None)


def after_tensors(lse: Any, scale: Any, lengths: tuple) -> tuple:
    """The compiled function's arguments after q, k, v and out, before the stream: ``lse`` (or
    None), the scale, then ``cu_seqlens_q, cu_seqlens_k, max_seqlen_q`` (`NO_LENGTHS` for the
    dense layout). The one statement of that order for compiling, running and recording."""
    return (lse, scale, *lengths)
#: Forward speed against torch's SDPA default (cuDNN) by (head dim, causal), for the ranking
#: (PickAny): through `kernel_api.ops.attention`, H200, bf16, `benchmarks/attention.py --quick
#: --cases d64,d128,llama`: b16 h16 s1024 d64 causal 317 against 318 TFLOP/s, full 404 against
#: 427; b4 h32 s4096 d128 causal 600 against 593 (b4 h32/8 s2048 causal 507 against 521), full 698
#: against 641. Causal d128 takes 0.99 between its MHA (1.01) and GQA (0.97) shapes; a tie within
#: a percent ranks just behind SDPA, which needs no compile. A training forward (with the lse)
#: competes with torch's cuDNN forward instead, which ranks at 0.95 and measured 0.83x SDPA at
#: d64 causal and 0.96x at d128 causal through its bound launch (docs/performance.md).
SPEED_VS_SDPA = {(64, True): 0.99, (64, False): 0.94, (128, True): 0.99, (128, False): 1.09}


class Plan(NamedTuple):
    """A launch's compile-time shape: query rows per CTA, and CTAs of a persistent launch (0: one
    CTA per tile)."""

    tile_m: int
    persistent_ctas: int


def plan(head_dim: int, causal: bool, seqlen_q: int, sm_count: int) -> Plan:
    """The tile and launch for a problem (`SHORT_CAUSAL_SEQLEN`'s measurements): full attention and
    short causal problems run persistent, one CTA per SM; head dim 64 takes 192-row tiles but for
    short causal problems. (Full attention measured +10 % persistent at s1024-4096, and -2 % at
    d64 s8192: 537 against 550 TFLOP/s, too little for a rule of its own.)"""
    short_causal = causal and seqlen_q <= SHORT_CAUSAL_SEQLEN
    tile_m = 192 if head_dim == 64 and not short_causal else 128
    return Plan(tile_m, sm_count if (not causal or short_causal) else 0)


@CuTeDSLProvider.register
class Sm90Attention(CuteDslKernel):
    """kernel_api's warp-specialised TMA + wgmma attention forward for sm_90a (dense layout)."""

    supported_args_type = AttentionArguments
    workspace_free = True
    compiles_from_cache_only = True  # (its compile is its cute_compile, which honours cache_only)
    performance_hint = 0.9

    def __init__(self, metadata: KernelMetadata) -> None:
        super().__init__(metadata)
        self.dtype: DataType = metadata.operands.q.dtype
        self.head_dim: int = metadata.operands.head_dims[0]
        self.varlen: bool = metadata.operands.varlen

    @classmethod
    def generate_kernels(cls, metadata_filter: Any, epilogue_args: Any = None, cc: int | None = None) -> list:
        if epilogue_args is not None:
            return []
        found = []
        for layout, pattern in LAYOUTS.items():
            for dtype in (DataType.bf16, DataType.f16):
                attrs = TensorAttributes(dtype, pattern, _VECTOR)
                for d in HEAD_DIMS:
                    operands = AttentionOperandsMetadata(attrs, attrs, attrs, attrs, head_dims=(d,), max_head_dim=d,
                                                         lse=True)
                    # (tile_shape: the tile of long problems; `plan` chooses per problem)
                    design = BLASDesignMetadata(tile_shape=(192 if d == 64 else 128, TILE_N, d), stages=STAGES[d],
                                                schedule="warpspecialized")
                    suffix = "_varlen" if layout == "varlen" else ""
                    metadata = KernelMetadata(f"{cls.__name__}_{dtype}_d{d}{suffix}", cls, operands, design,
                                              min_cc=90, max_cc=90)
                    if metadata.supports_cc(cc) and (metadata_filter is None or metadata_filter(metadata)):
                        found.append(cls(metadata))
        return found

    def _supports(self, args: AttentionArguments) -> Status:
        if args.device.type == "cpu":  # (meta tensors plan and compile like CUDA ones)
            return Status.fail("operand q: on the CPU; the kernel runs on CUDA tensors", operand="q")
        if not MIN_SCALE <= args.scale <= MAX_SCALE:
            return Status.fail(f"scale: {args.scale}, the kernel takes scales from 2^-126 to 2^127 (a normal "
                               f"float32 scaling in base 2)", kind=Reason.OTHER, operand="scale", actual=args.scale,
                               required=MIN_SCALE)
        # (variable length: the query blocks of the longest sequence, for every sequence; the
        # arguments hold max_seqlen_q at most the packed tokens, whose extent is checked below)
        tiles = -(-args.seqlen_q // SMALLEST_TILE_M) * args.heads_q * args.batch
        if tiles > MAX_TILES:
            return Status.fail(f"operand q: {tiles:,} tiles of {SMALLEST_TILE_M} queries exceed the 32-bit tile "
                               f"index's limit (2^30-1)", kind=Reason.SHAPE, operand="q", actual=tiles,
                               required=MAX_TILES)
        for name in ("q", "k", "v", "out"):
            t = getattr(args, name)
            # (an expanded operand, such as k repeated over heads by expand, is left to kernels
            # that read element-wise: TMA addressing of repeated rows is untested here, and the
            # GEMM's TMA path stages such operands too)
            dim = expanded_dim(t)
            if dim is not None:
                return Status.fail(f"operand {name}: stride 0 in dim {dim} of size {t.shape[dim]} (an expanded "
                                   f"tensor), which this kernel's TMA loads do not take", kind=Reason.LAYOUT,
                                   operand=name)
            if max(t.shape) > MAX_EXTENT:
                return Status.fail(f"operand {name}: an extent of {max(t.shape):,} exceeds the 32-bit limit less a "
                                   f"tile (2^31-193)", kind=Reason.SHAPE, operand=name, actual=max(t.shape),
                                   required=MAX_EXTENT)
        return Status.success()

    def get_workspace_size(self, args: Any) -> int:
        return 0

    def estimated_cost(self, args: AttentionArguments, sm_count: int) -> float:
        """`attention_cost` (what SDPA is ranked by) over this kernel's speed against SDPA
        (`SPEED_VS_SDPA`). A packed batch runs at about the dense rate: `--cases varlen` measured
        605 TFLOP/s at 4 sequences of 4096 (d128 causal; 1.01x SDPA's dense call over the same
        tokens) and 300 at 16 of 1024 (d64 causal, 0.96x), docs/performance.md."""
        return attention_cost(args) / SPEED_VS_SDPA[self.head_dim, bool(args.causal)]

    def plan(self, args: AttentionArguments) -> Plan:
        """`plan` for ``args`` on their device (the targeted machines' SMs without one); for
        variable length by the longest query sequence."""
        device = args.device if args.device.type == "cuda" else None
        return plan(self.head_dim, args.causal, args.seqlen_q, planning_sm_count(device))

    def compile_key(self, args: AttentionArguments, cc: int | None) -> tuple:
        """One artifact per layout, mask, lse presence and plan: sizes, strides and sequence
        offsets are run-time values."""
        return (args.varlen, args.causal, args.lse is not None, self.plan(args), cc)

    def _impl(self, causal: bool, has_lse: bool, launch: Plan) -> Any:
        from .implementations.sm90_attention_impl import Sm90AttentionForward

        return Sm90AttentionForward(self.dtype.to_cutlass(), self.head_dim, causal, has_lse, tile_m=launch.tile_m,
                                    tile_n=TILE_N, num_stages=self.metadata.design.stages,
                                    scheduler_barrier=PINGPONG, persistent_ctas=launch.persistent_ctas,
                                    varlen=self.varlen)

    def compile(self, args: AttentionArguments, cc: int | None = None) -> CompiledArtifact:
        """Compile the arguments' layout, mask, lse presence and plan (no GPU needed with an
        explicit cc)."""
        import cutlass
        from cutlass.cute.runtime import make_fake_stream

        ops = self.metadata.operands
        rank = 3 if self.varlen else 4
        tensors = [fake_tensor_like(getattr(ops, name), rank) for name in ("q", "k", "v", "out")]
        lse = fake_tensor(DataType.f32, rank - 1, rank - 2, 1) if args.lse is not None else None
        impl = self._impl(args.causal, args.lse is not None, self.plan(args))
        # (the sequence offsets and the longest query sequence; None in a dense layout's function)
        lengths = ((fake_tensor(DataType.i32, 1, 0, 1), fake_tensor(DataType.i32, 1, 0, 1), cutlass.Int32(1))
                   if self.varlen else NO_LENGTHS)
        compiled = self.cute_compile(impl, *tensors, *after_tensors(lse, cutlass.Float32(1.0), lengths),
                                     make_fake_stream())
        return CompiledArtifact(compiled, self)

    def _run(self, args: AttentionArguments, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        if not args.q.numel() or not args.seqlen_q:
            return
        if not args.seqlen_k or not args.k.numel():  # no key: every row's sum is empty
            with stream_context(args.device, stream):
                args.out.zero_()
                if args.lse is not None:
                    args.lse.fill_(float("-inf"))
            return
        lengths = (args.cu_seqlens_q, args.cu_seqlens_k, args.seqlen_q) if args.varlen else NO_LENGTHS
        self.cute_run(artifact.compiled_obj, args.q, args.k, args.v, args.out,
                      *after_tensors(args.lse, args.scale, lengths), to_cuda_stream(stream))

    def _launcher(self, args: AttentionArguments, artifact: CompiledArtifact) -> Launcher | None:
        """``compiled(q, k, v, out, [lse,] scale, None, None, None, stream)`` (`after_tensors`): an
        lse is an operand of the launch, else None stands in its place at the head of the tail.
        Variable-length calls have none: their offsets are no operand of a recorded launch."""
        if args.varlen or not args.q.numel() or not args.seqlen_k:
            return None
        tail = after_tensors(None, args.scale, NO_LENGTHS)
        return Launcher(artifact, tail[1:] if args.lse is not None else tail)
