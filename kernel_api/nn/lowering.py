"""What a kernel_api projection becomes under ``torch.compile``: kernel_api's GEMM op, or the
plain aten ops it stands for (``F.linear`` / ``addmm`` and the activation), which Inductor
fuses with their neighbours and serves with its own GEMM choice.

    layer.compile_lowering = "aten"                        # one layer
    kernel_api.nn.set_compile_lowering(model, "kernel_api")  # every patched layer of a model

Inside a compiled graph kernel_api's op is opaque: Inductor cannot fuse the bias, activation,
residual add or casts around it into its own GEMM epilogue or into neighbouring pointwise
kernels, and it cannot choose cuBLAS or a template of its own for the shape. Small GEMMs (decode,
where M is the batch) are launch- and memory-bound, and there Inductor's fusions win; large
ones are compute-bound, and there a faster kernel, a fused epilogue or the split of misaligned
columns (`kernel_api.ops.dispatch.split_columns`) win.

`choose` is the rule, decided once per layer each time Dynamo traces it, from the shapes static
at that time (so a graph never branches or guards on it):

1. ``compile_lowering`` "aten" or "kernel_api" (a layer's attribute, default "auto") forces it.
2. M, the product of the input's leading dimensions, not static (Dynamo made it dynamic): aten.
   Such a graph serves every M, the small ones too.
3. A `PickBest` in force whose tuning records hold this exact problem (every GEMM the call
   runs): kernel_api when each recorded winner is a kernel of a provider other than torch's
   (measured faster than cuBLAS), aten when one is torch's.
4. Without records, a graph replayed as CUDA graphs (``mode="reduce-overhead"``,
   `kernel_api.core.tracing.graph_uses_cuda_graphs`), no autograd, and at least
   `COMPILE_MIN_ROWS` rows or output rows cuBLAS cannot vectorise (`columns_aligned`):
   kernel_api. A replayed graph pays no host time per op, and kept as kernel_api's op
   GPT-2's projections (8 x 1024-token prefill, H200, torch 2.11, `benchmarks/e2e_gpt2.py
   --quick --lowering kernel_api`) ran their kernels faster than the compiled model's (4.9
   against 5.4 ms a step): 1.06x under CUDA graphs. At any rows, GPT-2's lm_head (768 ->
   50257) took 37 us against cuBLAS's 154 at a decode step's 64 rows (22 against 29 at 1 row,
   58 against 129 at 128; inside a CUDA graph, H200).
5. Otherwise aten. Without CUDA graphs the kept ops' host time lost (GPT-2 prefill 0.59x;
   keeping only the fused projections, 0.68x, and 0.94x on a Llama stack), and decode-sized
   GEMMs are Inductor's to fuse. Lowered to aten, a patched model compiles to the compiled
   model's own graph (docs/performance.md, "The lowering rule on torch 2.11, measured"),
   except where `aten_fuses_activation`: a projection with a bias and a relu or tanh GELU, of
   at least `COMPILE_MIN_ROWS` half-precision rows on CUDA outside autograd (any static rows in
   a graph replayed as CUDA graphs), lowers to ``aten._addmm_activation``, cuBLASLt's
   bias-and-activation epilogue (the torch provider's kernel the registry runs for that
   problem). Inductor calls that op as it is, where from ``addmm`` and the activation it makes
   a GEMM and a separate pointwise kernel: GPT-2's MLP up-projections at 8 x 1024 tokens took
   0.79 against 1.06 ms a step (H200, torch 2.11). At decode rows the separate kernel is a launch
   a layer: under CUDA graphs GPT-2's decode step (64 x 1) ran at 0.999x the compiled model with
   the epilogue against 0.978x without (one run each); without CUDA graphs cuBLASLt's host time
   a call cancels the launch saved (0.965x against 0.964x), so there decode keeps ``addmm``.

Layers of memory-bound operations (norms, activations, rotary embeddings) keep kernel_api's op
under compile only when forced (`keeps_op`): Inductor generates those row-wise kernels itself
and fuses them with their neighbours (a residual add, a cast), which an opaque op prevents.

The choice is not a guard: a graph keeps the choice it was traced with until Dynamo traces it
again. ``compile_lowering`` is an attribute Dynamo reads, so changing it retraces; a new tuning
record or policy takes effect at the next trace (``torch._dynamo.reset()``).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch

from ..core import tracing

_log = logging.getLogger(__name__)

#: The values of a layer's ``compile_lowering``.
LOWERINGS = ("auto", "aten", "kernel_api")

#: Rows (M) from which a graph replayed as CUDA graphs keeps kernel_api's op, and from which a
#: layer keeping the op takes the epilogue function rather than the named epilogue, as eager
#: calls do (`kernel_api.nn.fusion.FUSE_MIN_ROWS`).
#: GPT-2 decode (64 rows, H200, torch 2.11) with every projection as kernel_api's op ran at 0.61x
#: the compiled model.
COMPILE_MIN_ROWS = 1024


def check_lowering(value: Any) -> str:
    """``value`` if it is one of `LOWERINGS`, else ValueError naming it."""
    if value not in LOWERINGS:
        raise ValueError(f"compile_lowering: expected one of {LOWERINGS}, got {value!r}")
    return value


class _Problem(NamedTuple):
    """What a tuning record's key reads of an arguments object, for a device of our choosing."""

    signature: tuple
    problem_shape: tuple


