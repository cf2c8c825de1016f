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
  branch. A GEMM that has already copied an input's tile into registers (SM90: TMA into shared
  memory, then to registers laid out as the accumulator fragment; `FusionPlan.staged` lists
  the inputs it may take so) hands those values to `apply_fragment` instead;
- an extra output is stored at the element's coordinate when it lies inside the output;
- a reduction adds (or takes the max / min) into its target with a global atomic at the
  element's coordinate of its view, whose reduced modes have the stride 0. A caller that hands
  its fragment's static coordinate offsets (`static_offsets`) to `reduce_fragment` gets one
  atomic per row (column, fragment) of the fragment instead of one per element: the elements a
  thread holds of one row are combined in registers first (out-of-range ones as the identity).

Math follows `kernel_api.epilogue.reference` (accurate exp / tanh / erf, not the fast
approximations) in the type of the value handed in: f32, or f64 for f64 GEMMs (whose scalars
are then f64 too), so results match a float64 reference to that type's rounding. The one
rewrite: in f32 the tanh-form GELU is computed as ``x * sigmoid(2u)``, the same function,
through the hardware's ex2 and reciprocal (a few ulp of f32; the accurate tanh costs the
epilogue about 3x the instructions beside the other warpgroup's wgmma). The erf GELU keeps the
accurate erf: no rewrite of it is the same function.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ..staging import TMA_ALIGN, tma_loadable, tma_storable

_TYPES = {"f16": cutlass.Float16, "bf16": cutlass.BFloat16, "f32": Float32}
_SQRT1_2 = 1.0 / math.sqrt(2.0)
_GELU_K0 = math.sqrt(2.0 / math.pi)
_GELU_K1 = 0.044715
# -2 log2(e) * u / x = _GELU_E0 + _GELU_E1 * x^2 (u = _GELU_K0 * (x + _GELU_K1 * x^3))
_GELU_E0 = -2.0 * _GELU_K0 / math.log(2.0)
_GELU_E1 = _GELU_E0 * _GELU_K1


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
        self.reductions = any(self.nodes[i][0] == "reduce" for i in self.aux)
        #: the parameters a TMA kernel may load in tiles (`tma_loadable`), in parameter order
        self.staged = tuple(i for i, key in enumerate(self.operands[:self.n_params]) if tma_loadable(key))
        #: the extra outputs (operand slots) a TMA kernel may store in tiles (`tma_storable`)
        self.staged_out = tuple(self.n_params + j for j in range(len(self.aux))
                                if tma_storable(self.operands[self.n_params + j]))

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
        if cutlass.const_expr(t is Float32):
            # 0.5 * x * (1 + tanh(u)) is x * sigmoid(2u): x / (1 + 2^(-2u log2 e)), with the
            # hardware's ex2 and reciprocal (each within 2 ulp), the two constants folded into
            # one polynomial in x: 2 FMA, 2 MUFU, 2 more FP32 operations, no branch. Overflow
            # of 2^(...) for very negative x gives x * 0 = -0, as the function's limit.
            v = x * (t(_GELU_E0) + t(_GELU_E1) * x * x)
            return x * cute.arch.rcp_approx(one + cute.math.exp2(v, fastmath=True))
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


