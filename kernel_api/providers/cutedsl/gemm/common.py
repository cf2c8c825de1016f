"""Shared, DSL-free pieces of the CuTe DSL GEMM kernels' interfaces.

Layout combinations and their names, the compile-time description of a fused epilogue
(`EpilogueSpec`), and `GemmKernelBase`, the template every GEMM family here derives from
(compile, run, the shared support checks; its docstring lists what a family supplies). Every
implementation follows one calling convention::

    impl(A, B, out, C_or_None, bias_or_None, alpha, beta, *extra, stream)

where A/B/out/C are the user's rank-2 or rank-3 tensors as they are (the implementation
builds (M, K, L)-style views itself, so a rank-2 call costs no extra host work), ``bias``
is a contiguous 1-D tensor, alpha/beta are accumulator-typed scalars and ``extra`` are the
family's own launch arguments (none for most; the persistent SM90 kernel's cluster count,
workspace and launch counter). Nothing here imports cutlass: implementations are imported
lazily inside ``compile``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ....arguments import EpilogueArguments, EpilogueSignature, GemmArguments
from ....arguments.epilogue import FusedEpilogueSignature
from ....core.artifact import CompiledArtifact
from ....core.dtypes import DataType
from .... import launcher
from ....launcher import Launcher, raw_stream
from ....metadata import (ACTIVATIONS, COLUMN_MAJOR, ROW_MAJOR, BLASDesignMetadata, EpilogueMetadata,
                          GemmOperandsMetadata, KernelMetadata, TensorAttributes)
from ....metadata.epilogue import FUNCTION_FEATURES
from ....core.status import Status
from ....utils import MAX_GRID_X, strides_to_layout_string, to_cuda_stream
from ..kernel import CuteDslKernel, fake_tensor, fake_tensor_like

#: (stride_A, stride_B, stride_out) for all eight row/column-major combinations, "ttt" first.
LAYOUT_COMBOS: tuple[tuple[tuple[int, ...], ...], ...] = tuple(itertools.product((ROW_MAJOR, COLUMN_MAJOR), repeat=3))

#: What the fused epilogues of these kernels can do (everything `EpilogueArguments` offers).
FULL_EPILOGUE = EpilogueMetadata(alpha_beta=True, bias=frozenset({"row", "column"}), activations=frozenset(ACTIVATIONS))
#: The named epilogue and epilogue functions (`kernel_api.epilogue`), emitted by
#: ``implementations/fusion.py``: every node, operand kind and reduction.
FUSED_EPILOGUE = EpilogueMetadata(alpha_beta=True, bias=frozenset({"row", "column"}),
                                  activations=frozenset(ACTIVATIONS), functions=FUNCTION_FEATURES)

# CUDA limits the grid's y and z extents to 65535 blocks (x: utils.MAX_GRID_X).
MAX_GRID_YZ = 65535
#: The kernels here are compiled for `fake_tensor`s whose extents are 32-bit (``sym_int32``)
#: and whose strides are 64-bit (``sym_int64``): element offsets (coordinate x stride) are
#: 64-bit, so M*K or M*N past 2^31 elements is fine (measured on an H200), but every extent,
#: and every tile-rounded extent the kernels compute in 32 bits (``(M + BM - 1) // BM``,
#: ``bm * BM + i`` tile coordinates, ``k_tiles * BK``), must stay below 2^31.
INT32_MAX = 2**31 - 1
# Extents below this pass the 32-bit checks for any tile up to 256 (the largest here).
_SAFE_EXTENT = INT32_MAX - 256


def extent_limits(args: GemmArguments, tile: tuple[int, int, int]) -> Status | None:
    """A failure when M, N or K rounded up to ``tile`` (BM, BN, BK) exceeds 32 bits, else None."""
    if args.M <= _SAFE_EXTENT and args.N <= _SAFE_EXTENT and args.K <= _SAFE_EXTENT:
        return None
    for name, value, t in (("M", args.M, tile[0]), ("N", args.N, tile[1]), ("K", args.K, tile[2])):
        padded = -(-value // t) * t
        if padded > INT32_MAX:
            return Status.fail(f"{name}={value:,} (rounded up to the tile's {t}: {padded:,}) exceeds the 32-bit "
                               f"index limit of this kernel (2^31-1 = {INT32_MAX:,})")
    return None


def grid_y_limit(args: GemmArguments, tile_n: int) -> Status | None:
    """A failure when the N tiles, which go on the grid's y axis, exceed its 65535 blocks."""
    tiles = -(-args.N // tile_n)
    if tiles > MAX_GRID_YZ:
        return Status.fail(f"N={args.N:,} makes {tiles:,} tiles of {tile_n} columns, past the grid's y limit of "
                           f"{MAX_GRID_YZ:,} blocks (N <= {MAX_GRID_YZ * tile_n:,} for this tile)")
    return None


def grid_x_tiles_limit(args: GemmArguments, tile_m: int, tile_n: int) -> Status | None:
    """A failure when all (M, N) tiles of one batch, which go on the grid's x axis (a 32-bit
    product), exceed its 2^31-1 blocks."""
    tiles = -(-args.M // tile_m) * -(-args.N // tile_n)
    if tiles > MAX_GRID_X:
        return Status.fail(f"M x N = {args.M:,} x {args.N:,} makes {tiles:,} tiles of {tile_m}x{tile_n}, past the "
                           f"grid's x limit of 2^31-1 = {MAX_GRID_X:,} blocks")
    return None


@dataclass(frozen=True)
class EpilogueSpec:
    """Compile-time shape of ``out = act(alpha * acc + beta * C + bias)``.

    ``scaled``: alpha/beta are applied (runtime values); ``has_c``: a C operand is read;
    ``bias``: None, "row" (one value per output column n) or "column" (one per row m);
    ``activation``: None, "relu", "gelu" (tanh approximation) or "silu".
    ``fusion``: an epilogue function's `FusedEpilogueSignature.key` (the others are then
    their defaults), emitted by ``implementations/fusion.py``.
    The default spec is the identity epilogue (out = acc).
    """

    scaled: bool = False
    has_c: bool = False
    bias: str | None = None
    activation: str | None = None
    fusion: tuple | None = None

    @classmethod
    def from_signature(cls, signature: EpilogueSignature | FusedEpilogueSignature | None) -> "EpilogueSpec":
        """From `GemmArguments.epilogue_signature` (None: identity epilogue)."""
        if signature is None:
            return cls()
        if type(signature) is FusedEpilogueSignature:
            return cls(fusion=signature.key)
        return cls(bool(signature.scaled), bool(signature.has_c), signature.bias_kind, signature.activation)

    @property
    def is_identity(self) -> bool:
        return not (self.scaled or self.has_c or self.bias or self.activation or self.fusion)

    def tag(self) -> str:
        """Short text for logs and artifact names, e.g. 'ab_c_biasrow_gelu'."""
        if self.fusion is not None:
            return "function"
        parts = [p for p in ("ab" if self.scaled else "", "c" if self.has_c else "",
                             f"bias{self.bias}" if self.bias else "", self.activation or "") if p]
        return "_".join(parts) or "none"


def epilogue_tail(args: GemmArguments) -> tuple | None:
    """``(C, bias, alpha, beta)`` of a launch for ``args``, the constants after the tensors in
    a `Launcher`'s tail; None when C is read (a C operand is not among the tensors a launcher
    passes, so a constant C would go stale). The bias is ``args``' own (resolved) tensor:
    `kernel_api.ops` finds it in the tail by identity and passes the caller's bias there."""
    ep = args.epilogue
    if ep is None:
        return (None, None, 1.0, 0.0)
    if ep.beta != 0.0 or ep.bound is not None:  # (an epilogue function's operands are not in the tail)
        return None
    return (None, ep.bias, ep.alpha, 0.0)


def function_epilogue_launcher(artifact: CompiledArtifact, extra: tuple, args: GemmArguments) -> Launcher:
    """The launch of a GEMM with an epilogue function: the plain epilogue's constants, the
    family's ``extra`` launch constants, then the bound operands (`BoundEpilogue.operands`)
    last. A caller whose operands have the same metadata passes its own operands in their place
    (`kernel_api.ops.epilogue_gemm`); the native replay never records such a launch (function
    epilogues do not go through the front door's recorded calls)."""
    return Launcher(artifact, (None, None, 1.0, 0.0, *extra, args.epilogue.bound.operands))


def launch_workspace(size: int, device: int, stream: Any) -> tuple[torch.Tensor, int]:
    """(``size`` bytes from torch's caching allocator for one launch, the raw stream) for a
    `Launcher` function's stream argument ``stream`` (a CUstream from the Python paths; anything
    `stream_handle` accepts) on CUDA device ``device`` (`kernel_api.launcher.raw_stream`,
    `kernel_api.launcher.launch_workspace`: the block is owned by the launch stream)."""
    handle = raw_stream(stream, device)
    return launcher.launch_workspace(size, device, handle), handle


def epilogue_supported_by_generation(epilogue_args: Any, epilogue: EpilogueMetadata) -> bool:
    """Whether instances with ``epilogue`` metadata can honour ``epilogue_args`` entirely."""
    if epilogue_args is None:
        return True
    if not isinstance(epilogue_args, EpilogueArguments):
        raise TypeError(f"epilogue_args: expected EpilogueArguments or None, got {type(epilogue_args).__name__}")
    if epilogue_args.is_trivial:
        return True
    if epilogue_args.is_function:
        return bool(epilogue.functions)
    if (epilogue_args.alpha != 1.0 or epilogue_args.beta != 0.0) and not epilogue.alpha_beta:
        return False
    if epilogue_args.bias is not None:
        kind = epilogue_args.bias_kind
        # An unbound EpilogueArguments does not know its kind yet: any supported kind may do.
        if (kind is not None and kind not in epilogue.bias) or (kind is None and not epilogue.bias):
            return False
    if epilogue_args.activation is not None and epilogue_args.activation not in epilogue.activations:
        return False
    return True


def tiled_gemm_metadata(cls: type, types: str, layouts: tuple[tuple[int, ...], ...], operands: GemmOperandsMetadata,
                        tile: tuple[int, int, int], grid: tuple[str, tuple[int, int]], stages: int, schedule: str,
                        min_cc: int, epilogue: EpilogueMetadata = FULL_EPILOGUE) -> KernelMetadata:
    """Metadata of one CTA-tiled GEMM instance (no clusters) with the fused epilogue ``epilogue``
    (the named one by default; `FUSED_EPILOGUE` where the implementation emits epilogue functions).

    ``types``: the dtype part of the name (e.g. "bf16bf16f32"); ``layouts``: (stride_A,
    stride_B, stride_out); ``grid``: ("threads" or "warps", (along M, along N)), kept in
    ``design.extra`` and named by its first letter. Names read
    ``<Class>_<types>_<layouts>_<BM>x<BN>x<BK>_<t|w><M>x<N>_s<stages>_a<A alignment>``.
    """
    key, (gm, gn) = grid
    name = (f"{cls.__name__}_{types}_{strides_to_layout_string(*layouts)}_{tile[0]}x{tile[1]}x{tile[2]}"
            f"_{key[0]}{gm}x{gn}_s{stages}_a{operands.A.divisibility}")
    design = BLASDesignMetadata(tile, (1, 1, 1), stages=stages, schedule=schedule, extra=((key, (gm, gn)),))
    return KernelMetadata(name, cls, operands, design, min_cc=min_cc, epilogue=epilogue)


class GemmKernelBase(CuteDslKernel):
    """The template of a CuTe DSL GEMM family: compile, run and the shared support checks.

    A family is one interface file (a subclass of this class, registered with
    ``@CuTeDSLProvider.register``; it imports no cutlass) and one implementation file under
    ``implementations/`` (the DSL class, which follows the calling convention of the module
    docstring). The subclass supplies:

    - ``generate_kernels(metadata_filter, epilogue_args=None, cc=None)`` (a staticmethod): one
      instance per configuration that passes the filter, the epilogue (see
      `epilogue_supported_by_generation`) and the cc, each with `KernelMetadata` whose name
      starts with the class name (`tiled_gemm_metadata` builds it for CTA-tiled kernels);
    - ``_make_impl(args)``: the implementation object for the compile in progress, built from
      the metadata and ``args``' epilogue (`_impl_layout_kwargs`); import cutlass there.

    Optional hooks:

    - ``_family_supports(args)``: the family's own limits (grid extents, tile counters...) as a
      failing `Status`, or None; run after the shared checks of `_common_supports`.
    - ``_extra_compile_args(args)`` and ``_extra_launch_args(args, workspace)``: the arguments
      the implementation takes between ``beta`` and the stream (cluster counts, a workspace, a
      launch counter...): compile-time placeholders, and the values of one launch. By default
      there are none. A family with a workspace also implements ``get_workspace_size`` and clears
      ``workspace_free``; a family with extra arguments also overrides ``_launcher`` (its tail).
    - ``batch_on_grid_z`` and ``specialise_c_alignment`` (class attributes, below), and
      `Kernel`'s ``performance_hint``.
    """

    supported_args_type = GemmArguments
    workspace_free = True  # get_workspace_size is 0 unless a family says otherwise
    #: The batch L goes on the grid's z axis, so a launch takes at most 65535 batches
    #: (False for persistent kernels, which walk the batches themselves).
    batch_on_grid_z: bool = True
    #: Compile C with the alignment the arguments have (the compiler may assume it) and key
    #: artifacts on it; False: C is compiled as unaligned and one artifact serves any C.
    specialise_c_alignment: bool = False

    def _make_impl(self, args: GemmArguments) -> Any:  # pragma: no cover - abstract in spirit
        raise NotImplementedError(f"{type(self).__name__} must implement _make_impl(args)")

    def _family_supports(self, args: GemmArguments) -> Status | None:
        """The family's checks beyond `_common_supports`: a failing `Status`, or None."""
        return None

    def _extra_compile_args(self, args: GemmArguments) -> tuple:
        """Compile-time placeholders of the arguments between ``beta`` and the stream."""
        return ()

    #: Optional hook: a method ``_extra_launch_args(args, workspace) -> tuple``, the values of
    #: the arguments between ``beta`` and the stream for one launch of a non-empty problem
    #: (``workspace`` as `Kernel.run` passes it). None: there are none, and `_run`, which every
    #: launch that is not bound takes, spends no call on asking.
    _extra_launch_args: Callable[[GemmArguments, Any], tuple] | None = None

    def _impl_layout_kwargs(self, args: GemmArguments) -> dict[str, Any]:
        """The keyword arguments every implementation takes: operand majorness and epilogue spec."""
        md = self.metadata.operands
        return dict(a_k_major=md.A.layout == "t", b_k_major=md.B.layout == "n", out_n_major=md.out.layout == "t",
                    spec=EpilogueSpec.from_signature(args.epilogue_signature))

    compiles_from_cache_only = True  # (its compile's cost is in cute_compile, which honours cache_only)

    def compile(self, args: GemmArguments, cc: int | None = None) -> CompiledArtifact:
        """Compile for ``args``' signature (rank, layouts, alignment, epilogue); shapes stay dynamic."""
        import cutlass
        from cutlass.cute.runtime import make_fake_stream

        md = self.metadata.operands
        rank = args.A.dim()
        A = fake_tensor_like(md.A, rank)
        B = fake_tensor_like(md.B, rank)
        out = fake_tensor_like(md.out, rank)
        spec = EpilogueSpec.from_signature(args.epilogue_signature)
        C = None
        if spec.has_c:
            c = args.epilogue_signature.c_attributes
            c_div = c.divisibility if self.specialise_c_alignment else 1
            C = fake_tensor_like(TensorAttributes(c.dtype, c.stride, c_div), rank)
        bias = fake_tensor(md.out.dtype, 1, 0, 1) if spec.bias else None
        scalar = cutlass.Float64 if md.accumulator_type is DataType.f64 else cutlass.Float32
        impl = self._make_impl(args)
        fused = ()  # (scalar: the epilogue's math type, f64 for f64 GEMMs)
        if spec.fusion is not None:  # an epilogue function: its operand tuple before the stream
            from .implementations.fusion import FusionPlan, fake_operands

            fused = (fake_operands(FusionPlan(spec.fusion), scalar),)
        compiled = self.cute_compile(impl, A, B, out, C, bias, scalar(1.0), scalar(0.0),
                                     *self._extra_compile_args(args), *fused, make_fake_stream())
        return CompiledArtifact(compiled, self)

    def compile_key(self, args: GemmArguments, cc: int | None) -> tuple:
        """What an artifact depends on beyond the instance: rank, epilogue shape, C's layout
        (and C's alignment where `specialise_c_alignment`).

        Operand alignment is the metadata's (fixed per instance), so problems of any size and
        alignment that the instance supports share one artifact.
        """
        sig = args.epilogue_signature
        c = None if sig is None else sig.c_attributes
        c_layout = (None if c is None else (c.dtype, c.stride, c.divisibility) if self.specialise_c_alignment
                    else (c.dtype, c.stride))
        return (args.A.dim(), EpilogueSpec.from_signature(sig), c_layout, cc)

    def _run(self, args: GemmArguments, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        if args.M == 0 or args.N == 0 or args.L == 0:
            return  # nothing to write; a zero-sized grid would be a launch error
        ep = args.epilogue
        if ep is None:
            C, bias, alpha, beta = None, None, 1.0, 0.0
        else:
            C, bias, alpha, beta = (ep.C if ep.beta != 0.0 else None), ep.bias, ep.alpha, ep.beta
            if ep.bound is not None:  # an epilogue function: its operands go before the stream
                extra = () if self._extra_launch_args is None else self._extra_launch_args(args, workspace)
                artifact.compiled_obj(args.A, args.B, args.out, None, None, 1.0, 0.0, *extra, ep.bound.operands,
                                      to_cuda_stream(stream))
                return
        extra = self._extra_launch_args
        if extra is None:
            artifact.compiled_obj(args.A, args.B, args.out, C, bias, alpha, beta, to_cuda_stream(stream))
        else:
            artifact.compiled_obj(args.A, args.B, args.out, C, bias, alpha, beta, *extra(args, workspace),
                                  to_cuda_stream(stream))

    def _launcher(self, args: GemmArguments, artifact: CompiledArtifact) -> Launcher | None:
        if not (args.M and args.N and args.L):
            return None
        if args.epilogue is not None and args.epilogue.bound is not None:
            # (launch constants a family adds may hold a per-launch workspace: no launcher then)
            return None if self._extra_launch_args is not None else function_epilogue_launcher(artifact, (), args)
        tail = epilogue_tail(args)
        return None if tail is None else Launcher(artifact, tail)

    def get_workspace_size(self, args: GemmArguments) -> int:
        return 0

    def _supports(self, args: GemmArguments) -> Status:
        status = self._common_supports(args)
        if status.error is not None:
            return status
        status = self._family_supports(args)
        return Status.success() if status is None else status

    def _common_supports(self, args: GemmArguments) -> Status:
        """Checks every GEMM implementation here needs beyond metadata: the batch on the grid's
        z axis (`batch_on_grid_z`), 32-bit extents (`extent_limits`), a single batch's stride."""
        if self.batch_on_grid_z and args.L > MAX_GRID_YZ:
            return Status.fail(f"batch L={args.L:,} exceeds the grid's z limit of {MAX_GRID_YZ:,} blocks")
        status = extent_limits(args, self.metadata.design.tile_shape)
        if status is not None:
            return status
        if args.A.dim() == 3 and args.L == 1:
            # Argument divisibility ignores the batch stride of a single batch, but the
            # compiled code assumes it (TVM-FFI checks it at call time; TMA descriptors encode it).
            for name in ("A", "B", "out"):
                attrs = getattr(self.metadata.operands, name)
                need = attrs.divisibility
                stride = getattr(args, name).stride(0)
                if need > 1 and stride % need:
                    return Status.fail(f"operand {name}: batch stride {stride} is not a multiple of {need} elements "
                                       f"({need * attrs.dtype.bytes} bytes), the alignment this kernel assumes")
        return Status.success()
