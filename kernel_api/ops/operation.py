"""One description per operation, and what kernel_api generates from it.

An `Operation` says what an operation's torch op looks like (its qualified name and schema),
how its inputs become the operation's `Arguments`, which argument fields are its outputs, what
those outputs look like given the inputs' metadata (the fake implementation), and, optionally,
its backward, written with other ops. `define_operation` turns it into:

- the ``torch.library`` op ``torch.ops.<namespace>.<name>``: an implementation that allocates
  the outputs (with the fake implementation, on real tensors), builds the arguments and runs
  them through `kernel_api.ops.call`; the fake implementation; an Autograd kernel that runs the
  backward (or, without one, refuses to differentiate);
- a Python function: eager calls build the arguments and go to `ops.call`; under
  ``torch.compile``, ``make_fx``, any torch dispatch mode or autograd, and for meta tensors,
  they go to the torch op, so graph tools and autograd see it.

Both eager paths (the function, and the torch op's implementation, which autograd's forward and
compiled graphs reach) replay a repeated call whose metadata an earlier call recorded
(`kernel_api.ops.replay`): one launch, no arguments built.

The op is defined with ``torch.library.Library`` (define, impl, register_fake) rather than
``torch.library.custom_op``, whose Python wrappers cost about 40 us a call: a call that needs
no gradient goes from the Autograd kernel straight to the implementation.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import torch

from ..arguments import Arguments
from ..core import tracing
from ..tuning.scope import CURRENT as _settings
from .dispatch import op_on_stream
from .replay import DECLINED, OperationReplay, needs_op

_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_is_compiling = tracing.is_compiling
_dispatch_modes = tracing.dispatch_mode_depth
_below_autograd = torch._C._AutoDispatchBelowADInplaceOrView
_empty_like = torch.empty_like
_dense = torch.contiguous_format


def like_input(k: int = 0) -> Callable[..., torch.Tensor]:
    """A fake implementation for an operation with one output shaped like an input.

    Args:
        k: the position of the input (in the schema) whose shape, dtype and device the output
            takes.

    Returns:
        ``fake(*inputs)``: a dense (row-major) tensor of input ``k``'s shape, dtype and device,
        as ``inputs[k].new_empty(inputs[k].shape)``. On real tensors it is also how the
        generated op allocates the output.
    """
    def fake(*inputs: Any) -> torch.Tensor:
        # (dense, as ``t.new_empty(t.shape)``: half its host time, which a replayed call pays)
        return _empty_like(inputs[k], memory_format=_dense)

    fake.__qualname__ = fake.__name__ = f"like_input_{k}"
    return fake


_LIKE_FIRST = like_input(0)


@dataclass(frozen=True)
class Operation:
    """Everything kernel_api needs to know to make an operation callable and traceable.

    Attributes:
        name: the qualified op name, ``"namespace::name"`` (``torch.ops.namespace.name``).
        schema: the torch schema without the name, e.g. ``"(Tensor x, int dim=-1) -> Tensor"``;
            one return per output, no aliasing or mutation.
        arguments: builds the operation's `Arguments` from the inputs (positionally, in schema
            order) and the outputs (as keywords named by ``outputs``), e.g. the arguments type
            itself when its parameters are the schema's inputs followed by the outputs.
        outputs: the argument fields the kernels write, in the order the op returns them.
        fake: output metadata from input metadata: ``fake(*inputs)`` returns empty output
            tensors (one, or a tuple). It is the fake implementation under tracing and how
            eager calls allocate outputs not given. Default: `like_input` (0).
        backward: optional ``backward(saved, *grads) -> tuple``, one gradient per input (None for
            non-tensors and inputs without one), written with other ops. ``saved`` has the
            inputs and outputs named by ``saved`` as attributes, and ``needs_input_grad``.
        saved: the input and output names the backward reads (None: all of them); tensors are
            kept with ``ctx.save_for_backward``.
        implementation: optional eager body of the torch op, ``implementation(*inputs)``
            returning the outputs, for an operation whose front door does more than build the
            arguments and call `kernel_api.ops.call` (softmax moves ``dim`` last and records
            its launch for the C replay); default: allocate with ``fake``, build, call.
    """

    name: str
    schema: str
    arguments: Callable[..., Arguments]
    outputs: tuple[str, ...] = ("out",)
    fake: Callable[..., Any] = _LIKE_FIRST
    backward: Callable[..., tuple] | None = None
    saved: tuple[str, ...] | None = None
    implementation: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        namespace, sep, short = self.name.partition("::")
        if not sep or not namespace.isidentifier() or not short.isidentifier():
            raise ValueError(f"Operation name: expected 'namespace::name', got {self.name!r}")
        if not isinstance(self.outputs, tuple) or not self.outputs or not all(isinstance(o, str) for o in self.outputs):
            raise ValueError(f"{self.name}: outputs must be a non-empty tuple of argument field names, "
                             f"got {self.outputs!r}")
        if not callable(self.arguments) or not callable(self.fake):
            raise TypeError(f"{self.name}: arguments and fake must be callables")


class _Defined:
    """Defined operations by name, with the torch library fragment of each namespace (kept
    alive: dropping a fragment would remove its ops)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.functions: dict[str, Callable[..., Any]] = {}
        self.libraries: dict[str, torch.library.Library] = {}


