"""Bad input, systematically, for every arguments type: operands that are not tensors, of the
wrong rank, shape, dtype or device, carrying torch's lazy negative bit, expanded or overlapping
outputs, and scalars out of range. Each refusal must be a TypeError or ValueError (or a
KernelApiError), in one line that starts by naming the operand or parameter; never an
IndexError, AttributeError, OverflowError, a torch RuntimeError or an input accepted without a
word. Good inputs of awkward shapes (dims of 1, empty batches) stay accepted.

Property-style and deterministic: each case draws its sizes from seeded generators, and every
mutation is applied to every operand it fits. Arguments are built from CPU tensors (meta tensors
stand for "another device") and never launched, except in
`test_dtypes_no_kernel_takes_are_refused_by_discovery`, which opens the front door to CPU tensors.
"""

from __future__ import annotations

import inspect
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest
import torch

from kernel_api import (AttentionArguments, AttentionBackwardArguments, CrossEntropyArguments,
                        CrossEntropyBackwardArguments, CrossEntropyReducedArguments, EpilogueArguments,
                        GatedActivationArguments, GatedActivationBackwardArguments, GemmArguments,
                        LayerNormArguments, LayerNormBackwardArguments, LinearCrossEntropyArguments, RMSNormArguments,
                        RMSNormBackwardArguments, RopeArguments, RopeBackwardArguments, SoftmaxArguments,
                        SoftmaxBackwardArguments, ops)
from kernel_api.arguments.cross_entropy import reduced_size
from kernel_api.core.errors import KernelApiError

F32 = torch.float32
DRAWS = 3  # seeded size draws per case


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(shape, dtype=F32)


def _empty(*shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=F32)


# ---- the cases: a good call of each arguments type, as a function of its sizes ----

def _gemm(L, M, N, K):
    lead = () if L is None else (L,)
    return dict(A=_randn(*lead, M, K), B=_randn(*lead, K, N), out=_empty(*lead, M, N))


def _softmax(shape):
    return dict(x=_randn(*shape), out=_empty(*shape))


def _softmax_bwd(shape):
    return dict(grad_out=_randn(*shape), out=_randn(*shape), grad_in=_empty(*shape))


def _norm(shape, layer=False, residual=False):
    kw = dict(x=_randn(*shape), weight=_randn(shape[-1]), out=_empty(*shape))
    if layer:
        kw["bias"] = _randn(shape[-1])
    if residual:
        kw.update(residual=_randn(*shape), residual_out=_empty(*shape))
    return kw


def _norm_bwd(shape, layer=False):
    kw = dict(grad_out=_randn(*shape), x=_randn(*shape), weight=_randn(shape[-1]), grad_x=_empty(*shape),
              grad_weight=_empty(shape[-1]))
    if layer:
        kw["grad_bias"] = _empty(shape[-1])
    return kw


def _gated(shape):
    return dict(gate=_randn(*shape), up=_randn(*shape), out=_empty(*shape))


def _gated_bwd(shape):
    return dict(grad_out=_randn(*shape), gate=_randn(*shape), up=_randn(*shape), grad_gate=_empty(*shape),
                grad_up=_empty(*shape))


def _rope(batch, hq, hk, seq, dim, table_batch=1, backward=False):
    q, k = _randn(batch, hq, seq, dim), _randn(batch, hk, seq, dim)
    tables = dict(cos=_randn(table_batch, seq, dim), sin=_randn(table_batch, seq, dim))
    if backward:
        return dict(grad_q_out=q, grad_k_out=k, **tables, grad_q=_empty(*q.shape), grad_k=_empty(*k.shape))
    return dict(q=q, k=k, **tables, q_out=_empty(*q.shape), k_out=_empty(*k.shape))


def _attention(batch, sq, sk, hkv, group, dim, lse=True):
    hq = hkv * group
    kw = dict(q=_randn(batch, sq, hq, dim), k=_randn(batch, sk, hkv, dim), v=_randn(batch, sk, hkv, dim),
              out=_empty(batch, sq, hq, dim))
    if lse:
        kw["lse"] = _empty(batch, hq, sq)
    return kw


def _offsets(lengths):
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)


def _varlen(lengths_q, lengths_k, hkv, group, dim):
    hq, tq, tk = hkv * group, sum(lengths_q), sum(lengths_k)
    return dict(q=_randn(tq, hq, dim), k=_randn(tk, hkv, dim), v=_randn(tk, hkv, dim), out=_empty(tq, hq, dim),
                lse=_empty(hq, tq), cu_seqlens_q=_offsets(lengths_q), cu_seqlens_k=_offsets(lengths_k))


