"""Repeated calls of the generated operations, replayed without building their arguments.

Every operation `define_operation` generates is replayed the same way, with no rule of its own.
A call takes the Python path the first time: it builds the arguments (checks, memory overlap),
lets the policy choose, compiles and launches. When the chosen kernel offers a `Launcher` that
keeps no tensor among its constants, and the arguments' tensors are the call's own or fixed views
of them, the call is recorded under everything the choice and the launch depend on:

- the settings' scope token (the policy in force and the providers it may use),
- the operation,
- the raw metadata of each tensor input and each given output: dtype, shape, strides, pointer
  alignment (the pointer's low 10 bits), device,
- the values and types of the other inputs,
- for outputs the call makes (the operation's ``fake``), their pointer alignments: their other
  metadata follow from the inputs', and the allocator's addresses vary from call to call.

A kernel whose launches take a workspace is replayed like any other: its launcher's function
takes the workspace it needs from torch's caching allocator on the launch stream, per call
(`kernel_api.launcher.launch_workspace`, as the front door's GEMM launchers do), so launches on
concurrent streams and in CUDA graph captures each get their own. A kernel's refusal for the
metadata (no `Launcher`) is recorded as well, so such calls skip asking it. A later call with an equal key makes its outputs as the first did,
picks the launch's tensors out of the call's (`Replay.pick`) and calls the launcher's function
on the current stream: no arguments, no choice, no `Kernel.run`. Equal metadata means the same
arguments summary, so the same choice and the same launch constants (the `Launcher` contract);
only memory overlap depends on more, so a call given outputs replays only when their bytes meet
no other tensor's (`outputs_apart`), and otherwise takes the Python path, which judges it.

An operation opted in with `replay_from_c` (attention) also records its calls for the native
replay (`kernel_api.native.recipes`), keyed by its front door's arguments: its front door asks C
first, which runs the recorded torch call or launch with no Python frame of this module.

The key is built in C by the native entry points' ``recall``/``remember`` (`kernel_api.native`,
the same raw-metadata key as the call key's tensor part), where they load; otherwise in Python, with the
same parts. Anything unusual declines to the Python path, which explains errors: tracing, torch
dispatch modes, autograd, tensor subclasses, meta or fake tensors, lazy negative or conjugate
bits, another current CUDA device than the recorded one, a stream given, an optional tensor
input given (its values may steer the arguments, as attention's sequence offsets do).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from operator import itemgetter
from typing import Any, Callable

import torch

from .. import native
from ..native import recipes
from ..arguments import Arguments, byte_extent
from ..kernel import Kernel
from ..core import tracing
from ..core.streams import cu_streams as _cu_streams, current_raw_stream as _current_raw_stream, to_cuda_stream
from ..tuning.scope import CURRENT as _settings
from .dispatch import call, choice_caches, launch, plain_state, record_replay

_Tensor = torch.Tensor
#: Tensor types replayed: plain tensors and parameters (a parameter adds no __torch_function__
#: or __torch_dispatch__ behaviour); other subclasses take the Python path, which sees them.
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
_is_compiling = tracing.is_compiling
_dispatch_modes = tracing.dispatch_mode_depth
_increment_version = torch._C._increment_version
_grad_enabled = torch.is_grad_enabled
_NO_LAUNCHER = Kernel._launcher
_current_device = torch._C._cuda_getDevice if hasattr(torch._C, "_cuda_getDevice") else torch.cuda.current_device

#: An operation's number sits at this bit of its key's tag, above the settings' ``policy_id``
#: (an address: user space ends below 2^48), then the bit of keys of calls that make their outputs.
_OPERATION_SHIFT = 48
_OPERATION_LIMIT = 1 << 11
_FRESH = 1 << 59
#: Entries per tensor key (one per value of the other inputs, e.g. eps), and Python-keyed
#: entries in all (the C store holds 4096, then forgets everything).
_VALUES_LIMIT = 256
_PYTHON_LIMIT = 4096

# The native entry points' recall/remember once they load (`native.when_entry_loads`); until
# then, or without them, the Python store keys the same parts.
_recall: Any = None
_remember: Any = None
_python_store: dict[tuple, dict] = {}

#: What `OperationReplay.fresh` returns when it did nothing: the caller takes its other paths.
DECLINED = object()
_empty_like = torch.empty_like
_dense = torch.contiguous_format


def _use_native(entry: Any) -> None:
    global _recall, _remember
    _recall, _remember = entry.recall, entry.remember


native.when_entry_loads(_use_native)


def forget() -> None:
    """Drop every recorded replay (`kernel_api.ops.clear_dispatch_cache` calls it)."""
    _python_store.clear()
    entry = native.entry() if _recall is not None else None
    if entry is not None:
        entry.forget()  # (the GEMM summaries go too: they are recomputed on their next call)


choice_caches.append(forget)


@dataclass(frozen=True, slots=True)
class Replay:
    """One recorded launch: ``function(*operands, *tail, stream)``.

    Attributes:
        function: the launcher's function.
        tail: its constants after the tensors.
        pick: the launch's tensors from the call's (inputs, then outputs; `derivation`), or None
            when they are the call's, in order.
        device: the CUDA device index launched on (-1: not a CUDA device, no stream).
        extents: the byte extents of the call's tensors (`outputs_apart`).
        token: the settings' scope token, kept alive while its id() is in the key.
    """

    function: Callable[..., Any]
    tail: tuple
    pick: Callable[[tuple], tuple] | None
    device: int
    extents: tuple[int, ...]
    token: Any


@dataclass(frozen=True, slots=True)
class PythonOnly:
    """Recorded where the chosen kernel offers no replay for the call's metadata (no `Launcher`,
    or a tensor among its constants): later such calls take the Python path without asking the
    kernel again.

    Attributes:
        token: as `Replay`'s.
    """

    token: Any


def outputs_apart(operands: tuple, first_output: int, extents: tuple[int, ...]) -> bool:
    """Whether each output's bytes meet no other operand's: the one overlap check of replayed
    calls that were given outputs (conservative: a call it refuses takes the Python path, whose
    arguments judge it exactly).

    Args:
        operands: the call's tensors, inputs then outputs.
        first_output: the index of the first output.
        extents: each operand's byte extent (`byte_extent`), fixed by the recorded metadata.
    """
    pointers = [t.data_ptr() for t in operands]
    for i in range(first_output, len(operands)):
        start, size = pointers[i], extents[i]
        if not size:
            continue
        for j, other in enumerate(pointers):
            if j != i and extents[j] and other < start + size and start < other + extents[j]:
                return False
    return True


def derivation(args: Arguments, operands: tuple) -> tuple | None:
    """How each of the arguments' tensors (``tensor_attributes`` order) comes from the call's
    ``operands``: the index of the one it is, or ``(index, shape, strides, offset)`` for a view
    of one (same dtype; ``offset`` in elements from that tensor's own); None when one is neither,
    or could come from several."""
    steps = []
    for name in args.tensor_attributes:
        t = getattr(args, name)
        found = [i for i, c in enumerate(operands) if c is t]
        if len(found) == 1:
            steps.append(found[0])
            continue
        if found or type(t) not in _PLAIN:
            return None
        storage = t.untyped_storage().data_ptr()
        sources = [i for i, c in enumerate(operands)
                   if c.dtype == t.dtype and c.device == t.device and c.untyped_storage().data_ptr() == storage]
        if len(sources) != 1 or not storage:
            return None
        source = operands[sources[0]]
        steps.append((sources[0], tuple(t.shape), t.stride(), t.storage_offset() - source.storage_offset()))
    return tuple(steps)


def _picker(steps: tuple, count: int) -> Callable[[tuple], tuple] | None:
    """`Replay.pick` for `derivation`'s ``steps``."""
    if any(type(s) is not int for s in steps):
        return partial(_made, steps)
    if steps == tuple(range(count)):
        return None
    if len(steps) == 1:
        return lambda operands, i=steps[0]: (operands[i],)
    return itemgetter(*steps)


def _made(steps: tuple, operands: tuple) -> tuple:
    """The launch's tensors for ``steps`` with views (`derivation`)."""
    made = []
    for s in steps:
        if type(s) is int:
            made.append(operands[s])
        else:
            source = operands[s[0]]
            made.append(source.as_strided(s[1], s[2], source.storage_offset() + s[3]))
    return tuple(made)


def _python_key(tag: int, operands: tuple) -> tuple | None:
    """The key `recall` builds in C, in Python: None for tensors it would not key (lazy bits,
    no memory)."""
    key: list = [tag]
    for t in operands:
        if t.is_neg() or t.is_conj() or (not t.data_ptr() and t.numel()):
            return None
        key.append((t.dtype, t.shape, t.stride(), t.data_ptr() & 1023, t.device))
    return tuple(key)


class OperationReplay:
    """The replays of one generated operation: `fresh` and `given` for repeated calls, `call`
    for the Python path (which records).

    A call whose outputs are all made here (``fresh``) is keyed by its tensor inputs, and its
    entry by the other inputs' values and the made outputs' pointer alignments (`_alignments`):
    the outputs' other metadata follow from the inputs' (the operation's ``fake``), and fresh
    memory cannot overlap the inputs; the values alone key how the outputs are made (`_makers`).
    A call given outputs is keyed by them too, its entry by the values.

    Args:
        index: the operation's number, 1 to 2047 (a part of every key; others are not replayed).
        name: the operation's qualified name (for errors).
        schema: the parsed torch schema (which inputs are tensors).
        fake, arguments, outputs: the `Operation`'s: how outputs are made, how the arguments are
            built, the output names.
    """

    __slots__ = ("bits", "name", "tensors", "values", "value_at", "n_inputs", "fake", "several", "arguments",
                 "outputs", "tensor_at", "number", "native")

    def __init__(self, index: int, name: str, schema: Any, fake: Callable[..., Any], arguments: Callable[..., Any],
                 outputs: tuple[str, ...]) -> None:
        self.bits = index << _OPERATION_SHIFT
        tensor_type = torch._C.TensorType.get()
        # (operations past the tag's room for numbers are never replayed: no tensor inputs kept)
        numbered = 0 < index < _OPERATION_LIMIT
        at = [i for i, a in enumerate(schema.arguments) if a.type == tensor_type] if numbered else []
        rest = [i for i, a in enumerate(schema.arguments) if a.type != tensor_type]
        self.n_inputs = len(at)
        self.tensors = (lambda inputs, i=at[0]: (inputs[i],)) if len(at) == 1 else itemgetter(*at) if at else None
        self.values = len(rest)
        self.value_at = rest[0] if len(rest) == 1 else itemgetter(*rest) if rest else None
        self.name, self.fake, self.arguments, self.outputs = name, fake, arguments, outputs
        self.several = len(outputs) > 1
        self.tensor_at = tuple(at)
        #: The operation's number in the native call key (`recipes.op_number`), keyed without
        #: cuBLAS's TF32 flag as the Python keys are (a generated operation's choice never reads
        #: it); `native`: whether its Python path records C recipes too (`replay_from_c`).
        self.number = recipes.op_number(name, recipes.ALL_STATE & ~recipes.TF32)
        self.native = False

    def _values_key(self, inputs: tuple) -> tuple:
        """The other inputs' values and types (``eps=1`` and ``eps=True`` are not ``eps=1.0``)."""
        n = self.values
        if n == 1:
            v = inputs[self.value_at]
            return (v, v.__class__)
        if n == 0:
            return ()
        return tuple([(v, v.__class__) for v in self.value_at(inputs)])

    def _found(self, tag: int, operands: tuple) -> dict | None:
        """The entries recorded for ``operands``' metadata under ``tag`` (the one lookup of
        every replay: `recall`'s key in C, `_python_key` without it); None also for operands that
        need the Python path (a tensor subclass, or autograd)."""
        grad = _grad_enabled()
        for t in operands:
            if t.__class__ not in _PLAIN or (grad and t.requires_grad):
                return None
        if _recall is not None:
            return _recall(tag, *operands)
        key = _python_key(tag, operands)
        return None if key is None else _python_store.get(key)

    def fresh(self, inputs: tuple, own: bool = False) -> Any:
        """Replay a call that makes its outputs (with the operation's ``fake``) on the current
        stream. The caller has ruled out tracing and dispatch modes.

        Args:
            inputs: every input, in schema order.
            own: on the Python path, return the outputs made here rather than `call`'s (the torch
                op's implementation returns what its ``fake`` describes).

        Returns:
            The outputs (one tensor, or a tuple); `DECLINED` when nothing is recorded for the
            tensor inputs or they need autograd or the Python path (nothing was made). A call
            recorded for its inputs but not for the alignments its new outputs took runs the
            Python path with those outputs, which records it.
        """
        if self.tensors is None:
            return DECLINED
        tensors = self.tensors(inputs)
        found = self._found(_settings.get().policy_id | self.bits | _FRESH, tensors)
        if found is None:
            return DECLINED
        n = self.values
        if n == 1:
            v = inputs[self.value_at]
            values: tuple = (v, v.__class__)
        else:
            values = self._values_key(inputs)
        try:
            makers = found.get(values)
        except TypeError:  # an unhashable value: never recorded
            return DECLINED
        if self.several:
            made = self.fake(*inputs) if makers is None else tuple(
                [_empty_like(tensors[j], memory_format=_dense) for j in makers])
            results = made
            alignments = _alignments(made)
        else:
            made = self.fake(*inputs) if makers is None else _empty_like(tensors[makers[0]], memory_format=_dense)
            results = (made,)
            alignments = made.data_ptr() & 1023
            alignments &= -alignments
        entry = found.get((values, alignments))
        if entry.__class__ is PythonOnly:
            return DECLINED if needs_op(inputs) else self.python_path(inputs, None, made, own, False)
        if entry is not None:
            device = entry.device
            if device < 0:
                stream = None
            elif _current_device() == device:
                stream = _cu_streams.get(_current_raw_stream(device)) if _current_raw_stream is not None else None
                if stream is None:
                    stream = to_cuda_stream(None)
            else:
                return DECLINED
            operands = tensors + results
            pick = entry.pick
            entry.function(*(operands if pick is None else pick(operands)), *entry.tail, stream)
            return made
        if needs_op(inputs):
            return DECLINED
        # (the outputs just made go to the Python path: the record is for their alignments)
        return self.python_path(inputs, None, made, own)

    def python_path(self, inputs: tuple, stream: Any, made: Any = None, own: bool = False,
                    record: bool = True) -> Any:
        """A call that makes its outputs, on the Python path (`call`, which records it).

        Args:
            inputs: every input, in schema order.
            stream: the launch stream (None: the current one).
            made: the outputs, made already by the operation's ``fake``; None: made here.
            own: return ``made`` rather than `call`'s result (the arguments' outputs).
            record: record the call (False: known not to be replayable).
        """
        if made is None:
            made = self.fake(*inputs)
        if self.several and not (isinstance(made, tuple) and len(made) == len(self.outputs)):
            raise ValueError(f"{self.name}: expected {len(self.outputs)} outputs {self.outputs}, got "
                             f"{type(made).__name__}")
        results = made if self.several else (made,)
        done = self.call(self.arguments(*inputs, **dict(zip(self.outputs, results))), inputs, results, stream, True,
                         record)
        return made if own else done

    def given(self, inputs: tuple, results: tuple) -> Any:
        """Replay a call given outputs (``results``: each given or made), on the current stream,
        when no output overlaps another operand. The caller has ruled out tracing, dispatch
        modes and autograd.

        Returns:
            The outputs (one tensor, or a tuple; their version counters bumped), or `DECLINED`
            (take the Python path, which records the call). A call whose kernel's refusal is
            recorded runs the Python path here, without recording.
        """
        if self.tensors is None:
            return DECLINED
        operands = self.tensors(inputs) + results
        found = self._found(_settings.get().policy_id | self.bits, operands)
        if found is None:
            return DECLINED
        try:
            entry = found.get(self._values_key(inputs))
        except TypeError:
            return DECLINED
        if entry is None:
            return DECLINED
        if entry.__class__ is PythonOnly:
            return self.call(self.arguments(*inputs, **dict(zip(self.outputs, results))), inputs, results, None,
                             False, False)
        if not outputs_apart(operands, self.n_inputs, entry.extents) or not _run(entry, operands):
            return DECLINED
        _increment_version(results)
        return results if self.several else results[0]

    def call(self, args: Arguments, inputs: tuple, results: tuple, stream: Any, fresh: bool,
             record: bool = True) -> Any:
        """The Python path: `kernel_api.ops.launch` of ``args`` (built from ``inputs`` and
        ``results``; ``fresh``: all made for this call), recorded for replay when it can be (see
        the module docstring) and ``record`` holds.

        Returns:
            What `kernel_api.ops.call` returns: the arguments' outputs.
        """
        if not isinstance(args, Arguments) or _is_compiling() or _dispatch_modes():
            return call(args, stream=stream)  # (which refuses them, saying why)
        # (read before the launch: a kernel may hand a made output its own memory, as the torch
        # provider's attention does, and the replay keys the outputs it makes, not those)
        alignments = _alignments(results)
        kernel, artifact = launch(args, stream)
        outputs = tuple([getattr(args, name) for name in type(args).output_names])
        _increment_version(outputs)
        if record and len(outputs) == len(results) and all(map(_is, outputs, results)):
            self._record(args, kernel, artifact, inputs, results, fresh, alignments)
            if self.native and stream is None:
                self._record_native(args, kernel, artifact, inputs, results, fresh)
        if not outputs:
            return None
        return outputs[0] if len(outputs) == 1 else outputs

    def _record(self, args: Arguments, kernel: Any, artifact: Any, inputs: tuple, results: tuple,
                fresh: bool, alignments: Any) -> None:
        if type(kernel)._launcher is _NO_LAUNCHER or self.tensors is None:
            return  # (the class offers no fast path: nothing to ask per call)
        tensors = self.tensors(inputs)
        operands = tensors + results
        if any(t.__class__ not in _PLAIN for t in operands) or len(set(map(id, operands))) != len(operands):
            return  # (the same tensor twice: which launch operand is which would be a guess)
        n = self.values
        others = (inputs[self.value_at],) if n == 1 else self.value_at(inputs) if n else ()
        if any(isinstance(v, _Tensor) for v in others):
            return  # an optional tensor given: its values may steer the arguments
        values = self._values_key(inputs)
        try:
            hash(values)
        except TypeError:
            return
        settings = _settings.get()
        if settings.policy_id >> _OPERATION_SHIFT:
            return
        tag = settings.policy_id | self.bits
        entry: Any = PythonOnly(settings.scope_token)
        # (a launcher of a kernel with a workspace makes it per call: the same call as any other)
        launcher = kernel._launcher(args, artifact)
        # (no fast path, or a constant that is this call's tensor: the kernel's answer for any
        # call with this metadata, kept as such)
        if launcher is not None and not any(isinstance(c, _Tensor) for c in launcher.tail):
            steps = derivation(args, operands)
            if steps is None:
                return
            entry = Replay(launcher.function, launcher.tail, _picker(steps, len(operands)),
                           args.device_index if args.device.type == "cuda" else -1,
                           tuple([byte_extent(t) for t in operands]), settings.scope_token)
        store = _store(tag | _FRESH, tensors) if fresh else _store(tag, operands)
        if store is not None:
            if len(store) >= _VALUES_LIMIT:
                store.clear()
            if fresh:
                store[(values, alignments)] = entry
                makers = _makers(tensors, results)
                if makers is not None:
                    store[values] = makers
            else:
                store[values] = entry

    def _record_native(self, args: Arguments, kernel: Any, artifact: Any, inputs: tuple, results: tuple,
                       fresh: bool) -> None:
        """Record, for the native replay (`kernel_api.native.recipes`), what this call of one
        output on the current stream ran, keyed as the front door's call ``(*inputs, out,
        stream)`` with the stream None and ``out`` None when the call made it (``fresh``): the
        kernel's torch call (returning a made output, or writing the given one; for a made one,
        run once more here to check what it returns, `_returns_like`), or its TVM-FFI launch (a
        made output made dense like the input it is like, `_makers`)."""
        if self.several or self.tensors is None:
            return
        n = self.values
        others = (inputs[self.value_at],) if n == 1 else self.value_at(inputs) if n else ()
        if any(isinstance(v, _Tensor) and not is_operand(args, v) for v in others):
            return  # an optional tensor given that is no operand: its values may steer the arguments
        tensors = self.tensors(inputs)
        if not plain_state((*tensors, *results)):
            return
        launcher = kernel._launcher(args, artifact)
        if launcher is None:
            return
        if not fresh:
            if launcher.torch_call is not None or launcher.ffi:
                record_replay(self.number, kernel, artifact, args, (*inputs, results[0], None))
            return
        makers = _makers(tensors, results)
        like = -1 if makers is None else self.tensor_at[makers[0]]
        if launcher.torch_call is None and like < 0:
            return
        if launcher.torch_call is not None and (_capturing(args) or not _returns_like(launcher, args, results[0])):
            return  # (the check runs the torch call: never into a CUDA graph being captured)
        record_replay(self.number, kernel, artifact, args, (*inputs, None, None), results[0], like)


def is_operand(args: Arguments, t: Any) -> bool:
    """Whether ``t`` is one of ``args``' operands (``tensor_attributes``), whose values never steer
    the arguments (the call key holds all an operand's part in the choice and the launch: its
    metadata), unlike inputs outside them, such as sequence offsets a CPU call reads."""
    return any(getattr(args, name) is t for name in args.tensor_attributes)


def _capturing(args: Arguments) -> bool:
    """Whether a CUDA graph is being captured on the current stream of the arguments' device."""
    return args.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _returns_like(launcher: Any, args: Arguments, made: Any) -> bool:
    """Whether the launcher's ``torch_call``, run once on the arguments' inputs, returns a tensor
    with the made output's metadata (shape, strides, dtype, device): what a replay returns in its
    place must be what the Python path returns (a backend may lay its output out otherwise, e.g.
    SDPA's math backend). A torch call that raises is not recorded either."""
    inputs = [t for t in (getattr(args, name) for name in args.tensor_attributes) if t is not made]
    try:
        got = launcher.torch_call(*launcher.torch_arguments((*inputs, *launcher.tail)))
    except Exception:  # noqa: BLE001 - not recorded; the Python path serves such calls
        return False
    return (isinstance(got, _Tensor) and got.shape == made.shape and got.stride() == made.stride()
            and got.dtype == made.dtype and got.device == made.device)


def replay_from_c(function: Callable[..., Any]) -> int:
    """Opt a generated operation of one output (``define_operation``'s ``function``) into the
    native replay: its Python path records, for calls on the current stream (the output made or
    given), the recipe of what ran, keyed by the arguments ``(*inputs, out, stream)`` in schema
    order (`OperationReplay._record_native`). A front door that calls
    ``replay(number, *inputs, out, stream)`` first then runs a repeated call without Python of
    kernel_api's.

    Returns:
        The operation's number in the call key.
    """
    found = function.replay
    found.native = True
    return found.number


def _makers(tensors: tuple, results: tuple) -> tuple[int, ...] | None:
    """For outputs the operation's ``fake`` made dense like tensor inputs (same shape, dtype and
    device: an activation's ``out``, a norm's ``grad_weight``), the index of such an input per
    output; None when some output is like none. A replay then makes them with
    ``torch.empty_like(input, memory_format=torch.contiguous_format)`` instead of calling
    ``fake``: the same metadata (``fake`` follows the inputs' metadata and values, which the key
    holds), in half ``new_empty``'s host time and without a Python frame."""
    makers = []
    for r in results:
        for j, t in enumerate(tensors):
            if r.shape == t.shape and r.dtype == t.dtype and r.device == t.device:
                dense = _empty_like(t, memory_format=_dense)
                if r.stride() == dense.stride() and r.__class__ is dense.__class__:
                    makers.append(j)
                    break
        else:
            return None
    return tuple(makers)


def _alignments(results: tuple) -> Any:
    """The made outputs' pointer alignments (the largest power of two dividing the address, up
    to 1024 bytes, 0 for more: what arguments summaries read of a pointer), as a part of a fresh
    call's key: one for one output, a tuple for several."""
    if len(results) == 1:
        low = results[0].data_ptr() & 1023
        return low & -low
    return tuple([(p & 1023) & -(p & 1023) for p in [t.data_ptr() for t in results]])


def needs_op(inputs: tuple) -> bool:
    """Whether an eager call goes to the torch op: an input requires grad with grad mode on
    (autograd records the op), or is a meta tensor (the fake implementation answers)."""
    grad = _grad_enabled()
    for v in inputs:
        if isinstance(v, _Tensor) and (v.is_meta or (grad and v.requires_grad)):
            return True
    return False


def _run(entry: Replay, operands: tuple) -> bool:
    """Launch ``entry`` for ``operands`` on the current stream; False (nothing launched) when
    another CUDA device than the recorded one is current."""
    device = entry.device
    if device >= 0:
        if _current_device() != device:
            return False
        stream = _cu_streams.get(_current_raw_stream(device)) if _current_raw_stream is not None else None
        if stream is None:
            stream = to_cuda_stream(None)
    else:
        stream = None
    pick = entry.pick
    entry.function(*(operands if pick is None else pick(operands)), *entry.tail, stream)
    return True


def _is(a: Any, b: Any) -> bool:
    return a is b


def _store(tag: int, operands: tuple) -> dict | None:
    """The dict of `Replay` by input values for ``tag`` and the operands' metadata, made when
    missing; None when the operands cannot be keyed (the call is not recorded)."""
    if _remember is None:
        native.entry()  # loads the entry points once (recording happens once per key)
    if _remember is not None:
        found = _recall(tag, *operands)
        if found is None:
            found = {}
            if not _remember(tag, found, *operands):
                return None
        return found
    key = _python_key(tag, operands)
    if key is None:
        return None
    found = _python_store.get(key)
    if found is None:
        if len(_python_store) >= _PYTHON_LIMIT:
            _python_store.clear()
        found = _python_store[key] = {}
    return found


__all__ = ["DECLINED", "OperationReplay", "PythonOnly", "Replay", "derivation", "forget", "is_operand", "needs_op",
           "outputs_apart", "replay_from_c"]