_defined = _Defined()


def define_operation(op: Operation) -> Callable[..., Any]:
    """Generate an operation's torch op and front door from its description.

    Defining the same description again returns the same function (a module imported twice);
    another description under a defined name raises.

    Args:
        op: the `Operation`.

    Returns:
        ``function(*inputs, <output>=None, ..., stream=None)``: inputs as in the schema
        (defaults applied, keywords by schema name), then each output by its own name
        (``op.outputs``): a tensor to write, or None to allocate it with ``op.fake``. Eager
        calls run `kernel_api.ops.call` and return its outputs; under tracing, a dispatch mode
        or autograd the call goes to the torch op (given outputs are then filled by a copy).
        ``function.operation`` is ``op``, ``function.op`` the torch op's overload
        (``torch.ops.namespace.name.default``) and ``function.replay`` its `OperationReplay`.

    Raises:
        ValueError: the name is defined by another description, or the schema does not parse
            or disagrees with ``op.outputs``.
    """
    with _defined.lock:
        found = _defined.functions.get(op.name)
        if found is not None:
            if found.operation == op:
                return found
            raise ValueError(f"operation {op.name}: already defined by another description")
        function = _generate(op)
        _defined.functions[op.name] = function
        return function


def defined_operations() -> dict[str, Operation]:
    """The operations `define_operation` generated in this process.

    Returns:
        Qualified name -> `Operation`.
    """
    return {name: f.operation for name, f in _defined.functions.items()}


def _parse(op: Operation) -> Any:
    try:
        schema = torch._C.parse_schema(f"{op.name}{op.schema}")
    except RuntimeError as exc:
        raise ValueError(f"{op.name}: schema {op.schema!r} does not parse: {str(exc).splitlines()[0]}") from None
    if len(schema.returns) != len(op.outputs):
        raise ValueError(f"{op.name}: the schema returns {len(schema.returns)} value(s) but outputs names "
                         f"{len(op.outputs)}: {op.outputs}")
    names = [a.name for a in schema.arguments]
    clash = set(names) & {*op.outputs, "stream"}
    if clash:
        raise ValueError(f"{op.name}: {sorted(clash)} name both an input and an output (or stream); the function's "
                         f"keywords and the backward's saved values need distinct names")
    return schema


def _generate(op: Operation) -> Callable[..., Any]:
    schema = _parse(op)
    namespace, short = op.name.split("::")
    lib = _defined.libraries.get(namespace)
    if lib is None:
        lib = _defined.libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
    lib.define(f"{short}{op.schema}", tags=(torch.Tag.pt2_compliant_tag,))
    overload = getattr(getattr(torch.ops, namespace), short).default
    input_names = tuple(a.name for a in schema.arguments)
    complete = _completer(schema)
    replay = OperationReplay(len(_defined.functions) + 1, op.name, schema, op.fake, op.arguments, op.outputs)
    lib.impl(short, op.implementation or _implementation(op, complete, replay), "CompositeExplicitAutograd")
    torch.library.register_fake(op.name, op.fake, lib=lib)
    lib.impl(short, _autograd_kernel(op, overload, input_names, complete), "Autograd")
    return _front_door(op, overload, schema, replay)


