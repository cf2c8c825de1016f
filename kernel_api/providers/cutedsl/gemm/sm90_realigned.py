"""`Sm90RealignedGemm`: the Hopper TMA + WGMMA GEMM for f16/bf16 operands of any alignment.

TMA reads and writes global memory only at 16-byte aligned base pointers and strides, so
`Sm90WarpSpecializedGemm` declares a divisibility of 16 bytes for A, B and out, and everything
else (an odd N such as GPT-2's 50257, an odd K or M, a view such as ``big[:, 1:]``) used to fall
to the SIMT fallback at 0.13-0.19x cuBLAS. This family takes any alignment: per launch, each of
A, B and out that TMA cannot address in place is staged in a padded, aligned copy in the
workspace (same majorness, leading dimension rounded up to 128 bytes, each region 256-byte
aligned), and one `Sm90WarpSpecializedGemm` configuration runs on the aligned views. A
misaligned out is computed into its padded copy and copied back (the inner kernel applies the
whole epilogue, so the copy-back is a plain copy). TMA bounds every access by the logical
extents, so the padding is never read nor written by the kernel. The copies cost O(MK + KN +
MN) memory traffic against the O(MNK) multiply: a few percent on large problems. They run on
the line-copy kernel (``implementations/line_copy.cu``, NVRTC: aligned 16-byte stores fed by
funnel-shifted aligned loads, 2.9-3.8 TB/s on the H200 where torch's copy_ and
cudaMemcpy2DAsync ran 1.4-2.4; docs/performance.md, "Realigned GEMM").

Operands that TMA can address as they are (an aligned pointer and strides, whatever the
extents, e.g. an odd K inside a buffer whose rows are padded) are used in place. C and the bias
are read element by element by the inner kernel's epilogue and are never copied.

Arguments whose A, B and out are all 16-byte aligned are refused (`Sm90WarpSpecializedGemm`
serves them without the staging checks and the workspace); so discovery offers this family
exactly where the direct kernel is not offered, and `PickAny` ranks it by its own estimate
(`estimated_cost`: the inner kernel's tile model plus the copies), which puts it far ahead of
the SIMT fallback on every problem but tiny ones.

The compiled artifact is the inner kernel's (compiled for the aligned views: the inner compile
depends on the rank, the epilogue and C's layout, never on A/B/out's sizes or alignment), so
one artifact serves every misaligned shape of one layout and epilogue, and it shares the disk
cache with the direct kernel's.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ....arguments import GemmArguments
from ....core.artifact import CompiledArtifact
from ....core.dtypes import DataType
from ....core.status import Status
from ....core.streams import stream_handle, to_cuda_stream
from ....cost import GEMM_COST_UNITS_PER_SECOND, estimated_cost
from ....launcher import Launcher
from ....metadata import GemmOperandsMetadata, KernelMetadata, TensorAttributes
from ....utils import strides_to_layout_string
from .. import CuTeDSLProvider
from .common import (FULL_EPILOGUE, LAYOUT_COMBOS, GemmKernelBase, epilogue_supported_by_generation, epilogue_tail,
                     launch_workspace)
from .implementations.line_copy import copy_lines
from .implementations.line_copy import prepare as prepare_line_copy
from .sm90_warpspecialized import F32_OUT_CONFIGS, Sm90Config, Sm90WarpSpecializedGemm, next_epoch, tma_divisibility

#: TMA's alignment unit for base pointers and strides.
TMA_ALIGN_BYTES = 16
#: Alignment of each staged region (and of the inner kernel's stream-K workspace) in the workspace.
REGION_ALIGN_BYTES = 256
#: The staged copies' leading dimension is rounded up to this many bytes, not to TMA's 16: at
#: a pitch that is no multiple of 128 bytes most rows of a TMA box straddle two 128-byte lines.
#: Measured on the H200 (the staged run, the inner kernel and the copies timed apart), whole
#: runs: f16 4097^3 3 % (128x256 cooperative)
#: and 8 % (128x128 ping-pong) faster, 4096x50257x4096 2 % / 7 %, 8192x50257x768 4 % / 2 %;
#: 256-1024 bytes gained nothing more.
STAGED_PITCH_BYTES = 128
_AB_TYPES = (DataType.bf16, DataType.f16)

#: The inner configurations: the direct kernel's f32-output set, and the 128x256 cooperative
#: tile with stream-K that also splits a fuller last wave at K <= 80 k-tiles (5120): f16 and
#: bf16 4097^3 (4.4 waves) 5 % faster than its data-parallel twin on the H200, 4096x50257x4096
#: (47.8 waves) 1 % slower, where the cost model keeps the twin
#: (`sm90_warpspecialized.stream_k_waves`).
REALIGNED_CONFIGS: tuple[Sm90Config, ...] = F32_OUT_CONFIGS + (
    Sm90Config((128, 256), (2, 1), "cooperative", swizzle=4, stream_k=True, sk_any_wave_max_k_tiles=80),)
#: Bytes per second (read + write) the staging copies sustain on the H200 with the line-copy
#: kernel (`copy_lines`): 2.9 TB/s on 8 KB lines, 3.5-3.6 on 16 KB, 3.96 on 100 KB, and 2.0 on
#: 2 KB lines of 16 MB (docs/performance.md, "Realigned GEMM"; torch's copy_
#: and cudaMemcpy2DAsync, which staged before it, ran 1.4-2.4).
_COPY_BYTES_PER_SECOND = 3.5e12
#: Stage with the line-copy kernel (`copy_lines`); False: torch's copy_ and cudaMemcpy2DAsync
#: only (the slower staging, kept for comparison).
USE_LINE_COPY = True
#: Lines at least this long (bytes) are staged with cudaMemcpy2DAsync, shorter ones with torch's
#: copy_ (H200: 2.4 vs 1.8 TB/s on 100 KB lines, 1.4 vs 1.6 on 8 KB lines).
_MEMCPY_2D_MIN_LINE_BYTES = 32768
#: Launch and tail of one copy kernel (4 MB of 2 KB lines took 8.4 us, 2.3 of them moving bytes;
#: whole runs fit 3 us beside `STAGED_INNER_LAUNCH_SECONDS`).
_COPY_FIXED_SECONDS = 3e-6
#: PickAny weighs the staged kernels against cuBLAS's alignment-1 path and `SimtGemm`, whose
#: estimates are their run times in seconds, launch included (`TorchGemm._unaligned_cost`,
#: `SimtGemm.estimated_cost`). So this estimate is one too: the inner kernel's launch, and its
#: tile-model cost read as seconds at `GEMM_COST_UNITS_PER_SECOND` times a factor, since those
#: units overstate its time on these problems. Fitted with `_COPY_FIXED_SECONDS` to the 290
#: recorded staged timings (37x53x29 to 4096x50257x4096, bf16/f16, H200 and H100;
#: tests/data/measured_gemm_times.json): rms log error 0.11, against 0.24 for the inner cost
#: plus copies alone (e.g.
#: 100x5001x3001 on the 128x256 tile: 100 us estimated, 61 measured; 95x1000x300: 5.7, 9.5).
#: Every staged kernel of a problem stages the same copies, so their order among themselves is
#: unchanged.
STAGED_INNER_SECONDS_FACTOR = 0.675
STAGED_INNER_LAUNCH_SECONDS = 5.5e-6


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def tma_view(t: torch.Tensor, row_major: bool, align: int) -> torch.Tensor | None:
    """``t`` when TMA can address it in place, else None (it must be staged in a padded copy).

    TMA needs a 16-byte aligned base pointer and strides that are multiples of ``align``
    elements (16 bytes); the extents may be anything. Also staged: a zero stride of a mode wider
    than 1 (an expanded operand), and a single line (one row of a row-major operand) whose
    contiguous extent is not a multiple of ``align``: measured on the H200, the kernel then
    wrote that line up to its next 16-byte boundary (an out of shape (1, 77) with stride (80, 1)
    got 3 elements past its end); a copy of one line costs nothing worth saving.
    """
    if t.data_ptr() % TMA_ALIGN_BYTES:
        return None
    rank = t.dim()
    unit = rank - 1 if row_major else rank - 2
    shape, stride = t.shape, t.stride()
    for mode in range(rank):
        if mode != unit and (stride[mode] % align or (stride[mode] == 0 and shape[mode] > 1)):
            return None
    if shape[rank - 2 if row_major else rank - 1] == 1 and shape[unit] % align:
        return None
    return t


def padded_layout(shape: tuple[int, ...], row_major: bool, align: int) -> tuple[tuple[int, ...], int]:
    """(strides, elements) of a packed copy of an operand of ``shape`` whose leading dimension
    is rounded up to ``align`` elements (the batch stride follows)."""
    rows, cols = shape[-2], shape[-1]
    if row_major:
        ld = _round_up(max(cols, 1), align)
        matrix, stride = rows * ld, (ld, 1)
    else:
        ld = _round_up(max(rows, 1), align)
        matrix, stride = cols * ld, (1, ld)
    if len(shape) == 3:
        return (matrix, *stride), shape[0] * matrix
    return stride, matrix


class _Plan:
    """Where one launch's operands come from: ``views`` (name -> tensor TMA reads in place) and
    ``staged`` ((name, byte offset, strides, byte size) of each padded copy), the inner kernel's
    workspace bytes (at offset 0) and the total workspace bytes."""

    __slots__ = ("views", "staged", "inner_bytes", "total_bytes")

    def __init__(self, views: dict, staged: list, inner_bytes: int, total_bytes: int) -> None:
        self.views, self.staged, self.inner_bytes, self.total_bytes = views, staged, inner_bytes, total_bytes


_memcpy_2d: list = []  # [cudaMemcpy2DAsync, the device-to-device kind], once imported


def copy_2d(dst: torch.Tensor, src: torch.Tensor, row_major: bool, stream: int) -> bool:
    """Copy ``src`` into ``dst`` (same shape and majorness) with ``cudaMemcpy2DAsync`` on the raw
    ``stream``: one 2-D copy per batch, or one for all batches when each operand's batches follow
    each other at the matrix stride. The driver's pitched copy runs at any alignment. False (and
    nothing copied) where a pitch is smaller than a line (an expanded or overlapping operand)."""
    rank = src.dim()
    ld_mode = rank - 2 if row_major else rank - 1
    lines, width = src.shape[ld_mode], src.shape[rank - 1 if row_major else rank - 2]
    size = src.element_size()
    sp, dp = src.stride(ld_mode), dst.stride(ld_mode)
    if lines == 1:
        sp = dp = width
    if sp < width or dp < width:
        return False
    batches = src.shape[0] if rank == 3 else 1
    if batches > 1 and src.stride(0) == lines * sp and dst.stride(0) == lines * dp:
        lines, batches = lines * batches, 1
    elif batches > 1 and (src.stride(0) < lines * sp or dst.stride(0) < lines * dp):
        return False
    if not _memcpy_2d:
        from cuda.bindings import runtime

        _memcpy_2d[:] = [runtime.cudaMemcpy2DAsync, runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice]
    memcpy, kind = _memcpy_2d
    s_ptr, d_ptr = src.data_ptr(), dst.data_ptr()
    for b in range(batches):
        offset = b * size
        err = memcpy(d_ptr + offset * (dst.stride(0) if rank == 3 else 0), dp * size,
                     s_ptr + offset * (src.stride(0) if rank == 3 else 0), sp * size,
                     width * size, lines, kind, stream)[0]
        if int(err) != 0:
            raise RuntimeError(f"cudaMemcpy2DAsync failed: {err}")
    return True


def _long_lines(t: torch.Tensor, row_major: bool) -> bool:
    """Whether ``t``'s contiguous lines are long enough for cudaMemcpy2DAsync to beat copy_."""
    return t.shape[-1 if row_major else -2] * t.element_size() >= _MEMCPY_2D_MIN_LINE_BYTES


