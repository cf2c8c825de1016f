"""CUDA streams: every spelling kernel_api accepts, converted in one place.

A stream may be given as

- None: torch's current stream, on the current device (or on ``device``, where the caller
  knows the operands' device);
- a ``torch.cuda.Stream`` (``torch.cuda.ExternalStream`` included);
- an int: a raw ``cudaStream_t`` (0 is the legacy default stream);
- a ``cuda.bindings.driver.CUstream``;
- any object with the CUDA stream protocol, ``__cuda_stream__() -> (version, handle)``
  (cuda.core streams, CuPy streams...).

Anything else, bool included, raises TypeError naming its type. Two conversions follow these
rules: `stream_handle` gives the raw handle (an int), for launchers that take one (the cuda_src
provider's driver launches); `to_cuda_stream` gives a ``CUstream``, the stream argument of
CuTe DSL and TVM-FFI functions.

`to_cuda_stream` caches, so that a launch loop pays no conversion: CUstreams by raw handle
(`cu_streams`), and the last stream object it converted with its CUstream (`last_stream`, one
tuple so that threads read a consistent pair). Hot paths read those inline instead of calling
it: ``last = streams.last_stream; last[1] if stream is last[0] else to_cuda_stream(stream)``
(`Kernel.run`'s bound launch), and ``cu_streams.get(current_raw_stream(device))`` for the
current stream (`kernel_api.ops`). None is never the cached object (the current stream
changes), nor are ints (their ids are reused).

The native entry points (``kernel_api/native/python_entry.cc``, its ``StreamArgument``) convert
their stream argument by the same rules, narrowed to what reaches them: None is the current
stream of the first tensor's device (torch's, read through the DLPack exchange API; none for
CPU tensors), an int is passed on as an int, any other object as the pointer ``int()`` gives
(a CUstream's handle). Python turns every other spelling into a CUstream with `to_cuda_stream`
first: `Kernel.run` before calling a bound launch; replays run on the current stream.
tests/test_streams.py checks that both sides give
the same handle for each spelling.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

#: torch's current raw stream of a device index, without building a torch.cuda.Stream (which
#: costs microseconds); None on builds without CUDA.
current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)

#: raw handle -> CUstream (a value wrapper: cached to save its construction per call)
cu_streams: dict[int, Any] = {}
_CU_STREAMS_LIMIT = 4096

#: (the stream object `to_cuda_stream` converted last, its CUstream)
last_stream: tuple[Any, Any] = (object(), None)


def stream_handle(stream: Any = None, device: int | None = None) -> int:
    """The raw ``cudaStream_t`` value (an int) of any accepted stream spelling.

    ``device`` (an index) says whose current stream None means; None: the current device's.
    """
    if stream is None:
        if current_raw_stream is not None:
            return current_raw_stream(_current_device() if device is None else device)
        return torch.cuda.current_stream(device).cuda_stream
    if type(stream) is int:
        return stream
    if isinstance(stream, torch.cuda.Stream):
        return stream.cuda_stream
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        return int(protocol()[1])
    if type(stream).__name__ == "CUstream":  # cuda.bindings versions without the protocol
        return int(stream)
    if isinstance(stream, int) and not isinstance(stream, bool):
        return int(stream)
    raise TypeError(f"stream: expected a torch.cuda.Stream, CUstream, int handle, an object with "
                    f"__cuda_stream__, or None, got {type(stream).__name__}")


def to_cuda_stream(stream: Any = None) -> Any:
    """A ``cuda.bindings.driver.CUstream`` for any accepted stream spelling (None: torch's
    current stream on the current device)."""
    global last_stream
    last = last_stream
    if stream is last[0]:
        return last[1]
    if stream is None:
        if current_raw_stream is not None:
            handle = current_raw_stream(_current_device())
        else:
            handle = torch.cuda.current_stream().cuda_stream
    elif type(stream) is torch.cuda.Stream:
        handle = stream.cuda_stream
    else:
        from cuda.bindings import driver

        if isinstance(stream, driver.CUstream):
            last_stream = (stream, stream)
            return stream
        handle = stream_handle(stream)
    found = cu_streams.get(handle)
    if found is None:
        from cuda.bindings import driver

        if len(cu_streams) > _CU_STREAMS_LIMIT:
            cu_streams.clear()
        found = cu_streams[handle] = driver.CUstream(handle)
    if stream is not None and type(stream) is not int:
        last_stream = (stream, found)
    return found


def stream_context(device: torch.device, stream: Any) -> Any:
    """The launch stream as torch's current one, for code that launches on torch's (another
    library's kernels, torch ops).

    Args:
        device: the operands' device.
        stream: any stream spelling kernel_api accepts (None: the current one).

    Returns:
        A context manager: ``torch.cuda.stream`` of it, or a null context when it is current.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    handle = stream_handle(stream, index)
    if handle == torch.cuda.current_stream(index).cuda_stream:
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(handle, device=torch.device("cuda", index)))