def _completer(schema: Any) -> Callable[..., tuple]:
    """``complete(inputs, named)``: every input in schema order, defaults filled in (torch's
    dispatcher hands Python kernels only the arguments the caller passed)."""
    names = tuple(a.name for a in schema.arguments)
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    n = len(names)

    def complete(inputs: tuple, named: dict) -> tuple:
        if not named and len(inputs) == n:
            return inputs
        values = dict(zip(names, inputs))
        values.update(named)
        return tuple([values[name] if name in values else defaults[name] for name in names])

    return complete


def _implementation(op: Operation, complete: Callable[..., tuple], replay: OperationReplay) -> Callable[..., Any]:
    """The torch op's eager body: allocate the outputs, then replay a recorded call, or build the
    arguments and `ops.call` them (recording the call)."""
    def implementation(*inputs: Any, **named: Any) -> Any:
        inputs = complete(inputs, named)
        if not (_is_compiling() or _dispatch_modes()):
            done = replay.fresh(inputs, True)
            if done is not DECLINED:
                return done
        return replay.python_path(inputs, None, None, True)

    implementation.__qualname__ = f"{op.name}.implementation"
    return implementation


def _autograd_kernel(op: Operation, overload: Any, input_names: tuple[str, ...],
                     complete: Callable[..., tuple]) -> Callable[..., Any]:
    """The op's Autograd kernel: a generated `torch.autograd.Function` when a gradient is wanted,
    otherwise the op below autograd (no Python autograd frames)."""
    saved_names = op.saved if op.saved is not None else (*input_names, *op.outputs)
    backward = op.backward

    def forward(ctx: Any, *inputs: Any) -> Any:
        with _below_autograd():
            result = overload(*inputs)
        values = dict(zip(input_names, inputs))
        values.update(zip(op.outputs, result if len(op.outputs) > 1 else (result,)))
        tensors = [n for n in saved_names if isinstance(values.get(n), _Tensor)]
        ctx.save_for_backward(*[values[n] for n in tensors])
        ctx.tensor_names = tensors
        ctx.others = {n: values.get(n) for n in saved_names if n not in tensors}
        # the settings in force (policy, providers): autograd runs a CUDA backward on a device
        # thread of its own, where the caller's context variables are not set
        ctx.settings = _settings.get()
        return result

    def backward_(ctx: Any, *grads: Any) -> tuple:
        if backward is None:
            raise RuntimeError(f"{op.name}: no backward is defined (its Operation has none)")
        saved = SimpleNamespace(**dict(zip(ctx.tensor_names, ctx.saved_tensors)), **ctx.others,
                                needs_input_grad=ctx.needs_input_grad)
        token = _settings.set(ctx.settings)  # the backward's kernels are chosen as the forward's were
        try:
            result = backward(saved, *grads)
        finally:
            _settings.reset(token)
        if not isinstance(result, tuple):
            result = (result,)
        if len(result) != len(input_names):
            raise ValueError(f"{op.name}: backward returned {len(result)} gradient(s) for {len(input_names)} inputs "
                             f"{input_names}")
        return result

    function = type(f"{op.name.replace('::', '_')}_Function", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward_)})
    apply = function.apply

    def autograd(*inputs: Any, **named: Any) -> Any:
        inputs = complete(inputs, named)
        if _grad_enabled() and any(isinstance(v, _Tensor) and v.requires_grad for v in inputs):
            return apply(*inputs)
        with _below_autograd():
            return overload(*inputs)

    return autograd


