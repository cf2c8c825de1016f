"""The torch provider's attention forward, `TorchAttention`: one instance per dtype, layout and
torch backend (`BACKENDS`), the backend in the instance's design and name.

- ``sdpa`` (named ``TorchAttention_<dtype>_<layout>``): ``torch.nn.functional.scaled_dot_product_attention``
  on any device (SDPA picks its own backend; on an H200 with torch 2.11 that is cuDNN). It
  cannot return the row log-sum-exp, so it declines arguments that ask for it.
- ``math`` (``..._math``): `attention_with_lse`, the definition with the scores materialised
  (float32 arithmetic), on any device and dtype: the log-sum-exp where nothing faster serves
  (CPU, float32), not a training kernel for long sequences.
- ``flash`` (``..._flash``): aten ``_flash_attention_forward`` (torch's FlashAttention-2),
  CUDA, f16/bf16, head dims multiples of 8 up to 256, dense and variable length, GQA and the
  bottom-right causal mask natively; it returns the log-sum-exp in kernel_api's form.
- ``cudnn`` (``..._cudnn``): aten ``_scaled_dot_product_cudnn_attention`` with
  ``compute_log_sumexp``, CUDA, f16/bf16, dense, head dims multiples of 8 up to 128; GQA read in
  place where torch's cuDNN attention takes it (`cudnn_reads_gqa`), else k and v repeated to q's
  heads (a copy); causal only with equal lengths (cuDNN's mask is top-left aligned,
  kernel_api's bottom-right).

q, k and v reach the backends as (batch, heads, seqlen, head_dim) views of kernel_api's
(batch, seqlen, heads, head_dim) tensors, never copies; SDPA reads GQA in place
(``enable_gqa``). The backends allocate their outputs in q's layout, so for (batch, seqlen,
heads, head_dim)-dense q their output, viewed back, has the op's output's metadata: outputs the
op made for the call (``outputs_made``) then take the backend's memory (`adopt`, no copy
kernel); outputs a caller gave are copied into, as are outputs of another layout.
FlashAttention-2's forward writes ``out`` in place where torch has
``_flash_attention_forward_no_dropout_inplace``. The causal mask is bottom-right aligned
(`kernel_api.arguments.attention`).

Dense calls are replayed (`kernel_api.ops.replay`) through `TorchAttention._launcher`: a
function that reads the backend, the scalars and the output policy fixed at recording, and
enters no context on the current stream. Where SDPA serves, the launcher's ``torch_call`` is
the SDPA call itself, which `ops.attention`'s repeated calls replay from C (returning SDPA's
output: nothing made to be replaced).

Cost of variable length through ``sdpa`` and ``math``: the offsets are read on the host (on a
GPU a device synchronisation per call) and each sequence runs on its own; ``flash`` takes the
offsets on the device.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, NamedTuple

import torch

from ...arguments.attention import LAYOUTS, AttentionArguments
from ...arguments.attention_math import SDPA_GQA, attention_with_lse, torch_attention
from ...core.artifact import CompiledArtifact
from ...core.dtypes import DataType
from ...core.status import Reason, Status
from ...core.streams import current_raw_stream, stream_context
from ...cost.attention import attention_cost
from ...launcher import Launcher
from ...metadata import KernelMetadata, TensorAttributes
from ...metadata.attention import AttentionOperandsMetadata
from . import TorchProvider
from .base import TorchKernel

#: FlashAttention-2's forward into a given output, where this torch has it (2.13 does).
_FLASH_INTO = getattr(torch.ops.aten, "_flash_attention_forward_no_dropout_inplace", None)
_FLASH = torch.ops.aten._flash_attention_forward.default
#: cuDNN's forward (torch's own binding where it has one: less host time than the op overload).
_CUDNN = getattr(torch, "_scaled_dot_product_cudnn_attention", None) or \
    torch.ops.aten._scaled_dot_product_cudnn_attention.default
_sdpa = torch.nn.functional.scaled_dot_product_attention
_grad_enabled = torch.is_grad_enabled
_HALF = (DataType.f16, DataType.bf16)
_ALL = (DataType.f16, DataType.bf16, DataType.f32, DataType.f64)


class Backend(NamedTuple):
    """What one torch attention backend takes and how fast it runs.

    Attributes:
        dtypes: the element types.
        divisibility: the alignment (elements) q, k, v and out need.
        max_head_dim: the largest head dim (multiples of 8 when ``divisibility`` is 8).
        layouts: the layouts ("dense", "varlen").
        lse: whether it writes the row log-sum-exp.
        cuda: whether it runs on CUDA tensors only.
        speed: its speed against SDPA's default forward (PickAny's ranking: the cost is
            `attention_cost` over it).
        cache_seqlens: whether it takes a KV cache's per-row lengths (`run_kv_cache`).
        varlen_speed: its speed on variable-length batches, where that differs from ``speed``.
    """

    dtypes: tuple[DataType, ...]
    divisibility: int
    max_head_dim: int
    layouts: tuple[str, ...]
    lse: bool
    cuda: bool
    speed: float
    cache_seqlens: bool = False
    varlen_speed: float | None = None


#: The backends. Speeds against SDPA's forward without lse (H200, torch 2.11, bf16,
#: benchmarks/attention.py, each kernel on its own, TFLOP/s): ``cudnn`` with lse and the copies
#: 567 against SDPA's 600 at b4 h32 s4096 d128 causal, 654 against 656 full, 263 against 319 at
#: b16 h16 s1024 d64 causal (so SDPA keeps inference); ``flash`` (FlashAttention-2) 312, 349 and
#: 180; ``math`` materialises the scores (nominal). ``sdpa`` runs variable length one sequence at a
#: time after reading the offsets on the host (a synchronisation), so its speed falls with the
#: number of sequences: measured (`--cases varlen`) 0.66x SDPA's dense call over the same tokens
#: at 4 sequences of 4096 (d128 causal, where FlashAttention-2's varlen ran 0.53x) and 0.12x at 16
#: of 1024 (d64 causal, FlashAttention-2's 0.44x). Its varlen speed, 0.3, is a placement rather
#: than a measurement: behind FlashAttention-2's (0.52), whose speed does not depend on the count,
#: at the price of about 20 % on a few long sequences.
BACKENDS = {
    "sdpa": Backend(_ALL, 1, 256, ("dense", "varlen"), lse=False, cuda=False, speed=1.0, cache_seqlens=True,
                    varlen_speed=0.3),
    "math": Backend(_ALL, 1, 256, ("dense", "varlen"), lse=True, cuda=False, speed=0.05, cache_seqlens=True),
    "flash": Backend(_HALF, 8, 256, ("dense", "varlen"), lse=True, cuda=True, speed=0.52),
    "cudnn": Backend(_HALF, 8, 128, ("dense",), lse=True, cuda=True, speed=0.95),
}


def backend_status(backend: str, args: Any) -> Status:
    """What a backend's metadata cannot say: the device, head dims multiples of 8, and cuDNN's
    mask and GQA limits (shared by the forward and backward kernels).

    Args:
        backend: a key of `BACKENDS`.
        args: `AttentionArguments` or `AttentionBackwardArguments`.

    Returns:
        Success, or the reason naming the operand.
    """
    spec = BACKENDS[backend]
    if spec.cuda and args.device.type != "cuda":
        return Status.fail(f"operand q: on {args.device.type}, torch's {backend} attention runs on CUDA tensors only",
                           kind=Reason.OTHER, operand="q", actual=args.device.type, required="cuda")
    if spec.divisibility == 8 and args.head_dim % 8:
        return Status.fail(f"operand q: head_dim {args.head_dim}, torch's {backend} attention takes multiples of 8",
                           kind=Reason.SHAPE, operand="q", actual=args.head_dim, required=8)
    if backend == "cudnn" and args.causal and args.seqlen_q != args.seqlen_k:
        return Status.fail(f"causal: seqlen_q {args.seqlen_q} != seqlen_k {args.seqlen_k}; cuDNN's causal mask is "
                           f"top-left aligned", kind=Reason.SHAPE, operand="causal", actual=args.seqlen_q,
                           required=args.seqlen_k)
    if backend == "flash" and args.varlen and args.seqlen_q == 1 and args.heads_q != args.heads_kv:
        return Status.fail("operand q: variable-length decoding under GQA (FlashAttention-2 returns its "
                           "log-sum-exp per batch there)", kind=Reason.SHAPE, operand="q", actual=1, required=2)
    return Status.success()


def generate(cls: type, make_operands: Callable[[TensorAttributes, Backend], Any],
             metadata_filter: Any) -> list:
    """The instances of a torch attention class (forward or backward): one per backend, dtype
    and layout, named ``<class>_<dtype>_<layout>`` for ``sdpa`` and ``..._<backend>`` else."""
    found = []
    for backend, spec in BACKENDS.items():
        if not hasattr(cls, f"_run_{backend}"):
            continue
        for dt in spec.dtypes:
            for layout in spec.layouts:
                attrs = TensorAttributes(dt, LAYOUTS[layout], spec.divisibility)
                suffix = "" if backend == "sdpa" else f"_{backend}"
                metadata = KernelMetadata(f"{cls.__name__}_{dt}_{layout}{suffix}", cls, make_operands(attrs, spec),
                                          design=AttentionDesign(backend))
                if metadata_filter is None or metadata_filter(metadata):
                    found.append(cls(metadata))
    return found


class AttentionDesign(NamedTuple):
    """The design of a torch attention instance: which torch backend runs it."""

    backend: str


def launch_context(args: Any, stream: Any) -> Any:
    """The launch stream as torch's current one on CUDA; nothing on other devices."""
    if args.device.type == "cuda":
        return stream_context(args.device, stream)
    return contextlib.nullcontext()