def _records_policy() -> Any:
    """The `PickBest` in force when it reads tuning records, else None."""
    from ..tuning.policies import PickBest
    from ..tuning.scope import current

    policy = current().policy
    return policy if isinstance(policy, PickBest) and policy.use_records else None


def _recorded(rows: int, K: int, N: int, dtype: torch.dtype, activation: str | None, has_bias: bool,
              device_index: int) -> str | None:
    """"kernel_api" or "aten" from the tuning records of a `PickBest` in force for every GEMM of
    this problem, or None (another policy, or a GEMM without a record)."""
    from ..ops import gemm_arguments
    from ..registry import get_kernels
    from ..tuning.records import TuningRecords, record_key
    from ..tuning.scope import current
    from ..core.arch import device_cc

    scope = current()
    policy = _records_policy()
    if policy is None or device_index < 0:
        return None
    # The problem on meta tensors (nothing allocated), keyed as on the layer's device.
    A = torch.empty(rows, K, dtype=dtype, device="meta")
    B = torch.empty(N, K, dtype=dtype, device="meta").t()
    bias = torch.empty(N, dtype=dtype, device="meta") if has_bias else None
    records = policy.records if policy.records is not None else TuningRecords()
    name, cc = torch.cuda.get_device_name(device_index), device_cc(device_index)
    verdict = None
    for args in gemm_arguments(A, B, bias=bias, activation=activation):
        candidates = get_kernels(args, providers=scope.providers, cc=cc)
        problem = _Problem(args.signature[:-1] + (device_index,), args.problem_shape)
        key = record_key(problem, policy.record_context(args, candidates))
        found = records.lookup(name, cc, key.operation, key.shape)
        winner = None if found is None else next(
            (k for k in candidates if k.metadata.kernel_name == found.kernel_name), None)
        if winner is None:
            return None
        if winner.metadata.provider == "torch":
            verdict = "aten"
        elif verdict is None:
            verdict = "kernel_api"
    return verdict


def static_rows(x: torch.Tensor) -> int | None:
    """The rows a projection of ``x`` multiplies (the product of its leading dimensions), or None
    when Dynamo made any of them dynamic (a SymInt).

    Asked as ``(rows == rows) is True``: a static product compares to a constant True, a SymInt
    (any dimension dynamic) to a symbolic bool, without a guard or an error in torch 2.11 and 2.13
    alike. (torch 2.11's Dynamo does not fold ``d.__class__ is int`` for a static dimension, and
    both versions answer ``isinstance`` and ``type`` of a SymInt as int's.) One ``numel`` rather
    than a loop over the dimensions: every projection asks it under Dynamo, which traces each
    instruction of the loop."""
    rows = x.shape[:-1].numel()
    return rows if (rows == rows) is True else None


def static_size(*sizes: Any) -> bool:
    """Whether every size is static under Dynamo (an int, not a SymInt), asked as `static_rows`
    asks: ``(d == d) is True`` folds to a constant for an int only."""
    for d in sizes:
        if (d == d) is not True:
            return False
    return True


@tracing.assume_constant_result
def _trace_context() -> tuple[bool, bool]:
    """(no `PickBest` reading tuning records in force, the graph replayed as CUDA graphs): what
    the rule reads of the trace rather than of a layer. Dynamo takes the answer as a constant,
    as `choose`'s."""
    return _records_policy() is None, tracing.graph_uses_cuda_graphs()


@tracing.assume_constant_result
def columns_aligned(N: int, dtype: torch.dtype) -> bool:
    """Whether every row of a dense (M, N) output of ``dtype`` starts on a 16-byte boundary, which
    cuBLAS's vectorised kernels need: otherwise it runs element-wise ("align1") kernels, 4.2x
    slower than kernel_api's at GPT-2's lm_head (N = 50257)."""
    return N * dtype.itemsize % 16 == 0


@tracing.assume_constant_result
def aten_whatever_the_problem(lowering: str, rows: int | None, aligned: bool = True) -> bool:
    """Under Dynamo, for a layer whose ``compile_lowering`` is ``lowering``, called on ``rows``
    rows (`static_rows`), whose output rows are ``aligned`` (`columns_aligned`): whether it
    lowers to aten before the rest of its problem is read: forced so, or "auto" with no tuning
    records in force and either a graph not replayed as CUDA graphs, or rows dynamic, or fewer
    than `COMPILE_MIN_ROWS` rows with aligned output rows (rules 2, 4 and 5 of the module
    docstring then give aten whatever else the problem is). Layers ask it first, so that such a
    graph reads (and guards) no more of a layer than its ``compile_lowering`` and rows: Dynamo
    evaluates every guard on every call, CUDA-graph replays included, and a patched GPT-2 that
    read each projection's shapes, activation and epilogue operands paid about 0.12 ms a decode
    step in guards over the unpatched model's (H200 host). Dynamo calls it while tracing and
    takes the answer as a constant, as `choose`'s: every projection asks it, some twice."""
    if lowering == "aten":
        return True
    if lowering != "auto":
        return False
    no_records, cuda_graphs = _trace_context()
    return no_records and (not cuda_graphs or rows is None or (rows < COMPILE_MIN_ROWS and aligned))