def _front_door(op: Operation, overload: Any, schema: Any, replay: OperationReplay) -> Callable[..., Any]:
    """The Python function `define_operation` returns: inputs as in the schema, then each
    output by its own name (keyword only, default None: allocated), then ``stream``."""
    arguments, fake, outputs = op.arguments, op.fake, op.outputs
    several = len(outputs) > 1
    single = not several
    n = len(schema.arguments)
    keyword = inspect.Parameter.KEYWORD_ONLY
    signature = inspect.Signature([
        *[inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                            default=a.default_value if a.has_default_value() else inspect.Parameter.empty)
          for a in schema.arguments],
        *[inspect.Parameter(name, keyword, default=None) for name in outputs],
        inspect.Parameter("stream", keyword, default=None)])

    output_names = frozenset(outputs)
    # the defaults of the trailing inputs that have one: a call leaving them out by position
    # takes them without a binding
    defaulted = n
    while defaulted and schema.arguments[defaulted - 1].has_default_value():
        defaulted -= 1
    defaults = tuple([a.default_value for a in schema.arguments[defaulted:]])

    def function(*inputs: Any, stream: Any = None, **named: Any) -> Any:
        if defaulted <= len(inputs) <= n and output_names.issuperset(named):
            # the inputs by position (the trailing defaulted ones, e.g. eps, may be left out),
            # outputs (if any) by name: no binding needed (the common call, e.g. the op
            # functions' own `f(x, w, eps, out=out)`)
            if len(inputs) < n:
                inputs = (*inputs, *defaults[len(inputs) - defaulted:])
            # (one output: no comprehension, which Dynamo traces as a frame of its own at every call)
            given = [named.get(outputs[0])] if single else [named.get(name) for name in outputs]
            fresh = not named or (given[0] is None if single else all(g is None for g in given))
        else:  # inputs by name, or a wrong call: the signature binds and explains
            try:
                bound = signature.bind(*inputs, stream=stream, **named)
            except TypeError as exc:
                raise TypeError(f"{op.name}: {exc}") from None
            bound.apply_defaults()
            values = bound.arguments
            inputs = tuple([values[a.name] for a in schema.arguments])
            given = [values[name] for name in outputs]
            fresh = all(g is None for g in given)
        if _is_compiling() or _dispatch_modes():
            return _through_op(op, overload, stream, given, inputs)
        if fresh:  # outputs made here: new memory, which no input overlaps
            if stream is None:
                done = replay.fresh(inputs)
                if done is not DECLINED:
                    return done
            if needs_op(inputs):
                return _through_op(op, overload, stream, given, inputs)
            return replay.python_path(inputs, stream)
        if needs_op(inputs):
            return _through_op(op, overload, stream, given, inputs)
        if any(g is None for g in given):
            made = fake(*inputs)
            made = made if several else (made,)
            given = [m if g is None else g for g, m in zip(given, made)]
        results = tuple(given)
        if stream is None:
            done = replay.given(inputs, results)
            if done is not DECLINED:
                return done
        return replay.call(arguments(*inputs, **dict(zip(outputs, results))), inputs, results, stream, False)

    function.__name__ = function.__qualname__ = op.name.split("::")[1]
    function.__doc__ = f"``{op.name}{op.schema}`` through kernel_api (see `kernel_api.ops.define_operation`)."
    function.operation = op
    function.op = overload
    function.replay = replay
    function.__signature__ = signature
    return function


def _through_op(op: Operation, overload: Any, stream: Any, given: list, inputs: tuple) -> Any:
    """Run the torch op (tracing, dispatch modes, autograd); given outputs are filled by a copy."""
    # (no generator, nor `op_on_stream`'s frame on the current stream: Dynamo traces this at every call)
    result = overload(*inputs) if stream is None else op_on_stream(overload, stream, *inputs)
    for g in given:
        if g is not None:
            break
    else:
        return result
    results = result if len(op.outputs) > 1 else (result,)
    if _grad_enabled() and any(r.requires_grad for r in results):
        raise ValueError(f"{op.name}: results that require grad cannot be written into given outputs "
                         f"{op.outputs}; leave them None")
    done = tuple([r if g is None else g.copy_(r) for g, r in zip(given, results)])
    return done if len(done) > 1 else done[0]
