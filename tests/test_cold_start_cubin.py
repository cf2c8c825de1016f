"""A cached NVRTC cubin loads and launches through the CUDA driver API, without ``cuda.core``
(whose import was most of a warm first softmax): in a new process the cached kernel's compile is a
cache hit and its load imports no cuda.core (on the CPU up to the driver's refusal, on a GPU
through the launch, against float64). Then `CudaLauncher` with the driver stood in for: its
launches, parameters and cooperative grids."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from kernel_api.core.errors import KernelLaunchError
from kernel_api.nvrtc import cubin_launcher as launcher_mod

ROOT = Path(__file__).resolve().parents[1]

# A new process: the cuda_src softmax kernel for 300 x 1000 bf16 rows, compiled for sm_90 (on a
# CPU: meta tensors), then loaded; on a GPU also run against float64. One JSON line.
CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    import torch, kernel_api
    from kernel_api.core.errors import KernelLaunchError
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "meta"
    x = torch.randn(300, 1000, device=device).to(torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    args = kernel_api.SoftmaxArguments(x, out)
    kernels = [k for k in kernel_api.get_kernels(args, cc=90, providers=["cuda_src"])
               if type(k).__name__ == "CudaSoftmaxForward"]
    kernel = kernels[0]
    artifact = kernel.compile(args, cc=90)
    found = {{"kernel": kernel.metadata.kernel_name, "hit": artifact.compiled_obj.compiled.cache_hit,
              "cuda_core_after_compile": "cuda.core" in sys.modules}}
    if gpu:
        kernel.run(args, compiled_artifact=artifact)
        torch.cuda.synchronize()
        ref = torch.softmax(x.double(), -1)
        found["error"] = float((out.double() - ref).abs().max())
    else:
        # The load up to the driver call: without a GPU the driver is missing, so it fails there.
        torch.cuda.is_available = lambda: True
        torch.cuda.init = lambda: None
        try:
            artifact.compiled_obj.kernel
        except KernelLaunchError as exc:
            found["load_error"] = str(exc)[:300]
    found["cuda_core_after_load"] = "cuda.core" in sys.modules
    print(json.dumps(found))
""")


def _child(cache_dir: Path) -> dict:
    env = dict(os.environ, KERNEL_API_CACHE_DIR=str(cache_dir), PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    done = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT))], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cached_cubin_loads_in_a_new_process_without_cuda_core(tmp_path):
    cold = _child(tmp_path)  # compiles (NVRTC through cuda.core) into the cache
    assert not cold["hit"]
    warm = _child(tmp_path)
    assert warm["hit"] and warm["kernel"] == cold["kernel"]
    assert not warm["cuda_core_after_compile"] and not warm["cuda_core_after_load"], warm
    if torch.cuda.is_available():
        assert warm["error"] < 8e-3, warm
    else:  # the load went as far as the driver
        assert "could not load kernel" in warm["load_error"], warm


# ---- CudaLauncher with the driver stood in for -----------------------------------------------
class _FakeDriver:
    """What `CudaLauncher` asks of ``cuda.bindings.driver``: launches are recorded with their
    parameters read back from the packed array; ``results`` queues CUresults for launches."""

    CUfunction_attribute = types.SimpleNamespace(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES="static_smem",
                                                 CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK="max_threads",
                                                 CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES="dynamic_smem")

    def __init__(self, per_sm=1, occupancy_fails=False, param_sizes=None):
        self.launched: list = []
        self.results: list[int] = []
        self.bound: list = []
        self.per_sm, self.occupancy_fails = per_sm, occupancy_fails
        self.attributes = {"static_smem": 520, "max_threads": 1024}
        self.param_sizes = param_sizes

    @staticmethod
    def CUfunction(handle):
        return ("function", handle)

    def cuKernelGetAttribute(self, attr, handle, device):
        return (0, self.attributes[attr])

    def cuKernelSetAttribute(self, attr, value, handle, device):
        self.attributes[attr] = value
        return (0,)

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, function, threads, smem):
        if self.occupancy_fails:
            raise RuntimeError("no occupancy query here")
        return (0, self.per_sm)

    def cuGetErrorName(self, err):
        return (0, f"CUDA_ERROR_{int(err)}".encode())

    def cuDevicePrimaryCtxRetain(self, device):
        return (0, f"context{device}")

    def cuCtxSetCurrent(self, ctx):
        self.bound.append(ctx)
        return (0,)

    def _record(self, kind, function, dims, smem, stream, params):
        count = len(self.param_sizes or ()) or 3
        pointers = (ctypes.c_void_p * count).from_address(params)
        values = [ctypes.c_int64.from_address(p).value for p in pointers]
        self.launched.append((kind, function, dims, smem, stream, values, pointers))
        return (self.results.pop(0) if self.results else 0,)

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        return self._record("plain", f, (gx, gy, gz, bx, by, bz), smem, stream, params)

    def cuLaunchCooperativeKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, params):
        return self._record("cooperative", f, (gx, gy, gz, bx, by, bz), smem, stream, params)


