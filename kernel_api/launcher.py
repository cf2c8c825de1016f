"""Launching compiled code again without per-call Python work.

A kernel offers this through one optional hook, `Kernel._launcher(args, artifact)`: a
`Launcher` says that every launch of ``artifact`` for operands whose raw metadata (dtypes,
shapes, strides, pointer alignment, device) equal ``args``' is one call
``launcher.function(*tensors, *launcher.tail, stream)``, the tensors in
``args.tensor_attributes`` order. Three fast paths follow from it:

- `Kernel.run` binds it to the arguments' tensors (`Launcher.bind`) and keeps the result on
  the arguments as a `Binding`: running the same arguments again is one call with the stream;
- `kernel_api.ops` keeps it under the operands' raw metadata and calls ``function`` for later
  calls with equal metadata, without building arguments (`Launcher.launch`);
- when ``function`` is a TVM-FFI function (`Launcher.ffi`), `kernel_api.ops` records
  ``(function, tail)`` as the launch of the call's recipe under its call key
  (`kernel_api.native.recipes`), which the native replay runs for repeated calls without
  Python at all; a kernel that launches through torch instead offers ``torch_call``
  (``torch_call(*inputs, *tail, out=output)`` on the current stream, or
  ``torch_call(*inputs, *tail)`` for an allocating call), which the recipe records as its
  torch call.

The stream comes last: a ``cuda.bindings`` CUstream from the Python paths
(`kernel_api.core.streams.to_cuda_stream`), the raw pointer (or None for the current stream)
when the native replay or a native bound launch calls a TVM-FFI function.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from . import native
from .core.artifact import CompiledArtifact
from .core.streams import current_raw_stream, stream_handle


def ffi_function(compiled: Any) -> Any:
    """The positional TVM-FFI function behind a compiled object, or None.

    CuTe DSL functions loaded from the artifact cache are TVM-FFI functions already; fresh
    compiles with named parameters come wrapped in a Python keyword-argument adapter
    (``__tvm_ffi_object__``), whose positional calls reach the same function. None when there
    is no function (compiled for another architecture without a GPU), when calls need
    Python-side conversion (pointer arguments), or when TVM-FFI is not installed.
    """
    try:
        import tvm_ffi
    except ImportError:  # nothing can be a TVM-FFI function then
        return None
    execution_args = getattr(compiled, "execution_args", None)
    if execution_args is not None and getattr(execution_args, "has_pointer_address_arg_specs", False):
        return None
    if not isinstance(compiled, tvm_ffi.Function):
        unwrap = getattr(compiled, "__tvm_ffi_object__", None)
        compiled = unwrap() if unwrap is not None else None
    if not isinstance(compiled, tvm_ffi.Function) or not compiled.__chandle__():
        return None
    return compiled


class Launcher:
    """``function(*tensors, *tail, stream)`` launches a compiled kernel; immutable.

    ``compiled`` is the function, or a `CompiledArtifact` whose ``compiled_obj`` is called. The
    positional TVM-FFI function behind either (`ffi_function`) is used where there is one, and
    ``ffi`` says so: then the native replay records ``(function, tail)`` and native bound
    launches call it. ``tail`` holds the constants the function takes after the operand tensors.

    A TVM-FFI function whose ``release_gil`` is False (what `CuteDslKernel` sets unless the
    kernel's ``keep_gil_during_launch`` is False) is bound through the native entry points,
    whose launches hold the GIL; one that releases the GIL around calls is bound as a plain
    partial, which lets other threads run while it launches.

    ``torch_call``: for a kernel that launches through torch (a tail of tensors only, such as a
    bias), a callable doing the same work as ``function`` on the caller's current stream, called
    as ``torch_call(*inputs, *tail, out=output)`` with the tensors in order, the output last
    (torch.matmul for `TorchGemm`'s product, torch.addmm's for its bias epilogues; SDPA on views
    for `TorchAttention`). The C entry points then run repeated `kernel_api.ops` calls without
    Python frames of ours: torch's own host time plus a microsecond or so. Allocating calls (no
    ``out``) call ``torch_call(*inputs, *tail)``, which returns a new output with the metadata
    of the one the operation makes (for gemm ``(*A.shape[:-1], N)``, contiguous, of A's dtype:
    what torch.matmul returns; a generated operation's calls check it once when they record).
    ``torch_order`` reorders those positional arguments (`torch_arguments`), so a torch function
    that takes them in another order is recorded itself, with no Python function around it.
    """

    __slots__ = ("function", "tail", "ffi", "torch_call", "torch_order")

    function: Callable[..., Any]
    tail: tuple
    ffi: bool
    torch_call: Callable[..., Any] | None
    torch_order: tuple[int, ...] | None

    def __init__(self, compiled: Any, tail: Sequence[Any] = (), torch_call: Callable[..., Any] | None = None,
                 torch_order: Sequence[int] | None = None) -> None:
        if isinstance(compiled, CompiledArtifact):
            compiled = compiled.compiled_obj
        resolved = ffi_function(compiled)
        function = compiled if resolved is None else resolved
        if not callable(function):
            raise TypeError(f"Launcher: expected a callable or a CompiledArtifact holding one, got "
                            f"{type(function).__name__}")
        try:
            constants = None if isinstance(tail, (str, bytes)) else tuple(tail)
        except TypeError:
            constants = None
        if constants is None:
            raise TypeError(f"Launcher: tail must be a sequence of the constants after the tensors, got {tail!r}")
        if torch_call is not None and (not callable(torch_call) or resolved is not None
                                       or not all(isinstance(c, torch.Tensor) for c in constants)):
            raise TypeError("Launcher: torch_call must be a callable, for a torch-launched function whose tail holds "
                            f"only tensors, got {torch_call!r}")
        order = None if torch_order is None else tuple(torch_order)
        if order is not None and (torch_call is None or len(set(order)) != len(order)
                                  or not all(isinstance(i, int) and i >= 0 for i in order)):
            raise TypeError(f"Launcher: torch_order must be distinct positions, with a torch_call, got {torch_order!r}")
        object.__setattr__(self, "function", function)
        object.__setattr__(self, "tail", constants)
        object.__setattr__(self, "ffi", resolved is not None)
        object.__setattr__(self, "torch_call", torch_call)
        object.__setattr__(self, "torch_order", order)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Launcher is immutable (cannot set {name})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Launcher is immutable (cannot delete {name})")

    def __repr__(self) -> str:
        function = getattr(self, "function", None)
        name = getattr(function, "__name__", type(function).__name__)
        call = getattr(self, "torch_call", None)
        return (f"Launcher({name}, tail={getattr(self, 'tail', None)!r}, ffi={getattr(self, 'ffi', None)}"
                f"{'' if call is None else ', torch_call=' + getattr(call, '__name__', type(call).__name__)})")

    def torch_arguments(self, values: Sequence[Any]) -> tuple:
        """``torch_call``'s positional arguments from ``(*inputs, *tail)``: in that order, or as
        ``torch_order`` picks them (``(2, 0, 1)``: torch.addmm's ``(bias, A, B)``)."""
        return tuple(values) if self.torch_order is None else tuple(values[i] for i in self.torch_order)

    def launch(self, tensors: Sequence[torch.Tensor], stream: Any) -> None:
        """Launch for ``tensors`` (in ``args.tensor_attributes`` order) on ``stream`` (a CUstream)."""
        self.function(*tensors, *self.tail, stream)

    def bind(self, tensors: Sequence[Any]) -> Callable[[Any], None]:
        """``launch(stream)`` for these tensors, reading them (their data, shape, strides) at each call."""
        if self.ffi and not getattr(self.function, "release_gil", True):
            entry = native.entry()
            if entry is not None:
                try:
                    # Reads the live tensors through torch's DLPack exchange API (no allocation)
                    # and passes the tail converted once: cheaper than a bare call.
                    return entry.bind(self.function, tuple(tensors), self.tail)
                except TypeError:  # operands or constants it cannot hold: the partial converts them
                    pass
        # Everything but the stream is fixed: a C-level partial, no Python frame per call.
        return functools.partial(self.function, *tensors, *self.tail)

    def bind_snapshot(self, tensors: Sequence[Any], live: Callable[[Any], None]) -> Callable[[Any], None]:
        """The launch for callers that vouch the tensors' shapes, strides and storage have not
        changed since ``live`` (this launcher's `bind` of them) was made: it may hold operands
        converted once. Data written in place is always seen.

        Converting a torch tensor for TVM-FFI costs ~0.1 us per call; operands converted once
        make a vouched-for call cheaper than a bare call with torch tensors. A native bound
        launch already costs less, and is returned as it is.
        """
        if not self.ffi or not isinstance(live, functools.partial) or live.func is not self.function:
            return live
        try:
            import tvm_ffi

            # Each converted from its own alias (detach), which keeps the storage alive even if
            # the caller's tensor is later pointed elsewhere with set_ (unsupported, but then
            # not a dangling pointer).
            packed = [tvm_ffi.from_dlpack(t.detach()) if isinstance(t, torch.Tensor) else t for t in tensors]
        except Exception:  # noqa: BLE001 - a dtype DLPack cannot carry: the live launch converts per call
            return live
        return functools.partial(self.function, *packed, *self.tail)


class Binding:
    """What `Kernel.run` keeps on arguments it ran (``args._binding``); immutable.

    ``artifact``: the compiled artifact the binding launches; ``launch``: ``launch(stream)``
    reading the arguments' live tensors, or None when the kernel offers no `Launcher` for
    them; ``checked_by``: the kernel whose support check passed for the arguments (None when
    every run so far vouched for them); ``snapshot``: the launch ``run(...,
    assume_supported_args=True)`` takes, which may hold operands converted once.
    """

    __slots__ = ("artifact", "launch", "checked_by", "snapshot")

    artifact: Any
    launch: Callable[[Any], None] | None
    checked_by: Any
    snapshot: Callable[[Any], None] | None

    def __init__(self, artifact: Any, launch: Callable[[Any], None] | None, checked_by: Any,
                 snapshot: Callable[[Any], None] | None) -> None:
        object.__setattr__(self, "artifact", artifact)
        object.__setattr__(self, "launch", launch)
        object.__setattr__(self, "checked_by", checked_by)
        object.__setattr__(self, "snapshot", snapshot)

    @classmethod
    def of(cls, launcher: Launcher | None, artifact: Any, tensors: Sequence[Any], checked_by: Any) -> "Binding":
        """The binding of ``launcher`` (None: no fast path) to ``tensors``."""
        if launcher is None:
            return cls(artifact, None, checked_by, None)
        live = launcher.bind(tensors)
        return cls(artifact, live, checked_by, launcher.bind_snapshot(tensors, live))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Binding is immutable (cannot set {name})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Binding is immutable (cannot delete {name})")

    def __repr__(self) -> str:
        checked = getattr(getattr(self.checked_by, "metadata", None), "kernel_name", self.checked_by)
        return (f"Binding({self.artifact!r}, launch={'yes' if self.launch is not None else 'none'}, "
                f"checked_by={checked!r}, snapshot={'own' if self.snapshot not in (None, self.launch) else 'live'})")


# ---- pieces launcher functions share ----------------------------------------------------------

def raw_stream(stream: Any, device: int) -> int:
    """The raw ``cudaStream_t`` of a launcher function's stream argument (a CUstream or an int;
    anything else `stream_handle` accepts, None being ``device``'s current stream)."""
    try:
        return int(stream)
    except TypeError:
        return stream_handle(stream, device)


def launch_workspace(size: int, device: int, stream: int) -> torch.Tensor:
    """``size`` bytes from torch's caching allocator for one launch on the raw ``stream`` of
    ``device``, owned by that stream: freed when the caller drops it, the block is reused only
    by work queued on the same stream after this launch."""
    where = torch.device("cuda", device)
    if current_raw_stream is not None and current_raw_stream(device) == stream:
        return torch.empty(size, dtype=torch.uint8, device=where)
    with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=where)):
        return torch.empty(size, dtype=torch.uint8, device=where)