#: The activations cuBLASLt fuses into ``aten._addmm_activation``'s epilogue (gelu: tanh, as ours).
_ADDMM_ACTIVATIONS = frozenset({"gelu", "relu"})


def aten_fuses_activation(activation: str | None, rows: int | None, on_cuda: bool, training: bool,
                          x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether an aten lowering of a projection is ``aten._addmm_activation`` rather than an
    ``addmm`` and a separate activation (the module docstring, rule 5): from `COMPILE_MIN_ROWS`
    rows, and at any static rows in a graph replayed as CUDA graphs. The operands' dtypes are
    read last, so a decode-sized call outside CUDA graphs guards none of the autocast state.

    Args:
        activation: the layer's fused activation, or None.
        rows: M, the input's static rows (`static_rows`), or None when dynamic.
        on_cuda: whether the input is a CUDA tensor.
        training: whether autograd records the call (``_addmm_activation`` keeps no pre-activation
            for a backward).
        x, weight, bias: the projection's operands (`one_dtype`).
    """
    if not (activation in _ADDMM_ACTIVATIONS and bias is not None and on_cuda and not training
            and rows is not None):
        return False
    if rows < COMPILE_MIN_ROWS and not _trace_context()[1]:
        return False  # (decode-sized, no CUDA graphs: Inductor's addmm, then its GELU kernel)
    return one_dtype(x, weight, bias) in (torch.bfloat16, torch.float16)


def one_dtype(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype | None:
    """The one dtype of a projection's input, weight and bias outside autocast, else None
    (autocast casts ``addmm``'s operands, not necessarily ``_addmm_activation``'s)."""
    if bias is None or weight.dtype != x.dtype or bias.dtype != x.dtype or torch.is_autocast_enabled("cuda"):
        return None
    return x.dtype


@tracing.assume_constant_result
def choose(lowering: str, rows: int | None, K: int, N: int, dtype: torch.dtype, activation: str | None,
           has_bias: bool, training: bool, device_index: int) -> str:
    """The module docstring's rule: "kernel_api" or "aten" for one projection under compile.

    Dynamo calls it while tracing and takes its answer as a constant (no guard, no graph
    break), so every argument is a plain value.

    Args:
        lowering: the layer's ``compile_lowering`` (`LOWERINGS`).
        rows: M, the input's rows, or None when Dynamo made them dynamic.
        K, N: the projection's input and output features.
        dtype: the operands' dtype.
        activation: the layer's fused activation, or None.
        has_bias: whether the layer adds a bias.
        training: whether autograd records the call (a backward follows).
        device_index: the CUDA device, -1 for another device.

    Returns:
        "kernel_api" or "aten".
    """
    if lowering != "auto":
        return check_lowering(lowering)
    if rows is None:
        return "aten"
    try:
        measured = _recorded(rows, K, N, dtype, activation, has_bias, device_index)
    except Exception as exc:  # noqa: BLE001 - unreadable records leave the static rule
        _log.debug("compile lowering: tuning records not read for %dx%dx%d: %s", rows, N, K, exc)
        measured = None
    if measured is not None:
        return measured
    if not training and tracing.graph_uses_cuda_graphs() and (rows >= COMPILE_MIN_ROWS
                                                             or not columns_aligned(N, dtype)):
        return "kernel_api"
    return "aten"


def keeps_op(layer: torch.nn.Module) -> bool:
    """Under Dynamo, whether a kernel_api layer of a memory-bound operation keeps kernel_api's
    op: only when its ``compile_lowering`` is "kernel_api"; otherwise it runs the torch forward
    it replaced, for Inductor to generate and fuse (the module docstring).

    Args:
        layer: a kernel_api layer (its class declares ``compile_lowering``).
    """
    return getattr(layer, "compile_lowering", "auto") == "kernel_api"


def set_compile_lowering(module: torch.nn.Module, lowering: str) -> torch.nn.Module:
    """Set ``compile_lowering`` on every kernel_api layer in ``module`` (itself included): the
    modules whose class declares the attribute (`kernel_api.nn.Linear`, the patched Conv1D, and
    any kernel_api layer that follows `keeps_op`).

    Args:
        module: a model patched by `kernel_api.nn.patch`, or a kernel_api layer.
        lowering: "auto" (the module docstring's rule), "aten" or "kernel_api".

    Returns:
        ``module``. Graphs compiled before are retraced at their next call.
    """
    check_lowering(lowering)
    for layer in module.modules():
        if isinstance(getattr(type(layer), "compile_lowering", None), str):
            layer.compile_lowering = lowering
    return module