def adopt(target: torch.Tensor, result: torch.Tensor, made: bool) -> None:
    """Put a backend's ``result`` in ``target``: when the op made ``target`` for this call
    (``made``: nothing else holds it) and ``result`` has its shape, strides and dtype, ``target``
    takes ``result``'s memory (``Tensor.set_``: no kernel); otherwise a copy."""
    if made and result.stride() == target.stride() and result.shape == target.shape and \
            result.dtype == target.dtype:
        target.set_(result)
    else:
        target.copy_(result)


_gqa_answers: dict[Any, bool] = {}


def cudnn_reads_gqa(device: torch.device) -> bool:
    """Whether torch's cuDNN attention takes k and v with fewer heads than q on ``device``,
    forward and backward: asked once per device (`_ask_cudnn_gqa`). False where this torch
    cannot say, has cuDNN attention turned off, or disagrees with the repeated heads: then k and
    v are repeated."""
    found = _gqa_answers.get(device)
    if found is None:
        found = _ask_cudnn_gqa(device)
        if found is None:  # (asked during a CUDA graph capture: repeat, ask again later)
            return False
        _gqa_answers[device] = found
    return found


def _ask_cudnn_gqa(device: torch.device) -> bool | None:
    """torch's own SDPA dispatcher about a small causal GQA problem, then the answer checked: the
    cuDNN ops' forward (out, lse) and backward on it against the same ops with k and v repeated
    (one synchronisation, once per device). None during a CUDA graph capture (nothing run)."""
    try:
        with torch.cuda.device(device):
            if torch.cuda.is_current_stream_capturing():
                return None
            g = torch.Generator(device=device).manual_seed(0)

            def operand(heads: int) -> torch.Tensor:  # (batch, heads, seqlen, head_dim) views of BSHD
                return torch.randn(1, 128, heads, 64, dtype=torch.bfloat16, device=device,
                                   generator=g).transpose(1, 2)

            q, k, v, grad = operand(4), operand(2), operand(2), operand(4)
            params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, True)
            if not torch.backends.cuda.can_use_cudnn_attention(params, False):
                return False
            return gqa_agrees(_cudnn_round_trip, q, k, v, grad)
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return False


