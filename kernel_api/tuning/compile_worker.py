"""Compiling kernels in worker processes that never import the caller's ``__main__``.

`PickBest` compiles its candidates in parallel so that the tuning process then loads each
artifact from the shared disk cache in milliseconds; ``kernel-api precompile`` fills the cache
with them ahead of time (`compile_requests`, requests of many shapes at once). The workers are started as
``python -m kernel_api.tuning.compile_worker``: unlike ``multiprocessing``'s spawn start method,
that does not re-run the user's script (a script without an ``if __name__ == "__main__":``
guard would otherwise start copies of itself).

Protocol: the parent writes requests to a worker's stdin and reads replies from its stdout,
each message a 4-byte big-endian length and a UTF-8 JSON object. A request names one kernel
instance (its class's module and qualified name, and its kernel name), the target cc and a
description of the arguments (shapes, strides, dtypes, pointer alignment) from which the
worker rebuilds look-alike arguments on the ``meta`` device (no memory). The reply carries
the kernel name and None or the failure's message. End of input ends the worker; a worker
whose parent died exits too (it watches its parent id), so none outlives the tuning process.

The workers get the parent's environment (``KERNEL_API_CACHE_DIR`` among it) and its
``sys.path`` (through ``PYTHONPATH``), so they import the same ``kernel_api`` and the same
plugin and user kernel modules. A kernel class defined in ``__main__`` or inside a function
cannot be imported by a worker: such kernels are left to the parent, which compiles every
candidate anyway when it measures them.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import io
import json
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import torch

from ..arguments import Arguments, GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments
from ..arguments.base import unbound_copy

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
#: Seconds a worker gets to exit after its input is closed before it is killed.
_EXIT_GRACE_S = 10.0
#: How often a worker checks that its parent is still alive.
_PARENT_POLL_S = 0.5
#: Default limit on one kernel's compile in a worker.
DEFAULT_COMPILE_TIMEOUT_S = 900.0


class WorkerError(RuntimeError):
    """A worker died, timed out or broke the protocol."""


@dataclasses.dataclass(frozen=True)
class CompileRequest:
    """One kernel to compile: which instance, for which arguments signature and cc."""

    kernel_module: str
    kernel_class: str
    kernel_name: str
    cc: int
    kind: str
    arguments: dict


# ---- argument descriptions ------------------------------------------------------------------
#: The most elements of a tensor whose values a description carries (integer operands such as
#: class indices, tensors outside the operands such as sequence offsets): a larger one is
#: described without them, enough for a compile but not to rebuild on a device.
MAX_DESCRIBED_VALUES = 1 << 16


def _tensor(x: torch.Tensor) -> dict:
    # The pointer's offset in elements, modulo the largest divisibility anyone checks.
    offset = (x.data_ptr() // x.element_size()) % 128 if x.data_ptr() else 0
    return {"shape": list(x.shape), "stride": list(x.stride()), "dtype": str(x.dtype).split(".")[-1],
            "offset": offset}


class _TensorFreePickler(pickle.Pickler):
    """Pickles an arguments object whose tensor fields were taken out: any tensor left (inside
    another object) refuses, so no device memory travels and nothing is described wrongly."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            raise pickle.PicklingError("a tensor inside another field of the arguments")
        return NotImplemented


def _slot_names(cls: type) -> list[str]:
    return [name for klass in reversed(cls.__mro__) for name in getattr(klass, "__slots__", ())]