def _launcher(monkeypatch, sms=132, cooperative=True, convert_args=False, **fake):
    drv = _FakeDriver(**fake)
    monkeypatch.setattr(launcher_mod, "_drv", drv)
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    compiled = types.SimpleNamespace(symbols={}, cubin=b"", arch="sm_90a")
    lch = launcher_mod.CudaLauncher(compiled, "k<1>", "FakeKernel", convert_args=convert_args)
    lch._kernel = launcher_mod.LoadedKernel("kernel-handle", "library")
    lch._function = drv.CUfunction(7)
    if convert_args:
        lch._packer = launcher_mod.ParamPacker("FakeKernel", drv.param_sizes)
    limits = object.__new__(launcher_mod._DeviceLimits)
    for name, value in dict(max_threads=1024, max_block=(1024, 1024, 64), max_grid=(2**31 - 1, 65535, 65535),
                            max_smem_optin=232448, max_smem_default=49152, sms=sms, cooperative=cooperative,
                            threads_per_sm=2048, smem_per_sm=233472, smem_reserved=1024).items():
        setattr(limits, name, value)
    lch._devices[0] = limits
    return lch, drv


def test_a_launch_is_cu_launch_kernel_with_the_parameters_packed(monkeypatch):
    lch, drv = _launcher(monkeypatch)
    x = torch.zeros(4)
    lch.launch(0x70, 0, (5, 2), 128, 0, (x, 3, -9))
    lch.launch(0x70, 0, (5, 2), 128, 0, (x.data_ptr() + 4, 4, 2**63 + 5))  # (the same layout; an unsigned value)
    (kind, function, dims, smem, stream, values, _), second = drv.launched
    assert (kind, function, dims, smem, stream) == ("plain", ("function", 7), (5, 2, 1, 128, 1, 1), 0, 0x70)
    assert values == [x.data_ptr(), 3, -9]
    assert second[5][:2] == [x.data_ptr() + 4, 4] and second[5][2] % 2**64 == 2**63 + 5


def test_python_numbers_take_the_kernels_parameter_sizes(monkeypatch):
    lch, drv = _launcher(monkeypatch, convert_args=True, param_sizes=(8, 4, 4))
    lch.launch(0, 0, 1, 32, 0, (torch.zeros(2), 2**32 - 1, 0.5))
    *_, pointers = drv.launched[0]
    assert ctypes.c_uint32.from_address(pointers[1]).value == 2**32 - 1
    assert ctypes.c_float.from_address(pointers[2]).value == 0.5
    with pytest.raises(KernelLaunchError, match="takes 3 parameter"):
        lch.launch(0, 0, 1, 32, 0, (1, 2))
    lch.launch(0, 0, 1, 32, 0, (np.int32(5), np.int64(-3), np.float64(0.25)))  # numpy: its kind, their size
    *_, pointers = drv.launched[1]
    assert ctypes.c_int64.from_address(pointers[0]).value == 5
    assert ctypes.c_int32.from_address(pointers[1]).value == -3
    assert ctypes.c_float.from_address(pointers[2]).value == 0.25


