"""``gemm(A, B, epilogue=fn, **operands)``: a GEMM with an epilogue function fused into it.

`gemm_with_epilogue` is what `kernel_api.ops.gemm` runs when it is given ``epilogue``: eager
calls build `EpilogueArguments(fn, **operands)` and go through `dispatch.call` (the policy
chooses among the kernels whose metadata fuses every node; `explain` names the node others
cannot). Under ``torch.compile``, a dispatch mode or autograd the call goes to the torch op

    torch.ops.kernel_api.gemm_epilogue(A, B, source, names, tensors, scalar_names, scalars, outputs)

whose ``source`` (the function's text) is a constant of the graph: two calls of one function
differing in scalar values trace to one graph and run one compiled kernel. Extra outputs are
mutated in place (``outputs``, in the order the function returns them after ``D``); the op
returns ``D``. The op has a fake implementation, so ``fullgraph=True`` traces it; it has no
backward (a gradient through an epilogue function is not provided).
"""

from __future__ import annotations

from typing import Any

import torch

from ..arguments import EpilogueArguments, GemmArguments
from ..core import tracing
from . import dispatch

_lib = torch.library.Library("kernel_api", "FRAGMENT")
_lib.define("gemm_epilogue(Tensor A, Tensor B, str source, str[] names, Tensor[] tensors, str[] scalar_names, "
            "float[] scalars, Tensor(a!)[] outputs) -> Tensor")


def _new_output(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    return A.new_empty((*A.shape[:-1], B.shape[-1]))


def _values(names: list, tensors: list, scalar_names: list, scalars: list, outputs: list,
            output_names: tuple) -> dict:
    values = dict(zip(names, tensors))
    values.update(zip(scalar_names, scalars))
    values.update(zip(output_names, outputs))
    return values


def _run(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None, epilogue: EpilogueArguments,
         accumulator_type: Any, stream: Any) -> torch.Tensor:
    if out is None:
        out = _new_output(A, B)
    args = GemmArguments(A, B, out, accumulator_type=accumulator_type, epilogue=epilogue)
    dispatch.call(args, stream=stream)
    for t in args.epilogue.bound.outputs.values():  # written in place, as a torch in-place op would be
        torch.autograd.graph.increment_version(t)
    return out


def _op_impl(A, B, source, names, tensors, scalar_names, scalars, outputs):
    from ..epilogue import parse_cached

    graph = parse_cached(source)
    extra = tuple(n for n, _ in graph.outputs if n != "D")
    epilogue = EpilogueArguments(source, **_values(names, tensors, scalar_names, scalars, outputs, extra))
    return _run(A, B, None, epilogue, None, None)


def _op_fake(A, B, source, names, tensors, scalar_names, scalars, outputs):
    return _new_output(A, B)


_lib.impl("gemm_epilogue", _op_impl, "CompositeExplicitAutograd")
torch.library.register_fake("kernel_api::gemm_epilogue", _op_fake, lib=_lib)


@tracing.assume_constant_result
def _source_and_outputs(fn: Any) -> tuple:
    """(source text, names of the extra outputs) of an epilogue function: constants of a trace."""
    from ..epilogue import parse_cached, source_of

    graph = parse_cached(fn)
    source = source_of(fn)[0] if not isinstance(fn, str) else fn
    return source, tuple(n for n, _ in graph.outputs if n != "D")


_NAMED_DEFAULTS = {"alpha": 1.0, "beta": 0.0, "C": None, "bias": None}


def gemm_with_epilogue(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None, epilogue: Any,
                       operands: dict, accumulator_type: Any = None, stream: Any = None,
                       named: dict | None = None) -> torch.Tensor:
    """``D`` of ``epilogue`` (a function, its source string, or a function-form
    `EpilogueArguments`) applied to ``A @ B``, fused into the GEMM; extra outputs are written
    into the tensors ``operands`` names. ``named``: gemm's own ``alpha``, ``beta``, ``C`` and
    ``bias``, which bind to the function's parameters of those names (gemm takes them before
    ``**operands`` does); given to a function without such a parameter, they are an error.
    Returns ``out`` (a new tensor when None)."""
    if named:
        from ..epilogue import parse_cached

        fn_params = parse_cached(epilogue.function if isinstance(epilogue, EpilogueArguments) else epilogue).params
        operands = dict(operands)
        for name, value in named.items():
            if name in fn_params:
                if value is not None:
                    operands.setdefault(name, value)
            elif value is not _NAMED_DEFAULTS.get(name) and value != _NAMED_DEFAULTS.get(name):
                raise TypeError(f"gemm: {name}= given, but the epilogue function has no parameter {name}")
    if isinstance(epilogue, EpilogueArguments):
        if not epilogue.is_function:
            raise TypeError("epilogue: give a function, its source string, or EpilogueArguments(fn, **operands); "
                            "the named form is gemm's alpha=, beta=, C=, bias=, activation=")
        if operands:
            raise TypeError(f"epilogue: operand {next(iter(operands))!r} given beside EpilogueArguments, which holds "
                            f"its operands")
        fn, operands = epilogue.function, epilogue.operands
    else:
        fn = epilogue
    if tracing.is_compiling() or tracing.dispatch_mode_depth() or (
            torch.is_grad_enabled() and (A.requires_grad or B.requires_grad or any(
                isinstance(v, torch.Tensor) and v.requires_grad for v in operands.values()))):
        if accumulator_type is not None:
            raise ValueError("accumulator_type: not supported under torch.compile, autograd or a torch dispatch mode")
        source, extra = _source_and_outputs(fn)
        names = [k for k, v in operands.items() if isinstance(v, torch.Tensor) and k not in extra and k != "D"]
        scalar_names = [k for k, v in operands.items() if not isinstance(v, torch.Tensor)]
        outputs = [operands[k] for k in extra]
        result = dispatch.op_on_stream(torch.ops.kernel_api.gemm_epilogue, stream, A, B, source, names,
                                       [operands[k] for k in names], scalar_names,
                                       [float(operands[k]) for k in scalar_names], outputs)
        return result if out is None else out.copy_(result)
    if not isinstance(epilogue, EpilogueArguments) or named:
        epilogue = EpilogueArguments(fn, **operands)
    return _run(A, B, out, epilogue, accumulator_type, stream)