def _cache(batch, sq, cache, hkv, group, dim):
    kw = _attention(batch, sq, cache, hkv, group, dim, lse=False)
    kw["cache_seqlens"] = torch.randint(0, cache + 1, (batch,), dtype=torch.int32)
    return kw


def _attention_bwd(batch, sq, sk, hkv, group, dim):
    fwd = _attention(batch, sq, sk, hkv, group, dim)
    return dict(grad_out=_randn(*fwd["q"].shape), q=fwd["q"], k=fwd["k"], v=fwd["v"], out=_randn(*fwd["q"].shape),
                lse=_randn(*fwd["lse"].shape), grad_q=_empty(*fwd["q"].shape), grad_k=_empty(*fwd["k"].shape),
                grad_v=_empty(*fwd["v"].shape))


def _ce(rows, classes, grad=True):
    kw = dict(logits=_randn(*rows, classes), target=torch.randint(0, classes, rows), loss=_empty(*rows),
              lse=_empty(*rows))
    if grad:
        kw.update(grad_logits=_empty(*rows, classes), grad_loss=_randn(*rows))
    return kw


def _ce_reduced(rows, classes):
    n = int(np.prod(rows))
    return dict(logits=_randn(*rows, classes), target=torch.randint(0, classes, rows), loss=_empty(reduced_size(n)),
                grad_logits=_empty(*rows, classes), grad_loss=_randn(*rows))


def _ce_bwd(rows, classes):
    return dict(grad_loss=_randn(*rows), logits=_randn(*rows, classes), target=torch.randint(0, classes, rows),
                lse=_randn(*rows), grad_logits=_empty(*rows, classes))


def _linear_ce(tokens, hidden, vocab):
    return dict(hidden=_randn(tokens, hidden), weight=_randn(vocab, hidden), target=torch.randint(0, vocab, (tokens,)),
                loss=_empty(tokens), bias=_randn(vocab), grad_hidden=_empty(tokens, hidden),
                grad_weight=_empty(vocab, hidden), grad_bias=_empty(vocab), grad_loss=_randn(tokens))


def _rows_shape(rng):
    return tuple(rng.randint(2, 5) for _ in range(rng.randint(1, 2))) + (rng.randint(2, 9),)


_NAN, _INF = float("nan"), float("inf")
_EPS = (-1e-6, _NAN, _INF, -_INF, 10**400, "1e-5", None, True, torch.tensor(1e-5))
_CE_SCALARS = dict(ignore_index=(True, 1.5, None, "-100", torch.tensor(-100), 2**63, -2**63 - 1, 10**30),
                   label_smoothing=(-0.1, 1.5, _NAN, _INF, 10**400, "0.1", True, None),
                   z_loss=(-1e-4, _NAN, _INF, 10**400, "0", None))
_ATTENTION_SCALARS = dict(causal=(1, None, "yes", np.bool_(True)),
                          scale=(_NAN, _INF, -_INF, 10**400, "0.1", True, torch.tensor(0.1)))
_ACTIVATION = dict(activation=("relu", None, 1, "SILU", ["silu"]))
_UNSQUEEZE = dict(unsqueeze_dim=(0, 3, -1, None, True, "1", 10**30))

# What a mutation may legitimately leave accepted, as (mutation, operand) pairs.
# GEMM's operands have dtypes of their own (mixed and integer GEMMs exist): kernels decide, and
# discovery refuses what none takes (test_dtypes_no_kernel_takes_are_refused_by_discovery).
_GEMM_DTYPES = frozenset((kind, name) for kind in ("int32", "float64") for name in ("A", "B", "out"))
# RMSNorm's weight may have a dtype of its own (f32 weights of bf16 activations).
_WEIGHT_DTYPES = frozenset((kind, "weight") for kind in ("int32", "float64"))


@dataclass(frozen=True)
class Case:
    """An arguments type: ``good(**sizes)`` builds the keyword arguments of a good call, ``draw``
    draws sizes (every dim at least 2, so a changed size is a wrong one), ``awkward`` are sizes of
    good calls with dims of 1 and 0, ``scalars`` the values each non-tensor parameter must refuse."""

    id: str
    cls: type
    good: Callable[..., dict]
    draw: Callable[[random.Random], dict]
    awkward: tuple[dict, ...] = ()
    scalars: dict[str, tuple] = field(default_factory=dict)
    allowed: frozenset = frozenset()


