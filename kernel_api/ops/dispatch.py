"""The front door: call an operation, let the policy in force choose the kernel.

`call` runs any operation's arguments; `gemm` and `softmax` are kernel_api's own front doors.
After the first call for a policy and an `Arguments.problem_key` (which ends with the device),
the choice and its compiled artifact come from a dictionary. A repeated call goes further: the
front door first asks the native entry points to replay it (``replay(op, *args)``: one call key
for every operation, `kernel_api.native.recipes`), which run what the call's Python path
recorded for calls keyed as this one (a torch call, or the chosen kernel's TVM-FFI launch)
without building arguments or entering Python. Without the entry points, plain GEMMs repeat from
a Python dictionary keyed by the operands' raw metadata (`_fast`).

Inside ``torch.compile``/``torch.export`` tracing, or when an input requires grad, the calls
go through the ``torch.ops.kernel_api.*`` custom ops (`kernel_api.ops.library`), which carry
fake implementations and autograd formulas; otherwise they launch directly. A tensor given as
``out=`` (``grad_in=``) has its autograd version counter bumped after the write, as a torch
in-place op would: a backward that saved it raises instead of using the overwritten values.

f32 GEMMs follow torch's matmul precision (docs/kernels.md, "f32 GEMM precision"): kernels whose
math type is ``tf32`` or ``tf32x3`` are candidates only while torch lets cuBLAS use TF32
(``torch.backends.cuda.matmul.allow_tf32``, i.e. ``torch.set_float32_matmul_precision`` "high"
or "medium"); otherwise the choice is among f32-math kernels (cuBLAS FP32 through the torch
provider, SIMT). The setting is read once per f32 call and is part of the cache keys (the call
key holds it for every call), so a change takes effect at the next call.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

from .. import native, registry
from . import front_doors
from ..native import recipes
from ..arguments import (Arguments, EpilogueArguments, GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments,
                         byte_extent)
from ..core.dtypes import DataType
from ..core import tracing
from ..core.errors import DeviceError
from ..tuning.scope import CURRENT as _settings  # the context variable itself: no call frame per op
from ..tuning.settings import current
from ..core.streams import cu_streams as _cu_streams, current_raw_stream as _current_raw_stream, to_cuda_stream
from ..kernel import Kernel
from ..launcher import Launcher

_log = logging.getLogger(__name__)
_dispatch: dict[tuple, tuple] = {}


# `_fast`'s entries are slotted classes, not NamedTuples: a slot reads as fast as a tuple's item,
# a NamedTuple's field (or item) about 7 ns slower (CPython 3.11 specializes neither read for a
# tuple subclass), and a repeated call reads three to five of them.
@dataclass(frozen=True, slots=True)
class PlainEntry:
    """`_fast`'s entry for a plain call: what launches it, and what checks it first.

    Attributes:
        launcher: the chosen kernel's `Launcher` for the recorded operands.
        device: the CUDA device index the call was recorded on (its launches go there).
        token: the policy's scope token, kept alive while its id() is in the key.
        extents: the byte extents of A, B and out (`_may_overlap`).
    """

    launcher: Launcher
    device: int
    token: Any
    extents: tuple[int, int, int]

    @property
    def replayable(self) -> bool:
        """Whether the native replay runs this launch (a TVM-FFI function or a torch call)."""
        return self.launcher.ffi or self.launcher.torch_call is not None


@dataclass(frozen=True, slots=True)
class EpilogueEntry:
    """`_fast`'s entry for a GEMM with an epilogue (`_epilogue_entry`): the launcher's function,
    called as ``function(A, B, out, *before, [bias,] *after, stream)`` with each call's own bias.

    Attributes:
        function: the launcher's function.
        before: the launcher's constant arguments before the bias.
        after: those after it (all of them for a call without a bias).
        device, token, extents: as `PlainEntry`'s.
        replayable: whether the native replay runs this launch (`PlainEntry.replayable`).
    """

    function: Any
    before: tuple
    after: tuple
    device: int
    token: Any
    extents: tuple[int, int, int]
    replayable: bool = False


# Raw tensor metadata (dtypes, shapes, strides, pointer alignment, devices) -> a `PlainEntry`
# or an `EpilogueEntry`, so a repeated call skips building arguments (see _raw_gemm_key). The native
# entry points' replay does more without Python work where they load; this dictionary serves
# kernels whose launch is a Python function and machines without them.
_fast: dict[tuple, PlainEntry | EpilogueEntry] = {}
_FAST_LIMIT = 4096
_entry_tried = False  # whether the native entry points were loaded (they may be missing)
#: ``replay(op, *args)`` of the entry points once they load (None before and without them): the
#: recipe the Python path recorded for a call keyed as this one, run in C (`kernel_api.native.recipes`).
replay_call: Any = None
_entry: Any = None  # the entry points, once loaded
#: The front doors' numbers in call keys (softmax's choices never follow cuBLAS's TF32 flag;
#: gemm's follow it for a float32 A alone, `_launch`: keyed for calls with a float32 tensor).
GEMM_OP = recipes.op_number("kernel_api.gemm", recipes.ALL_STATE | recipes.TF32_FOR_FLOAT32)
SOFTMAX_OP = recipes.op_number("kernel_api.softmax", recipes.ALL_STATE & ~recipes.TF32)
SOFTMAX_BACKWARD_OP = recipes.op_number("kernel_api.softmax_backward", recipes.ALL_STATE & ~recipes.TF32)
#: Where epilogue functions are run: ``{"gemm": gemm_with_epilogue}``, filled by
#: ops/epilogue_gemm.py when it is imported (it builds on this module, so this module does not
#: import it).
_epilogue_functions: dict[str, Any] = {}
#: What else remembers choices, emptied by `clear_dispatch_cache`: each a ``forget()`` (the
#: generated operations' replays, added by ops/replay.py when it is imported).
choice_caches: list[Any] = []
_tagged_policies: dict[int, Any] = {}  # keeps every scope token whose id() keys recipes alive
_Tensor = torch.Tensor
#: Operand types the fast paths take as they are: plain tensors and parameters (nn layers pass
#: their weight, or GPT-2's Conv1D weight itself, and their bias as `torch.nn.Parameter`; a
#: parameter adds no __torch_function__ or __torch_dispatch__ behaviour at run time). Other
#: subclasses go to GemmArguments, which sees what they are.
_PLAIN = (torch.Tensor, torch.nn.Parameter)
# The tracing guards (core/tracing.py says which tracer each one sees).
_is_compiling = tracing.is_compiling
_is_dynamo_compiling = tracing.is_dynamo_compiling
_dispatch_modes = tracing.dispatch_mode_depth
_grad_enabled = torch.is_grad_enabled
_function_modes = getattr(torch._C, "_is_torch_function_mode_enabled", lambda: False)
_autocast_any = getattr(torch._C, "_is_any_autocast_enabled", torch.is_autocast_enabled)
# What torch.autograd.graph.increment_version(out) calls, without its Python frame: ops write
# outputs through raw pointers, which autograd does not see; a bumped version counter makes a
# backward that saved the overwritten tensor raise instead of using the new values.
_increment_version = torch._C._increment_version
_current_device = torch._C._cuda_getDevice if hasattr(torch._C, "_cuda_getDevice") else torch.cuda.current_device
_f32 = torch.float32
# What torch.matmul's cuBLAS call reads (allow_tf32, which float32_matmul_precision "high"/"medium"
# and the fp32_precision API set too); a C call, unlike torch.get_float32_matmul_precision, which
# can raise when the legacy and new APIs were mixed.
_tf32_allowed = torch._C._get_cublas_allow_tf32


#: Math types of f32-operand kernels not always as accurate as cuBLAS FP32, offered by ops only
#: while torch allows TF32. 3xTF32 with its accumulator promoted measures 0.2x cuBLAS FP32's
#: norm-wise error at K >= 4096 on an H200, but its split keeps 22 of f32's 24 operand bits: a
#: K-independent floor near 2^-22 that cuBLAS FP32 undercuts at small K (GPU tests, docs/kernels.md).
_TF32_MATH = frozenset({DataType.tf32, DataType.tf32x3})


def allowed_math(kernels: list, tf32_allowed: bool) -> list:
    """``kernels`` less those with tf32 or tf32x3 math when torch does not allow TF32 matmuls
    (the f32 precision rule of `kernel_api.ops`; f32-math kernels always stay)."""
    if tf32_allowed:
        return kernels
    return [k for k in kernels if k.metadata.operands.math_type not in _TF32_MATH]


def _raw_gemm_key(policy: Any, A: torch.Tensor, B: torch.Tensor, out: torch.Tensor) -> tuple:
    """Everything GemmArguments' summary (and so the choice and its support verdict) depends
    on, read straight off the tensors. Pointer bits up to 1024 bytes: the largest alignment
    arguments record (128 elements of 8 bytes)."""
    dtype = A.dtype
    return (id(policy), dtype, B.dtype, out.dtype, A.shape, B.shape, out.shape, A.stride(), B.stride(),
            out.stride(), (A.data_ptr() & 1023) | (B.data_ptr() & 1023) << 10 | (out.data_ptr() & 1023) << 20,
            A.get_device(), B.get_device(), out.get_device(),
            _tf32_allowed() if dtype is _f32 else None)  # f32: the choice follows torch's precision


def _may_overlap(out_ptr: int, a_ptr: int, b_ptr: int, extents: tuple[int, int, int]) -> bool:
    """Whether out's bytes may meet A's or B's (extents fixed by the recorded metadata).
    Conservative: such a call goes to GemmArguments, which judges it exactly."""
    a, b, o = extents
    return o > 0 and (out_ptr < a_ptr + a and a_ptr < out_ptr + o or out_ptr < b_ptr + b and b_ptr < out_ptr + o)


def _fast_serves(found: PlainEntry | EpilogueEntry) -> bool:
    """Whether ``_fast``'s entry serves a call: always without the native replay; with it, only
    calls C cannot replay (a launcher that is a Python function). A call that C could replay but
    did not has no recipe for its call key (an allocating call and one given an output of the same
    metadata share the raw key, not the call key): it takes the Python path once, which records it."""
    return replay_call is None or not found.replayable


def _launch_fast(found: PlainEntry, stream: Any, *tensors: torch.Tensor) -> None:
    """Launch ``_fast``'s entry on its device (not the current one)."""
    with torch.cuda.device(found.device):
        found.launcher.launch(tensors, to_cuda_stream(stream))


