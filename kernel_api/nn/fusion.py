"""`FusedProjection`: a kernel_api projection that takes what its caller does right after it
(a residual add, a gate multiply) into its GEMM's epilogue.

A caller that knows what follows a projection hands it the operands first (`armed`), then calls
the projection as usual; the projection consumes them and returns

    D = activation(x @ W + b) [* gate_activation(gate)] [+ residual]

(its own bias and activation first: an activation before the add). `kernel_api.nn.patch` makes
the callers: a decoder block hands the residual to the projection ending each of its branches
(`kernel_api.nn.blocks`), a gated MLP hands the gate projection's output to the up projection
(`kernel_api.nn.mlp`).

How one call runs (``rows``: the product of the input's leading dimensions):

- eager, ``rows >= FUSE_MIN_ROWS``, no autograd: one `ops.gemm` with the epilogue function (on
  SM90 the (M, N) operands are staged by TMA; fused / plain 1.015 for a residual on the H200,
  1.02 for a tanh-GELU gate, 1.055 for an erf-GELU one, docs/performance.md);
- a residual with nothing else before it, fewer rows or autograd on: the named epilogue
  (``C=residual, beta=1``), whose call the front door replays from C and whose backward is the
  GEMM op's (the residual's gradient is the output's). The callers `patch` makes hand operands
  over in eager code only for the epilogue function's calls (`worth_arming`), so this form serves
  direct callers and forced compile lowerings;
- under ``torch.compile``: `kernel_api.nn.lowering.choose` as for a plain projection; "aten"
  gives the layer's aten forward and the epilogue as torch ops, for Inductor to fuse;
- otherwise (a gate or an activation before the add while training, autocast, a CPU model):
  the layer's own forward, then the epilogue as torch ops.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .. import ops
from ..core import tracing
from . import lowering
from .linear import Conv1DLinear, fronted_class
from .mixin import forward_behind, ops_take

#: Rows from which an eager call runs the epilogue function rather than the named epilogue or
#: torch ops after the GEMM: binding a function epilogue is Python work (parse cache, operand
#: views, the policy) that a decode-sized GEMM of a few microseconds would not hide. The same
#: bound as the compile rule's (`lowering.COMPILE_MIN_ROWS`).
FUSE_MIN_ROWS = lowering.COMPILE_MIN_ROWS

#: The layers' activation names (`kernel_api.nn.Linear`) as epilogue functions: "gelu" is the tanh
#: approximation there.
_FUNCTIONS = {"relu": "relu", "gelu": "gelu_tanh", "silu": "silu"}
#: The same as torch functions.
TORCH_ACTIVATIONS = {"relu": F.relu, "gelu": lambda z: F.gelu(z, approximate="tanh"), "silu": F.silu}

# The attributes `armed` sets on a projection for one call. They are plain instance attributes
# (never a Parameter, buffer or submodule), so they are set with ``object.__setattr__``: the same
# write as ``torch.nn.Module.__setattr__`` makes for them, without the Python that Dynamo would
# trace at every hand-over (about 1.5 ms of a compile per write, on a CPU host).
RESIDUAL, GATE = "kernel_api_residual", "kernel_api_gate"


@tracing.assume_constant_result
def epilogue_source(bias: bool, activation: str | None, gate_activation: str | None, gate: bool,
                    residual: bool) -> str:
    """The epilogue function's source for these parts:
    ``D = activation(accum + bias) * gate_activation(gate) + residual``. Dynamo calls it while
    tracing and takes the text as a constant."""
    params, expr = ["accum"], "accum"
    if bias:
        params.append("bias")
        expr = "accum + bias"
    if activation is not None:
        expr = f"{_FUNCTIONS[activation]}({expr})"
    if gate:
        params.append("gate")
        factor = f"{_FUNCTIONS[gate_activation]}(gate)" if gate_activation else "gate"
        expr = f"({expr}) * {factor}" if bias and activation is None else f"{expr} * {factor}"
    if residual:
        params.append("residual")
        expr = f"{expr} + residual"
    return f"def epilogue({', '.join(params)}):\n    D = {expr}\n    return D\n"


def torch_epilogue(y: torch.Tensor, gate: torch.Tensor | None, gate_activation: str | None,
                   residual: torch.Tensor | None) -> torch.Tensor:
    """What the epilogue adds after the layer's output ``y``, as torch ops (the model's own math:
    ``act(gate) * y``, then ``+ residual``)."""
    if gate is not None:
        y = (TORCH_ACTIVATIONS[gate_activation](gate) if gate_activation else gate) * y
    if residual is not None:
        y = y + residual
    return y


def worth_arming(operand: torch.Tensor, projections: tuple = ()) -> bool:
    """Whether a caller should hand ``operand`` (a residual or gate shaped as the output of one of
    ``projections``) to the projection: under Dynamo only when one of ``projections`` keeps
    kernel_api's op for it (`FusedProjection.keeps_op_for`): handing over is a module attribute
    set and cleared, which a compiled graph replays in Python after every call, and a layer
    lowered to aten gains nothing from it. In eager code only for the epilogue function's calls
    (`FUSE_MIN_ROWS` rows, no autograd): a smaller eager call would spend more host time choosing
    (a few microseconds of Python) than the add it saves, and in training the named epilogue's
    backward runs the add's gradient as a kernel of its own."""
    if tracing.is_dynamo_compiling():
        for p in projections:  # (a loop: Dynamo traces a generator as a frame of its own)
            if isinstance(p, FusedProjection) and FusedProjection.keeps_op_for(p, operand):
                return True
        return False
    if torch.is_grad_enabled() and operand.requires_grad:
        return False
    N = operand.shape[-1] if operand.dim() else 1
    return N > 0 and operand.numel() // N >= FUSE_MIN_ROWS