def gqa_agrees(round_trip: Callable[..., tuple], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               grad: torch.Tensor) -> bool:
    """Whether ``round_trip(q, k, v, grad) -> (out, lse, grad_q, grad_k, grad_v)`` (attention as
    (batch, heads, seqlen, head_dim) tensors) gives with k and v of fewer heads what it gives
    with them repeated to q's heads, the repeated heads' gradients summed per group (bf16
    tolerances)."""
    groups = q.shape[1] // k.shape[1]
    got = round_trip(q, k, v, grad)
    repeated = [t.transpose(1, 2).repeat_interleave(groups, 2).transpose(1, 2) for t in (k, v)]
    want = round_trip(q, *repeated, grad)
    want = (*want[:3], *(w.unflatten(1, (k.shape[1], groups)).sum(2) for w in want[3:]))
    return all(a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=3e-2, rtol=3e-2)
               for a, b in zip(got, want))


def _cudnn_round_trip(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> tuple:
    """(out, lse, grad_q, grad_k, grad_v) of causal attention through torch's cuDNN ops."""
    o, l, *_, seed, offset, _ = _CUDNN(q, k, v, None, True, 0.0, True, False)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default(
        grad, q, k, v, o, l, seed, offset, None, None, None, q.shape[2], k.shape[2], 0.0, True)
    return o, l, dq, dk, dv


def _empty_problem(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, lse: Any) -> bool:
    """Whether there is nothing to attend (no query, or no key: then ``out`` is zeros and ``lse``
    -inf, written here); the aten kernels are not launched on empty problems."""
    if not q.numel():
        return True
    if not k.numel():
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return True
    return False


@TorchProvider.register
class TorchAttention(TorchKernel):
    """Attention with torch's own kernels, one instance per backend (`BACKENDS`), dtype and
    layout: SDPA (any device; no log-sum-exp), the materialised definition (any device, with
    the log-sum-exp), FlashAttention-2 and cuDNN (CUDA, with the log-sum-exp)."""

    supported_args_type = AttentionArguments
    performance_hint = 0.5

    @classmethod
    def generate_kernels(cls, metadata_filter: Callable[[KernelMetadata], bool] | None, epilogue_args: Any = None,
                         cc: int | None = None) -> list["TorchAttention"]:
        """One instance per backend, dtype and layout the backend takes.

        Args:
            metadata_filter: keeps the instances whose metadata it accepts (None: all).
            epilogue_args: attention has no epilogue; any makes the list empty.
            cc: unused (torch runs on whatever device the tensors are on).

        Returns:
            The instances.
        """
        if epilogue_args is not None:
            return []
        return generate(cls, lambda a, spec: AttentionOperandsMetadata(a, a, a, a, max_head_dim=spec.max_head_dim,
                                                                       lse=spec.lse, cache_seqlens=spec.cache_seqlens),
                        metadata_filter)

    @property
    def backend(self) -> str:
        return self.metadata.design.backend

    def _supports(self, args: AttentionArguments) -> Status:
        return backend_status(self.backend, args)

    def estimated_cost(self, args: AttentionArguments, sm_count: int) -> float:
        """`kernel_api.cost.attention.attention_cost` over the backend's speed (`BACKENDS`, its
        variable-length speed for a packed batch)."""
        spec = BACKENDS[self.backend]
        return attention_cost(args) / (spec.varlen_speed if args.varlen and spec.varlen_speed else spec.speed)

    def _run(self, args: AttentionArguments, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        with launch_context(args, stream), torch.no_grad():
            if args.cache_seqlens is not None:
                run_kv_cache(self.backend, args)
                return
            getattr(self, f"_run_{self.backend}")(args, args.q, args.k, args.v, args.out, args.lse)

    def _launcher(self, args: AttentionArguments, artifact: CompiledArtifact) -> Launcher | None:
        """Dense calls (the operands are all a call takes); variable length keeps its offsets
        outside the operands. The launch enters no context on the current stream (any CPU call)
        with no input needing a gradient (`direct_launch`). Where SDPA's flags state the problem,
        the launcher's ``torch_call`` is SDPA on views, returning its output viewed back (dense
        for dense q: the made output's metadata), or copying it into a given ``out``: a call
        that makes its output is then replayed from C as that one torch call
        (`kernel_api.native.recipes.Call`), with no output made only to be replaced."""
        if args.varlen or args.cache_seqlens is not None:
            return None
        run, scalars = getattr(self, f"_run_{self.backend}"), Scalars(args)
        index = scalars.index
        flags = sdpa_flags(args.seqlen_q, args.seqlen_k, args.heads_q, args.heads_kv, args.causal) \
            if self.backend == "sdpa" else None

        if flags is not None:  # (SDPA's flags fixed for the recorded sizes: `_run_sdpa` without its checks)
            scale, made = args.scale, args.outputs_made

            def launch(q: Any, k: Any, v: Any, out: Any, stream: Any) -> None:
                if direct_launch(index, stream, q, k, v):
                    adopt(out, sdpa_views(q, k, v, flags, scale), made)
                    return
                with stream_context(scalars.device, stream), torch.no_grad():
                    run(scalars, q, k, v, out, None)

            launch.__name__ = f"launch_{self.metadata.kernel_name}"
            return Launcher(launch, torch_call=sdpa_call(flags, scale, args.head_dim, self.metadata.kernel_name))
        else:
            def launch(q: Any, k: Any, v: Any, out: Any, *rest: Any) -> None:
                lse = rest[0] if len(rest) == 2 else None
                if direct_launch(index, rest[-1], q, k, v):
                    run(scalars, q, k, v, out, lse)
                    return
                with stream_context(scalars.device, rest[-1]), torch.no_grad():
                    run(scalars, q, k, v, out, lse)

        launch.__name__ = f"launch_{self.metadata.kernel_name}"
        return Launcher(launch)

    # ---- one method per backend: (args, q, k, v, out, lse) -> writes out (and lse when given) ----

    @staticmethod
    def _run_sdpa(args: Any, q: Any, k: Any, v: Any, out: torch.Tensor, lse: Any) -> None:
        if args.cu_seqlens_q is None:
            adopt(out, sdpa_dense(q, k, v, args.causal, args.scale), args.outputs_made)
        else:
            out.copy_(torch_attention(q, k, v, args.causal, args.scale, args.cu_seqlens_q, args.cu_seqlens_k))

    @staticmethod
    def _run_math(args: Any, q: Any, k: Any, v: Any, out: torch.Tensor, lse: Any) -> None:
        o, l = attention_with_lse(q, k, v, args.causal, args.scale, args.cu_seqlens_q, args.cu_seqlens_k)
        adopt(out, o, args.outputs_made)
        if lse is not None:
            adopt(lse, l, args.outputs_made)

    @staticmethod
    def _run_flash(args: Any, q: Any, k: Any, v: Any, out: torch.Tensor, lse: Any) -> None:
        if _empty_problem(q, k, out, lse):
            return
        if _FLASH_INTO is not None:  # (into out)
            l = _FLASH_INTO(out, q, k, v, args.cu_seqlens_q, args.cu_seqlens_k, args.seqlen_q, args.seqlen_k, 0.0,
                            args.causal, False, scale=args.scale)
        else:
            o, l = _FLASH(q, k, v, args.cu_seqlens_q, args.cu_seqlens_k, args.seqlen_q, args.seqlen_k, 0.0, args.causal,
                          False, scale=args.scale)[:2]
            adopt(out, o, args.outputs_made)
        if lse is not None:
            adopt(lse, l.reshape(lse.shape), args.outputs_made)

    @staticmethod
    def _run_cudnn(args: Any, q: Any, k: Any, v: Any, out: torch.Tensor, lse: Any) -> None:
        if _empty_problem(q, k, out, lse):
            return
        if q.shape[2] != k.shape[2] and not cudnn_reads_gqa(q.device):
            k, v = repeat_heads(k, q.shape[2]), repeat_heads(v, q.shape[2])
        o, l = _CUDNN(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, lse is not None, 0.0, args.causal,
                      False, scale=args.scale)[:2]
        adopt(out, o.transpose(1, 2), args.outputs_made)
        if lse is not None:
            adopt(lse, l.reshape(lse.shape), args.outputs_made)


def run_kv_cache(backend: str, args: AttentionArguments) -> None:
    """Attention against a KV cache of per-row lengths (``args.cache_seqlens``, read on the
    device) with the lengths' mask: ``sdpa`` through SDPA (`torch_attention`), ``math`` with the
    scores materialised and the log-sum-exp when wanted (`attention_with_lse`)."""
    q, k, v, lengths = args.q, args.k, args.v, args.cache_seqlens
    if backend == "sdpa":
        adopt(args.out, torch_attention(q, k, v, args.causal, args.scale, cache_seqlens=lengths), args.outputs_made)
        return
    o, l = attention_with_lse(q, k, v, args.causal, args.scale, cache_seqlens=lengths)
    adopt(args.out, o, args.outputs_made)
    if args.lse is not None:
        adopt(args.lse, l, args.outputs_made)


def sdpa_flags(seqlen_q: int, seqlen_k: int, heads_q: int, heads_kv: int, causal: bool) -> tuple[bool, bool] | None:
    """SDPA's ``(is_causal, enable_gqa)`` for a dense problem of these sizes, or None where SDPA's
    flags cannot state it: its top-left causal mask is not kernel_api's (fewer or more queries
    than keys, more than one query), a side is empty, or this torch's SDPA has no ``enable_gqa``
    (then `torch_attention` serves, which builds the mask)."""
    if causal and seqlen_q != seqlen_k:
        if seqlen_q != 1:
            return None
        causal = False  # (the one query is the last: it sees every key)
    if not (seqlen_q and seqlen_k and SDPA_GQA):
        return None
    return causal, heads_q != heads_kv


def sdpa_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flags: tuple[bool, bool],
               scale: float) -> torch.Tensor:
    """SDPA on (batch, heads, seqlen, head_dim) views of dense (batch, seqlen, heads, head_dim)
    tensors with `sdpa_flags`' ``flags``: its output viewed as (batch, seqlen_q, heads, head_dim)."""
    return _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=flags[0], scale=scale,
                 enable_gqa=flags[1]).transpose(1, 2)


