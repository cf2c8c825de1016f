"""The torch provider's kernels: `TorchGemm`, `TorchSoftmax`, `TorchSoftmaxBackward`.

Each instance covers one dtype (f16, bf16, f32, f64) and, for GEMM, one layout of each of A,
B and out (row- or column-major), at any alignment (divisibility 1): metadata matches layouts
exactly, so the 32 GEMM instances together take every operand GemmArguments accepts. torch
picks its own algorithm per call, so an instance is one entry in a tuning table, not a design.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ...arguments import GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments
from ...core.artifact import CompiledArtifact
from ...core.dtypes import DataType
from ...core.streams import current_raw_stream as _current_raw_stream, stream_handle
from ...cost import GEMM_COST_UNITS_PER_SECOND, SKINNY_GEMM, TILE_STREAM_BYTES_PER_SECOND, gemm_bytes
from ...launcher import Launcher
from ...metadata import (BLASDesignMetadata, EpilogueMetadata, GemmOperandsMetadata, KernelMetadata, RowReductionDesignMetadata,
                         SoftmaxBackwardOperandsMetadata, SoftmaxOperandsMetadata, TensorAttributes)
from . import TorchProvider
from .base import TorchKernel

_DTYPES = (DataType.f16, DataType.bf16, DataType.f32, DataType.f64)
# torch's accumulators: f32 for the half types and f32, f64 for f64
_ACCUMULATOR = {DataType.f16: DataType.f32, DataType.bf16: DataType.f32, DataType.f32: DataType.f32,
                DataType.f64: DataType.f64}
_LAYOUTS = {"t": (0, 0, 1), "n": (0, 1, 0)}  # row-major, column-major (GemmArguments' only patterns)
_TORCH_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "gelu": lambda z: torch.nn.functional.gelu(z, approximate="tanh"),  # the epilogue's gelu
    "silu": torch.nn.functional.silu,
}

# PickAny's model of cuBLAS in `kernel_api.cost.gemm_cost` units: a tensor-core
# library at TORCH_GEMM_HINT (our Sm90 family: 1.0) with the efficiency of a 128x256 tile, but
# without wave quantisation: cuBLAS splits K or streams tiles where whole tiles would leave SMs
# idle. Measured on the H200 (GPT-2's GEMMs at 8192 tokens, profiled): cuBLAS ran
# the per-layer projections in 0.90x our time, the dW GEMMs (K = 8192, few output tiles) in
# 0.68x, decode (M = 64) in 0.6x, and matched PickBest's Sm90 choice within 3% on the
# aligned square and LLM shapes (benchmarks/gemm_shapes.py) (one wave or many). So PickAny takes cuBLAS where our best
# tile model loses more than ~5% to quantisation, and ours where it does not.
TORCH_GEMM_HINT = 0.95
# cuBLAS with an operand not 16-byte aligned (a leading dimension or extent) falls to
# alignment-1 kernels. For 4- and 8-byte operands PickAny rates them at this fraction of the
# aligned model's speed, by element size. Measured on odd shapes of 333^3 to 4095x4096x4095
# (H200, gemm_shapes.py --group odd_wide): TF32 ran
# 57-124 TFLOP/s, against 376 aligned at 4096^3 (f32: 0.35; FP32's SIMT path runs its aligned
# rate, 29-49, but competes only with SimtGemm, 2-5x slower); DGEMM 7-46 against 58 aligned
# (f64: 0.8). A single 0.17 for every size took our 3xTF32 kernels at 0.66-0.78x cuBLAS TF32 and the
# Sm80 DMMA tiles at 0.65-0.71x DGEMM on these shapes. 16-bit operands have their own model
# (`TorchGemm._unaligned_cost`, below).
TORCH_UNALIGNED_FACTOR = {4: 0.35, 8: 0.8}
# DGEMM's time against the tile model that ranks our f64 kernels: the MAC model's 128x256
# efficiency is a 16-bit library's, and `CudaGemmF64`'s estimates (its `performance_hint` and
# cost scales) stand 1.43-1.50x above it at 2048^3 and 8192^3 where it ran 0.97-0.98x DGEMM's
# speed (H200, gemm_shapes.py --group f64). 1.4 keeps DGEMM first there (by 2 and
# 7 %) and weighs our odd-stride kernels (8-byte copies, 1.21-1.27x DGEMM from 2000x3000x1001
# up, gemm_shapes.py --group odd_wide) against it; without it the
# f64 alignment-1 factor alone made DGEMM look 1.4x faster than it is.
TORCH_DGEMM_COST = 1.4
# For 16-bit operands the alignment-1 path is modelled on its own (`TorchGemm._unaligned_cost`):
# 64x64 output tiles, one per SM at a time, each TORCH_UNALIGNED_TILE_K_SECONDS per k (split along K
# on fewer tiles than SMs), after a fixed time per dtype (TORCH_UNALIGNED_FIXED_SECONDS: f16's
# alignment-1 kernels start 3-4 us sooner, 5.1-7.1 us against bf16's 7.8-10 on 37x53x29 to
# 257x513x127). Fitted to the 58 recorded bf16/f16 problems with an operand not 16-byte aligned,
# 37x53x29 to 4096x50257x4096 (H200 and H100, tests/data/measured_gemm_times.json): rms log error 0.23, where the
# factor above (no fixed time) was 5-23 us short from 0.1 to 4 GFLOP (100x5001x555: 7.8 us
# estimated, 31.3 measured) and PickAny took cuBLAS there at 0.67-0.87x of the staged kernels
# (one factor for every dtype, 0.17, fitted to GPT-2's lm_head alone, 6.7 ms for 8192 x 50257 x
# 768 against 0.9 ms padded, misses these).
# What it misses most: M <= 100 against N >= 4000 (100x5001x555, 64x50257x768: 0.55-0.75x the
# measured time), where cuBLAS picks slower kernels than at the same tiles elsewhere.
TORCH_UNALIGNED_FIXED_SECONDS = {DataType.f16: 5e-6, DataType.bf16: 9e-6}
TORCH_UNALIGNED_TILE_K_SECONDS = 9.5e-9
_TILE_INTENSITY = 128 * 256 / (128 + 256)
# cuBLASLt's fused bias + GELU epilogue against ours (same fusion): GPT-2's c_fc at 8192 tokens,
# 0.069 ms against our best 0.081 (H200; the "H200 GPT-2 and sweep" run of tests/data).
TORCH_GELU_EPILOGUE_FACTOR = 0.85
# cuBLAS's per-output work (prologue, epilogue, the store) in k-steps: it loses ground to our
# Sm90 family as K shrinks. Measured (PickBest's timings of GPT-2's projections at 8192
# tokens): at K = 768 cuBLAS ran at 0.81x (H200) / 0.84x (H100) our speed on 8192 x 768 and at
# 0.92x on the H100's 8192 x 2304, while at K = 2304-3072 it ran 1.04-1.2x faster; the flat
# TORCH_GEMM_HINT alone took cuBLAS for all of them. So its cost is (1 + this / K) times the work.
TORCH_FIXED_K_STEPS = 77
# A floor under cuBLAS's cost where the problem is a matrix-vector product in all but name
# (min(M, N) <= TORCH_STREAM_MAX_ROWS: decode steps), bound by reading the large operand: a fixed
# time plus the bytes of A, B and out at a streaming rate, fitted to cuBLAS on the H200 at M = 1,
# N = K = 4096 / 8192 / 14336 (15.4 / 36.8 / 105.6 us; docs/performance.md, "Small-M GEMM").
# Without it the MAC model made cuBLAS look 50-100x cheaper than it is at M = 1, and PickAny
# never weighed the small-M family against it. Up to SKINNY_GEMM (128) rows it holds too where
# the operands are at least TORCH_STREAM_MIN_BYTES: at M = 64 and 128, N, K in 4096..14336
# (34-412 MB), cuBLAS took 0.88-1.03x of it (H200, gemm_shapes.py --group small_m),
# where the MAC model said 0.3-0.5x; not for small problems, where the fixed time does not hold
# (GPT-2's decode at M = 64, 2304 x 768, 3.6 MB: cuBLAS well under 6.5 us), and the MAC model's
# ranking was measured right (test_torch_provider).
TORCH_STREAM_MAX_ROWS = 16
TORCH_STREAM_MIN_BYTES = 32 << 20
TORCH_STREAM_FIXED_SECONDS = 6.5e-6
TORCH_STREAM_BYTES_PER_SECOND = 4.1e12
# cuBLAS's output tile by operand element size, for `TorchGemm._tiles`: 16-bit nvjet kernels run
# 128x256-class tiles (192x128 to 320x128 in GPT-2's prefill and training profiles and ncu at
# 8192^3; `_TILE_INTENSITY` is 128x256's), DGEMM 128x64 (ncu:
# sm90_xmma_gemm_f64..._tilesize128x64x16); f32
# 128x128 (not profiled; every recorded f32 case has many waves of either).
_CUBLAS_TILE = {2: (128, 256), 4: (128, 128), 8: (128, 64)}
# The MAC model spreads cuBLAS's work evenly over the SMs. On an output of fewer tiles than SMs
# that balance is bought by splitting K (split-K or stream-K), which is not free: the s =
# ceil(SMs / tiles) partial sums (f32; f64 for DGEMM) are written and read back once each, at
# the rate tile kernels stream (`TILE_STREAM_BYTES_PER_SECOND`), and a reduction kernel runs
# (cublasLt::splitKreduce_kernel: 12 launches 0.028 ms, 2.3 us each, in GPT-2's decode profile
# on the H200). Measured: GPT-2's c_attn dW (768 x 2304 x
# 8192: 54 tiles, s = 3, 42 MB of partials) cuBLAS 0.0512 ms against 0.0454 for our 128x128
# tile (H100, the "H100 GPT-2 and sweep" run of tests/data; 0.0447 against 0.0441 on the
# H200, profiled), where the even spread alone put cuBLAS 18 % ahead;
# the c_fc / mlp.c_proj dW (72 tiles, s = 2) stay cuBLAS's, as measured (0.060 / 0.056 ms
# against our 0.081). (At a partials rate of 3.8 TB/s or more c_attn dW would go to cuBLAS
# again; at 2.5 cuBLAS is costed 8 % above our kernel.) Not where min(M, N) <= SKINNY_GEMM:
# there cuBLAS runs narrow tiles (nvjet 64x32 / 64x8 at GPT-2's decode) and its streaming time
# alone matches the measurements (H200, M = 64 / 128 at N, K >= 4096: 6.5 us + the bytes at
# 4.1 TB/s within 10 % of the measured 15-103 us, gemm_shapes.py --group small_m).
TORCH_SPLIT_K_REDUCE_SECONDS = 2.3e-6
# A split is only worth its reduction where each piece keeps a long k range: at most K /
# `TORCH_SPLIT_K_MIN_PIECE` splits (an assumption, not profiled: a 256 x 384 x 512 product, 4
# tiles, would otherwise be charged 33 splits, and the GPU test that expects cuBLAS for such a
# small problem failed on that).
TORCH_SPLIT_K_MIN_PIECE = 1024
# `TORCH_GELU_EPILOGUE_FACTOR` applies at every M: timed on the GPU alone (the "H100 GPT-2 and
# sweep" run of tests/data), cuBLASLt's bias + GELU at GPT-2's decode c_fc took 0.0084 ms, next to
# 0.0080 for c_attn's bias-only call, so the fused epilogue is as cheap at a decode step. (Samples
# that include the host's launch time, 0.0763 ms there, would charge it two more output passes.)
# torch chooses its algorithm (and tile) per call: tile (0, 0, 0) says "none fixed", so
# metadata filters on tile sizes pass these instances over.
_LIBRARY = BLASDesignMetadata(tile_shape=(0, 0, 0), schedule="library")


def _torch_stream(stream: Any) -> Any:
    """A torch stream context for any stream spelling kernel_api accepts (None: the current one)."""
    if stream is None or isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    return torch.cuda.stream(torch.cuda.ExternalStream(stream_handle(stream)))


_current_device = torch._C._cuda_getDevice if hasattr(torch._C, "_cuda_getDevice") else torch.cuda.current_device


@TorchProvider.register
class TorchGemm(TorchKernel):
    """``out = activation(alpha * A @ B + beta * C + bias)`` with torch (cuBLAS / cuBLASLt)."""

    supported_args_type = GemmArguments
    performance_hint = TORCH_GEMM_HINT

    @classmethod
    def generate_kernels(cls, metadata_filter: Callable[[KernelMetadata], bool] | None, epilogue_args: Any = None,
                         cc: int | None = None) -> list["TorchGemm"]:
        found = []
        for dt in _DTYPES:
            for a in _LAYOUTS:
                for b in _LAYOUTS:
                    for o in _LAYOUTS:
                        operands = GemmOperandsMetadata(TensorAttributes(dt, _LAYOUTS[a], 1),
                                                        TensorAttributes(dt, _LAYOUTS[b], 1),
                                                        TensorAttributes(dt, _LAYOUTS[o], 1), _ACCUMULATOR[dt])
                        metadata = KernelMetadata(f"TorchGemm_{dt}_{a}{b}{o}", cls, operands, design=_LIBRARY,
                                                  epilogue=EpilogueMetadata())
                        if metadata_filter is None or metadata_filter(metadata):
                            found.append(cls(metadata))
        return found

    def estimated_cost(self, args: GemmArguments, sm_count: int) -> float:
        """The work spread evenly over the SMs (no wave quantisation) at `TORCH_GEMM_HINT`'s
        efficiency for a 128x256 tile, with `TORCH_FIXED_K_STEPS` more k-steps per output, plus
        the split-K reduction that spread costs on a non-skinny output of fewer tiles than SMs
        (`_split_k_cost`), or the time to stream the operands when that is longer
        (`_streaming_cost`), times 1 / `TORCH_UNALIGNED_FACTOR` (by element size) when an
        operand is not 16-byte aligned, 16-bit operands then taking `_unaligned_cost` instead;
        f64's work times `TORCH_DGEMM_COST`; for cuBLASLt's bias + GELU times
        `TORCH_GELU_EPILOGUE_FACTOR`."""
        efficiency = TORCH_GEMM_HINT * _TILE_INTENSITY / (_TILE_INTENSITY + 32)
        element = args.tensor_attributes["A"].dtype.bytes
        if any(attrs.divisibility * attrs.dtype.bytes < 16 for attrs in args.tensor_attributes.values()):
            if element == 2:
                return self._unaligned_cost(args, sm_count)
            efficiency *= TORCH_UNALIGNED_FACTOR[element]
        if element == 8:
            efficiency /= TORCH_DGEMM_COST
        work = max(args.M, 1) * max(args.N, 1) * (max(args.K, 1) + TORCH_FIXED_K_STEPS) * max(args.L, 1)
        cost = max(work / max(sm_count, 1) / efficiency + self._split_k_cost(args, sm_count),
                   self._streaming_cost(args))
        epilogue = args.epilogue
        if (epilogue is not None and epilogue.activation == "gelu" and epilogue.bias_kind == "row"
                and args.A.dim() == 2 and epilogue.alpha == 1.0 and epilogue.beta == 0.0):
            cost *= TORCH_GELU_EPILOGUE_FACTOR  # the _addmm_activation path (`_run`)
        return cost

    def _unaligned_cost(self, args: GemmArguments, sm_count: int) -> float:
        """cuBLAS's alignment-1 path for 16-bit operands: `TORCH_UNALIGNED_FIXED_SECONDS` (by
        dtype) plus the waves of 64x64 tiles at `TORCH_UNALIGNED_TILE_K_SECONDS` per k (split
        along K on fewer tiles than SMs, as `_split_k_cost` has it), or streaming the operands
        where that is longer (`_streaming_cost`), in gemm_cost units: the run time, launch
        included, as `SimtGemm`'s and the staged kernels' estimates are."""
        tiles = -(-args.M // 64) * -(-args.N // 64) * max(args.L, 1)
        waves = -(-tiles // max(sm_count, 1))
        # fewer tiles than SMs: K split in pieces of at least TORCH_SPLIT_K_MIN_PIECE (100x1333x3001,
        # 42 tiles: 21.4 us measured, 35 estimated without)
        splits = max(1, min(sm_count // max(tiles, 1), args.K // TORCH_SPLIT_K_MIN_PIECE))
        fixed = TORCH_UNALIGNED_FIXED_SECONDS[args.tensor_attributes["A"].dtype]
        seconds = fixed + waves * max(args.K, 1) * TORCH_UNALIGNED_TILE_K_SECONDS / splits
        return max(seconds * GEMM_COST_UNITS_PER_SECOND, self._streaming_cost(args))

    @staticmethod
    def _tiles(args: GemmArguments) -> int:
        """Output tiles of cuBLAS's tile for the operands' element size (`_CUBLAS_TILE`)."""
        tm, tn = _CUBLAS_TILE.get(args.tensor_attributes["A"].dtype.bytes, (128, 256))
        return -(-args.M // tm) * -(-args.N // tn) * max(args.L, 1)

    def _split_k_cost(self, args: GemmArguments, sm_count: int) -> float:
        """On an output of min(M, N) > `SKINNY_GEMM` with fewer cuBLAS tiles than SMs, the split-K
        reduction: ceil(SMs / tiles) partial sums (at most K / `TORCH_SPLIT_K_MIN_PIECE`; none
        below two) of the output in the accumulator type, written
        and read back at `TILE_STREAM_BYTES_PER_SECOND`, plus `TORCH_SPLIT_K_REDUCE_SECONDS`, in
        gemm_cost units; else 0."""
        tiles = self._tiles(args)
        if min(args.M, args.N) <= SKINNY_GEMM or tiles >= sm_count:
            return 0.0
        splits = min(-(-sm_count // max(tiles, 1)), args.K // TORCH_SPLIT_K_MIN_PIECE)
        if splits < 2:
            return 0.0
        accumulator = 8 if args.tensor_attributes["A"].dtype.bytes == 8 else 4
        partial_bytes = 2 * splits * args.M * args.N * max(args.L, 1) * accumulator
        seconds = TORCH_SPLIT_K_REDUCE_SECONDS + partial_bytes / TILE_STREAM_BYTES_PER_SECOND
        return seconds * GEMM_COST_UNITS_PER_SECOND

    @staticmethod
    def _streaming_cost(args: GemmArguments) -> float:
        """Up to `TORCH_STREAM_MAX_ROWS` rows (or columns), and up to `SKINNY_GEMM` where the
        operands take at least `TORCH_STREAM_MIN_BYTES`, `TORCH_STREAM_FIXED_SECONDS` plus
        reading A and B and writing out at `TORCH_STREAM_BYTES_PER_SECOND`, in gemm_cost units;
        else 0."""
        rows, streamed = min(args.M, args.N), gemm_bytes(args)
        if rows > SKINNY_GEMM or (rows > TORCH_STREAM_MAX_ROWS and streamed < TORCH_STREAM_MIN_BYTES):
            return 0.0
        seconds = TORCH_STREAM_FIXED_SECONDS + streamed / TORCH_STREAM_BYTES_PER_SECOND
        return seconds * GEMM_COST_UNITS_PER_SECOND

    def _launcher(self, args: GemmArguments, artifact: CompiledArtifact) -> Launcher | None:
        """torch calls for the common cases (a product; a row bias, relu or gelu on a 2-D one),
        so repeated `kernel_api.ops` calls skip building arguments; the bias is the arguments'
        own, which `kernel_api.ops` replaces by each call's."""
        epilogue = args.epilogue
        if epilogue is None:
            # torch_call: repeated plain ops.gemm calls on the current stream run from the C entry
            # points (benchmarks/host_latency_torch.py). A 2-D product is torch.mm, batches of one
            # size torch.bmm: the products matmul reaches after its own dispatch, one call fewer.
            return Launcher(_matmul_launch, torch_call=_product_call(args.A, args.B))
        if (args.A.dim() == 2 and epilogue.alpha == 1.0 and epilogue.beta == 0.0 and epilogue.bias is not None
                and epilogue.bias_kind == "row"):
            # torch_call: repeated calls on the current stream run from the C entry points too
            # torch.addmm and _addmm_activation take (bias, A, B): recorded as they are, reordered
            if epilogue.activation is None:
                return Launcher(_addmm_launch, (epilogue.bias,), torch_call=torch.addmm, torch_order=(2, 0, 1))
            if epilogue.activation == "relu":
                return Launcher(_addmm_relu_launch, (epilogue.bias,), torch_call=torch._addmm_activation,
                                torch_order=(2, 0, 1))
            if epilogue.activation == "gelu":  # (use_gelu is keyword-only: a Python function passes it)
                return Launcher(_addmm_gelu_launch, (epilogue.bias,), torch_call=_addmm_gelu_call)
        return None

    def _run(self, args: GemmArguments, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        A, B, out, epilogue = args.A, args.B, args.out, args.epilogue
        with _torch_stream(stream):
            if epilogue is None:
                torch.matmul(A, B, out=out)
                return
            alpha, beta, bias, activation = epilogue.alpha, epilogue.beta, epilogue.bias, epilogue.activation
            plain_scale = alpha == 1.0 and beta == 0.0
            if (A.dim() == 2 and plain_scale and bias is not None and epilogue.bias_kind == "row"
                    and activation in (None, "relu", "gelu")):
                # cuBLASLt's bias (+ relu / tanh-gelu) epilogues
                if activation is None:
                    torch.addmm(bias, A, B, out=out)
                else:
                    torch._addmm_activation(bias, A, B, use_gelu=activation == "gelu", out=out)
                return
            z = torch.matmul(A, B)
            if alpha != 1.0:
                z.mul_(alpha)
            if beta != 0.0:
                z.add_(epilogue.C, alpha=beta)
            if bias is not None:
                z.add_(bias if epilogue.bias_kind == "row" else bias.unsqueeze(-1))
            if activation is not None:
                z = _TORCH_ACTIVATIONS[activation](z)
            out.copy_(z)


def _on_current_stream(stream: Any) -> bool:
    """Whether ``stream`` (a CUstream from kernel_api's launch paths) is torch's current one."""
    return _current_raw_stream is not None and int(stream) == _current_raw_stream(_current_device())


def _product_call(A: torch.Tensor, B: torch.Tensor) -> Any:
    """The torch function that computes ``A @ B`` for these operands' ranks with the least
    dispatch: ``torch.mm`` (2-D), ``torch.bmm`` (3-D of one batch size), else ``torch.matmul``."""
    if A.dim() == 2 and B.dim() == 2:
        return torch.mm
    if A.dim() == 3 and B.dim() == 3 and A.shape[0] == B.shape[0]:
        return torch.bmm
    return torch.matmul


def _matmul_launch(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor, stream: Any) -> None:
    if _on_current_stream(stream):
        torch.matmul(A, B, out=out)
    else:
        with _torch_stream(stream):
            torch.matmul(A, B, out=out)


def _addmm_launch(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor, bias: torch.Tensor, stream: Any) -> None:
    if _on_current_stream(stream):
        torch.addmm(bias, A, B, out=out)
    else:
        with _torch_stream(stream):
            torch.addmm(bias, A, B, out=out)


def _addmm_gelu_launch(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor, bias: torch.Tensor, stream: Any) -> None:
    with contextlib.nullcontext() if _on_current_stream(stream) else _torch_stream(stream):
        torch._addmm_activation(bias, A, B, use_gelu=True, out=out)


def _addmm_relu_launch(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor, bias: torch.Tensor, stream: Any) -> None:
    with contextlib.nullcontext() if _on_current_stream(stream) else _torch_stream(stream):
        torch._addmm_activation(bias, A, B, use_gelu=False, out=out)


# tanh GELU's product as a `Launcher.torch_call`, on the current stream: (A, B, bias[, out=out]),
# allocating when out is None (then no out=None is passed on: torch's argument parser takes a
# quarter microsecond for it).
def _addmm_gelu_call(A: torch.Tensor, B: torch.Tensor, bias: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        return torch._addmm_activation(bias, A, B, use_gelu=True)
    return torch._addmm_activation(bias, A, B, use_gelu=True, out=out)


def _row_design() -> RowReductionDesignMetadata:
    return RowReductionDesignMetadata("block", 1, 1, 1, None)


@TorchProvider.register
class TorchSoftmax(TorchKernel):
    """``softmax(x)`` over the last dimension with ``torch._softmax``."""

    supported_args_type = SoftmaxArguments
    # Below every softmax of ours in PickAny's row_cost (theirs stays under 24 = 12 / 0.5).
    performance_hint = 0.02

    @classmethod
    def generate_kernels(cls, metadata_filter: Callable[[KernelMetadata], bool] | None, epilogue_args: Any = None,
                         cc: int | None = None) -> list["TorchSoftmax"]:
        if epilogue_args is not None:
            return []
        found = []
        for dt in _DTYPES:
            attrs = TensorAttributes(dt, (0, 1), 1)
            metadata = KernelMetadata(f"TorchSoftmax_{dt}", cls, SoftmaxOperandsMetadata(attrs, attrs, _ACCUMULATOR[dt]),
                                      design=_row_design())
            if metadata_filter is None or metadata_filter(metadata):
                found.append(cls(metadata))
        return found

    def _launcher(self, args: SoftmaxArguments, artifact: CompiledArtifact) -> Launcher | None:
        """torch's softmax, with ``torch_call``: repeated `kernel_api.ops.softmax` calls on the
        current stream run it from the C entry points, allocating ones letting torch allocate."""
        return Launcher(_softmax_launch, torch_call=_softmax_call)

    def _run(self, args: SoftmaxArguments, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        with _torch_stream(stream):
            torch.softmax(args.x, -1, out=args.out)


@TorchProvider.register
class TorchSoftmaxBackward(TorchKernel):
    """The gradient of softmax with ``torch._softmax_backward_data``."""

    supported_args_type = SoftmaxBackwardArguments
    performance_hint = 0.02

    @classmethod
    def generate_kernels(cls, metadata_filter: Callable[[KernelMetadata], bool] | None, epilogue_args: Any = None,
                         cc: int | None = None) -> list["TorchSoftmaxBackward"]:
        if epilogue_args is not None:
            return []
        found = []
        for dt in _DTYPES:
            attrs = TensorAttributes(dt, (0, 1), 1)
            operands = SoftmaxBackwardOperandsMetadata(attrs, attrs, attrs, _ACCUMULATOR[dt])
            metadata = KernelMetadata(f"TorchSoftmaxBackward_{dt}", cls, operands, design=_row_design())
            if metadata_filter is None or metadata_filter(metadata):
                found.append(cls(metadata))
        return found

    def _launcher(self, args: SoftmaxBackwardArguments, artifact: CompiledArtifact) -> Launcher | None:
        """torch's softmax backward, with ``torch_call`` (see `TorchSoftmax._launcher`)."""
        return Launcher(_softmax_backward_launch, torch_call=_softmax_backward_call)

    def _run(self, args: SoftmaxBackwardArguments, artifact: CompiledArtifact, stream: Any,
             workspace: Any = None) -> None:
        with _torch_stream(stream):
            _softmax_backward_call(args.grad_out, args.out, out=args.grad_in)


# The softmax kernels' launches, for the Python paths (``function(*operands, stream)``), and their
# torch calls on the current stream (``call(*inputs, out=output)``; allocating without ``out``).
# (no out=None passed on: torch's argument parser takes a quarter microsecond for it)
def _softmax_call(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return torch.softmax(x, -1) if out is None else torch.softmax(x, -1, out=out)


def _softmax_backward_call(grad_out: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        return torch._softmax_backward_data(grad_out, y, -1, y.dtype)
    return torch._softmax_backward_data(grad_out, y, -1, y.dtype, grad_input=out)  # (the out= overload's name)


def _softmax_launch(x: torch.Tensor, out: torch.Tensor, stream: Any) -> None:
    with contextlib.nullcontext() if _on_current_stream(stream) else _torch_stream(stream):
        torch.softmax(x, -1, out=out)


def _softmax_backward_launch(grad_out: torch.Tensor, y: torch.Tensor, grad_in: torch.Tensor, stream: Any) -> None:
    with contextlib.nullcontext() if _on_current_stream(stream) else _torch_stream(stream):
        _softmax_backward_call(grad_out, y, out=grad_in)