def _describe_any(args: Arguments) -> dict | None:
    """Any arguments type: the object pickled without its tensors (its summary, scalars and
    type), and each tensor field described (`_tensor`): a floating operand by its layout, a
    field that is one tensor with an earlier one by that field's name, an integer operand (class
    indices) or a tensor outside the operands (sequence offsets) with its values too, where they
    are at most `MAX_DESCRIBED_VALUES` (else ``values`` is None). None when that cannot be done."""
    shell = unbound_copy(args)
    fields: dict[str, dict] = {}
    first: dict[int, str] = {}
    for name in _slot_names(type(args)):
        value = getattr(args, name, None)
        if not isinstance(value, torch.Tensor):
            continue
        if id(value) in first:
            fields[name] = {"same_as": first[id(value)]}
        else:
            first[id(value)] = name
            fields[name] = _tensor(value)
            if name not in args.tensor_attributes or not value.is_floating_point():
                carried = value.numel() <= MAX_DESCRIBED_VALUES and value.device.type != "meta"
                fields[name]["values"] = value.reshape(-1).tolist() if carried else None
        setattr(shell, name, None)
    buffer = io.BytesIO()
    try:
        _TensorFreePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(shell)
    except Exception as exc:  # an unpicklable field: compiled in the parent
        logger.debug("%s cannot be described to a worker: %s", type(args).__name__, exc)
        return None
    return {"object": base64.b64encode(buffer.getvalue()).decode("ascii"), "tensors": fields}


def describe_arguments(args: Any) -> tuple[str, dict] | None:
    """``(kind, description)`` from which `arguments_from_description` rebuilds arguments of
    the same signature (dtypes, shapes, strides, pointer alignment), or None when a worker
    cannot rebuild them (an epilogue's extra tensors). GEMM and softmax are described by their
    operands; any other `Arguments` type as ``"arguments"`` (`_describe_any`)."""
    tensor = _tensor
    if isinstance(args, GemmArguments):
        if args.epilogue is not None:
            return None  # epilogue tensors: compile in the parent
        return "gemm", {"A": tensor(args.A), "B": tensor(args.B), "out": tensor(args.out),
                        "acc": args.accumulator_type.value}
    if isinstance(args, SoftmaxArguments):
        return "softmax", {"x": tensor(args.x), "out": tensor(args.out), "dim": args.dim}
    if isinstance(args, SoftmaxBackwardArguments):
        return "softmax_bwd", {"grad_out": tensor(args.grad_out), "out": tensor(args.out),
                               "grad_in": tensor(args.grad_in), "dim": args.dim}
    if isinstance(args, Arguments):
        described = _describe_any(args)
        return None if described is None else ("arguments", described)
    return None


def arguments_from_description(kind: str, description: dict, device: str | torch.device = "meta") -> Any:
    """Arguments with the described signature: on the ``meta`` device (no memory), or on
    ``device`` with uninitialised memory (tuning fills its own random inputs)."""
    def make(x: dict) -> torch.Tensor:
        dtype = getattr(torch, x["dtype"])
        shape, stride, offset = tuple(x["shape"]), tuple(x["stride"]), x["offset"]
        if torch.device(device).type == "meta":
            # A meta tensor's data_ptr is its storage offset in bytes: the offset keeps the alignment.
            return torch.empty(0, dtype=dtype, device="meta").as_strided(shape, stride, offset)
        # The storage's own alignment is generous (CUDA allocations: 512 bytes), so the offset in
        # elements reproduces the described pointer alignment.
        extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
        return torch.empty(offset + extent, dtype=dtype, device=device).as_strided(shape, stride, offset)
    if kind == "gemm":
        return GemmArguments(make(description["A"]), make(description["B"]), make(description["out"]),
                             accumulator_type=description["acc"])
    if kind == "softmax":
        return SoftmaxArguments(make(description["x"]), make(description["out"]), dim=description["dim"])
    if kind == "softmax_bwd":
        return SoftmaxBackwardArguments(make(description["grad_out"]), make(description["out"]),
                                        make(description["grad_in"]), dim=description["dim"])
    if kind == "arguments":
        return _rebuild_any(description, make, torch.device(device))
    raise ValueError(f"arguments kind {kind!r} is not one a worker can rebuild")


