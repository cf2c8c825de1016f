"""Fused GEMM epilogue math in CuTe DSL, reusable by any GEMM implementation.

``out = activation(alpha * acc + beta * C + bias)``, described at compile time by an
`EpilogueSpec` (see ``gemm/common.py``). Three entry points, from smallest to largest:

- ``activate(x, name)``: relu / gelu (tanh approximation) / silu of a scalar.
- ``epilogue_value(spec, acc, alpha, beta, c, bias)``: the whole formula for one element
  (pass ``c``/``bias`` as None when the spec has none); returns the accumulator type.
- ``store_fragment(spec, acc, coords, mOut, mC, mBias, alpha, beta, M, N)``: apply it to
  every element of a thread's accumulator fragment and store the in-bounds ones, given a
  fragment of (m, n) coordinates partitioned exactly like ``acc`` (e.g. the same
  ``thr_mma.partition_C`` applied to an identity tensor). ``mOut``/``mC`` are (M, N) views
  of one batch, ``mBias`` the 1-D bias.

Math runs in the accumulator's type (f32, or f64 for f64 GEMMs); transcendental functions
use the accurate (non-approximate) versions so f32 results match a float64 reference to
~1e-6.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from ..common import EpilogueSpec
from . import fusion

__all__ = ["EpilogueSpec", "activate", "epilogue_value", "store_fragment", "store_fused"]

_GELU_K0 = 0.7978845608028654  # sqrt(2/pi)
_GELU_K1 = 0.044715


@cute.jit
def activate(x, name: cutlass.Constexpr):
    """``name`` in (None, "relu", "gelu", "silu") applied to the scalar ``x`` (same type back)."""
    result = x
    if cutlass.const_expr(name == "relu"):
        result = cutlass.max(x, type(x)(0.0))
    elif cutlass.const_expr(name == "gelu"):
        inner = type(x)(_GELU_K0) * (x + type(x)(_GELU_K1) * x * x * x)
        result = type(x)(0.5) * x * (type(x)(1.0) + cute.math.tanh(inner))
    elif cutlass.const_expr(name == "silu"):
        result = x / (type(x)(1.0) + cute.math.exp(-x))
    return result


@cute.jit
def epilogue_value(spec: cutlass.Constexpr, acc, alpha, beta, c, bias):
    """``activation(alpha * acc + beta * c + bias)`` for one element, in ``acc``'s type."""
    v = acc
    if cutlass.const_expr(spec.scaled):
        v = v * alpha
    if cutlass.const_expr(spec.has_c):
        v = v + beta * c.to(type(acc))
    if cutlass.const_expr(spec.bias is not None):
        v = v + bias.to(type(acc))
    return activate(v, spec.activation)


@cute.jit
def _element(spec: cutlass.Constexpr, acc, m, n, mC, mBias, alpha, beta):
    c = None
    b = None
    if cutlass.const_expr(spec.has_c):
        c = mC[m, n]
    if cutlass.const_expr(spec.bias == "row"):
        b = mBias[n]
    elif cutlass.const_expr(spec.bias == "column"):
        b = mBias[m]
    return epilogue_value(spec, acc, alpha, beta, c, b)


@cute.jit
def store_fragment(spec: cutlass.Constexpr, acc: cute.Tensor, coords: cute.Tensor, mOut: cute.Tensor, mC,
                   mBias, alpha, beta, M, N, pairs: cutlass.Constexpr = False):
    """Apply the epilogue to each element of ``acc`` and store those with (m, n) < (M, N).

    ``pairs=True`` promises that fragment elements (2j, 2j+1) sit at (m, n), (m, n+1) with n
    even and that ``mOut`` is N-contiguous (as in the mma.sync accumulator layout with a
    row-major output); the store then writes both with one vector store whenever N, the
    row stride and the pointer allow it (checked once, at run time), else element-wise.
    """
    width = mOut.element_type.width // 8
    vector_ok = False
    if cutlass.const_expr(pairs):
        vector_ok = (N % 2 == 0) and (mOut.stride[0] % 2 == 0) and (mOut.iterator.toint() % (2 * width) == 0)
    if vector_ok:
        pair = cute.make_rmem_tensor(cute.make_layout(2), mOut.element_type)
        for j in cutlass.range_constexpr(cute.size(acc) // 2):
            m, n = coords[2 * j]
            if cute.elem_less((m, n), (M, N)):
                pair[0] = _element(spec, acc[2 * j], m, n, mC, mBias, alpha, beta).to(mOut.element_type)
                pair[1] = _element(spec, acc[2 * j + 1], m, n + 1, mC, mBias, alpha, beta).to(mOut.element_type)
                dst = cute.domain_offset((m, n), mOut)
                cute.autovec_copy(pair, cute.make_tensor(dst.iterator.align(2 * width), cute.make_layout(2)))
    else:
        for i in cutlass.range_constexpr(cute.size(acc)):
            m, n = coords[i]
            if cute.elem_less((m, n), (M, N)):
                mOut[m, n] = _element(spec, acc[i], m, n, mC, mBias, alpha, beta).to(mOut.element_type)


def store_fused(plan, acc: cute.Tensor, coords: cute.Tensor, mOut: cute.Tensor, batch, operands, M, N):
    """An epilogue function (`fusion.FusionPlan`) on each element of ``acc``: its extra loads,
    stores and reductions at the element's (batch, m, n), then ``D`` stored where (m, n) < (M, N)
    (`fusion.apply_and_store`; traced as plain Python, so the fragment's offsets stay static)."""
    fusion.apply_and_store(plan, acc, coords, mOut, batch, M, N, operands)