def _launch(args: Any, stream: Any = None, fast_key: tuple | None = None, tensors: tuple = ()) -> tuple:
    """Choose (once per policy, signature and shape), compile and launch; then, when the
    arguments kept the caller's ``tensors`` as they are, keep the kernel's launcher for them in
    ``_fast`` under ``fast_key`` (the Python replay of machines without the native entry
    points). Returns the choice that ran: ``(kernel, artifact, scope token)``."""
    args.check_memory()  # the run below assumes the arguments supported
    scope = current()
    policy = scope.policy
    # scope_token: the policy, or (policy, providers) when settings restrict the providers
    token = scope.scope_token
    # f32 GEMMs: the candidates follow torch's matmul precision (the module docstring's rule)
    tf32 = _tf32_allowed() if type(args) is GemmArguments and args.A.dtype is _f32 else None
    # The arguments' own key (its signature ends with the operands' device index, so choices
    # are per device): no rule of any operation here.
    key = (id(token), args.problem_key(), tf32)
    found = _dispatch.get(key)
    if found is None:
        device = args.device
        if device.type not in LAUNCH_DEVICE_TYPES:
            name = next(iter(args.tensor_attributes))
            raise DeviceError(f"operand {name} is on {device}; kernel_api.ops run on CUDA tensors")
        with torch.cuda.device(device) if device.type == "cuda" else _no_context:
            candidates = registry.get_kernels(args, providers=scope.providers)
            if tf32 is not None:
                candidates = allowed_math(candidates, tf32)
            if not candidates:
                raise registry.no_kernel_error(args)
            kernel = policy.choose(args, replayable_first(candidates, args))
            found = _dispatch[key] = (kernel, kernel.compile(args), token)  # keep token alive: id() stays unique
            if _log.isEnabledFor(logging.DEBUG):  # once per choice, never on repeated calls
                _log_fast_path(kernel, found[1], args)
    kernel, artifact, _ = found
    # Honour the operands' device: launch (and take the default stream) there, not on
    # whichever device happens to be current.
    index = args.device_index
    if index >= 0 and index != _current_device():
        with torch.cuda.device(index):
            kernel.run(args, compiled_artifact=artifact, stream=stream, assume_supported_args=True)
    else:
        kernel.run(args, compiled_artifact=artifact, stream=stream, assume_supported_args=True)
    # Only when arguments kept the caller's tensors as they are (no re-strided views).
    if fast_key is not None and tensors and all(
            getattr(args, name) is t for name, t in zip(args.tensor_attributes, tensors)):
        launcher = kernel._launcher(args, artifact)
        if launcher is None:
            return found
        if len(_fast) >= _FAST_LIMIT:
            _fast.clear()
        extents = tuple(byte_extent(t) for t in tensors)
        if type(args) is GemmArguments and args.epilogue is not None:
            entry = _epilogue_entry(launcher, args.epilogue.bias, index, token, extents)
            if entry is not None:
                _fast[fast_key] = entry
            return found
        _fast[fast_key] = PlainEntry(launcher, index, token, extents)
    return found