CASES = [
    Case("gemm", GemmArguments, _gemm,
         lambda r: dict(L=r.choice((None, r.randint(2, 4))), M=r.randint(2, 9), N=r.randint(2, 9), K=r.randint(2, 9)),
         awkward=(dict(L=None, M=1, N=1, K=1), dict(L=1, M=1, N=3, K=2), dict(L=None, M=0, N=4, K=3),
                  dict(L=None, M=3, N=4, K=0), dict(L=0, M=2, N=2, K=2), dict(L=2, M=3, N=0, K=2)),
         scalars=dict(accumulator_type=("nonsense", "i32", torch.int32, 5, [], _NAN, True),
                      epilogue=(3, "relu", object())),
         allowed=_GEMM_DTYPES),
    Case("softmax", SoftmaxArguments, _softmax, lambda r: dict(shape=_rows_shape(r)),
         awkward=(dict(shape=(1, 1)), dict(shape=(0, 8)), dict(shape=(5,)), dict(shape=(1,)), dict(shape=(3, 0)),
                  dict(shape=(2, 1, 7))),
         scalars=dict(dim=(0, -10, 10, 1.0, None, True, "-1", 10**30))),
    Case("softmax_backward", SoftmaxBackwardArguments, _softmax_bwd, lambda r: dict(shape=_rows_shape(r)),
         awkward=(dict(shape=(1, 1)), dict(shape=(0, 8)), dict(shape=(5,))),
         scalars=dict(dim=(0, -10, 1.0, None, True))),
    Case("rms_norm", RMSNormArguments, _norm, lambda r: dict(shape=_rows_shape(r)),
         awkward=(dict(shape=(1, 1)), dict(shape=(0, 8)), dict(shape=(8,)), dict(shape=(2, 1, 3)),
                  dict(shape=(4, 0))),
         scalars=dict(eps=_EPS), allowed=_WEIGHT_DTYPES),
    Case("rms_norm_residual", RMSNormArguments, lambda shape: _norm(shape, residual=True),
         lambda r: dict(shape=_rows_shape(r)), awkward=(dict(shape=(1, 1)), dict(shape=(0, 4))),
         scalars=dict(eps=_EPS), allowed=_WEIGHT_DTYPES),
    Case("layer_norm", LayerNormArguments, lambda shape: _norm(shape, layer=True), lambda r: dict(shape=_rows_shape(r)),
         awkward=(dict(shape=(1, 1)), dict(shape=(0, 8)), dict(shape=(8,))), scalars=dict(eps=_EPS)),
    Case("layer_norm_residual", LayerNormArguments, lambda shape: _norm(shape, layer=True, residual=True),
         lambda r: dict(shape=_rows_shape(r)), awkward=(dict(shape=(1, 1)),), scalars=dict(eps=_EPS)),
    Case("rms_norm_backward", RMSNormBackwardArguments, _norm_bwd, lambda r: dict(shape=_rows_shape(r)),
         awkward=(dict(shape=(1, 1)), dict(shape=(0, 8))), scalars=dict(eps=_EPS)),
    Case("layer_norm_backward", LayerNormBackwardArguments, lambda shape: _norm_bwd(shape, layer=True),
         lambda r: dict(shape=_rows_shape(r)), awkward=(dict(shape=(1, 1)), dict(shape=(0, 8))),
         scalars=dict(eps=_EPS)),
    Case("gated_activation", GatedActivationArguments, _gated, lambda r: dict(shape=_rows_shape(r)),
         awkward=(dict(shape=(1, 1)), dict(shape=(0, 4)), dict(shape=(5,)), dict(shape=(4, 0))), scalars=_ACTIVATION),
    Case("gated_activation_backward", GatedActivationBackwardArguments, _gated_bwd,
         lambda r: dict(shape=_rows_shape(r)), awkward=(dict(shape=(1, 1)), dict(shape=(0, 4))), scalars=_ACTIVATION),
    Case("rope", RopeArguments, _rope,
         lambda r: dict(batch=r.randint(3, 4), hq=r.randint(2, 4), hk=r.randint(2, 3), seq=r.randint(2, 6),
                        dim=2 * r.randint(1, 4), table_batch=r.choice((1, None))),
         awkward=(dict(batch=1, hq=1, hk=1, seq=1, dim=2), dict(batch=0, hq=2, hk=1, seq=3, dim=4),
                  dict(batch=2, hq=3, hk=1, seq=1, dim=2, table_batch=2), dict(batch=1, hq=2, hk=2, seq=0, dim=4)),
         scalars=_UNSQUEEZE),
    Case("rope_backward", RopeBackwardArguments, lambda **s: _rope(**s, backward=True),
         lambda r: dict(batch=r.randint(3, 4), hq=r.randint(2, 4), hk=r.randint(2, 3), seq=r.randint(2, 6),
                        dim=2 * r.randint(1, 4)),
         awkward=(dict(batch=1, hq=1, hk=1, seq=1, dim=2),), scalars=_UNSQUEEZE),
    Case("attention", AttentionArguments, _attention,
         lambda r: dict(batch=r.randint(2, 3), sq=r.randint(2, 6), sk=r.randint(2, 6), hkv=r.randint(2, 3),
                        group=r.randint(1, 2), dim=r.randint(2, 8)),
         awkward=(dict(batch=1, sq=1, sk=1, hkv=1, group=1, dim=1), dict(batch=0, sq=3, sk=3, hkv=1, group=2, dim=8),
                  dict(batch=2, sq=3, sk=0, hkv=2, group=1, dim=4), dict(batch=2, sq=0, sk=5, hkv=1, group=4, dim=4),
                  dict(batch=1, sq=4, sk=2, hkv=1, group=1, dim=4, lse=False)),
         scalars=dict(_ATTENTION_SCALARS, max_seqlen_q=(4,), max_seqlen_k=(4,))),
    Case("attention_varlen", AttentionArguments, _varlen,
         lambda r: dict(lengths_q=[r.randint(2, 5) for _ in range(r.randint(2, 3))], lengths_k=None,
                        hkv=r.randint(2, 3), group=r.randint(1, 2), dim=r.randint(2, 8)),
         awkward=(dict(lengths_q=[0, 3], lengths_k=[2, 0], hkv=1, group=1, dim=4),
                  dict(lengths_q=[1], lengths_k=[1], hkv=1, group=2, dim=2)),
         scalars=dict(_ATTENTION_SCALARS, max_seqlen_q=(-1, 1.5, True, "4", 1), max_seqlen_k=(-1, 1.5, 1))),
    Case("attention_cache", AttentionArguments, _cache,
         lambda r: dict(batch=r.randint(2, 3), sq=r.randint(2, 4), cache=r.randint(2, 8), hkv=r.randint(2, 3),
                        group=r.randint(1, 2), dim=r.randint(2, 8)),
         awkward=(dict(batch=1, sq=1, cache=1, hkv=1, group=1, dim=2),), scalars=_ATTENTION_SCALARS),
    Case("attention_backward", AttentionBackwardArguments, _attention_bwd,
         lambda r: dict(batch=r.randint(2, 3), sq=r.randint(2, 6), sk=r.randint(2, 6), hkv=r.randint(2, 3),
                        group=r.randint(1, 2), dim=r.randint(2, 8)),
         awkward=(dict(batch=1, sq=1, sk=1, hkv=1, group=1, dim=1), dict(batch=0, sq=2, sk=2, hkv=1, group=1, dim=4)),
         scalars=_ATTENTION_SCALARS),
    Case("cross_entropy", CrossEntropyArguments, _ce,
         lambda r: dict(rows=tuple(r.randint(2, 5) for _ in range(r.randint(1, 2))), classes=r.randint(2, 9)),
         awkward=(dict(rows=(0,), classes=5), dict(rows=(1,), classes=1), dict(rows=(), classes=7),
                  dict(rows=(2, 0), classes=3), dict(rows=(3,), classes=4, grad=False)),
         scalars=_CE_SCALARS),
    Case("cross_entropy_reduced", CrossEntropyReducedArguments, _ce_reduced,
         lambda r: dict(rows=tuple(r.randint(2, 5) for _ in range(r.randint(1, 2))), classes=r.randint(2, 9)),
         awkward=(dict(rows=(0,), classes=5), dict(rows=(1,), classes=1)),
         scalars=dict(_CE_SCALARS, reduction=("none", None, 1, "MEAN", []))),
    Case("cross_entropy_backward", CrossEntropyBackwardArguments, _ce_bwd,
         lambda r: dict(rows=tuple(r.randint(2, 5) for _ in range(r.randint(1, 2))), classes=r.randint(2, 9)),
         awkward=(dict(rows=(0,), classes=5), dict(rows=(1,), classes=1)), scalars=_CE_SCALARS),
    Case("linear_cross_entropy", LinearCrossEntropyArguments, _linear_ce,
         lambda r: dict(tokens=r.randint(2, 6), hidden=r.randint(2, 8), vocab=r.randint(2, 9)),
         awkward=(dict(tokens=0, hidden=4, vocab=5), dict(tokens=1, hidden=1, vocab=1), dict(tokens=3, hidden=0, vocab=2)),
         scalars=_CE_SCALARS),
]
_BY_ID = {case.id: case for case in CASES}