class armed:
    """``with armed(projection, residual=r, gate=g): y = projection(x)``: hands the operands to the
    projection's next call (which consumes them). ``consumed`` says, after the block, whether it
    did: a caller whose projection was not called adds them itself."""

    def __init__(self, projection: torch.nn.Module, residual: torch.Tensor | None = None,
                 gate: torch.Tensor | None = None) -> None:
        self.projection, self.residual, self.gate = projection, residual, gate
        self.consumed = False

    def __enter__(self) -> "armed":
        if self.residual is not None:
            object.__setattr__(self.projection, RESIDUAL, self.residual)
        if self.gate is not None:
            object.__setattr__(self.projection, GATE, self.gate)
        return self

    def __exit__(self, *exc: Any) -> None:
        p = self.projection
        self.consumed = getattr(p, RESIDUAL) is None and getattr(p, GATE) is None
        object.__setattr__(p, RESIDUAL, None)
        object.__setattr__(p, GATE, None)


def fused_class(cls: type) -> type:
    """``cls`` (a kernel_api projection class) with `FusedProjection` in front, made once."""
    return fronted_class(FusedProjection, cls, f"Fused{cls.__name__}",
                         f"{cls.__qualname__} taking a residual or gate into its epilogue (kernel_api.nn.patch).")


def fused_from(layer: torch.nn.Module, gate_activation: str | None = None) -> torch.nn.Module:
    """A `fused_class` version of the kernel_api projection ``layer``, holding its Parameters."""
    new = fused_class(type(layer)).__new__(fused_class(type(layer)))
    new.__dict__.update({key: value.copy() if isinstance(value, dict) else value
                         for key, value in layer.__dict__.items()})
    new.gate_activation = gate_activation
    # The operands `armed` hands over live in the instance from the start (None between calls):
    # under torch.compile the module's __dict__ then holds the same keys before and after a
    # call, and Dynamo's guards on it hold (set only by the first call, they would recompile).
    new.kernel_api_residual = new.kernel_api_gate = None
    return new