#: Device types the front door launches on. The shipped kernels are CUDA kernels, so operands on
#: another device are refused (DeviceError naming the operand) before any choice; tests whose toy
#: kernels compute with torch on the CPU add "cpu".
LAUNCH_DEVICE_TYPES = frozenset({"cuda"})
_no_context = contextlib.nullcontext()


def call(args: Arguments, *, stream: Any = None) -> Any:
    """Run any operation's arguments with the kernel the policy in force chooses.

    The first call for a problem (`Arguments.problem_key`, under the policy and the settings'
    providers) finds the candidates, lets the policy choose, compiles and remembers the choice;
    later calls with an equal key reuse it. Eager only: under ``torch.compile``, ``make_fx`` or
    another dispatch mode call the operation's torch op instead (`define_operation`'s callable
    routes there by itself).

    Args:
        args: the arguments object of any operation (e.g. ``SoftmaxArguments(x, out)``), its
            outputs allocated by the caller.
        stream: the stream to launch on (torch stream, CUstream, int handle); None: the current
            stream of the operands' device.

    Returns:
        The arguments' output (``type(args).output_names``): one tensor, a tuple of several, or
        None when the type names none. Each has its autograd version counter bumped, as a torch
        in-place op would.

    Raises:
        TypeError: ``args`` is no `Arguments`.
        RuntimeError: called under tracing or a torch dispatch mode.
        DeviceError: the operands are not on a device the front door launches on.
        NoKernelFoundError: no kernel takes the arguments (naming the nearest misses).
    """
    if not isinstance(args, Arguments):
        raise TypeError(f"args: expected a kernel_api Arguments object (e.g. SoftmaxArguments), "
                        f"got {type(args).__name__}")
    if _is_compiling() or _dispatch_modes():
        raise RuntimeError("kernel_api.ops.call launches kernels eagerly; under torch.compile, make_fx or a dispatch "
                           "mode call the operation's torch op (the function define_operation returns)")
    _launch(args, stream)
    names = type(args).output_names
    if not names:
        return None
    outputs = tuple([getattr(args, name) for name in names])
    _increment_version(outputs)
    return outputs[0] if len(outputs) == 1 else outputs


def launch(args: Arguments, stream: Any = None) -> tuple[Kernel, Any]:
    """Choose, compile and launch ``args`` as `call` does, and say what ran. The caller has
    checked what `call` checks (an `Arguments`, no tracing, no dispatch mode) and bumps the
    outputs' version counters itself: the generated operations (`kernel_api.ops.operation`),
    which record the choice for their replay (`kernel_api.ops.replay`).

    Args:
        args: the arguments, outputs allocated.
        stream: as for `call`.

    Returns:
        ``(kernel, artifact)``: the chosen kernel and the compiled artifact it launched.
    """
    kernel, artifact, _ = _launch(args, stream)
    return kernel, artifact


#: Problems moving fewer bytes than this (operands read and written once) are given only to
#: kernels whose calls the front door replays from C, when any fits (`replayable_first`): a
#: kernel class offering no `Kernel._launcher` (the softmax window and row-group families,
#: whose launches take a workspace and a launch epoch of their own) runs every call
#: through the Python path, 75-150 us of host time a call on an H200 host (benchmarks/softmax.py
#: --public-only: the 1x1M window forward took 158 us a call, its kernel 9 us), where a replayed
#: call took 7-12 us; 256 MiB is what the GPU streams in 75 us. 32x131072 softmax went from those
#: families (0.27-0.52x torch) to the cluster splits (1.85-2.94x); on a faster host the families
#: would keep problems of 90-256 MiB, where their kernels run up to 1.7x faster.
REPLAYABLE_FIRST_BYTES = 256 << 20


def replayable_first(candidates: list, args: Any) -> list:
    """``candidates`` less the kernels whose class offers no `Launcher` (`Kernel._launcher` not
    overridden: never replayed from C), for problems under `REPLAYABLE_FIRST_BYTES` when any
    other candidate remains; else ``candidates``."""
    if len(candidates) < 2:
        return candidates
    moved = sum(byte_extent(getattr(args, name)) for name in args.tensor_attributes)
    if moved >= REPLAYABLE_FIRST_BYTES:
        return candidates
    replayable = [k for k in candidates if type(k)._launcher is not _no_launcher]
    return replayable or candidates


_no_launcher = Kernel._launcher


def _epilogue_entry(launcher: Launcher, bias: Any, index: int, token: Any, extents: tuple) -> EpilogueEntry | None:
    """``_fast``'s entry for a GEMM with an epilogue (alpha, bias, activation; no C). The
    launcher's tail holds the recorded call's bias; later calls pass their own bias in its
    place (found by identity), so no launch reuses a stale bias tensor. None when the tail
    does not hold the bias (nothing is recorded then)."""
    tail = launcher.tail
    replayable = launcher.ffi or launcher.torch_call is not None
    if bias is None:
        return EpilogueEntry(launcher.function, tail, (), index, token, extents, replayable)
    for i, value in enumerate(tail):
        if value is bias:
            return EpilogueEntry(launcher.function, tail[:i], tail[i + 1:], index, token, extents, replayable)
    return None


def _log_fast_path(kernel: Any, artifact: Any, args: Any) -> None:
    """Say at DEBUG, when a kernel is first chosen for a problem, why its repeated calls will
    not be replayed from C (nothing when they may be)."""
    name = kernel.metadata.kernel_name
    launcher = kernel._launcher(args, artifact)
    if launcher is None:
        _log.debug("%s: no fast path (_launcher returned None); every call goes through Kernel.run", name)
    elif not launcher.ffi and launcher.torch_call is None:
        _log.debug("%s: neither a TVM-FFI function nor a torch call, so not replayed from C; repeated calls "
                   "take the Python path", name)
    elif native.entry() is None:
        _log.debug("%s: the native entry points are unavailable (%s); repeated calls stay on the Python path", name,
                   native.why_not_entry())


