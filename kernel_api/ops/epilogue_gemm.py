"""``gemm(A, B, epilogue=fn, **operands)``: a GEMM with an epilogue function fused into it.

`gemm_with_epilogue` is what `kernel_api.ops.gemm` runs when it is given ``epilogue``: eager
calls build `EpilogueArguments(fn, **operands)` and go through `dispatch.call` (the policy
chooses among the kernels whose metadata fuses every node; `explain` names the node others
cannot). Under ``torch.compile``, a dispatch mode or autograd the call goes to the torch op

    torch.ops.kernel_api.gemm_epilogue(A, B, source, names, tensors, scalar_names, scalars, initial)

whose ``source`` (the function's text as hexadecimal UTF-8, `_op_text`: Inductor's generated
wrapper writes a str argument into its Python source, where a line break of the function's text
broke it) is a constant of the graph: two calls of one function
differing in scalar values trace to one graph and run one compiled kernel. The op is functional:
it returns ``[D, *extra outputs]`` as new tensors (``initial``: the caller's extra outputs, in
return order, whose values a reduction starts from), which the caller's tensors then receive by
a copy. It has a fake implementation, so ``fullgraph=True`` traces it, and a backward that
recomputes the accumulator and differentiates the epilogue with torch (`_backward`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from ..arguments import EpilogueArguments, GemmArguments
from ..core import tracing
from . import dispatch

_lib = torch.library.Library("kernel_api", "FRAGMENT")
_lib.define("gemm_epilogue(Tensor A, Tensor B, str source, str[] names, Tensor[] tensors, str[] scalar_names, "
            "float[] scalars, Tensor[] initial) -> Tensor[]")


@functools.lru_cache(maxsize=256)
def _op_text(source: str) -> str:
    """An epilogue function's text as the op's ``source`` argument: hexadecimal UTF-8, which no
    quoting of generated code can break."""
    return source.encode().hex()


@functools.lru_cache(maxsize=256)
def _op_source(text: str) -> str:
    """The function's text from the op's ``source`` argument (`_op_text`)."""
    return bytes.fromhex(text).decode()


def _new_output(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    return A.new_empty((*A.shape[:-1], B.shape[-1]))


def _run(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None, epilogue: EpilogueArguments,
         accumulator_type: Any, stream: Any, record: tuple | None = None) -> torch.Tensor:
    """The Python path: arguments, the policy's choice, the launch; with ``record`` (a
    `_recorded` key, for a call whose outputs it made itself) the launch is kept for later calls
    of that key."""
    if out is None:
        out = _new_output(A, B)
    args = GemmArguments(A, B, out, accumulator_type=accumulator_type, epilogue=epilogue)
    if record is None:
        dispatch.call(args, stream=stream)
    else:
        kernel, artifact = dispatch.launch(args, stream)
        _record(record, kernel, artifact, args, A, B, out)
    for t in args.epilogue.bound.outputs.values():  # written in place, as a torch in-place op would be
        torch.autograd.graph.increment_version(t)
    return out


class _Recorded(NamedTuple):
    """A launch kept for repeated calls: ``function(A, B, out, *head, operands, stream)``."""

    function: Any
    head: tuple      # the launcher's constants before the bound operands
    sources: tuple   # how the operands are made from a call's values (`operand_sources`)
    token: Any       # the policy scope the choice was made in (kept alive: its id is in the key)


#: Repeated calls of an epilogue function whose tensors have one metadata, under one policy:
#: launched from here without arguments, binding or the dispatcher (about 150 us of Python a call
#: on an H200 host, which a compiled graph calling the op for every projection pays in full).
#: Only for calls whose outputs (D and every extra output) are tensors made for the call, so no
#: output can meet an input. Cleared with the front door's choices.
_recorded: dict[tuple, _Recorded] = {}
_PLAIN = dispatch._PLAIN  # (tensor types served: a model's weights are Parameters)
_RECORDED_LIMIT = 1024
dispatch.choice_caches.append(_recorded.clear)


def _metadata(value: Any) -> Any:
    """What a recorded launch depends on in one operand (`_raw_gemm_key`'s fields for a tensor)."""
    if type(value) in _PLAIN:
        return (value.dtype, value.shape, value.stride(), value.data_ptr() & 1023, value.get_device(),
                value.is_neg() or value.is_conj())
    return type(value)


def _record_key(op_text: str, A: Any, B: Any, out: torch.Tensor, values: dict) -> tuple | None:
    """`_recorded`'s key for a call, or None when the call is not one it serves (not plain CUDA
    tensors, under tracing or a dispatch mode)."""
    if type(A) not in _PLAIN or type(B) not in _PLAIN or not A.is_cuda or tracing.dispatch_mode_depth():
        return None
    for v in values.values():
        if isinstance(v, torch.Tensor) and type(v) not in _PLAIN:
            return None
    tf32 = dispatch._tf32_allowed() if A.dtype is torch.float32 else None
    return (op_text, id(dispatch.current().scope_token), _metadata(A), _metadata(B), _metadata(out), tf32,
            tuple([(name, _metadata(v)) for name, v in values.items()]))


def _record(key: tuple, kernel: Any, artifact: Any, args: GemmArguments, A: torch.Tensor, B: torch.Tensor,
            out: torch.Tensor) -> None:
    """Keep the launch of ``args`` under ``key`` when the kernel offers one that ends with the
    bound operands (`function_epilogue_launcher`) and the arguments kept the caller's tensors."""
    bound = args.epilogue.bound
    if args.A is not A or args.B is not B or args.out is not out:
        return
    launcher = kernel._launcher(args, artifact)
    if launcher is None or not launcher.tail or launcher.tail[-1] is not bound.operands:
        return
    from ..epilogue import operand_sources

    if len(_recorded) >= _RECORDED_LIMIT:
        _recorded.clear()
    _recorded[key] = _Recorded(launcher.function, launcher.tail[:-1], operand_sources(bound),
                               dispatch.current().scope_token)


def _launch_recorded(key: tuple, A: torch.Tensor, B: torch.Tensor, out: torch.Tensor, values: dict) -> bool:
    """Launch the call keyed ``key`` as recorded; False when nothing is recorded for it (or its
    device is not the current one)."""
    found = _recorded.get(key)
    if found is None or A.get_device() != dispatch._current_device():
        return False
    from ..epilogue import remake_operands

    found.function(A, B, out, *found.head, remake_operands(found.sources, values), dispatch.to_cuda_stream(None))
    return True


def _extra_outputs(graph: Any) -> list[tuple[str, bool]]:
    """(name, is a reduction) of each output after ``D``, in return order."""
    return [(n, graph.nodes[i].kind == "reduce") for n, i in graph.outputs if n != "D"]


def _op_impl(A, B, source, names, tensors, scalar_names, scalars, initial):
    """The functional op: extra outputs are new tensors (a reduction's starts from its
    ``initial`` value, a store's takes only its shape and type from it); returns [D, *extra]."""
    from ..epilogue import parse_cached

    text = source
    source = _op_source(text)
    graph = parse_cached(source)
    extra = _extra_outputs(graph)
    made = [t.clone() if reduced else torch.empty_like(t) for (_, reduced), t in zip(extra, initial)]
    values = dict(zip(names, tensors))
    values.update(zip(scalar_names, scalars))
    values.update((name, t) for (name, _), t in zip(extra, made))
    D = _new_output(A, B)
    key = _record_key(text, A, B, D, values)
    if key is None or not _launch_recorded(key, A, B, D, values):
        _run(A, B, D, EpilogueArguments(source, **values), None, None, key)
    return [D, *made]


def _op_fake(A, B, source, names, tensors, scalar_names, scalars, initial):
    return [_new_output(A, B), *(torch.empty_like(t) for t in initial)]


_lib.impl("gemm_epilogue", _op_impl, "CompositeExplicitAutograd")
torch.library.register_fake("kernel_api::gemm_epilogue", _op_fake, lib=_lib)


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    A, B, source, names, tensors, scalar_names, scalars, initial = inputs
    ctx.save_for_backward(A, B, *tensors)
    ctx.source, ctx.names, ctx.scalars = _op_source(source), list(names), dict(zip(scalar_names, scalars))
    ctx.n_initial, ctx.n_scalars = len(initial), len(scalars)


def _backward(ctx: Any, grads: list) -> tuple:
    """Recompute the accumulator (a GEMM through the registry, in f32, or f64 for f64
    operands) where the gradients depend on its value (`kernel_api.epilogue.needs_accumulator`;
    an epilogue affine in it, such as a residual or bias add, skips it), differentiate the
    epilogue with torch (`kernel_api.epilogue.evaluate`) for the gradients of the accumulator
    and the tensor operands, then two GEMMs for A and B. Reductions are not differentiated."""
    from ..epilogue import evaluate, needs_accumulator, parse_cached

    A, B, *tensors = ctx.saved_tensors
    graph = parse_cached(ctx.source)
    extra = _extra_outputs(graph)
    math = torch.float64 if A.dtype == torch.float64 else torch.float32
    shape = (*A.shape[:-1], B.shape[-1])
    with torch.enable_grad():
        if needs_accumulator(graph, [n for n, t in zip(ctx.names, tensors) if t.requires_grad]):
            acc = dispatch.gemm(A.detach(), B.detach(), out=A.new_empty(shape, dtype=math)).requires_grad_(True)
        else:  # (any value gives the same gradients: a zero, broadcast, in no memory)
            acc = A.new_zeros((), dtype=math).requires_grad_(True).expand(shape)
        operands = {n: t.detach().to(math).requires_grad_(t.requires_grad) for n, t in zip(ctx.names, tensors)}
        operands.update(ctx.scalars)
        values = evaluate(graph, acc, operands, dtype=math)
        outs, outs_grad = [], []
        for i, name in enumerate(["D"] + [n for n, _ in extra]):
            reduced = i > 0 and extra[i - 1][1]
            if grads[i] is not None and not reduced:
                outs.append(values[name])
                outs_grad.append(grads[i].to(math))
        wanted = [acc] + [operands[n] for n in ctx.names if operands[n].requires_grad]
        found = (torch.autograd.grad(outs, wanted, outs_grad, allow_unused=True) if outs
                 else (None,) * len(wanted))
    grad_acc = torch.zeros_like(acc) if found[0] is None else found[0]
    grad_acc = grad_acc.to(A.dtype)
    grad_A = dispatch.gemm(grad_acc, B.detach().transpose(-1, -2)) if A.requires_grad else None
    grad_B = dispatch.gemm(A.detach().transpose(-1, -2), grad_acc) if B.requires_grad else None
    rest = iter(found[1:])
    grad_tensors = []
    for t in tensors:
        g = next(rest) if t.requires_grad else None
        grad_tensors.append(None if g is None else g.to(t.dtype))
    # (torch's autograd checks the structure: a list of non-tensors takes None, an empty list [])
    names, scalars = ([] if not ctx.names else None), ([] if not ctx.n_scalars else None)
    return grad_A, grad_B, None, names, grad_tensors, scalars, scalars, [None] * ctx.n_initial


torch.library.register_autograd("kernel_api::gemm_epilogue", _backward, setup_context=_setup, lib=_lib)


@tracing.assume_constant_result
def _function_info(fn: Any) -> tuple:
    """(source text as the op's argument (`_op_text`), names of the extra outputs, parameter
    names) of an epilogue function: constants of a trace (Dynamo calls this while tracing and
    keeps the result)."""
    from ..epilogue import parse_cached, source_of

    graph = parse_cached(fn)
    source = source_of(fn)[0] if not isinstance(fn, str) else fn
    return _op_text(source), tuple(n for n, _ in graph.outputs if n != "D"), graph.params


#: gemm's own keywords that bind to an epilogue function's parameters of those names.
_NAMED = ("alpha", "beta", "C", "bias")


def gemm_with_epilogue(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None, epilogue: Any,
                       operands: dict, accumulator_type: Any = None, stream: Any = None,
                       named: dict | None = None) -> torch.Tensor:
    """``D`` of ``epilogue`` (a function, its source string, or a function-form
    `EpilogueArguments`) applied to ``A @ B``, fused into the GEMM; extra outputs are written
    into the tensors ``operands`` names. ``named``: gemm's own ``alpha``, ``beta``, ``C`` and
    ``bias``, which bind to the function's parameters of those names (gemm takes them before
    ``**operands`` does); given (not None, alpha not 1, beta not 0) to a function without such
    a parameter, they are an error. Returns ``out`` (a new tensor when None)."""
    given = isinstance(epilogue, EpilogueArguments)
    if given:
        if not epilogue.is_function:
            raise TypeError("epilogue: give a function, its source string, or EpilogueArguments(fn, **operands); "
                            "the named form is gemm's alpha=, beta=, C=, bias=, activation=")
        if operands:
            raise TypeError(f"epilogue: operand {next(iter(operands))!r} given beside EpilogueArguments, which holds "
                            f"its operands")
        fn, operands = epilogue.function, epilogue.operands
    else:
        fn = epilogue
    op_text, extra, params = _function_info(fn)
    if out is None and isinstance(operands.get("D"), torch.Tensor):  # (the peer's spelling of out)
        out = operands["D"]
    if named:
        operands = dict(operands)
        for name in _NAMED:
            value = named.get(name)
            if name in params:
                if value is not None and name not in operands:
                    operands[name] = value
            elif (value is not None if name in ("C", "bias") else value != (1.0 if name == "alpha" else 0.0)):
                raise TypeError(f"gemm: {name}= given, but the epilogue function has no parameter {name}")
    if tracing.is_compiling() or tracing.dispatch_mode_depth() or (
            torch.is_grad_enabled() and (A.requires_grad or B.requires_grad or any(
                isinstance(v, torch.Tensor) and v.requires_grad for v in operands.values()))):
        if accumulator_type is not None:
            raise ValueError("accumulator_type: not supported under torch.compile, autograd or a torch dispatch mode")
        names = [k for k, v in operands.items() if isinstance(v, torch.Tensor) and k not in extra and k != "D"]
        scalar_names = [k for k, v in operands.items() if not isinstance(v, torch.Tensor) and k != "D"]
        results = dispatch.op_on_stream(torch.ops.kernel_api.gemm_epilogue, stream, A, B, op_text, names,
                                        [operands[k] for k in names], scalar_names,
                                        [float(operands[k]) for k in scalar_names], [operands[k] for k in extra])
        for k, made in zip(extra, results[1:]):  # the caller's extra outputs, written as in eager calls
            operands[k].copy_(made)
        return results[0] if out is None else out.copy_(results[0])
    key = None
    if out is None and not extra and accumulator_type is None and stream is None:
        # (the output is made here and there is no extra one: a recorded launch may serve it)
        out = _new_output(A, B)
        key = _record_key(op_text, A, B, out, operands)
        if key is not None and _launch_recorded(key, A, B, out, operands):
            return out
    if not given or named:
        epilogue = EpilogueArguments(fn, **operands)
    return _run(A, B, out, epilogue, accumulator_type, stream, key)


def traced_gemm(A: torch.Tensor, B: torch.Tensor, epilogue: Any, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Under Dynamo: ``D`` of ``epilogue`` (a function or its source string, with no output but
    ``D`` and no scalar parameter) applied to ``A @ B``, its tensor operands ``tensors`` by name:
    the op call `gemm_with_epilogue` makes for such a call, without the argument handling that
    Dynamo would trace at every call (a few milliseconds of a compile each)."""
    op_text = _function_info(epilogue)[0]
    return torch.ops.kernel_api.gemm_epilogue(A, B, op_text, list(tensors), list(tensors.values()), [], [], [])[0]


dispatch._epilogue_functions["gemm"] = gemm_with_epilogue