class FusedProjection(torch.nn.Module):
    """Mixin in front of a kernel_api projection (`kernel_api.nn.Linear`, the patched GPT-2
    Conv1D): a call with operands handed by `armed` returns
    ``activation(x @ W + b) * gate_activation(gate) + residual`` (the module docstring says how
    it runs); a call without them is the projection's own. ``gate_activation``: what the gate
    goes through (None: the gate as it is)."""

    kernel_api_residual: torch.Tensor | None = None
    kernel_api_gate: torch.Tensor | None = None
    gate_activation: str | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if tracing.is_dynamo_compiling() and lowering.aten_whatever_the_problem(self.compile_lowering,
                                                                                lowering.static_rows(input)):
            # (lowered to aten: no caller hands operands over, `worth_arming`; a direct user of
            # `armed` sees them not consumed and adds them itself)
            return forward_behind(self, FusedProjection)(self, input)
        residual, gate = self.kernel_api_residual, self.kernel_api_gate
        if residual is None and gate is None:
            return forward_behind(self, FusedProjection)(self, input)
        object.__setattr__(self, RESIDUAL, None)  # consumed
        object.__setattr__(self, GATE, None)
        how = self._how(input, residual, gate)
        if how == "function":
            return self._function(input, residual, gate)
        if how == "named":
            return self._named(input, residual)
        return torch_epilogue(forward_behind(self, FusedProjection)(self, input), gate, self.gate_activation, residual)

    def keeps_op_for(self, operand: torch.Tensor) -> bool:
        """Under Dynamo: whether a call whose output is shaped as ``operand`` keeps kernel_api's
        op (`kernel_api.nn.lowering.choose`, read before the call's input exists: the rows are the
        operand's, autograd the operand's or the weight's)."""
        forced, rows = self.compile_lowering, lowering.static_rows(operand)
        if lowering.aten_whatever_the_problem(forced, rows):
            return False
        weight, bias = self.weight, self.bias
        K, N = self._weight_kn().shape
        training = torch.is_grad_enabled() and (operand.requires_grad or weight.requires_grad)
        return lowering.choose(forced, rows, K, N, operand.dtype,
                               self.activation, bias is not None, training,
                               operand.device.index if operand.is_cuda else -1) == "kernel_api"

    def takes(self, x: torch.Tensor, residual: torch.Tensor | None = None, gate: torch.Tensor | None = None) -> bool:
        """Whether a call on ``x`` with these operands runs them in the GEMM's epilogue function
        (rather than the named epilogue or torch ops after the GEMM)."""
        return self._how(x, residual, gate) == "function"

    # ---- the choice
    def _weight_kn(self) -> torch.Tensor:
        """The weight as (K, N): transformers' Conv1D stores it so, torch.nn.Linear as (N, K)."""
        return self.weight if isinstance(self, Conv1DLinear) else self.weight.t()

    def _how(self, x: torch.Tensor, residual: torch.Tensor | None, gate: torch.Tensor | None) -> str:
        """"function", "named" or "torch" (the module docstring's rule)."""
        # (loops rather than comprehensions: under Dynamo, which traces a call's rule while
        # compiling, each comprehension or generator is a frame of its own)
        bias = self.bias
        operands = [x, self.weight]
        for t in (bias, residual, gate):
            if t is not None:
                operands.append(t)
        if not ops_take(*operands) or torch.is_autocast_enabled("cuda") or x.dim() < 2:
            return "torch"
        K, N = self._weight_kn().shape
        shape = (*x.shape[:-1], N)
        if x.shape[-1] != K:
            return "torch"  # (the layer's own forward names what is wrong)
        for t in (residual, gate):
            if t is not None and t.shape != shape:
                return "torch"  # (torch broadcasts)
        training = False
        if torch.is_grad_enabled():
            for t in operands:
                if t.requires_grad:
                    training = True
                    break
        rows = lowering.static_rows(x)
        only_residual = gate is None and self.activation is None
        if tracing.is_dynamo_compiling():
            chosen = lowering.choose(self.compile_lowering, rows, K, N, x.dtype, self.activation, bias is not None,
                                     training, x.device.index if x.is_cuda else -1)
            if chosen == "aten":
                return "torch"
        if only_residual and (training or rows is None or rows < FUSE_MIN_ROWS):
            return "named"
        if training or rows is None or rows < FUSE_MIN_ROWS:
            return "torch"
        return "function"

    # ---- the two fused forms
    def _function(self, x: torch.Tensor, residual: torch.Tensor | None, gate: torch.Tensor | None) -> torch.Tensor:
        w = self._weight_kn()
        K, N = w.shape
        bias = self.bias
        source = epilogue_source(bias is not None, self.activation, self.gate_activation, gate is not None,
                                 residual is not None)
        operands = {}
        if tracing.is_dynamo_compiling():
            # The op directly, its operands in the order `ops.gemm` gives them (bias, a keyword
            # of its own, last)
            if gate is not None:
                operands["gate"] = gate.reshape(-1, N)
            if residual is not None:
                operands["residual"] = residual.reshape(-1, N)
            if bias is not None:
                operands["bias"] = bias
            return ops.epilogue_gemm.traced_gemm(x.reshape(-1, K), w, source, operands).reshape(*x.shape[:-1], N)
        if bias is not None:
            operands["bias"] = bias
        if gate is not None:
            operands["gate"] = gate.reshape(-1, N)
        if residual is not None:
            operands["residual"] = residual.reshape(-1, N)
        y = ops.gemm(x.reshape(-1, K), w, epilogue=source, **operands)
        return y.reshape(*x.shape[:-1], N)

    def _named(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        w = self._weight_kn()
        K, N = w.shape
        y = ops.gemm(x.reshape(-1, K), w, C=residual.reshape(-1, N), beta=1.0, bias=self.bias)
        return y.reshape(*x.shape[:-1], N)