def call_recorded(op: int, args: Arguments, call: tuple, made: Any = None, fast_key: tuple | None = None,
                  tensors: tuple = ()) -> None:
    """A front door's Python path after it built ``args``: `call`'s choice, compile and launch
    (on the stream ``call`` ends with), then, for a call on the current stream in the plain
    state, the recipe of what ran recorded for calls keyed as ``call`` (`record_replay`).

    Args:
        op: the front door's number in call keys.
        args: the arguments, outputs given or made by the caller.
        call: the front door's arguments as it was given them, its stream last.
        made: the output the caller made (dense, like ``call[0]``), or None when it was given.
        fast_key, tensors: `_launch`'s (the Python GEMM dictionary).
    """
    stream = call[-1]
    found = _launch(args, stream, fast_key, tensors)
    if found is not None and stream is None and plain_state(tuple(a for a in call if isinstance(a, _Tensor))):
        record_replay(op, found[0], found[1], args, call, made)


def plain_state(tensors: tuple) -> bool:
    """Whether a call with these tensor inputs runs plainly: no torch dispatch or function mode,
    no autocast, no input requiring grad under grad mode. A launch is recorded for replay only
    from such a call (the call key holds that state, so it replays only in it).

    Args:
        tensors: the call's tensor inputs (None entries are skipped).
    """
    if _dispatch_modes() or _function_modes() or _autocast_any():
        return False
    return not (_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def record_replay(op: int, kernel: Kernel, artifact: Any, args: Arguments, call: tuple, made: Any = None,
                  like: int = 0) -> bool:
    """Record what a front door's Python path launched for ``args``, for later calls keyed as
    ``call`` (the front door's arguments, as given): the kernel's torch call (`Launcher.torch_call`,
    a `recipes.Call`) or its TVM-FFI function (a `recipes.Launch`), its tensors found among the
    call's arguments (themselves, tensors of equal metadata and memory, or views of their
    memory). The caller made the output ``made`` (a dense tensor with argument ``like``'s dtype
    and device), or it is one of the call's arguments.

    Returns:
        Whether a recipe was recorded (not for a kernel without a `Launcher` or one that is
        neither, tensors that are not the call's own, constants C cannot hold).
    """
    if not _load_entry():
        return False
    launcher = kernel._launcher(args, artifact)
    if launcher is None or not (launcher.ffi or launcher.torch_call is not None):
        return False

    views: list[tuple] = []

    def slot(t: Any) -> int | None:
        """Where the launch's tensor ``t`` comes from: the made output, a call argument (itself,
        or a view with its metadata), or (for a TVM-FFI launch) a view of one's memory."""
        if made is not None and t is made:
            return recipes.MADE
        for i, given in enumerate(call):
            if given is t:
                return i
        tensors = [(i, g) for i, g in enumerate(call) if isinstance(g, _Tensor) and g.dtype == t.dtype
                   and g.device == t.device]
        for i, given in tensors:
            if given.data_ptr() == t.data_ptr() and given.shape == t.shape and given.stride() == t.stride():
                return i
        base = t.untyped_storage().data_ptr()
        for i, given in tensors if launcher.ffi and base else ():
            if given.untyped_storage().data_ptr() == base:
                views.append((i, tuple(t.shape), tuple(t.stride()), t.storage_offset() - given.storage_offset()))
                return recipes.view(len(views) - 1)
        return None

    names = type(args).output_names
    if len(names) != 1:
        return False
    output = getattr(args, names[0])
    tensors = [getattr(args, name) for name in args.tensor_attributes]
    slots = [slot(t) for t in tensors]
    out = slot(output)
    if None in slots or out is None:
        return False
    order, constants = list(slots), []
    for value in launcher.tail:
        if isinstance(value, _Tensor):
            order.append(slot(value))
        else:
            order.append(recipes.constant(len(constants)))
            constants.append(value)
    if None in order:
        return False
    if launcher.torch_call is not None:  # torch_call(*inputs, *tail, out=output); torch allocates a made one
        inputs = tuple(s for t, s in zip(tensors, order) if t is not output) + tuple(order[len(tensors):])
        recipe: Any = recipes.Call(launcher.torch_call, launcher.torch_arguments(inputs),
                                   out=-1 if out == recipes.MADE else out)
    else:
        shape = None if out != recipes.MADE else (like, tuple(made.shape), recipes.alignment(made.data_ptr()))
        recipe = recipes.Launch(launcher.function, tuple(order), tuple(constants),
                                output=-1 if out == recipes.MADE else out, made=shape, views=tuple(views))
    token = current().scope_token
    _tag_policy(token)
    try:
        return recipes.record(_entry, op, recipe, *call)
    except (TypeError, ValueError):  # constants C cannot hold: the Python path serves such calls
        return False


def _record_call(op: int, recipe: Any, call: tuple) -> None:
    """Record ``recipe`` (a `recipes.Call` of torch's) for calls keyed as ``call``."""
    if _load_entry():
        _tag_policy(current().scope_token)
        recipes.record(_entry, op, recipe, *call)


def _load_entry() -> bool:
    """Load the native entry points once and configure their call key; whether they are there."""
    global _entry, replay_call, _entry_tried
    if not _entry_tried:
        _entry_tried = True
        entry = native.entry()
        if entry is None:
            # (no log record here: every recording call comes here then; `_log_fast_path` says it once)
            return False
        entry.configure_replay(_settings, _grad_enabled, _dispatch_modes, _function_modes, _autocast_any,
                               _tf32_allowed, _increment_version)
        native.torch_reads(entry)
        _entry, replay_call = entry, entry.replay
        front_doors.set_replay(entry.replay_function)
    return _entry is not None


def _tag_policy(token: Any) -> None:
    """Keep the scope token ``token`` alive while its id() keys recipes (forgetting every recipe
    when too many tokens have)."""
    if id(token) not in _tagged_policies and len(_tagged_policies) >= _FAST_LIMIT:
        _entry.forget_replays()  # a policy per call would otherwise keep every policy alive
        _tagged_policies.clear()
    _tagged_policies[id(token)] = token


def op_on_stream(op: Any, stream: Any, *inputs: Any) -> Any:
    """``op(*inputs)`` for a torch op run under tracing or autograd, with ``stream`` current.

    Args:
        op: the torch op (or overload).
        stream: a ``torch.cuda.Stream``, or None for the current stream; no other spelling,
            since tracing sees only torch streams.
        inputs: the op's arguments.

    Returns:
        What ``op`` returns.

    Raises:
        TypeError: ``stream`` is neither None nor a ``torch.cuda.Stream``.
    """
    if stream is None:
        return op(*inputs)
    if not isinstance(stream, torch.cuda.Stream):
        raise TypeError("stream: under torch.compile or autograd pass a torch.cuda.Stream (or None)")
    with torch.cuda.stream(stream):
        return op(*inputs)


def _traced_call(op: Any, stream: Any, out: torch.Tensor | None, *inputs: Any) -> torch.Tensor:
    """Run a custom op (tracing or autograd); ``out=`` is filled by a copy."""
    result = op_on_stream(op, stream, *inputs)
    if out is None:
        return result
    if _grad_enabled() and result.requires_grad:
        raise ValueError("out=: results that require grad cannot be written into a given tensor; leave out=None")
    return out.copy_(result)


def gemm(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None = None, *, alpha: float = 1.0,
         beta: float = 0.0, C: torch.Tensor | None = None, bias: torch.Tensor | None = None,
         activation: str | None = None, accumulator_type: Any = None, stream: Any = None, epilogue: Any = None,
         **operands: Any) -> torch.Tensor:
    """``out = activation(alpha * A @ B + beta * C + bias)`` with the kernel the policy picks.

    ``out`` defaults to a new tensor of A's dtype, shape (..., M, N). Differentiable in A, B,
    C and bias (an activation too); traceable by ``torch.compile`` (``kernel_api::gemm``).
    A repeated call whose arguments have the values, and whose tensors the dtypes, shapes,
    strides, alignment and devices, of an earlier call is replayed from C (`recipes`).

    ``epilogue``: an epilogue function (or its source string, or a function-form
    `EpilogueArguments`) fused into the GEMM, its operands given by name in ``operands``
    (``alpha``, ``beta``, ``C`` and ``bias`` bind to its parameters of those names):
    `kernel_api.ops.epilogue_gemm`.
    """
    # (_is_dynamo_compiling first: Dynamo folds it to True and reads nothing else here, so no guards)
    if not _is_dynamo_compiling() and replay_call is not None and epilogue is None and not operands:
        # What the Python path recorded for a call keyed as this one, run in C; None when
        # nothing is (docs/architecture.md, "The replay contract").
        done = replay_call(GEMM_OP, A, B, out, alpha, beta, C, bias, activation, accumulator_type, stream)
        if done is not None:
            return done
    return _gemm_unreplayed(A, B, out, alpha=alpha, beta=beta, C=C, bias=bias, activation=activation,
                            accumulator_type=accumulator_type, stream=stream, epilogue=epilogue, **operands)


def _gemm_unreplayed(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None = None, *, alpha: float = 1.0,
                     beta: float = 0.0, C: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     activation: str | None = None, accumulator_type: Any = None, stream: Any = None,
                     epilogue: Any = None, **operands: Any) -> torch.Tensor:
    """`gemm` after its replay attempt (what the C front door runs when the replay has nothing)."""
    # ---- epilogue functions (ops/epilogue_gemm.py): the only branch they add to this path
    if epilogue is not None:
        gemm_with_epilogue = _epilogue_functions.get("gemm")
        if gemm_with_epilogue is None:
            raise RuntimeError("gemm: epilogue functions need kernel_api.ops.epilogue_gemm (import kernel_api.ops)")
        if activation is not None:
            raise TypeError("gemm: activation= is the named epilogue's; write it into the epilogue function")
        return gemm_with_epilogue(A, B, out, epilogue, operands, accumulator_type, stream,
                                  dict(alpha=alpha, beta=beta, C=C, bias=bias))
    if operands:
        raise TypeError(f"gemm: unexpected keyword {next(iter(operands))!r} (operands by name need epilogue=)")
    # ----
    if (_is_dynamo_compiling() and out is None and stream is None and accumulator_type is None
            and isinstance(A, _Tensor) and isinstance(B, _Tensor) and (C is None or isinstance(C, _Tensor))
            and (bias is None or isinstance(bias, _Tensor))):
        # Under Dynamo the op itself, as `_traced_call` would call it: Dynamo traces every line
        # of Python it inlines, and the checks and calls below cost a compile as much as the op.
        return torch.ops.kernel_api.gemm(A, B, C, bias, float(alpha), float(beta), activation)
    if not isinstance(A, _Tensor) or not isinstance(B, _Tensor):
        raise TypeError(f"gemm: A and B must be torch tensors, got {type(A).__name__} and {type(B).__name__}")
    if out is not None and not isinstance(out, _Tensor):
        raise _not_a_tensor("gemm", "out", out, True)
    if C is not None and not isinstance(C, _Tensor):
        raise _not_a_tensor("gemm", "C", C, True)
    if bias is not None and not isinstance(bias, _Tensor):
        raise _not_a_tensor("gemm", "bias", bias, True)
    # (_is_compiling first: under tracing it short-circuits, so Dynamo guards on nothing else here)
    if _is_compiling() or _dispatch_modes() or (
            (A.requires_grad or B.requires_grad or (C is not None and C.requires_grad)
             or (bias is not None and bias.requires_grad)) and _grad_enabled()):
        if accumulator_type is not None:
            raise ValueError("accumulator_type: not supported under torch.compile, autograd or a torch dispatch mode "
                             "(the default is used)")
        return _traced_call(torch.ops.kernel_api.gemm, stream, out, A, B, C, bias, float(alpha), float(beta),
                            activation)
    return _gemm_eager(A, B, out, alpha, beta, C, bias, activation, accumulator_type, stream)


# The front door callers see: a C function where the native front doors are built (front_doors.py)
gemm = front_doors.c_front_door(
    gemm, _gemm_unreplayed, GEMM_OP, key=("A", "B", "out", "alpha", "beta", "C", "bias", "activation",
                                          "accumulator_type", "stream"), default_only=("epilogue",))


def _not_a_tensor(op: str, name: str, value: Any, optional: bool = False) -> TypeError:
    return TypeError(f"{op}: {name} must be a torch tensor{' or None' if optional else ''}, got {type(value).__name__}")


def _new_gemm_output(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    return A.new_empty((*A.shape[:-1], B.shape[-1]))


# Problems with at least this many rows have their misaligned columns split off (`split_columns`):
# below it, copying nothing but launching twice costs more than the tensor cores save.
SPLIT_MIN_ROWS = 256


def split_columns(A: torch.Tensor, B: torch.Tensor, C: torch.Tensor | None, beta: float,
                  bias: torch.Tensor | None) -> int:
    """Columns of a new output that a GEMM computes apart from the rest, or 0 (shapes and
    dtypes only, so fake tensors give the same answer).

    A row of N elements that is not a multiple of 16 bytes (GPT-2's 50257-token lm_head) gives
    every kernel that needs aligned rows (the tensor-core families) divisibility 1, leaving a
    slow path. For a 2-D problem of at least `SPLIT_MIN_ROWS` rows and no C, the output is
    allocated with padded rows (`padded_output`; ``torch.empty_strided``: same shape, row stride
    rounded up) and computed as two GEMMs: the aligned first ``N - N % vec`` columns, then the
    few left. The result is that strided tensor, as torch.compile's own padding makes."""
    if A.dim() != 2 or B.dim() != 2 or (C is not None and beta != 0.0):
        return 0
    N, vec = B.shape[-1], 16 // A.element_size()
    if N % vec == 0 or N < 4 * vec or A.shape[0] < SPLIT_MIN_ROWS:
        return 0
    if bias is not None:
        shape, M = tuple(bias.shape), A.shape[0]
        if not (shape in ((N,), (1, N), (M, 1)) or (shape == (M,) and M != N)):
            return 0  # the unsplit call explains the bad shape
    return N - N % vec


#: Rows of at least this many bytes are padded to a multiple of 128 bytes (at most 1/32 more
#: memory), shorter ones to 16: TMA then moves whole 128-byte lines per box row. An out at a
#: pitch of 100528 bytes (GPT-2's 50257 bf16 logits padded to 16 bytes) against 100608: the same
#: kernel ran 2-5 % faster at 8192x50257x768 on the H200 (docs/performance.md, "Realigned GEMM").
LINE_PADDED_ROW_BYTES = 4096


def padded_output(A: torch.Tensor, N: int) -> torch.Tensor:
    """A new (M, N) output of A's dtype whose rows start 16 bytes apart, or 128 for rows of at
    least `LINE_PADDED_ROW_BYTES` (`split_columns`)."""
    size = A.element_size()
    vec = (128 if N * size >= LINE_PADDED_ROW_BYTES else 16) // size
    return torch.empty_strided((A.shape[0], N), (-(-N // vec) * vec, 1), dtype=A.dtype, device=A.device)


def column_parts(A: torch.Tensor, B: torch.Tensor, head: int,
                 bias: torch.Tensor | None) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, Any]]]:
    """`split_columns`' padded output and its two GEMMs' operands.

    Args:
        A, B: the 2-D operands.
        head: the columns the first GEMM computes (`split_columns`' answer).
        bias: the GEMM's bias, or None; a row bias (N or (1, N) elements) is split with the columns.

    Returns:
        ``(out, parts)``: the new output (`padded_output`) and, for the aligned columns and then
        the rest, ``(B's columns, out's columns, the bias for them)``.
    """
    N = B.shape[-1]
    out = padded_output(A, N)
    row = bias is not None and tuple(bias.shape) in ((N,), (1, N))
    return out, [(B[:, cols], out[:, cols], bias[..., cols] if row else bias)
                 for cols in (slice(None, head), slice(head, None))]


def _gemm_split(A: torch.Tensor, B: torch.Tensor, head: int, alpha: float, bias: torch.Tensor | None,
                activation: str | None, accumulator_type: Any, stream: Any) -> torch.Tensor:
    """`split_columns`' two GEMMs into one padded output."""
    out, parts = column_parts(A, B, head, bias)
    for B_part, out_part, bias_part in parts:  # (each part's recipe replays it from C)
        if replay_call is None or replay_call(GEMM_OP, A, B_part, out_part, alpha, 0.0, None, bias_part, activation,
                                              accumulator_type, stream) is None:
            _gemm_eager(A, B_part, out_part, alpha, 0.0, None, bias_part, activation, accumulator_type, stream)
    return out


def _gemm_eager(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None, alpha: float, beta: float,
                C: torch.Tensor | None, bias: torch.Tensor | None, activation: str | None,
                accumulator_type: Any, stream: Any) -> torch.Tensor:
    given = out is not None  # the caller's tensor: its version counter is bumped after the write
    if not given:
        head = split_columns(A, B, C, beta, bias) if A.dim() == 2 else 0
        if head:
            return _gemm_split(A, B, head, alpha, bias, activation, accumulator_type, stream)
        out = _new_gemm_output(A, B)
    epilogue = fast_key = None
    if alpha != 1.0 or beta != 0.0 or bias is not None or activation is not None:
        if (beta == 0.0 and accumulator_type is None and type(alpha) in (float, int) and type(A) in _PLAIN
                and type(B) in _PLAIN and type(out) in _PLAIN
                and (bias is None or (type(bias) in _PLAIN and bias.dim() == 1))):
            # A repeated epilogue call (nn layers: bias, activation): launched from ``_fast`` with
            # this call's bias (`_epilogue_entry`), keyed on its metadata as well.
            fast_key = (_raw_gemm_key(current().scope_token, A, B, out), alpha, activation,
                        None if bias is None else (bias.dtype, bias.shape, bias.stride(), bias.data_ptr() & 1023,
                                                   bias.get_device()))
            found = _fast.get(fast_key)
            if (found is not None and _fast_serves(found)
                    and not _may_overlap(out.data_ptr(), A.data_ptr(), B.data_ptr(), found.extents)
                    and not (A.is_neg() or B.is_neg() or out.is_neg() or (bias is not None and bias.is_neg()))):
                device = _current_device() if found.device >= 0 else -1  # (-1: recorded for CPU tensors)
                if found.device != device:
                    with torch.cuda.device(found.device):
                        found.function(A, B, out, *found.before, *(() if bias is None else (bias,)), *found.after,
                                       to_cuda_stream(stream))
                else:
                    cu_stream = None
                    if stream is None and _current_raw_stream is not None:
                        cu_stream = _cu_streams.get(_current_raw_stream(device))
                    found.function(A, B, out, *found.before, *(() if bias is None else (bias,)), *found.after,
                                   cu_stream if cu_stream is not None else to_cuda_stream(stream))
                if given:
                    _increment_version((out,))
                return out
        # (built after the fast path: a recorded call is validated by its first call's arguments)
        epilogue = EpilogueArguments(alpha=alpha, beta=beta, C=C, bias=bias, activation=activation)
    elif accumulator_type is None and type(A) in _PLAIN and type(B) in _PLAIN and type(out) in _PLAIN:
        fast_key = _raw_gemm_key(current().scope_token, A, B, out)
        found = _fast.get(fast_key)
        # (the key has no lazy negative bit: such operands go to GemmArguments, which refuses them)
        if (found is not None and _fast_serves(found)
                and not _may_overlap(out.data_ptr(), A.data_ptr(), B.data_ptr(), found.extents)
                and not (A.is_neg() or B.is_neg() or out.is_neg())):
            device = _current_device() if found.device >= 0 else -1  # (-1: recorded for CPU tensors)
            if found.device != device:
                _launch_fast(found, stream, A, B, out)
            else:
                launcher = found.launcher  # launcher.launch((A, B, out), stream), without its frame
                if stream is None and _current_raw_stream is not None:
                    # the current stream of the device just read, without a second device query
                    cu_stream = _cu_streams.get(_current_raw_stream(device))
                    launcher.function(A, B, out, *launcher.tail,
                                      cu_stream if cu_stream is not None else to_cuda_stream(None))
                else:
                    launcher.function(A, B, out, *launcher.tail, to_cuda_stream(stream))
            if given:
                _increment_version((out,))
            return out
    args = GemmArguments(A, B, out, accumulator_type=accumulator_type, epilogue=epilogue)
    call_recorded(GEMM_OP, args, (A, B, out if given else None, alpha, beta, C, bias, activation, accumulator_type,
                                  stream), None if given else out, fast_key, (A, B, out))
    if given:
        _increment_version((out,))
    return out


def softmax(x: torch.Tensor, dim: int = -1, out: torch.Tensor | None = None, stream: Any = None) -> torch.Tensor:
    """``softmax(x, dim)`` over the last dimension; differentiable (the backward runs the
    registry's softmax-backward kernels) and traceable (``kernel_api::softmax``). Repeated
    calls keyed as an earlier one are replayed from C (`recipes`: the kernel's launch or the
    torch provider's call; under autograd, for small problems, torch's own softmax)."""
    if not _is_dynamo_compiling():
        if replay_call is not None:
            done = replay_call(SOFTMAX_OP, x, dim, out, stream)
            if done is not None:
                return done
    return _softmax_unreplayed(x, dim, out, stream)


def _softmax_unreplayed(x: torch.Tensor, dim: int = -1, out: torch.Tensor | None = None,
                        stream: Any = None) -> torch.Tensor:
    """`softmax` after its replay attempt (what the C front door runs when the replay has nothing)."""
    if not isinstance(x, _Tensor):
        raise _not_a_tensor("softmax", "x", x)
    if out is not None and not isinstance(out, _Tensor):
        raise _not_a_tensor("softmax", "out", out, True)
    if _is_compiling() or _dispatch_modes():
        return _traced_call(torch.ops.kernel_api.softmax, stream, out, x, dim)
    if x.requires_grad and _grad_enabled():
        if not x.is_cuda:  # (meta tensors: the custom op's fake implementation)
            return _traced_call(torch.ops.kernel_api.softmax, stream, out, x, dim)
        if out is not None:
            raise ValueError("out=: results that require grad cannot be written into a given tensor; leave out=None")
        if stream is None and torch_softmax_serves_autograd(x):
            y = torch.softmax(x, dim)  # (see AUTOGRAD_NATIVE_MAX_ELEMENTS)
            if not (_dispatch_modes() or _function_modes() or _autocast_any()):
                # torch's own op under autograd: C replays it for calls keyed as this one
                # (`_softmax`: softmax's work, without its composite's dispatch)
                _record_call(SOFTMAX_OP, recipes.Call(torch._softmax, (0, 1, recipes.constant(0)), (False,)),
                             (x, dim, None, None))
            return y
        if _functorch_active():
            return _SoftmaxWithGrad.apply(x, dim, stream)
        return _apply_softmax_with_grad(x, dim, stream)
    return _softmax_eager(x, dim, out, stream)


softmax = front_doors.c_front_door(softmax, _softmax_unreplayed, SOFTMAX_OP, key=("x", "dim", "out", "stream"))


#: Softmax under autograd of at most this many elements is torch's own (`torch.softmax`, whose
#: backward is a C++ node), not ours through `_SoftmaxWithGrad`: a Python autograd node costs
#: the forward and backward a Python frame each, and the backward the GIL on autograd's device
#: thread, which small problems do not earn back. Measured on an H200 host (benchmarks/softmax.py
#: --public-only, ``torch.autograd.grad`` of ``ops.softmax(x)``): 0.71-0.87x torch's step for
#: 1M-16.8M elements (8192x128 to 16384x1024), 1.21-2.0x from 33.5M (8192x4097, 65536x1024 and up).
AUTOGRAD_NATIVE_MAX_ELEMENTS = 1 << 24


def torch_softmax_serves_autograd(x: torch.Tensor) -> bool:
    """Whether ops' softmax of ``x`` under autograd is torch's own: ``x`` has at most
    `AUTOGRAD_NATIVE_MAX_ELEMENTS` elements and the settings in force allow the torch provider
    (a restriction such as ``settings(providers=["cuda_src"])`` keeps the choice among ours).

    Args:
        x: the softmax's input.

    Returns:
        True when ``torch.softmax`` serves the call.
    """
    return x.numel() <= AUTOGRAD_NATIVE_MAX_ELEMENTS and torch_provider_allowed()


def torch_provider_allowed() -> bool:
    """Whether the settings in force let the torch provider serve (no provider restriction, or
    one that names it): where they do, an operation may take torch's own op directly."""
    providers = _settings.get().providers
    return providers is None or "torch" in providers


_functorch_active = torch._C._are_functorch_transforms_active


def _new_like(t: torch.Tensor) -> torch.Tensor:
    """How ops' softmax functions make an allocating call's output: a dense (row-major) tensor of
    ``t``'s shape, dtype and device (what the recipe they record tells C to make)."""
    return t.new_empty(t.shape)


class _SoftmaxWithGrad(torch.autograd.Function):
    """`softmax` of a CUDA tensor that requires grad, eagerly (no tracer, no dispatch mode): the
    forward and backward run through the front door (their recorded launches), without the
    custom op's dispatch. Tracers and dispatch modes see ``kernel_api::softmax`` instead."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, stream: Any) -> torch.Tensor:
        # (grad mode is off in here)
        out = replay_call(SOFTMAX_OP, x, dim, None, stream) if replay_call is not None else None
        if out is None:
            out = _softmax_eager(x, dim, None, stream)
        ctx.save_for_backward(out)
        ctx.dim = dim
        ctx.settings = _settings.get()  # (autograd runs a CUDA backward on a thread of its own)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (out,) = ctx.saved_tensors
        token = _settings.set(ctx.settings)  # the backward's kernel is chosen as the forward's was
        try:
            if _grad_enabled():  # create_graph: the custom op, which says that it has no second derivative
                return torch.ops.kernel_api.softmax_backward(grad, out, ctx.dim), None, None
            return softmax_backward(grad, out, ctx.dim), None, None
        finally:
            _settings.reset(token)


# `_SoftmaxWithGrad.apply` without `torch.autograd.Function.apply`'s Python wrapper (which looks
# for functorch's wrappers in the arguments): the C apply itself, used while no functorch
# transform is active.
_apply_softmax_with_grad = torch._C._FunctionBase.__dict__["apply"].__get__(None, _SoftmaxWithGrad)


def _moved_dim(t: torch.Tensor, dim: Any) -> int | None:
    """For an operand the kernels cannot take as it is (``dim`` not last, or rows that are not
    dense and evenly spaced): ``dim`` normalised, so the caller moves it last into a contiguous
    copy; None when the kernels take ``t`` (or when ``dim`` is invalid: the arguments say why)."""
    ndim = t.dim()
    if isinstance(dim, bool) or not isinstance(dim, int) or ndim == 0 or not -ndim <= dim < ndim:
        return None
    d = dim % ndim
    if d == ndim - 1 and t.is_contiguous():
        return None
    if d == ndim - 1 and (t.shape[-1] <= 1 or t.stride(-1) == 1):
        try:
            t.view(-1, t.shape[-1])  # rows one stride apart: the kernels take them as they are
            return None
        except RuntimeError:
            pass
    return d


def _softmax_eager(x: torch.Tensor, dim: int, out: torch.Tensor | None, stream: Any) -> torch.Tensor:
    d = _moved_dim(x, dim) if isinstance(x, _Tensor) else None
    if d is not None:
        # As torch does for any layout: softmax along dim of a contiguous copy with dim last.
        y = _softmax_eager(x.movedim(d, -1).contiguous(), -1, None, stream).movedim(-1, d)
        if out is None:
            return y
        if out.shape != x.shape:
            raise ValueError(f"operand out: shape {tuple(out.shape)} must equal x's {tuple(x.shape)}")
        out.copy_(y)  # (copy_ bumps out's version)
        return out
    given = out is not None  # the caller's tensor: its version counter is bumped after the write
    if not given:
        out = _new_like(x)
    call_recorded(SOFTMAX_OP, SoftmaxArguments(x, out, dim=dim), (x, dim, out if given else None, stream),
                  None if given else out)
    if given:
        _increment_version((out,))
    return out


def softmax_backward(grad_out: torch.Tensor, out: torch.Tensor, dim: int = -1,
                     grad_in: torch.Tensor | None = None, stream: Any = None) -> torch.Tensor:
    """Gradient of softmax: ``out * (grad_out - sum(grad_out * out, dim))``."""
    if not _is_dynamo_compiling():
        if replay_call is not None:
            done = replay_call(SOFTMAX_BACKWARD_OP, grad_out, out, dim, grad_in, stream)
            if done is not None:
                return done
    return _softmax_backward_unreplayed(grad_out, out, dim, grad_in, stream)


def _softmax_backward_unreplayed(grad_out: torch.Tensor, out: torch.Tensor, dim: int = -1,
                                 grad_in: torch.Tensor | None = None, stream: Any = None) -> torch.Tensor:
    """`softmax_backward` after its replay attempt (what the C front door runs on a miss)."""
    for name, value in (("grad_out", grad_out), ("out", out)):
        if not isinstance(value, _Tensor):
            raise _not_a_tensor("softmax_backward", name, value)
    if grad_in is not None and not isinstance(grad_in, _Tensor):
        raise _not_a_tensor("softmax_backward", "grad_in", grad_in, True)
    if _is_compiling() or _dispatch_modes():
        return _traced_call(torch.ops.kernel_api.softmax_backward, stream, grad_in, grad_out, out, dim)
    return _softmax_backward_eager(grad_out, out, dim, grad_in, stream)


softmax_backward = front_doors.c_front_door(softmax_backward, _softmax_backward_unreplayed, SOFTMAX_BACKWARD_OP,
                                            key=("grad_out", "out", "dim", "grad_in", "stream"))


def _softmax_backward_eager(grad_out: torch.Tensor, out: torch.Tensor, dim: int, grad_in: torch.Tensor | None,
                            stream: Any) -> torch.Tensor:
    d = _moved_dim(out, dim) if isinstance(out, _Tensor) and isinstance(grad_out, _Tensor) else None
    if d is None and isinstance(grad_out, _Tensor) and isinstance(out, _Tensor):
        d = _moved_dim(grad_out, dim)
    if d is not None and grad_out.shape == out.shape:
        g = _softmax_backward_eager(grad_out.movedim(d, -1).contiguous(), out.movedim(d, -1).contiguous(), -1,
                                    None, stream).movedim(-1, d)
        if grad_in is None:
            return g
        if grad_in.shape != out.shape:
            raise ValueError(f"operand grad_in: shape {tuple(grad_in.shape)} must equal out's {tuple(out.shape)}")
        grad_in.copy_(g)
        return grad_in
    given = grad_in is not None  # the caller's tensor: its version counter is bumped after the write
    if not given:
        grad_in = _new_like(grad_out)  # (dense, like grad_out: C makes the outputs of replays so)
    call_recorded(SOFTMAX_BACKWARD_OP, SoftmaxBackwardArguments(grad_out, out, grad_in, dim=dim),
                  (grad_out, out, dim, grad_in if given else None, stream), None if given else grad_in)
    if given:
        _increment_version((grad_in,))
    return grad_in


def chosen_kernels() -> list[tuple[tuple, Kernel]]:
    """The choices ``kernel_api.ops`` remembers, for inspection: ``(problem_key, kernel)`` for
    each (`Arguments.problem_key`), in the order they were made."""
    return [(problem, kernel) for (_, problem, _), (kernel, _, _) in _dispatch.items()]


def clear_dispatch_cache() -> None:
    """Forget every choice and recorded launch (the next calls choose and compile again)."""
    _dispatch.clear()
    _fast.clear()
    for forget in choice_caches:
        forget()
    if _entry is not None:
        _entry.forget_replays()
    _tagged_policies.clear()