def _draws(case: Case) -> list[dict]:
    """The keyword arguments of ``DRAWS`` good calls, each from seeded sizes."""
    found = []
    for seed in range(DRAWS):
        rng = random.Random(f"{case.id}/{seed}")
        torch.manual_seed(seed)
        sizes = case.draw(rng)
        if case.id == "attention_varlen":
            sizes["lengths_k"] = [rng.randint(2, 5) for _ in sizes["lengths_q"]]
        if sizes.get("table_batch", 0) is None:
            sizes["table_batch"] = sizes["batch"]
        found.append(case.good(**sizes))
    return found


def _optional(cls: type) -> set[str]:
    """The parameters of ``cls`` that default to None (a tensor there may be left out)."""
    return {n for n, p in inspect.signature(cls.__init__).parameters.items() if p.default is None}


# ---- the mutations: operand -> replacements that must be refused ----

def _is_float(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point


def _grow(t: torch.Tensor, dim: int) -> torch.Tensor | None:
    if t.dim() == 0:
        return None
    shape = list(t.shape)
    shape[dim] += 1
    return torch.zeros(shape, dtype=t.dtype)


def _expanded(t: torch.Tensor) -> list[torch.Tensor]:
    """``t``'s shape and dtype with a stride 0 on its first dim longer than 1, and as one row
    broadcast over every leading dim (rows evenly spaced, 0 apart)."""
    found = []
    dim = next((d for d, n in enumerate(t.shape) if n > 1), None)
    if dim is not None:
        shape = list(t.shape)
        shape[dim] = 1
        found.append(torch.empty(shape, dtype=t.dtype).expand(t.shape))
    if t.dim() > 2 and t.shape[:-1].numel() > 1:  # (of 2 dims, the first variant)
        found.append(torch.empty(t.shape[-1], dtype=t.dtype).expand(t.shape))
    return found


# kind -> function of (tensor, is_optional) -> replacement (None: the mutation does not apply)
OPERAND_MUTATIONS: dict[str, Callable[[torch.Tensor, bool], Any]] = {
    "none": lambda t, optional: None if optional else _NONE,
    "list": lambda t, optional: t.tolist(),
    "numpy": lambda t, optional: t.numpy(),
    "float": lambda t, optional: 1.0,
    "bool": lambda t, optional: t.bool(),
    "complex": lambda t, optional: t.to(torch.complex64),
    "int32": lambda t, optional: t.to(torch.int32) if _is_float(t) else None,
    "float64": lambda t, optional: t.to(torch.float64) if _is_float(t) else None,
    "float32": lambda t, optional: None if _is_float(t) else t.to(F32),
    "int16": lambda t, optional: None if _is_float(t) else t.to(torch.int16),
    "meta": lambda t, optional: t.to("meta"),
    "lazy_negative": lambda t, optional: torch._neg_view(t),
    "unsqueeze": lambda t, optional: t.unsqueeze(0),
    "scalar": lambda t, optional: t.flatten()[0] if t.dim() and t.numel() else None,
    "grow_first": lambda t, optional: _grow(t, 0),
    "grow_last": lambda t, optional: _grow(t, -1),
}
_NONE = object()  # stands for None where None is a replacement
# Mutations after which the message must name the mutated operand itself (a shape that does not
# fit may be reported on the operand it disagrees with).
NAMES_THE_OPERAND = {"none", "list", "numpy", "float", "bool", "complex", "int32", "float64", "float32", "int16",
                     "meta", "lazy_negative"}


def _mutated_calls(case: Case, kind: str) -> list[tuple[str, dict]]:
    """(operand, keyword arguments) of every call with one operand replaced by ``kind``."""
    optional = _optional(case.cls)
    calls = []
    for kw in _draws(case):
        for name, t in kw.items():
            if not isinstance(t, torch.Tensor) or (kind, name) in case.allowed:
                continue
            if kind == "expanded" or kind == "overlapping":
                calls += [(name, c) for c in _output_mutations(case, kw, name, kind)]
                continue
            new = OPERAND_MUTATIONS[kind](t, name in optional)
            if new is None:
                continue
            calls.append((name, {**kw, name: None if new is _NONE else new}))
    return calls


def _output_mutations(case: Case, kw: dict, name: str, kind: str) -> list[dict]:
    """Calls whose output ``name`` is expanded (a stride 0), or whose output ``name`` overlaps
    another floating operand by all but one element."""
    if name not in case.cls(**kw).output_names:
        return []
    out = kw[name]
    if kind == "expanded":
        return [{**kw, name: new} for new in _expanded(out)]
    calls = []
    for other, t in kw.items():
        if other == name or not isinstance(t, torch.Tensor) or t.dtype != out.dtype or t.numel() < 2 or out.numel() < 1:
            continue
        buf = torch.randn(max(t.numel(), out.numel()) + 1, dtype=out.dtype)
        calls.append({**kw, other: buf[:t.numel()].view(t.shape), name: buf[1:1 + out.numel()].view(out.shape)})
    return calls


# ---- checking a refusal ----

_FIRST_WORDS = re.compile(r"^(?:epilogue )?(?:operand )?(\w+)[ :]")


def _refusal(cls: type, kw: dict) -> BaseException | None:
    """What construction (then `check_memory`, which every launch runs first) raises; None when
    both accept."""
    try:
        cls(**kw).check_memory()
    except Exception as exc:  # noqa: BLE001 - what is raised is what is judged
        return exc
    return None


def _fault(case: Case, kw: dict, names: set[str]) -> str | None:
    """Why the refusal of ``kw`` breaks the rule, or None when it is one clear line naming one of
    ``names`` (None there: any parameter of the type)."""
    exc = _refusal(case.cls, kw)
    if exc is None:
        return "accepted"
    if not isinstance(exc, (TypeError, ValueError, KernelApiError)):
        return f"{type(exc).__name__}: {exc}"
    text = str(exc)
    if "\n" in text or not text.strip():
        return f"{type(exc).__name__} not one line: {text!r}"
    first = _FIRST_WORDS.match(text)
    params = set(inspect.signature(case.cls.__init__).parameters)
    if first is None or first.group(1) not in params:
        return f"{type(exc).__name__} does not start by naming an operand or parameter: {text!r}"
    if not any(re.search(rf"\b{re.escape(n)}\b", text) for n in names):
        return f"{type(exc).__name__} does not name {sorted(names)}: {text!r}"
    return None


def _report(faults: list[str]) -> str:
    return f"{len(faults)} fault(s):\n" + "\n".join(faults[:25])


# ---- the tests ----

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_good_inputs_are_accepted(case):
    """The drawn sizes and the awkward ones (dims of 1, empty batches) build arguments."""
    for kw in _draws(case) + [case.good(**sizes) for sizes in case.awkward]:
        assert _refusal(case.cls, kw) is None, {k: getattr(v, "shape", v) for k, v in kw.items()}


@pytest.mark.parametrize("kind", [*OPERAND_MUTATIONS, "expanded", "overlapping"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_operands_are_one_line_naming_the_operand(case, kind):
    faults = []
    for name, kw in _mutated_calls(case, kind):
        fault = _fault(case, kw, {name} if kind in NAMES_THE_OPERAND else
                       {n for n, v in kw.items() if isinstance(v, torch.Tensor)})
        if fault is not None:
            faults.append(f"{case.id} {kind} {name}: {fault}")
    assert not faults, _report(faults)


@pytest.mark.parametrize("case", [c for c in CASES if c.scalars], ids=lambda c: c.id)
def test_bad_scalars_are_one_line_naming_the_parameter(case):
    faults = []
    kw = _draws(case)[0]
    for param, values in case.scalars.items():
        for value in values:
            fault = _fault(case, {**kw, param: value}, {param})
            if fault is not None:
                faults.append(f"{case.id} {param}={value!r}: {fault}")
    assert not faults, _report(faults)


def test_lazy_bits_are_refused_on_meta_tensors_and_conjugate_views():
    """The lazy negative bit on meta tensors (no memory, as torch.compile traces), and the
    conjugate bit's real views (``c.conj().imag``): kernels read memory without the bit."""
    meta = dict(device="meta", dtype=F32)
    q = torch.empty(2, 3, 4, 8, **meta)
    with pytest.raises(ValueError, match=r"^operand lse: has torch's lazy negative bit"):
        AttentionArguments(q, q, q, torch.empty_like(q), torch._neg_view(torch.empty(2, 4, 3, **meta)))
    conj_imag = torch.randn(4, dtype=torch.complex64).conj().imag
    assert conj_imag.is_neg()
    with pytest.raises(ValueError, match=r"^operand grad_loss: has torch's lazy negative bit"):
        CrossEntropyBackwardArguments(conj_imag, _randn(4, 3), torch.zeros(4, dtype=torch.long), _randn(4), _empty(4, 3))
    with pytest.raises(TypeError, match=r"^operand x: dtype torch.complex64 is not supported"):
        SoftmaxArguments(torch.randn(4, dtype=torch.complex64).conj(), torch.empty(4, dtype=torch.complex64))
    # off the CPU the offsets' values are never read: only the bit says they are not what kernels see
    cu = torch._neg_view(torch.tensor([0, 3], dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match=r"^operand cu_seqlens_q: has torch's lazy negative bit"):
        AttentionArguments(torch.empty(3, 4, 8, **meta), torch.empty(3, 4, 8, **meta), torch.empty(3, 4, 8, **meta),
                           torch.empty(3, 4, 8, **meta), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=3,
                           max_seqlen_k=3)


def test_offsets_kernels_read_by_pointer_must_be_contiguous():
    """Kernels take the sequence offsets' pointer and read consecutive int32s: a strided view
    would be read as other values."""
    kw = _varlen([2, 3], [3, 1], 1, 1, 4)
    strided = torch.zeros(6, dtype=torch.int32)[::2]
    strided.copy_(kw["cu_seqlens_q"])
    with pytest.raises(ValueError, match=r"^operand cu_seqlens_q: must be contiguous, got stride 2$"):
        AttentionArguments(**{**kw, "cu_seqlens_q": strided})


def test_varlen_off_the_cpu_needs_the_longest_lengths():
    meta = dict(device="meta", dtype=F32)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device="meta")
    t = torch.empty(5, 2, 4, **meta)
    for missing in ("max_seqlen_q", "max_seqlen_k"):
        given = {k: 3 for k in ("max_seqlen_q", "max_seqlen_k") if k != missing}
        with pytest.raises(ValueError, match=rf"^{missing}: required with cu_seqlens_"):
            AttentionArguments(t, t, t, torch.empty_like(t), cu_seqlens_q=cu, cu_seqlens_k=cu, **given)


@pytest.mark.parametrize("value, error", [
    (_NAN, ValueError), (_INF, ValueError), (-_INF, ValueError), (10**400, ValueError), ("0.5", TypeError),
    (True, TypeError), (None, TypeError), (torch.tensor(0.5), TypeError)])
@pytest.mark.parametrize("label", ["alpha", "beta"])
def test_epilogue_scalars_are_finite_numbers(label, value, error):
    kw = dict(C=_randn(3, 5)) if label == "beta" else {}
    with pytest.raises(error, match=rf"^epilogue {label}: expected a (finite )?number") as info:
        GemmArguments(_randn(3, 4), _randn(4, 5), _empty(3, 5), epilogue=EpilogueArguments(**{label: value}, **kw))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("epilogue, message", [
    (lambda: EpilogueArguments(bias=[1.0]), r"^operand bias: expected a torch.Tensor"),
    (lambda: EpilogueArguments(bias=torch.tensor(1.0)), r"^epilogue operand bias: shape \(\) fits neither"),
    (lambda: EpilogueArguments(bias=torch.ones(5, dtype=torch.bool)), r"^epilogue operand bias: dtype torch.bool"),
    (lambda: EpilogueArguments(bias=torch._neg_view(_randn(5))), r"^operand bias: has torch's lazy"),
    (lambda: EpilogueArguments(bias=_randn(5).to("meta")), r"^epilogue operand bias: on meta"),
    (lambda: EpilogueArguments(bias=_randn(10)[::2]), r"^epilogue operand bias: elements must be contiguous"),
    (lambda: EpilogueArguments(beta=1.0, C=_randn(3, 4)), r"^epilogue operand C: shape \(3, 4\)"),
    (lambda: EpilogueArguments(beta=1.0, C=_randn(3, 5).double()), r"^epilogue operand C: dtype torch.float64"),
    (lambda: EpilogueArguments(beta=1.0, C=torch._neg_view(_randn(3, 5))), r"^operand C: has torch's lazy"),
    (lambda: EpilogueArguments(beta=1.0, C=[[1.0]]), r"^operand C: expected a torch.Tensor"),
    (lambda: EpilogueArguments(beta=1.0), r"^epilogue: beta=1.0 needs a C operand"),
    (lambda: EpilogueArguments(activation="tanh"), r"^epilogue activation: unknown 'tanh'"),
    (lambda: EpilogueArguments(activation=3), r"^epilogue activation: unknown 3"),
    (lambda: EpilogueArguments(foo=1), r"^epilogue: unexpected operand 'foo'"),
])
def test_bad_epilogue_operands_are_one_line(epilogue, message):
    with pytest.raises((TypeError, ValueError)) as info:
        GemmArguments(_randn(3, 4), _randn(4, 5), _empty(3, 5), epilogue=epilogue())
    assert re.search(message, str(info.value)) and "\n" not in str(info.value), str(info.value)


def test_in_place_where_the_type_allows_it_stays_accepted():
    """One view written in place over its input (each element read before it is written); a
    shifted view of the same memory is refused."""
    x = _randn(4, 8)
    SoftmaxArguments(x, x).check_memory()
    SoftmaxBackwardArguments(x, _randn(4, 8), x).check_memory()
    q = _randn(2, 3, 2, 4)
    AttentionArguments(q, _randn(2, 3, 2, 4), _randn(2, 3, 2, 4), q).check_memory()
    kw = _ce((4,), 6)
    CrossEntropyArguments(**{**kw, "grad_logits": kw["logits"]}).check_memory()
    buf = _randn(5, 8)
    with pytest.raises(ValueError, match=r"^operand out: overlaps x in memory but is not x itself"):
        SoftmaxArguments(buf[:4], buf[1:]).check_memory()
    with pytest.raises(ValueError, match=r"^operand grad_in: overlaps out in memory but is not out itself"):
        SoftmaxBackwardArguments(_randn(4, 8), buf[1:], buf[:4]).check_memory()


@pytest.mark.parametrize("call", [
    lambda: ops.softmax(_randn(4, 8).int()),
    lambda: ops.softmax(_randn(4, 8).to(torch.float8_e4m3fn)),
    lambda: ops.rms_norm(_randn(4, 8), torch.ones(8, dtype=torch.int32)),
    lambda: ops.layer_norm(_randn(4, 8).int(), torch.ones(8, dtype=torch.int32), torch.ones(8, dtype=torch.int32)),
    lambda: ops.gemm(_randn(4, 6).int(), _randn(6, 5)),
    lambda: ops.gemm(_randn(4, 6), _randn(6, 5), out=torch.empty(4, 5, dtype=torch.float64)),
    lambda: ops.swiglu(_randn(4, 8).int(), _randn(4, 8).int()),
    lambda: ops.rope(_randn(1, 2, 3, 4), _randn(1, 2, 3, 4), torch.ones(1, 3, 4, dtype=torch.int32),
                     torch.ones(1, 3, 4, dtype=torch.int32)),
    lambda: ops.attention(*(_randn(1, 3, 2, 4).int() for _ in range(3))),
], ids=["softmax_int", "softmax_fp8", "rms_norm_int_weight", "layer_norm_int", "gemm_int_A", "gemm_f64_out",
        "swiglu_int", "rope_int_tables", "attention_int"])
def test_dtypes_no_kernel_takes_are_refused_by_discovery(cpu_ops, call):
    """Arguments leave dtypes to kernels (mixed GEMMs, f32 weights); what no kernel takes is a
    KernelApiError whose first line names the problem, never torch's error from inside a kernel."""
    with pytest.raises(KernelApiError) as info:
        call()
    assert re.match(r"no kernel supports \w+Arguments\(", str(info.value)), str(info.value)


@pytest.mark.parametrize("make", [lambda t: t.to_sparse(), lambda t: t.to_sparse_csr(),
                                  lambda t: torch.nested.nested_tensor([t[0], t[1, :3]])],
                         ids=["sparse_coo", "sparse_csr", "nested"])
def test_sparse_and_nested_operands_are_refused_by_name(make):
    """Kernels read dense memory through strides: a sparse or nested operand is refused in one
    line naming it, not with torch's error about its missing strides or sizes."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch warns that sparse CSR and nested tensors are in beta)
        x = make(torch.randn(4, 8))
    dense = torch.randn(4, 8)
    for build, name in ((lambda: GemmArguments(x, torch.randn(8, 8), torch.empty(4, 8)), "A"),
                        (lambda: GemmArguments(dense, torch.randn(8, 8), x), "out"),
                        (lambda: SoftmaxArguments(x, torch.empty(4, 8)), "x"),
                        (lambda: RMSNormArguments(x, torch.randn(8), torch.empty(4, 8)), "x")):
        with pytest.raises(TypeError, match=rf"^operand {name}: a (sparse_coo|sparse_csr|nested) tensor;"):
            build()


def test_epilogue_function_numbers_are_finite():
    """An epilogue function's scalar operands and literals are finite floats: NaN, infinity and
    integers past the float range are refused naming the operand or the literal's line."""
    from kernel_api.epilogue.errors import EpilogueError

    def scaled(accum, alpha):
        D = accum * alpha
        return D

    def huge_literal(accum):
        D = accum * 1e400
        return D

    A, B, out = torch.randn(4, 8), torch.randn(8, 8), torch.empty(4, 8)
    for alpha in (float("nan"), float("inf"), 10**400):
        with pytest.raises(EpilogueError, match=r"^operand alpha: expected a finite number"):
            GemmArguments(A, B, out, epilogue=EpilogueArguments(scaled, alpha=alpha))
    with pytest.raises(EpilogueError, match="a literal outside the finite float range"):
        GemmArguments(A, B, out, epilogue=EpilogueArguments(huge_literal))
    GemmArguments(A, B, out, epilogue=EpilogueArguments(scaled, alpha=1e30))
