"""Streams: one set of conversion rules (kernel_api.core.streams), which the native entry points'
C converter (python_entry.cc's StreamArgument) mirrors. For every accepted spelling the Python
conversions and the C one give the same raw handle; the `gpu` tests check the spellings that
need a device (torch streams, None as the current stream)."""

from __future__ import annotations

import pytest
import torch
from cuda.bindings import driver

import kernel_api.utils
from kernel_api import native
from kernel_api.core import streams
from kernel_api.core.streams import stream_handle, to_cuda_stream
from kernel_api.nvrtc import cubin_launcher as cuda_src_launcher


class ProtocolStream:
    """A stream known only through the CUDA stream protocol (as cuda.core's and CuPy's are)."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


# (spelling, its raw handle, whether the C converter takes it as it is)
CPU_SPELLINGS = [
    (0, 0, True),
    (7, 7, True),
    (2**40, 2**40, True),
    (driver.CUstream(0), 0, True),
    (driver.CUstream(4096), 4096, True),
    (ProtocolStream(8192), 8192, False),  # the C side needs it converted first (Python does that)
]
_IDS = ["int0", "int7", "int2**40", "CUstream0", "CUstream4096", "protocol"]


def test_there_is_one_set_of_conversion_functions():
    assert kernel_api.utils.to_cuda_stream is to_cuda_stream and kernel_api.utils.stream_handle is stream_handle
    assert not hasattr(cuda_src_launcher, "raw_stream")  # no second name for the same conversion
    from kernel_api import kernel
    from kernel_api.ops import dispatch as ops

    assert kernel.to_cuda_stream is to_cuda_stream and ops.to_cuda_stream is to_cuda_stream
    assert ops._cu_streams is streams.cu_streams


@pytest.mark.parametrize("spelling, handle, _", CPU_SPELLINGS, ids=_IDS)
def test_python_conversions_agree(spelling, handle, _):
    assert stream_handle(spelling) == handle
    converted = to_cuda_stream(spelling)
    assert isinstance(converted, driver.CUstream) and int(converted) == handle
    assert to_cuda_stream(spelling) is converted  # cached (by object or by handle)
    if type(spelling) is not int:
        assert streams.last_stream == (spelling, converted)  # what Kernel.run reads inline


@pytest.mark.parametrize("spelling", [True, "0", 1.0, object(), (0, 1)], ids=["bool", "str", "float", "object", "tuple"])
def test_python_conversions_refuse_other_values_naming_their_type(spelling):
    for convert in (stream_handle, to_cuda_stream):
        with pytest.raises(TypeError, match=rf"stream: expected .* got {type(spelling).__name__}"):
            convert(spelling)


def _seen_handle(value):
    """The stream a TVM-FFI function received, as a handle: ints stay ints, pointers arrive as
    ctypes.c_void_p (whose value is None for the null pointer)."""
    if value is None or isinstance(value, int):
        return value
    return value.value or 0


@pytest.fixture
def entry():
    pytest.importorskip("tvm_ffi")
    if native.module_path() is None or native.entry() is None:
        pytest.skip(f"no native entry points in this install: {native.why_not_entry()}")
    return native.entry()


def _recorder():
    import tvm_ffi

    seen = []
    return seen, tvm_ffi.convert(lambda *call: seen.append(call[-1]))


@pytest.mark.parametrize("spelling, handle, c_takes_it", CPU_SPELLINGS, ids=_IDS)
def test_the_c_converter_agrees_with_python(entry, spelling, handle, c_takes_it):
    seen, function = _recorder()
    bound = entry.bind(function, (None,), ())  # (no tensor: no device to take a current stream from)
    bound(to_cuda_stream(spelling))  # what Kernel.run's bound path passes
    assert _seen_handle(seen[-1]) == stream_handle(spelling) == handle
    if c_takes_it:
        bound(spelling)
        assert _seen_handle(seen[-1]) == handle
    else:
        with pytest.raises(TypeError, match="stream: expected None, an int or a CUDA stream object"):
            bound(spelling)


def test_none_means_no_stream_for_cpu_tensors_in_c(entry):
    seen, function = _recorder()
    entry.bind(function, (torch.zeros(2),), ())(None)
    assert seen == [None]


# ---- spellings that need a GPU -----------------------------------------------------------------

@pytest.mark.gpu
def test_torch_streams_and_the_current_stream_convert_alike_in_python_and_c():
    side = torch.cuda.Stream()
    external = torch.cuda.ExternalStream(side.cuda_stream)
    for spelling in (side, external, torch.cuda.current_stream()):
        assert stream_handle(spelling) == spelling.cuda_stream
        assert int(to_cuda_stream(spelling)) == spelling.cuda_stream
    device = torch.cuda.current_device()
    with torch.cuda.stream(side):
        assert stream_handle(None) == stream_handle(None, device) == side.cuda_stream
        assert int(to_cuda_stream(None)) == side.cuda_stream
    assert stream_handle(None) == torch.cuda.current_stream().cuda_stream != side.cuda_stream
    assert int(to_cuda_stream(None)) == torch.cuda.current_stream().cuda_stream  # None is never cached
    entry = native.entry()
    if entry is None:
        pytest.skip(f"no native entry points in this install: {native.why_not_entry()}")
    seen, function = _recorder()
    bound = entry.bind(function, (torch.zeros(4, device="cuda"),), ())
    with torch.cuda.stream(side):
        bound(None)  # C reads torch's current stream of the tensor's device
        bound(to_cuda_stream(None))
    bound(to_cuda_stream(side))
    assert [_seen_handle(s) for s in seen] == [side.cuda_stream] * 3