def _rebuild_any(description: dict, make: Callable[[dict], torch.Tensor], device: torch.device) -> Any:
    """The arguments `_describe_any` described, their tensors made by ``make`` (on ``device``).

    On a real device the arguments are moved to it: ``device``, ``device_index`` and the last
    entry of the signature, which is the device index by the arguments types' convention
    (choices are per device); tensors whose values matter get the described ones (ValueError
    naming the field when they were not carried)."""
    args = pickle.loads(base64.b64decode(description["object"]))
    made: dict[str, torch.Tensor] = {}
    for name, field in description["tensors"].items():
        if "same_as" in field:
            made[name] = made[field["same_as"]]
        else:
            made[name] = make(field)
            if "values" in field and device.type != "meta":
                if field["values"] is None:
                    raise ValueError(f"operand {name}: its values matter and were not described (more than "
                                     f"{MAX_DESCRIBED_VALUES} elements, or a meta tensor); tune it with PickBest().tune")
                values = torch.tensor(field["values"], dtype=made[name].dtype).reshape(field["shape"])
                made[name].copy_(values)
        setattr(args, name, made[name])
    if device.type != "meta":
        index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda"
                                                                else -1)
        old = args.device_index
        args.device, args.device_index = torch.device(device.type, index) if index >= 0 else device, index
        signature = args.signature
        if isinstance(signature, tuple) and signature and signature[-1] == old:
            args.signature = signature[:-1] + (index,)
    return args


def importable_class(kernel_class: type) -> bool:
    """Whether a worker can import ``kernel_class`` by module and name (not from ``__main__``,
    not defined inside a function)."""
    module = getattr(kernel_class, "__module__", None)
    return bool(module) and module != "__main__" and "<locals>" not in kernel_class.__qualname__


# ---- framing --------------------------------------------------------------------------------
def _encode(message: dict) -> bytes:
    data = json.dumps(message).encode()
    return _LENGTH.pack(len(data)) + data


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes:
    chunks = []
    while size:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
        chunk = os.read(fd, size)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _read_message(fd: int, deadline: float | None = None) -> dict:
    (size,) = _LENGTH.unpack(_read_exact(fd, _LENGTH.size, deadline))
    return json.loads(_read_exact(fd, size, deadline))


# ---- the worker process ---------------------------------------------------------------------
def _compile_one(request: CompileRequest) -> str | None:
    """Compile one kernel into the disk caches; None on success, else the failure's message."""
    from .. import registry

    try:
        # Registers the class (user and plugin modules register on import).
        importlib.import_module(request.kernel_module)
    except Exception as exc:
        return f"the worker cannot import module {request.kernel_module!r}: {type(exc).__name__}: {exc}"
    try:
        args = arguments_from_description(request.kind, request.arguments)
        found = registry.get_kernels(args, cc=request.cc,
                                     metadata_filter=lambda m: m.kernel_name == request.kernel_name)
        for kernel in found:
            cls = type(kernel)
            if (cls.__module__, cls.__qualname__) == (request.kernel_module, request.kernel_class):
                kernel.compile(args, cc=request.cc)
                return None
        return (f"{request.kernel_name} ({request.kernel_module}.{request.kernel_class}) is not among the "
                f"worker's kernels for these arguments")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent:
            os._exit(1)


def main() -> None:
    """Serve compile requests from stdin until it closes (see the module docstring)."""
    # The protocol owns the original stdout; anything compilers or libraries print goes to stderr.
    reply = os.dup(1)
    os.dup2(2, 1)
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="kernel_api-parent-watch").start()
    while True:
        try:
            message = _read_message(0)
        except EOFError:
            return
        request = CompileRequest(**message)
        failure = _compile_one(request)
        data = _encode({"kernel_name": request.kernel_name, "failure": failure})
        view = memoryview(data)
        while view:
            view = view[os.write(reply, view):]


# ---- the parent side ------------------------------------------------------------------------
def worker_environment() -> dict[str, str]:
    """The parent's environment, with its import path so a worker process (compile or tuning
    worker) imports the same modules."""
    env = dict(os.environ)
    # In the parent's order, so that every module resolves as it did there.
    paths: list[str] = []
    for p in sys.path:
        p = os.path.abspath(p) if p else os.getcwd()
        if p not in paths and os.pathsep not in p:
            paths.append(p)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if package_root not in paths:  # kernel_api imported by other means than sys.path
        paths.insert(0, package_root)
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