def stage_copy(dst: torch.Tensor, src: torch.Tensor, row_major: bool, stream: int, device: int) -> None:
    """Copy ``src`` into ``dst`` (an operand into its padded copy, or the padded out back) on the
    raw ``stream``: the line-copy kernel where it takes the pair (`copy_lines`), else
    cudaMemcpy2DAsync on long lines, else torch's ``copy_`` (run inside `_launch_stream`)."""
    if USE_LINE_COPY and copy_lines(dst, src, row_major, stream, device):
        return
    if not (_long_lines(src, row_major) and copy_2d(dst, src, row_major, stream)):
        dst.copy_(src)


# raw stream handle -> torch stream object, for running the copies on the launch stream
_torch_streams: dict[tuple[int, int], torch.cuda.Stream] = {}


def _launch_stream(stream: Any, device: torch.device) -> contextlib.AbstractContextManager:
    """A context in which torch ops run on ``stream`` (any spelling kernel_api accepts)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    handle = stream_handle(stream, index)
    if handle == torch.cuda.current_stream(index).cuda_stream:
        return contextlib.nullcontext()
    found = _torch_streams.get((handle, index))
    if found is None:
        if len(_torch_streams) > 256:
            _torch_streams.clear()
        found = _torch_streams[(handle, index)] = torch.cuda.ExternalStream(handle, device=device)
    return torch.cuda.stream(found)


@CuTeDSLProvider.register
class Sm90RealignedGemm(GemmKernelBase):
    """`Sm90WarpSpecializedGemm` for A, B and out of any alignment (f16/bf16 in, f32 accumulate);
    see the module docstring.

    Names read ``Sm90RealignedGemm_<inner configuration>_align1x1x1``; ``design`` is the inner
    kernel's. The workspace (`get_workspace_size`) holds the inner kernel's stream-K workspace
    (if any) and the padded copies; `Kernel.run` allocates it on the launch stream when none is
    given.
    """

    performance_hint = 1.0  # the inner kernel's (estimated_cost adds the copies)
    batch_on_grid_z = False  # persistent: the inner kernel's scheduler walks the batches
    workspace_free = False
    specialise_c_alignment = True  # as the inner kernel compiles C (the template's compile_key keys on it)

    def __init__(self, metadata: KernelMetadata, inner: Sm90WarpSpecializedGemm) -> None:
        super().__init__(metadata)
        self.inner = inner
        md = inner.metadata.operands
        #: (name, row-major?, alignment in elements) of the operands TMA addresses
        self._operands = tuple((name, getattr(md, name).layout == "t", getattr(md, name).divisibility)
                               for name in ("A", "B", "out"))
        self._row_major = {name: row_major for name, row_major, _ in self._operands}

    # ---- discovery -----------------------------------------------------------------
    @staticmethod
    def generate_kernels(metadata_filter: Callable[[KernelMetadata], bool] | None, epilogue_args: Any = None,
                         cc: int | None = None) -> list["Sm90RealignedGemm"]:
        """One instance per (types, layouts, inner configuration); none unless cc is 90.

        The inner configurations (`REALIGNED_CONFIGS`) are the ones the direct kernel also emits
        for an f32 output (128x256 cooperative, 128x128 and 64x128 pingpong, 128x128 pingpong
        stream-K), and the 128x256 cooperative tile with stream-K splitting fuller last waves:
        one per shape class is enough here, where the copies, not the last percent of the
        multiply, decide against cuBLAS.
        """
        if cc is not None and cc != 90:
            return []
        if not epilogue_supported_by_generation(epilogue_args, FULL_EPILOGUE):
            return []
        kernels = []
        for ab in _AB_TYPES:
            for out_type in (ab, DataType.f32):
                for stride_A, stride_B, stride_out in LAYOUT_COMBOS:
                    for cfg in REALIGNED_CONFIGS:
                        kernel = Sm90RealignedGemm.instance(ab, out_type, stride_A, stride_B, stride_out, cfg)
                        if metadata_filter is None or metadata_filter(kernel.metadata):
                            kernels.append(kernel)
        return kernels

    @staticmethod
    def instance(ab: DataType, out_type: DataType, stride_A: tuple, stride_B: tuple, stride_out: tuple,
                 cfg: Sm90Config) -> "Sm90RealignedGemm":
        """The instance on one inner configuration (``cfg``; benchmarks try others than
        `generate_kernels`' with it)."""
        inner = Sm90WarpSpecializedGemm._make(ab, out_type, stride_A, stride_B, stride_out, cfg)
        operands = GemmOperandsMetadata(
            TensorAttributes(ab, stride_A, 1), TensorAttributes(ab, stride_B, 1),
            TensorAttributes(out_type, stride_out, 1), accumulator_type=DataType.f32)
        tail = inner.name[len("Sm90WarpSpecializedGemm_"):].rpartition("_align")[0]
        metadata = KernelMetadata(f"Sm90RealignedGemm_{tail}_align1x1x1", Sm90RealignedGemm, operands,
                                  inner.metadata.design, min_cc=90, max_cc=90, epilogue=FULL_EPILOGUE)
        return Sm90RealignedGemm(metadata, inner)

    def _family_supports(self, args: GemmArguments) -> Status | None:
        attrs = args.tensor_attributes
        if all(attrs[name].divisibility % align == 0 for name, _, align in self._operands):
            return Status.fail("A, B and out are all 16-byte aligned: Sm90WarpSpecializedGemm reads them in place "
                               "(nothing to realign)")
        return self.inner._family_supports(args)  # K=0 and the persistent scheduler's tile counter

    # ---- workspace -------------------------------------------------------------------
    def _plan(self, args: GemmArguments) -> _Plan:
        inner_bytes = _round_up(self.inner.get_workspace_size(args), REGION_ALIGN_BYTES)
        offset = inner_bytes
        views: dict[str, torch.Tensor] = {}
        staged = []
        for name, row_major, align in self._operands:
            t = getattr(args, name)
            view = tma_view(t, row_major, align)
            if view is not None:
                views[name] = view
                continue
            stride, elements = padded_layout(t.shape, row_major, max(align, STAGED_PITCH_BYTES // t.element_size()))
            size = elements * t.element_size()
            staged.append((name, offset, stride, size))
            offset += _round_up(size, REGION_ALIGN_BYTES)
        return _Plan(views, staged, inner_bytes, offset)

    def get_workspace_size(self, args: GemmArguments) -> int:
        """The inner kernel's workspace (stream-K) plus a padded copy of each of A, B and out that
        TMA cannot address in place (leading dimension rounded up to `STAGED_PITCH_BYTES`), each region
        256-byte aligned; 0 for an empty problem."""
        if args.M == 0 or args.N == 0 or args.L == 0:
            return 0
        return self._plan(args).total_bytes

    # ---- PickAny -----------------------------------------------------------------------
    def estimated_cost(self, args: GemmArguments, sm_count: int) -> float:
        """The run time, launches included: the inner kernel's tile-model cost times
        `STAGED_INNER_SECONDS_FACTOR` plus `STAGED_INNER_LAUNCH_SECONDS`, and the copies (read +
        write of every staged operand at `_COPY_BYTES_PER_SECOND`, and `_COPY_FIXED_SECONDS`
        each), in `gemm_cost` units (`GEMM_COST_UNITS_PER_SECOND`)."""
        seconds = STAGED_INNER_LAUNCH_SECONDS
        for name, row_major, align in self._operands:
            t = getattr(args, name)
            if tma_view(t, row_major, align) is None:
                seconds += 2 * t.numel() * t.element_size() / _COPY_BYTES_PER_SECOND + _COPY_FIXED_SECONDS
        return (STAGED_INNER_SECONDS_FACTOR * estimated_cost(self.inner, args, sm_count)
                + seconds * GEMM_COST_UNITS_PER_SECOND)

    # ---- compile / run ---------------------------------------------------------------
    compiles_from_cache_only = True  # (its compile's cost is in cute_compile, which honours cache_only)

    def compile(self, args: GemmArguments, cc: int | None = None) -> CompiledArtifact:
        """The inner kernel's compile for ``args``' rank, epilogue and C: it builds its operands
        from its own metadata (16-byte aligned), never from A/B/out's sizes or alignment. The
        line-copy kernel is compiled (or loaded) here too."""
        prepare_line_copy()  # the staging copies' NVRTC cubin (cached on disk)
        return CompiledArtifact(self.inner.compile(args, cc).compiled_obj, self)

    def _launcher(self, args: GemmArguments, artifact: CompiledArtifact) -> Launcher | None:
        """Every launch stages the same operands at the same offsets (the plan follows from the
        operands' metadata), so the plan is fixed here and each call takes a workspace from
        torch's caching allocator on the launch stream, stages, runs the inner kernel (with a new
        stream-K epoch where it splits) and copies a staged out back, in a Python function (no C
        operand, a non-empty problem, a device the inner kernel has run on)."""
        if not (args.M and args.N and args.L):
            return None
        tail = epilogue_tail(args)
        clusters = self.inner._clusters.get(args.device_index)
        if tail is None or clusters is None:
            return None
        plan = self._plan(args)
        launch = self._staged_launch(artifact, plan, args.device, clusters)
        size, device = plan.total_bytes, args.device_index

        def sm90_realigned(A: Any, B: Any, out: Any, C: Any, bias: Any, alpha: Any, beta: Any, stream: Any) -> None:
            workspace, handle = launch_workspace(size, device, stream)
            launch(A, B, out, C, bias, alpha, beta, workspace, handle, stream)

        return Launcher(sm90_realigned, tail)

    def _staged_launch(self, artifact: CompiledArtifact, plan: _Plan, device: torch.device, clusters: int) -> Any:
        """``launch(A, B, out, C, bias, alpha, beta, workspace, raw stream, stream)``: ``plan``'s
        staging copies on the raw stream, the inner kernel on ``stream`` (any spelling), and a
        staged out copied back, for operands with the metadata ``plan`` was made for."""
        index = device.index
        staged, inner_bytes, row_major = plan.staged, plan.inner_bytes, self._row_major
        stream_k = self.inner._stream_k
        compiled = artifact.compiled_obj

        def launch(A: Any, B: Any, out: Any, C: Any, bias: Any, alpha: Any, beta: Any, workspace: Any, handle: int,
                   stream: Any) -> None:
            views = {"A": A, "B": B, "out": out}
            staged_out = None
            with _launch_stream(handle, device):
                for name, offset, stride, size in staged:
                    src = views[name]
                    dst = workspace[offset:offset + size].view(src.dtype).as_strided(src.shape, stride)
                    if name == "out":
                        staged_out = dst
                    else:
                        stage_copy(dst, src, row_major[name], handle, index)
                    views[name] = dst
                inner_ws = workspace[:inner_bytes] if inner_bytes else None
                compiled(views["A"], views["B"], views["out"], C, bias, alpha, beta, clusters, inner_ws,
                         next_epoch() if stream_k else 0, to_cuda_stream(stream))
                if staged_out is not None:
                    stage_copy(out, staged_out, row_major["out"], handle, index)

        return launch

    def _run(self, args: GemmArguments, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        if args.M == 0 or args.N == 0 or args.L == 0:
            return  # nothing to write
        plan = self._plan(args)
        if plan.total_bytes:
            if not isinstance(workspace, torch.Tensor):
                raise ValueError(f"{self.name}: needs a workspace of {plan.total_bytes} bytes (get_workspace_size), "
                                 f"got {type(workspace).__name__}")
            if workspace.dtype is not torch.uint8:
                workspace = workspace.view(-1).view(torch.uint8)
            if workspace.numel() < plan.total_bytes:
                raise ValueError(f"{self.name}: the workspace has {workspace.numel()} bytes but these arguments need "
                                 f"{plan.total_bytes} (get_workspace_size)")
            if workspace.device != args.device:
                raise ValueError(f"{self.name}: the workspace is on {workspace.device} but the operands are on "
                                 f"{args.device}")
            if workspace.data_ptr() % REGION_ALIGN_BYTES:
                raise ValueError(f"{self.name}: the workspace must be {REGION_ALIGN_BYTES}-byte aligned")
        # (the inner kernel's checks of its own workspace and cluster slots, and its cluster count)
        clusters = self.inner._extra_launch_args(args, workspace[:plan.inner_bytes] if plan.inner_bytes else None)[0]
        ep = args.epilogue
        if ep is None:
            C, bias, alpha, beta = None, None, 1.0, 0.0
        else:
            C, bias, alpha, beta = (ep.C if ep.beta != 0.0 else None), ep.bias, ep.alpha, ep.beta
        self._staged_launch(artifact, plan, args.device, clusters)(
            args.A, args.B, args.out, C, bias, alpha, beta, workspace, stream_handle(stream, args.device_index), stream)
