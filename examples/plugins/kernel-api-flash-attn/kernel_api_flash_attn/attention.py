"""FlashAttention-4's forward (``flash_attn.cute.interface``) for `AttentionArguments`: dense and
variable-length layouts, causal (bottom-right, as kernel_api's) or full, GQA/MQA, f16/bf16.

On sm_90 FA4 runs its Hopper kernel (TMA, wgmma, warp-specialised producer and consumers; its
own tile follows the head dim: 192x128 up to 64, 128x128 up to 128, 128x80 at 256). It takes head
dims 8 to 256 that are multiples of 8, and every operand's strides 16-byte aligned (the
metadata's divisibility 8), with q, k, v, out's head dim contiguous.

Each dtype and layout has the instance that leaves the tile to FA4 (named without a tile); the
dense layout also has one instance per `tiles.FORWARD_TILES` configuration, for the head dims the
tile is built for (named by it, ``..._dense_128x128_rs_ol_a16``; the tile is the metadata's
``design``), ranked by its measured speed where it has one, else just behind FA4's own choice.

FA4 compiles with its own JIT for the GPU it runs on and caches the function per configuration;
``compile`` runs the forward once on the arguments' own tensors when they are on the GPU (that
warm-up compiles it; it writes only ``out`` and ``lse``, which the run overwrites). Launches go
to torch's current stream, made the requested one around the call.

The forward writes the row log-sum-exp into ``args.lse`` when it is asked for (FA4's form is
kernel_api's: (batch, heads, seqlen_q), or (heads, total_q) for variable length); its backward is
`kernel_api_flash_attn.attention_backward.FlashAttnBackward`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from flash_attn.cute.interface import _flash_attn_fwd

from kernel_api import AttentionArguments, CompilationError, CompiledArtifact, DataType, Kernel, KernelMetadata
from kernel_api import Status, TensorAttributes
from kernel_api.core.status import Reason
from kernel_api.cost.attention import attention_cost
from kernel_api.core.streams import current_raw_stream, stream_context
from kernel_api.launcher import Launcher
from kernel_api.metadata.attention import AttentionOperandsMetadata

from .provider import FlashAttnProvider
from .tiles import FORWARD_TILES, UNMEASURED, ForwardTile

_LAYOUTS = {"dense": (0, 0, 0, 1), "varlen": (0, 0, 1)}
MIN_HEAD_DIM, MAX_HEAD_DIM = 8, 256
#: FA4's forward speed against torch's SDPA (cuDNN) by whether the head dim is at least 128
#: (H200, benchmarks/attention.py: 647 against 600 TFLOP/s at b4 h32 s4096 d128 causal, 730
#: against 656 full; 254 against 319 at b16 h16 s1024 d64 causal)
SPEED_VS_SDPA = {True: 1.08, False: 0.8}


@FlashAttnProvider.register
class FlashAttnForward(Kernel):
    """``flash_attn.cute``'s forward: per dtype, one instance per layout (dense, varlen) with FA4's
    own tile, and one per `FORWARD_TILES` tile for the dense layout; sm_90+."""

    supported_args_type = AttentionArguments
    workspace_free = True
    # compile (the warm-up) runs in this process even while tuning asks for cached artifacts
    # only: FA4 keeps what it compiled in this process, so a compile worker's is lost
    compiles_from_cache_only = True
    performance_hint = 0.9
    min_cc = 90

    @classmethod
    def generate_kernels(cls, metadata_filter: Any, epilogue_args: Any = None, cc: int | None = None) -> list:
        if epilogue_args is not None or (cc is not None and cc < cls.min_cc):
            return []
        found = []
        for dtype in (DataType.bf16, DataType.f16):
            for layout, pattern in _LAYOUTS.items():
                attrs = TensorAttributes(dtype, pattern, 8)
                tiles = [None] + (list(FORWARD_TILES) if layout == "dense" else [])
                for tile in tiles:
                    top = MAX_HEAD_DIM if tile is None else tile.max_head_dim
                    operands = AttentionOperandsMetadata(attrs, attrs, attrs, attrs, max_head_dim=top, lse=True)
                    name = f"{cls.__name__}_{dtype}_{layout}{'' if tile is None else '_' + tile.name}_a16"
                    metadata = KernelMetadata(name, cls, operands, design=tile, min_cc=cls.min_cc)
                    if metadata_filter is None or metadata_filter(metadata):
                        found.append(cls(metadata))
        return found

    @property
    def tile(self) -> ForwardTile | None:
        """The instance's `ForwardTile`, or None where FA4 chooses the tile."""
        return self.metadata.design

    def _supports(self, args: AttentionArguments) -> Status:
        status = head_dim_status(args)
        tile = self.tile
        if status and tile is not None and not tile.takes(args.head_dim):
            return Status.fail(f"operand q: head_dim {args.head_dim}, the {tile.name} tile is for head dims "
                               f"{tile.min_head_dim} to {tile.max_head_dim}", kind=Reason.SHAPE, operand="q",
                               actual=args.head_dim, required=(tile.min_head_dim, tile.max_head_dim))
        return status

    def get_workspace_size(self, args: Any) -> int:
        return 0

    def estimated_cost(self, args: AttentionArguments, sm_count: int) -> float:
        """`attention_cost` (what the torch provider's SDPA is ranked by) over FA4's speed
        against SDPA (`SPEED_VS_SDPA`, measured on an H200), so PickAny takes FA4 for head dims
        of 128 and up, SDPA (inference) or torch's cuDNN forward (training) below. A tile
        instance goes by its speed measured on problems like ``args`` (`ForwardTile.speed_vs_sdpa`),
        or ranks `UNMEASURED` times behind FA4's choice where it has none."""
        speed = SPEED_VS_SDPA[args.head_dim >= 128]
        tile = self.tile
        if tile is not None:
            measured = tile.speed_vs_sdpa(args)
            speed = speed / UNMEASURED if measured is None else measured
        return attention_cost(args) / speed

    def compile(self, args: Any, cc: int | None = None) -> CompiledArtifact:
        """The warm-up: FA4's first call for these arguments' configuration (on the GPU only;
        CompilationError for another target, since FA4 compiles for the GPU it runs on)."""
        present = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        present = None if present is None else present[0] * 10 + present[1]
        if present is None or (cc is not None and cc != present):
            where = "no GPU is present" if present is None else f"the GPU is sm_{present}"
            raise CompilationError(f"{self.metadata.kernel_name}: FlashAttention-4 compiles for the GPU it runs on "
                                   f"and {where}; it cannot target sm_{cc}")
        if args.q.is_cuda and args.q.numel() and args.k.numel():
            try:
                _forward(args, args.q, args.k, args.v, args.out, args.lse, self.tile)
            except Exception as exc:  # noqa: BLE001 - FA4's compile or launch failure, said in one line
                raise CompilationError(f"{self.metadata.kernel_name}: FlashAttention-4 failed: "
                                       f"{type(exc).__name__}: {exc}") from exc
        return CompiledArtifact(None, self)

    def _run(self, args: AttentionArguments, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        if not args.q.numel():
            return
        with stream_context(args.device, stream):
            _forward(args, args.q, args.k, args.v, args.out, args.lse, self.tile)

    def _launcher(self, args: AttentionArguments, artifact: CompiledArtifact) -> Launcher | None:
        """Dense layouts only: a varlen call's sequence offsets are no operand of the launch."""
        if args.varlen or not args.q.numel():
            return None
        device, scalars, tile = args.device, _Scalars(args), self.tile

        def launch(q: Any, k: Any, v: Any, out: Any, *rest: Any) -> None:  # (lse,) stream
            with launch_stream(device, rest[-1]):
                _forward(scalars, q, k, v, out, rest[0] if len(rest) == 2 else None, tile)

        launch.__name__ = f"launch_{self.metadata.kernel_name}"
        return Launcher(launch)


_CURRENT = contextlib.nullcontext()


def launch_stream(device: torch.device, stream: Any) -> Any:
    """A recorded launch's stream as torch's current one: no context when ``stream`` (a CUstream
    or a raw handle) is the device's current stream already, a replayed call's usual case."""
    try:
        if int(stream) == current_raw_stream(device.index):
            return _CURRENT
    except TypeError:  # (None, or a spelling without int(): stream_context reads it)
        pass
    return stream_context(device, stream)


def head_dim_status(args: Any) -> Status:
    """FA4's head dims: multiples of 8 from `MIN_HEAD_DIM` (forward and backward)."""
    d = args.head_dim
    if d < MIN_HEAD_DIM or d % 8:
        return Status.fail(f"operand q: head_dim {d}, FlashAttention-4 takes multiples of 8 from {MIN_HEAD_DIM}",
                           kind=Reason.SHAPE, operand="q", actual=d, required=MIN_HEAD_DIM)
    return Status.success()


class _Scalars:
    """The scalars of a dense call, forward or backward (what a recorded launch keeps of its
    arguments: no tensors)."""

    __slots__ = ("causal", "scale", "varlen", "cu_seqlens_q", "cu_seqlens_k", "seqlen_q", "seqlen_k")

    def __init__(self, args: Any) -> None:
        self.causal, self.scale, self.varlen = args.causal, args.scale, False
        self.cu_seqlens_q = self.cu_seqlens_k = None
        self.seqlen_q, self.seqlen_k = args.seqlen_q, args.seqlen_k


def _forward(args: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor | None, tile: ForwardTile | None = None) -> None:
    """FA4's forward into ``out`` (and ``lse`` when given) on torch's current stream, with
    ``tile``'s configuration (None: FA4's own)."""
    options = {} if tile is None else tile.options()
    if args.varlen:
        _flash_attn_fwd(q, k, v, cu_seqlens_q=args.cu_seqlens_q, cu_seqlens_k=args.cu_seqlens_k,
                        max_seqlen_q=args.seqlen_q, max_seqlen_k=args.seqlen_k, softmax_scale=args.scale,
                        causal=args.causal, out=out, lse=lse, **options)
    else:
        _flash_attn_fwd(q, k, v, softmax_scale=args.scale, causal=args.causal, out=out, lse=lse, **options)