def sdpa_call(flags: tuple[bool, bool], scale: float, head_dim: int, name: str) -> Callable[..., torch.Tensor]:
    """``call(q, k, v, out=None)``: `sdpa_views` for these flags and scale, returning SDPA's output
    viewed back, or copying it into ``out`` (a `Launcher`'s ``torch_call``). It passes SDPA only
    the keywords whose values are not SDPA's defaults (each costs host time to parse); the
    scale ``1 / sqrt(head_dim)`` is SDPA's own default, the same double."""
    named: dict[str, Any] = {}
    if flags[0]:
        named["is_causal"] = True
    if flags[1]:
        named["enable_gqa"] = True
    if not head_dim or scale != 1.0 / math.sqrt(head_dim):
        named["scale"] = scale

    if named:
        def call(q: Any, k: Any, v: Any, out: Any = None) -> Any:
            result = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **named).transpose(1, 2)
            return result if out is None else out.copy_(result)
    else:
        def call(q: Any, k: Any, v: Any, out: Any = None) -> Any:
            result = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
            return result if out is None else out.copy_(result)

    call.__name__ = f"sdpa_{name}"
    return call


def sdpa_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Attention of dense (batch, seqlen, heads, head_dim) tensors through SDPA on views, GQA read
    in place (`sdpa_views`), or `torch_attention` where `sdpa_flags` says SDPA's cannot state it."""
    flags = sdpa_flags(q.shape[1], k.shape[1], q.shape[2], k.shape[2], causal)
    if flags is None:
        return torch_attention(q, k, v, causal, scale)
    return sdpa_views(q, k, v, flags, scale)


