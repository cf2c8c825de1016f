"""The CuTe DSL emitter of epilogue functions (`kernel_api.epilogue`'s DAG), shared by the GEMMs.

The DSL traces Python, so the emitter is a Python walk over the DAG at trace time: each node
becomes the DSL operations of its math, in f32, for one accumulator element at output
coordinate (batch, m, n). A GEMM calls `element` once per accumulator element in its epilogue
loop and stores the returned value as ``D`` its own way (the SM90 kernel through shared memory
and TMA, the SM80 ones directly); the extra operands travel as one tuple argument of the
compiled function (inputs by parameter, extra outputs by return order, then literals):

- a tensor input is read at the element's coordinate of its (L, M, N) view, whose broadcast
  modes carry a static stride 0 (a row vector reads one value per column, ...); coordinates are
  clamped into the output, so an edge tile's lanes past M or N read valid memory and never
  branch;
- an extra output is stored at the element's coordinate when it lies inside the output;
- a reduction adds (or takes the max / min) into its target with a global atomic at the
  element's coordinate of its view, whose reduced modes have the stride 0.

Math follows `kernel_api.epilogue.reference` (accurate exp / tanh / erf, not the fast
approximations) in the type of the value handed in: f32, or f64 for f64 GEMMs (whose scalars
are then f64 too), so results match a float64 reference to that type's rounding.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

_TYPES = {"f16": cutlass.Float16, "bf16": cutlass.BFloat16, "f32": Float32}
_SQRT1_2 = 1.0 / math.sqrt(2.0)
_GELU_K0 = math.sqrt(2.0 / math.pi)
_GELU_K1 = 0.044715


class FusionPlan:
    """A bound epilogue's structure as the emitter walks it (from `FusedEpilogueSignature.key`):
    ``nodes`` ((kind, args, attr) each), ``outputs`` (("D" | "aux", node)), ``operands`` (the
    `OperandKey` of each parameter and extra output). Compile-time only."""

    def __init__(self, key: tuple) -> None:
        self.key = key
        (self.nodes, self.outputs), self.operands = key
        self.n_params = sum(1 for kind, _, _ in self.nodes if kind == "input")
        self.aux = [index for name, index in self.outputs if name != "D"]
        self.d_index = next(index for name, index in self.outputs if name == "D")
        self.literal_base = self.n_params + len(self.aux)
        self.literals = sum(1 for kind, _, _ in self.nodes if kind == "literal")

    def __repr__(self) -> str:  # (stable: part of the compiled artifact's key)
        return f"FusionPlan({self.key!r})"


def _unary(op: str, x):
    t = type(x)
    one = t(1.0)
    if op == "identity":
        return x
    if op == "neg":
        return -x
    if op == "relu":
        return cutlass.max(x, t(0.0))
    if op == "sigmoid":
        return one / (one + cute.math.exp(-x))
    if op == "silu":
        return x / (one + cute.math.exp(-x))
    if op == "tanh":
        return cute.math.tanh(x)
    if op == "exp":
        return cute.math.exp(x)
    if op == "abs":
        return cutlass.max(x, -x)
    if op == "gelu":
        return t(0.5) * x * (one + cute.math.erf(x * t(_SQRT1_2)))
    if op == "gelu_tanh":
        inner = t(_GELU_K0) * (x + t(_GELU_K1) * x * x * x)
        return t(0.5) * x * (one + cute.math.tanh(inner))
    if op == "hardswish":
        return x * cutlass.min(cutlass.max(x + t(3.0), t(0.0)), t(6.0)) * t(1.0 / 6.0)
    raise ValueError(f"epilogue emitter: unknown unary op {op!r}")


def _binary(op: str, a, b):
    if op == "add":
        return a + b
    if op == "sub":
        return a - b
    if op == "mul":
        return a * b
    if op == "div":
        return a / b
    if op == "max":
        return cutlass.max(a, b)
    if op == "min":
        return cutlass.min(a, b)
    raise ValueError(f"epilogue emitter: unknown binary op {op!r}")


@cute.jit
def _store_if(t: cute.Tensor, batch, m, n, value, inside):
    if inside:
        t[batch, m, n] = value.to(t.element_type)


@cute.jit
def _reduce_if(t: cute.Tensor, batch, m, n, value, inside, op: cutlass.Constexpr):
    if inside:
        ptr = t.iterator + cute.crd2idx((batch, m, n), t.layout)
        v = value.to(Float32)  # (reduction targets are f32)
        if cutlass.const_expr(op == "sum"):
            cute.arch.atomic_add(ptr.llvm_ptr, v)
        elif cutlass.const_expr(op == "max"):
            cute.arch.atomic_fmax(ptr.llvm_ptr, v)
        else:
            cute.arch.atomic_fmin(ptr.llvm_ptr, v)


def element(plan: FusionPlan, acc, batch, m, n, m_total, n_total, operands):
    """The epilogue of one accumulator element ``acc`` (f32 or f64: the type the math runs in)
    at output coordinate (batch, m, n) of an output with ``m_total`` x ``n_total`` columns:
    loads, computes, stores the extra outputs and reductions, and returns the value of ``D``
    (in ``acc``'s type)."""
    t = type(acc)
    values = []
    clamped = None
    literal = plan.literal_base
    for kind, args, attr in plan.nodes:
        if kind == "accum":
            v = acc
        elif kind == "input":
            key = plan.operands[attr]
            if key.kind == "scalar":
                v = t(operands[attr])
            else:
                if clamped is None:
                    clamped = (cutlass.min(m, m_total - 1), cutlass.min(n, n_total - 1))
                v = operands[attr][batch, clamped[0], clamped[1]].to(t)
        elif kind == "literal":
            v = t(operands[literal])
            literal += 1
        elif kind == "unary":
            v = _unary(attr, values[args[0]])
        elif kind == "binary":
            v = _binary(attr, values[args[0]], values[args[1]])
        elif kind == "cast":
            v = values[args[0]].to(_TYPES[attr]).to(t)
        elif kind == "reduce":
            v = None
        else:
            raise ValueError(f"epilogue emitter: unknown node kind {kind!r}")
        values.append(v)
    inside = None
    for j, index in enumerate(plan.aux):
        slot = plan.n_params + j
        if inside is None:
            inside = cute.elem_less((m, n), (m_total, n_total))
        kind, args, attr = plan.nodes[index]
        if kind == "reduce":
            _reduce_if(operands[slot], batch, m, n, values[args[0]], inside, attr[0])
        else:
            _store_if(operands[slot], batch, m, n, values[index], inside)
    return values[plan.d_index]


def fake_operands(plan: FusionPlan, scalar=Float32) -> tuple:
    """Compile-time stand-ins of the operand tuple: fake (L, M, N) tensors with the static
    strides of their patterns, scalars of type ``scalar`` (the epilogue's math type)."""
    from cutlass.cute.runtime import make_fake_tensor

    fakes = []
    for key in plan.operands:
        if key.kind == "scalar":
            fakes.append(scalar(0.0))
            continue
        dtype = key.dtype.to_cutlass()
        shape = tuple(cute.sym_int32() for _ in range(3))
        stride = tuple(s if s in (0, 1) else cute.sym_int64() for s in key.pattern)
        fakes.append(make_fake_tensor(dtype, shape, stride, assumed_align=max(1, dtype.width // 8)))
    fakes.extend(scalar(0.0) for _ in range(plan.literals))
    return tuple(fakes)
