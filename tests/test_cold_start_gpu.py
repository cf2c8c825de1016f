"""On the GPU: a CuTe DSL GEMM loaded from a warm cache without the DSL (the shared library
`artifact_loader` links, through a remembered compile) computes what torch does, the cluster
count asked of the driver without the DSL equals the DSL's, and a cached NVRTC cubin runs in a
new process without cuda.core."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]

# Compiles (first process) or loads (second) the sm_90 GEMM, then runs it; one JSON line.
SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    import torch, kernel_api
    from kernel_api.arguments import GemmArguments
    gen = torch.Generator(device="cuda").manual_seed(0)
    A = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    B = torch.randn(256, 520, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.full((300, 520), float("nan"), device="cuda", dtype=torch.bfloat16)
    args = GemmArguments(A, B, out, accumulator_type=torch.float32)
    kernel = [k for k in kernel_api.get_kernels(args) if type(k).__name__ == "Sm90WarpSpecializedGemm"][0]
    artifact = kernel.compile(args)
    found = {{"name": kernel.name, "cutlass_after_compile": "cutlass" in sys.modules,
              "type": type(artifact.compiled_obj).__module__}}
    kernel.run(args, compiled_artifact=artifact)
    torch.cuda.synchronize()
    ref = A.float() @ B.float()
    found["error"] = float((out.float() - ref).norm() / ref.norm())
    print(json.dumps(found))
""")


def run(cache_dir):
    env = dict(os.environ, KERNEL_API_CACHE_DIR=str(cache_dir))
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(root=str(ROOT))], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs an sm_90 GPU")
def test_a_gemm_loaded_without_the_dsl_computes_what_torch_does(tmp_path):
    pytest.importorskip("cutlass")
    cold = run(tmp_path)
    assert cold["type"].startswith("cutlass") and cold["error"] < 8e-3
    warm = run(tmp_path)
    assert warm["name"] == cold["name"]
    assert not warm["cutlass_after_compile"] and warm["type"] == "tvm_ffi.core"
    assert warm["error"] < 8e-3


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a GPU with thread-block clusters")
@pytest.mark.parametrize("size", [1, 2, 4])
def test_the_driver_cluster_count_equals_the_dsls(size):
    cutlass_utils = pytest.importorskip("cutlass.utils")
    from cuda.bindings import driver

    from kernel_api.providers.cutedsl import cluster_occupancy

    torch.cuda.synchronize()
    _, device = driver.cuDeviceGet(0)
    _, context = driver.cuDevicePrimaryCtxRetain(device)
    driver.cuCtxSetCurrent(context)
    expected = int(cutlass_utils.HardwareInfo(0).get_max_active_clusters(size))
    assert cluster_occupancy.max_active_clusters(0, size) == expected


def test_a_cached_cubin_runs_in_a_new_process_without_cuda_core(tmp_path):
    """A cuda_src softmax kernel compiled in one process loads and runs in a new one through the
    driver API (its error against float64 in range), cuda.core never imported there
    (tests/test_cold_start_cubin.py's processes, on the GPU)."""
    from test_cold_start_cubin import _child

    assert not _child(tmp_path)["hit"]
    warm = _child(tmp_path)
    assert warm["hit"] and not warm["cuda_core_after_compile"] and not warm["cuda_core_after_load"], warm
    assert warm["error"] < 8e-3, warm