def direct_launch(index: int, stream: Any, *inputs: torch.Tensor) -> bool:
    """Whether a replayed launch runs as it is: on the CPU (``index`` -1) or on CUDA device
    ``index``'s current stream (``stream``, a CUstream or a raw handle, is it), with no input
    needing a gradient; else the caller enters the stream's context and no_grad."""
    if _grad_enabled():
        for t in inputs:
            if t.requires_grad:
                return False
    if index < 0:
        return True
    try:
        return int(stream) == current_raw_stream(index)
    except TypeError:  # (None, or a spelling without int(): the context sorts it out)
        return False


def repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """k or v (batch, seqlen, heads_kv, head_dim) with each head repeated to ``heads`` (GQA: a
    copy), or ``t`` itself when the heads already match."""
    groups = heads // t.shape[2]
    return t if groups == 1 else t.repeat_interleave(groups, dim=2)


class Scalars:
    """The scalars of a dense call: what a recorded launch keeps of its arguments (no tensors),
    ``outputs_made`` included (a call recorded with outputs the op made is replayed only for such
    calls: `kernel_api.ops.replay` keys calls given outputs apart)."""

    __slots__ = ("causal", "scale", "varlen", "cu_seqlens_q", "cu_seqlens_k", "seqlen_q", "seqlen_k", "device",
                 "index", "outputs_made")

    def __init__(self, args: Any) -> None:
        self.causal, self.scale, self.varlen = args.causal, args.scale, False
        self.cu_seqlens_q = self.cu_seqlens_k = None
        self.seqlen_q, self.seqlen_k, self.device = args.seqlen_q, args.seqlen_k, args.device
        self.index = args.device_index  # (-1 on the CPU)
        self.outputs_made = args.outputs_made