def element(plan: FusionPlan, acc, batch, m, n, m_total, n_total, operands, deferred=None, shared=None,
            captured=None):
    """The epilogue of one accumulator element ``acc`` (f32 or f64: the type the math runs in)
    at output coordinate (batch, m, n) of an output with ``m_total`` x ``n_total`` columns:
    loads, computes, stores the extra outputs and reductions, and returns the value of ``D``
    (in ``acc``'s type). With ``deferred`` (a list), reductions are not issued but appended
    to it as (output slot, op, value, inside) for `reduce_fragment`. ``shared``: node index ->
    value of inputs already loaded: broadcast ones loaded for another element of the same row /
    column (`_SharedLoads`), tiles the GEMM staged (`apply_fragment`'s ``staged``). ``captured``:
    operand slot -> None for extra outputs the GEMM stores itself: their values are put there
    instead of stored."""
    t = type(acc)
    values = []
    clamped = None
    literal = plan.literal_base
    for index, (kind, args, attr) in enumerate(plan.nodes):
        if kind == "accum":
            v = acc
        elif kind == "input":
            key = plan.operands[attr]
            if key.kind == "scalar":
                v = t(operands[attr])
            elif shared is not None and index in shared:
                v = shared[index].to(t)
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
            if deferred is None:
                _reduce_if(operands[slot], batch, m, n, values[args[0]], inside, attr[0])
            else:
                deferred.append((slot, attr[0], values[args[0]], inside))
        elif captured is not None and slot in captured:
            captured[slot] = values[index]
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
        width = max(1, dtype.width // 8)
        # (an operand's alignment, where its key records one, is part of the artifact's key)
        align = max(width, min(key.align or width, TMA_ALIGN))
        shape = tuple(cute.sym_int32() for _ in range(3))
        stride = tuple(s if s in (0, 1) else cute.sym_int64(divisibility=align // width) for s in key.pattern)
        fakes.append(make_fake_tensor(dtype, shape, stride, assumed_align=align))
    fakes.extend(scalar(0.0) for _ in range(plan.literals))
    return tuple(fakes)


def static_offsets(layout, count: int):
    """The static (m, n) offsets of the first ``count`` elements of a thread's partition of an
    identity tensor (its ``layout``, whose strides are scaled bases), or None when any stride
    is not static."""
    shape = cute.flatten_to_tuple(layout.shape)
    stride = cute.flatten_to_tuple(layout.stride)
    found = []
    for v in range(count):
        rest, off = v, [0, 0]
        for extent, st in zip(shape, stride):
            if not isinstance(extent, int):
                return None
            c, rest = rest % extent, rest // extent
            if isinstance(st, cute.ScaledBasis):
                if not st.is_static() or len(st.mode) != 1 or st.mode[0] > 1:
                    return None
                off[st.mode[0]] += c * st.value
            elif st != 0:
                return None
        found.append(tuple(off))
    return found


def reduce_fragment(plan: FusionPlan, deferred: list, coords: list, offsets: list, batch, m_total, n_total,
                    operands):
    """Issue the reductions `element` deferred for one fragment: ``deferred[e]`` the list of
    element e, ``coords[e]`` its (m, n), ``offsets[e]`` its static offset. The elements of one
    row (column, fragment: by the reduction's axis) are combined in registers, out-of-range
    ones as the identity, then one atomic per group lands at the group's first element."""
    if not deferred or not deferred[0]:
        return
    for j, (slot, op, _, _) in enumerate(deferred[0]):
        axis = plan.operands[slot].axis
        groups = {}
        for e, items in enumerate(deferred):
            _, _, value, inside = items[j]
            v = value.to(Float32)
            identity = Float32(0.0) if op == "sum" else Float32(float("-inf") if op == "max" else float("inf"))
            v = cutlass.select_(inside, v, identity)
            key = offsets[e][0] if axis == "row" else offsets[e][1] if axis == "column" else 0
            if key in groups:
                first, acc = groups[key]
                groups[key] = (first, acc + v if op == "sum" else cutlass.max(acc, v) if op == "max"
                               else cutlass.min(acc, v))
            else:
                groups[key] = (e, v)
        for first, acc in groups.values():
            m, n = coords[first]
            ok = m < m_total if axis == "row" else n < n_total if axis == "column" else m >= 0
            _reduce_if(operands[slot], batch, cutlass.min(m, m_total - 1), cutlass.min(n, n_total - 1), acc, ok, op)


@cute.jit
def _store2_if(t: cute.Tensor, m, n, value, inside):
    if inside:
        t[m, n] = value.to(t.element_type)


class _SharedLoads:
    """Loads of broadcast inputs (row vectors, column vectors, one value per batch) shared by
    the elements of a fragment that read the same value: keyed by the element's static offset
    along the input's varying mode, so a thread loads a row bias once per column it holds."""

    def __init__(self, plan: FusionPlan, offsets) -> None:
        self.plan, self.offsets, self.found = plan, offsets, {}
        self.nodes = []
        if offsets is not None:
            for index, (kind, _, attr) in enumerate(plan.nodes):
                key = plan.operands[attr] if kind == "input" else None
                if key is not None and key.kind == "load" and (key.pattern[1] == 0 or key.pattern[2] == 0):
                    self.nodes.append((index, attr, key.pattern))

    def get(self, e: int, batch, m, n, m_total, n_total, operands):
        """The shared values for element ``e`` at (batch, m, n), loading the ones not seen yet."""
        if not self.nodes:
            return None
        dm, dn = self.offsets[e]
        values = {}
        for index, attr, pattern in self.nodes:
            key = (index, dn if pattern[1] == 0 and pattern[2] != 0 else None,
                   dm if pattern[2] == 0 and pattern[1] != 0 else None)
            if key not in self.found:
                self.found[key] = operands[attr][batch, cutlass.min(m, m_total - 1), cutlass.min(n, n_total - 1)]
            values[index] = self.found[key]
        return values


def apply_fragment(plan: FusionPlan, frag, coords, row0, col0, batch, m_total, n_total, operands, staged=None,
                   outputs=None):
    """The epilogue on every element of the register fragment ``frag`` (in place: each value
    becomes its ``D``), element v at (row0, col0) + ``coords[v]`` (a partitioned identity
    tensor): extra loads, stores and reductions (grouped per row / column by the fragment's
    static offsets where they are static). ``staged``: parameter index -> a register fragment
    laid out as ``frag`` holding that input's values (already loaded by the caller);
    ``outputs``: operand slot -> a register fragment laid out as ``frag`` that receives that
    extra output's values (the caller stores it)."""
    count = cute.size(frag)
    static = static_offsets(coords.layout, count)
    offsets = static if plan.reductions else None
    shared = _SharedLoads(plan, static)
    staged_nodes = []
    if staged:
        staged_nodes = [(index, staged[attr]) for index, (kind, _, attr) in enumerate(plan.nodes)
                        if kind == "input" and attr in staged]
    deferred, crds = [], []
    for v in range(count):
        c = coords[v]
        m, n = row0 + c[0], col0 + c[1]
        items = [] if offsets is not None else None
        found = shared.get(v, batch, m, n, m_total, n_total, operands)
        if staged_nodes:
            found = dict(found or {})
            found.update((index, fragment[v]) for index, fragment in staged_nodes)
        captured = dict.fromkeys(outputs) if outputs else None
        frag[v] = element(plan, frag[v], batch, m, n, m_total, n_total, operands, items, found, captured)
        if outputs:
            for slot, fragment in outputs.items():
                fragment[v] = captured[slot].to(fragment.element_type)
        deferred.append(items)
        crds.append((m, n))
    if offsets is not None:
        reduce_fragment(plan, deferred, crds, offsets, batch, m_total, n_total, operands)


def apply_and_store(plan: FusionPlan, acc, coords, mOut, batch, m_total, n_total, operands):
    """The epilogue on every element of the accumulator fragment ``acc`` at ``coords[i]`` (a
    partitioned identity tensor of the output), ``D`` stored into ``mOut`` (an (M, N) view of
    one batch) where it lies inside. The math runs in f32, or f64 for an f64 accumulator."""
    math = cutlass.Float64 if acc.element_type == cutlass.Float64 else Float32
    count = cute.size(acc)
    static = static_offsets(coords.layout, count)
    offsets = static if plan.reductions else None
    shared = _SharedLoads(plan, static)
    deferred, crds = [], []
    for i in range(count):
        m, n = coords[i]
        items = [] if offsets is not None else None
        d = element(plan, acc[i].to(math), batch, m, n, m_total, n_total, operands, items,
                    shared.get(i, batch, m, n, m_total, n_total, operands))
        _store2_if(mOut, m, n, d, cute.elem_less((m, n), (m_total, n_total)))
        deferred.append(items)
        crds.append((m, n))
    if offsets is not None:
        reduce_fragment(plan, deferred, crds, offsets, batch, m_total, n_total, operands)