def test_numpy_and_ctypes_scalars_keep_their_own_types(monkeypatch):
    lch, drv = _launcher(monkeypatch)
    lch.launch(0, 0, 1, 32, 0, (np.float32(1.5), ctypes.c_int32(-4), np.int64(9)))
    *_, pointers = drv.launched[0]
    assert ctypes.c_float.from_address(pointers[0]).value == 1.5
    assert ctypes.c_int32.from_address(pointers[1]).value == -4
    assert ctypes.c_int64.from_address(pointers[2]).value == 9
    with pytest.raises(KernelLaunchError, match="parameter 1 is a str"):
        lch.launch(0, 0, 1, 32, 0, (1, "x", 2))


def test_cooperative_launches_go_through_cu_launch_cooperative_kernel(monkeypatch):
    lch, drv = _launcher(monkeypatch)
    lch.launch(7, 0, 132, 544, 40000, (1, 2, 3), cooperative=True)
    lch.launch(7, 0, 132, 544, 40000, (1, 2, 3))
    assert [entry[0] for entry in drv.launched] == ["cooperative", "plain"]
    assert drv.launched[0][2] == (132, 1, 1, 544, 1, 1) and drv.launched[0][3] == 40000
    assert lch.max_coresident(0, 544, 40000) == 132 and lch.max_dynamic_smem(0) == 232448 - 520


def test_coresident_ctas_from_the_device_limits_without_the_occupancy_query(monkeypatch):
    """(A driver whose occupancy query fails for the kernel: threads and shared memory per SM
    decide; the driver would refuse a grid too large anyway.)"""
    lch, _ = _launcher(monkeypatch, occupancy_fails=True)
    assert lch.max_coresident(0, 544, 14 * 16384) == 132  # one 224 KB ring per SM
    assert lch.max_coresident(0, 544, 2 * 16384) == 3 * 132  # threads: 2048 // 544
    assert lch.max_coresident(0, 256, 100 * 1024) == 2 * 132  # shared memory: 228 KB // (100 KB + 1.5 KB)


def test_cooperative_launch_refusals_are_errors_not_hangs(monkeypatch):
    lch, drv = _launcher(monkeypatch, per_sm=1, sms=132)
    with pytest.raises(KernelLaunchError, match=r"cooperative launch of 133 CTAs exceeds the 132 that can be resident"):
        lch.launch(7, 0, 133, 544, 1024, (1, 2, 3), cooperative=True)
    lch, drv = _launcher(monkeypatch, cooperative=False)
    with pytest.raises(KernelLaunchError, match="does not support cooperative launches"):
        lch.launch(7, 0, 8, 544, 1024, (1, 2, 3), cooperative=True)
    assert not drv.launched


def test_more_than_48_kb_of_shared_memory_is_opted_into_once(monkeypatch):
    lch, drv = _launcher(monkeypatch)
    lch.launch(0, 0, 4, 256, 100 * 1024, (1, 2, 3))
    lch.launch(0, 0, 4, 256, 100 * 1024, (1, 2, 3))
    assert drv.attributes["dynamic_smem"] == 100 * 1024 and len(drv.launched) == 2
    with pytest.raises(KernelLaunchError, match="exceed the device's 232448 bytes"):
        lch.launch(0, 0, 4, 256, 232448, (1, 2, 3))


def test_a_thread_without_a_context_gets_the_primary_one_and_failures_name_the_kernel(monkeypatch):
    lch, drv = _launcher(monkeypatch)
    drv.results = [launcher_mod._CUDA_ERROR_INVALID_CONTEXT]
    lch.launch(0, 0, 1, 32, 0, (1, 2, 3))
    assert drv.bound == ["context0"] and len(drv.launched) == 2
    drv.results = [700]
    with pytest.raises(KernelLaunchError, match=r"FakeKernel: launch of k<1> .* failed: .*CUDA_ERROR_700"):
        lch.launch(0, 0, 1, 32, 0, (1, 2, 3))
    with pytest.raises(KernelLaunchError, match=r"block \(2048, 1, 1\) \(2048 threads\) exceeds"):
        lch.launch(0, 0, 1, 2048, 0, (1, 2, 3))
