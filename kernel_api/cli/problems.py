"""Problems described by sizes and type names: the arguments the ``kernel-api`` commands and the
shapes files build, for every operation in `PROBLEMS`.

Each operation is one `Problem`: its fields (sizes, type names, switches) and how they become
arguments. The commands' options (``--m``, ``--seqlen-q``), a shapes file's fields and their
checks all come from that one description, so an operation added here is listed, explained,
precompiled, benchmarked and tuned by every command alike.

An installed package describes its own operations for the commands through the entry point
group ``kernel_api.problems``: each entry point names a `Problem`, or a list of them
(`all_problems`).

Tensors are made on torch's "meta" device by default, so nothing is allocated and no GPU is
needed; pointers then count as fully aligned.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import warnings
from typing import Any, Callable

import torch

from ..arguments import (AttentionArguments, CrossEntropyArguments, GatedActivationArguments, GemmArguments,
                         LayerNormArguments, RMSNormArguments, RopeArguments, SoftmaxArguments,
                         SoftmaxBackwardArguments)
from ..arguments.activations import GATE_ACTIVATIONS
from ..core.dtypes import to_dtype
from ..utils import layout_string_to_strides

DEVICE = "meta"

#: A field's default when it has none: the field is required.
REQUIRED = object()

#: The largest size torch takes (its sizes are int64).
MAX_SIZE = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class Field:
    """One value of a problem: an integer size (1 to `MAX_SIZE`), a type name, a choice or a switch.

    Attributes:
        name: the field's name in a shapes file; the option is ``--`` + name with ``-`` for ``_``.
        kind: ``int`` (a size from 1 to `MAX_SIZE`), ``"dtype"`` (a type name), ``"layout"`` (t/n per operand),
            ``bool`` (a switch, False unless given) or a tuple of the allowed strings.
        default: the value when not given; `REQUIRED` when it must be.
        help: the option's help text.
    """

    name: str
    kind: Any
    default: Any = REQUIRED
    help: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value: Any, label: str) -> Any:
        """``value`` if it is valid for this field, else ValueError naming ``label``."""
        if value is None and self.default is None:
            return None
        if self.kind is int:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{label} must be an integer >= 1, got {value!r}")
            if value > MAX_SIZE:
                raise ValueError(f"{label} must be at most {MAX_SIZE} (2**63 - 1, torch's largest size), got {value}")
        elif self.kind is bool:
            if not isinstance(value, bool):
                raise ValueError(f"{label} must be true or false, got {value!r}")
        elif isinstance(self.kind, tuple):
            if value not in self.kind:
                raise ValueError(f"{label} must be one of {list(self.kind)}, got {value!r}")
        else:
            if not isinstance(value, str):
                raise ValueError(f"{label} must be a string, got {value!r}")
            if self.kind == "dtype":
                to_dtype(value, label)
            elif self.kind == "layout":
                try:
                    layout_string_to_strides(value)
                except ValueError as exc:
                    raise ValueError(f"{label}: {exc}") from None
        return value


@dataclasses.dataclass(frozen=True)
class Problem:
    """An operation as the commands describe it: its fields, ``build(device=..., **values)`` that
    makes its arguments from them, and optionally ``summary(values)``, the sizes in a few words
    for report lines (default: the fields that differ from their defaults)."""

    op: str
    help: str
    fields: tuple[Field, ...]
    build: Callable[..., Any]
    summary: Callable[[dict], str] | None = None

    def values(self, given: dict, label: Callable[[Field], str]) -> dict:
        """Every field's value (``given``'s, else the default), each checked; ValueError names
        the field as ``label(field)`` gives it."""
        values = {}
        for f in self.fields:
            value = given.get(f.name, f.default)
            if value is REQUIRED:
                raise ValueError(f"{label(f)} is missing")
            values[f.name] = f.check(value, label(f))
        return values

    def arguments(self, values: dict, device: str = DEVICE) -> Any:
        """The arguments for checked ``values`` (`values`), tensors on ``device``; ValueError
        when torch cannot make tensors of those sizes (an element count past its index type)."""
        try:
            return self.build(device=device, **values)
        except RuntimeError as exc:
            raise ValueError(f"{self.op}: tensors of these sizes cannot be made: "
                             f"{str(exc).splitlines()[0]}") from None

    def describe(self, values: dict) -> str:
        """One line: the operation and its sizes (``summary``), or its fields that differ from
        their defaults."""
        if self.summary is not None:
            return f"{self.op} {self.summary(values)}"
        parts = [f"{f.name}={values[f.name]}" for f in self.fields
                 if values.get(f.name) is not None and (f.default is REQUIRED or values[f.name] != f.default)]
        return " ".join([self.op, *parts])


def _matrix(rows: int, cols: int, batch: int | None, row_major: bool, dtype: torch.dtype, device: str) -> torch.Tensor:
    # (torch computes the strides: sizes whose product overflows are its RuntimeError, which
    # `Problem.arguments` reports, not an int64 stride torch cannot unpack)
    lead = () if batch is None else (batch,)
    if row_major:
        return torch.empty(*lead, rows, cols, dtype=dtype, device=device)
    return torch.empty(*lead, cols, rows, dtype=dtype, device=device).transpose(-1, -2)


def _torch_dtype(name: str, flag: str = "--dtype") -> torch.dtype:
    return to_dtype(name, flag).to_torch()


def gemm_arguments(m: int, n: int, k: int, batch: int | None = None, dtype: str = "bf16", layout: str = "ttt",
                   out_dtype: str | None = None, accumulator: str | None = None, device: str = DEVICE) -> GemmArguments:
    """GemmArguments for a problem described by sizes, dtype names and a layout string.

    Args:
        m, n, k: the problem's sizes (at least 1).
        batch: the batch count L (operands become rank 3), or None for rank-2 operands.
        dtype: the operands' type name ("bf16", "f16", "f32", "f64").
        layout: "t" (row-major) or "n" (column-major) per A, B and out, e.g. "tnt".
        out_dtype: the output's type name (default: ``dtype``).
        accumulator: the accumulator's type name (default: the arguments' own).
        device: where the tensors are made (default: "meta", nothing allocated).

    Returns:
        The arguments; ValueError names the flag of a size or type that is not valid.
    """
    for label, v in (("--m", m), ("--n", n), ("--k", k)):
        if v < 1:
            raise ValueError(f"{label} must be >= 1, got {v}")
    if batch is not None and batch < 1:
        raise ValueError(f"--batch must be >= 1, got {batch}")
    in_t = _torch_dtype(dtype)
    out_t = _torch_dtype(out_dtype or dtype, "--out-dtype")
    sa, sb, so = layout_string_to_strides(layout)
    A = _matrix(m, k, batch, sa[-1] == 1, in_t, device)
    B = _matrix(k, n, batch, sb[-1] == 1, in_t, device)
    out = _matrix(m, n, batch, so[-1] == 1, out_t, device)
    return GemmArguments(A, B, out, accumulator_type=accumulator)


def softmax_arguments(rows: int, cols: int, dtype: str = "bf16", backward: bool = False,
                      device: str = DEVICE) -> SoftmaxArguments | SoftmaxBackwardArguments:
    """Softmax arguments (forward, or backward) for ``rows`` x ``cols`` row-major tensors.

    Args:
        rows, cols: the problem's sizes (at least 1).
        dtype: the tensors' type name.
        backward: the backward pass's arguments instead of the forward's.
        device: where the tensors are made (default: "meta", nothing allocated).

    Returns:
        `SoftmaxArguments`, or `SoftmaxBackwardArguments` with ``backward``.
    """
    if rows < 1 or cols < 1:
        raise ValueError(f"--rows and --cols must be >= 1, got {rows} x {cols}")
    t = _torch_dtype(dtype)
    make = lambda: torch.empty(rows, cols, dtype=t, device=device)  # noqa: E731
    if backward:
        return SoftmaxBackwardArguments(make(), make(), make())
    return SoftmaxArguments(make(), make())


def _norm_arguments(kind: str, rows: int, cols: int, dtype: str, weight_dtype: str | None, residual: bool,
                    device: str) -> Any:
    t = _torch_dtype(dtype)
    w = _torch_dtype(weight_dtype or dtype, "--weight-dtype")
    x, out = (torch.empty(rows, cols, dtype=t, device=device) for _ in range(2))
    weight = torch.empty(cols, dtype=w, device=device)
    extra = {}
    if residual:
        extra = dict(residual=torch.empty_like(x), residual_out=torch.empty_like(x))
    if kind == "rms_norm":
        return RMSNormArguments(x, weight, out, **extra)
    return LayerNormArguments(x, weight, torch.empty(cols, dtype=w, device=device), out, **extra)


def _attention_arguments(batch: int, heads: int, kv_heads: int | None, seqlen_q: int, seqlen_k: int | None,
                         head_dim: int, dtype: str, causal: bool, lse: bool, varlen: bool,
                         device: str) -> AttentionArguments:
    t = _torch_dtype(dtype)
    kv = kv_heads or heads
    if heads % kv:
        raise ValueError(f"--heads ({heads}) must be a multiple of --kv-heads ({kv})")
    sk = seqlen_k or seqlen_q
    if not varlen:
        q = torch.empty(batch, seqlen_q, heads, head_dim, dtype=t, device=device)
        k, v = (torch.empty(batch, sk, kv, head_dim, dtype=t, device=device) for _ in range(2))
        lse_t = torch.empty(batch, heads, seqlen_q, dtype=torch.float32, device=device) if lse else None
        return AttentionArguments(q, k, v, torch.empty_like(q), lse_t, causal=causal)
    # (the batch's sequences packed, each of the given lengths: offsets 0, seqlen, 2 seqlen, ...)
    q = torch.empty(batch * seqlen_q, heads, head_dim, dtype=t, device=device)
    k, v = (torch.empty(batch * sk, kv, head_dim, dtype=t, device=device) for _ in range(2))
    lse_t = torch.empty(heads, batch * seqlen_q, dtype=torch.float32, device=device) if lse else None
    cu_q, cu_k = (torch.arange(batch + 1, dtype=torch.int32, device=device) * n for n in (seqlen_q, sk))
    return AttentionArguments(q, k, v, torch.empty_like(q), lse_t, causal=causal, cu_seqlens_q=cu_q,
                              cu_seqlens_k=cu_k, max_seqlen_q=seqlen_q, max_seqlen_k=sk)


def _cross_entropy_arguments(rows: int, classes: int, dtype: str, device: str) -> CrossEntropyArguments:
    t = _torch_dtype(dtype)
    loss_t = torch.float64 if t == torch.float64 else torch.float32
    logits = torch.empty(rows, classes, dtype=t, device=device)
    # (valid class indices: a tuner's fresh arguments copy integer inputs as they are)
    target = torch.randint(0, classes, (rows,), dtype=torch.int64, device=device)
    loss, lse = (torch.empty(rows, dtype=loss_t, device=device) for _ in range(2))
    return CrossEntropyArguments(logits, target, loss, lse)


def _gated_arguments(rows: int, cols: int, dtype: str, activation: str, device: str) -> GatedActivationArguments:
    t = _torch_dtype(dtype)
    gate, up, out = (torch.empty(rows, cols, dtype=t, device=device) for _ in range(3))
    return GatedActivationArguments(gate, up, out, activation=activation)


def _rope_arguments(batch: int, seq: int, heads: int, kv_heads: int | None, head_dim: int, dtype: str,
                    device: str) -> RopeArguments:
    if head_dim % 2:
        raise ValueError(f"--head-dim must be even, got {head_dim}")
    t = _torch_dtype(dtype)
    q = torch.empty(batch, heads, seq, head_dim, dtype=t, device=device)
    k = torch.empty(batch, kv_heads or heads, seq, head_dim, dtype=t, device=device)
    cos, sin = (torch.empty(1, seq, head_dim, dtype=t, device=device) for _ in range(2))
    return RopeArguments(q, k, cos, sin, torch.empty_like(q), torch.empty_like(k))


_DTYPE = Field("dtype", "dtype", "bf16", "tensor type: bf16, f16, f32 (f64 where a kernel takes it)")
_ROWS = Field("rows", int, help="rows (the product of the leading dimensions)")


def _norm_problem(kind: str, formula: str) -> Problem:
    return Problem(kind, formula, (
        _ROWS, Field("cols", int, help="row length (normalised over)"), _DTYPE,
        Field("weight_dtype", "dtype", None, "weight (and bias) type (default: --dtype)"),
        Field("residual", bool, False, "x + residual is normalised and also written")),
        lambda device, **v: _norm_arguments(kind, device=device, **v))


#: Every operation the commands and shapes files describe, by name.
PROBLEMS: dict[str, Problem] = {p.op: p for p in (
    Problem("gemm", "out = A @ B", (
        Field("m", int), Field("n", int), Field("k", int),
        Field("batch", int, None, "batch count L (operands become rank 3)"),
        Field("dtype", "dtype", "bf16", "operand type: bf16, f16, f32, f64"),
        Field("layout", "layout", "ttt", "t/n per A, B, out (t = row-major), e.g. tnt"),
        Field("out_dtype", "dtype", None, "output type (default: --dtype)"),
        Field("accumulator", "dtype", None, "accumulator type (default: f64 for f64, else f32)")),
        lambda device, **v: gemm_arguments(device=device, **v),
        lambda v: (f"{v['m']}x{v['n']}x{v['k']}{'' if v.get('batch') is None else 'x' + str(v['batch'])} "
                   f"{v['dtype']} {v['layout']}")),
    Problem("softmax", "out = softmax(x, dim=-1)", (
        _ROWS, Field("cols", int), _DTYPE, Field("backward", bool, False, "the backward pass instead")),
        lambda device, **v: softmax_arguments(device=device, **v),
        lambda v: f"{v['rows']}x{v['cols']} {v['dtype']}" + (" backward" if v.get("backward") else "")),
    _norm_problem("rms_norm", "out = x / sqrt(mean(x^2) + eps) * weight, per row"),
    _norm_problem("layer_norm", "out = (x - mean) / sqrt(var + eps) * weight + bias, per row"),
    Problem("attention", "out = softmax(q k^T * scale [+ causal mask]) v, (batch, seq, heads, head_dim)", (
        Field("batch", int), Field("heads", int, help="query heads"),
        Field("kv_heads", int, None, "key/value heads (default: --heads; fewer: GQA, 1: MQA)"),
        Field("seqlen_q", int), Field("seqlen_k", int, None, "key length (default: --seqlen-q)"),
        Field("head_dim", int), _DTYPE,
        Field("causal", bool, False, "a bottom-right aligned causal mask"),
        Field("lse", bool, False, "also write the row log-sum-exp (what a backward needs)"),
        Field("varlen", bool, False, "the batch's sequences packed (tokens, heads, head_dim) with cu_seqlens "
              "offsets, each of the given lengths (the variable-length layout)")),
        lambda device, **v: _attention_arguments(device=device, **v)),
    Problem("cross_entropy", "loss, lse per row of logits against class indices", (
        _ROWS, Field("classes", int, help="classes (the logits' row length)"),
        Field("dtype", "dtype", "bf16", "logits type")),
        lambda device, **v: _cross_entropy_arguments(device=device, **v)),
    Problem("gated_activation", "out = act(gate) * up: SwiGLU (silu), GeGLU (gelu_tanh, gelu)", (
        _ROWS, Field("cols", int), _DTYPE,
        Field("activation", tuple(GATE_ACTIVATIONS), "silu", "the gate's activation")),
        lambda device, **v: _gated_arguments(device=device, **v)),
    Problem("rope", "rotary position embedding of q and k, (batch, heads, seq, head_dim)", (
        Field("batch", int), Field("seq", int), Field("heads", int, help="query heads"),
        Field("kv_heads", int, None, "key heads (default: --heads)"), Field("head_dim", int, help="even"), _DTYPE),
        lambda device, **v: _rope_arguments(device=device, **v)),
)}

#: The entry point group through which installed packages describe their operations.
ENTRY_POINT_GROUP = "kernel_api.problems"

_all: dict[str, Problem] | None = None


def all_problems() -> dict[str, Problem]:
    """`PROBLEMS` and the operations installed packages describe (``kernel_api.problems`` entry
    points, each a `Problem` or a list of them), loaded once. An entry point that fails to load
    (raising anything but KeyboardInterrupt, ``sys.exit`` included, as plugins' failures are
    reported), names something else, or describes an operation already described is skipped
    whole, with a RuntimeWarning naming it."""
    global _all
    if _all is None:
        found = dict(PROBLEMS)
        try:
            entry_points = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
        except Exception as exc:  # noqa: BLE001 - a broken metadata install must not stop the commands
            warnings.warn(f"kernel_api: the {ENTRY_POINT_GROUP} entry points cannot be read: {exc}", RuntimeWarning)
            entry_points = []
        for ep in entry_points:
            try:
                loaded = ep.load()
                problems = [loaded] if isinstance(loaded, Problem) else list(loaded)
                for problem in problems:
                    if not isinstance(problem, Problem):
                        raise TypeError(f"expected a kernel_api.cli.problems.Problem, got {type(problem).__name__}")
                    if problem.op in found:
                        raise ValueError(f"operation {problem.op!r} is described already")
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - one package's fault (sys.exit too) must not stop them
                warnings.warn(f"kernel_api: command-line problems {ep.name} ({ep.value}) skipped: "
                              f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                              RuntimeWarning)
                continue
            found.update((problem.op, problem) for problem in problems)
        _all = found
    return _all