class _Worker:
    """One ``python -m kernel_api.tuning.compile_worker`` process; its stderr goes to a temporary
    file whose tail explains a crash."""

    def __init__(self, env: dict[str, str]) -> None:
        self.stderr = tempfile.TemporaryFile()
        # -P (3.11+): the working directory does not shadow the modules on the parent's path.
        flags = ["-P"] if sys.version_info >= (3, 11) else []
        self.process = subprocess.Popen([sys.executable, *flags, "-m", "kernel_api.tuning.compile_worker"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                        env=env, bufsize=0, close_fds=True)

    def compile(self, request: CompileRequest, timeout: float | None) -> str | None:
        try:
            self.process.stdin.write(_encode(dataclasses.asdict(request)))
        except OSError:
            raise WorkerError(self._death("could not take the request")) from None
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            reply = _read_message(self.process.stdout.fileno(), deadline)
        except TimeoutError:
            raise WorkerError(f"compiling took longer than {timeout:g} s; the worker was stopped") from None
        except (EOFError, ValueError):
            raise WorkerError(self._death("died while compiling")) from None
        return reply["failure"]

    def _death(self, what: str) -> str:
        try:
            code = self.process.wait(timeout=_EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            code = None
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace").strip()[-800:]
        return f"the compile worker {what} (exit code {code})" + (f": {tail}" if tail else "")

    def close(self) -> None:
        """Close its input (it exits), wait briefly, kill it if it does not."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=_EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            self.kill()
        self._release()

    def kill(self) -> None:
        """Kill it and release its pipes (by the thread that talks to it)."""
        self.signal_kill()
        self.process.wait()
        self._release()

    def signal_kill(self) -> None:
        """Kill it, leaving its pipes to the thread that talks to it (which then reads EOF)."""
        if self.process.poll() is None:
            try:
                self.process.kill()
            except OSError:
                pass

    def _release(self) -> None:
        for stream in (self.process.stdin, self.process.stdout, self.stderr):
            try:
                stream.close()
            except OSError:
                pass


def compile_in_workers(args: Any, kernels: list, cc: int, num_workers: int,
                       progress: Callable[[int, int, str], None] | None = None,
                       timeout: float | None = DEFAULT_COMPILE_TIMEOUT_S) -> dict[str, str | None]:
    """Compile ``kernels`` for ``args``' signature and ``cc`` in up to ``num_workers`` worker
    processes, filling the shared disk caches.

    Args:
        args: the arguments the kernels will run with (only their signature matters).
        kernels: kernel instances; those a worker cannot import (classes defined in
            ``__main__`` or in a function) and all of them when the arguments cannot be
            described to a worker (an epilogue) are left out, for the caller to compile.
        cc: the target architecture.
        num_workers: the most worker processes to start.
        progress: called as ``progress(done, total, label)`` after each kernel.
        timeout: seconds one compile may take before its worker is killed (None: no limit).

    Returns:
        ``{kernel_name: None (compiled) or the failure's message}`` for every kernel sent to a
        worker. A failure (a compile error, a crashed or timed-out worker) concerns that
        kernel only: the remaining kernels go on in a fresh worker.
    """
    described = describe_arguments(args)
    if described is None:
        return {}
    kind, description = described
    cached: dict[str, str | None] = {}
    pending = []
    for kernel in uncached(kernels, args, cc, cached):
        request = compile_request(kernel, cc, kind, description)
        if request is not None:
            pending.append(request)
    failures = compile_requests(pending, num_workers, progress=progress, timeout=timeout)
    return {**cached, **{request.kernel_name: failure for request, failure in zip(pending, failures)}}


def uncached(kernels: list, args: Any, cc: int, hits: dict[str, str | None] | None = None) -> list:
    """Those of ``kernels`` whose artifact for ``args`` and ``cc`` is not in the disk caches:
    the others are loaded in this process (`kernel_api.kernel.compile_from_cache_only`, which
    compiles nothing) and entered in ``hits`` as compiled (None). A warm cache (a bundle
    installed, an earlier tuning) then starts no worker process at all."""
    from ..kernel import compile_from_cache_only

    left = []
    for kernel in kernels:
        if compile_from_cache_only(kernel, args, cc) is None:
            left.append(kernel)
        elif hits is not None:
            hits[kernel.metadata.kernel_name] = None
    if len(left) < len(kernels):
        logger.debug("%d of %d candidate(s) loaded from the disk caches; %d left to compile in workers",
                     len(kernels) - len(left), len(kernels), len(left))
    return left


def compile_request(kernel: Any, cc: int, kind: str, description: dict) -> CompileRequest | None:
    """The request that compiles ``kernel`` for described arguments (`describe_arguments`) and
    ``cc`` in a worker, or None when a worker cannot import its class (it is logged)."""
    cls = type(kernel)
    if not importable_class(cls):
        logger.debug("%s: class %s.%s cannot be imported by a worker; compiled in this process",
                     kernel.metadata.kernel_name, cls.__module__, cls.__qualname__)
        return None
    return CompileRequest(cls.__module__, cls.__qualname__, kernel.metadata.kernel_name, int(cc), kind, description)


def compile_requests(requests: list[CompileRequest], num_workers: int,
                     progress: Callable[[int, int, str], None] | None = None,
                     timeout: float | None = DEFAULT_COMPILE_TIMEOUT_S) -> list[str | None]:
    """Run compile ``requests`` (of any arguments and cc each) in up to ``num_workers`` worker
    processes, filling the shared disk caches; returns, in the requests' order, None (compiled)
    or the failure's message. A failure concerns that request only: the others go on, in a
    fresh worker if the failing one died. ``progress`` and ``timeout`` are as in
    `compile_in_workers`."""
    if not requests:
        return []
    pending = list(enumerate(requests))
    total = len(pending)
    pending.reverse()  # popped from the end: the caller's order
    results: dict[int, str | None] = {}
    live: set[_Worker] = set()
    errors: list[BaseException] = []
    lock = threading.Lock()
    stopping = threading.Event()
    env = worker_environment()

    def drive() -> None:
        worker = None
        try:
            while not stopping.is_set():
                with lock:
                    if not pending:
                        return
                    index, request = pending.pop()
                failure: str | None
                try:
                    if worker is None:
                        with lock:
                            if stopping.is_set():
                                return
                            worker = _Worker(env)
                            live.add(worker)
                    failure = worker.compile(request, timeout)
                except (WorkerError, OSError) as exc:
                    failure = str(exc)
                    if worker is not None:
                        worker.kill()
                        with lock:
                            live.discard(worker)
                        worker = None
                if failure is not None:
                    logger.info("compile worker: %s: %s", request.kernel_name, failure)
                with lock:  # one progress call at a time, in order
                    results[index] = failure
                    if progress is not None:
                        label = f"compiled {request.kernel_name}" if failure is None else f"{request.kernel_name}: {failure}"
                        progress(len(results), total, label)
        except BaseException as exc:  # e.g. a failing progress callback: re-raised by the caller's thread
            errors.append(exc)
            stopping.set()
        finally:
            if worker is not None:
                worker.close()
                with lock:
                    live.discard(worker)

    threads = [threading.Thread(target=drive, daemon=True, name=f"kernel_api-compile-{i}")
               for i in range(max(1, min(num_workers, total)))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        # Whatever ends the wait (KeyboardInterrupt included), no worker outlives the call: the
        # killed workers' threads see their pipes close and finish.
        stopping.set()
        with lock:
            doomed = list(live)
        for worker in doomed:
            worker.signal_kill()
        for t in threads:
            t.join(timeout=_EXIT_GRACE_S)
    if errors:
        raise errors[0]
    return [results.get(i, "not compiled: the compile workers were stopped") for i in range(total)]


if __name__ == "__main__":
    main()
