"""A torch without ``torch.Tensor.__dlpack_c_exchange_api__`` (builds older than the DLPack C
exchange API): kernel_api does not require torch-c-dlpack-ext. The native CPython entry points
need the exchange API, so they stay off with the reason recorded, and every call takes the
Python paths (TVM-FFI's ``from_dlpack``).

Each check runs in a new process that deletes the attribute before kernel_api (and tvm_ffi)
are imported, with TVM-FFI's own fallback (torch-c-dlpack-ext, or compiling it) disabled.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import os
os.environ["TVM_FFI_DISABLE_TORCH_C_DLPACK"] = "1"  # no torch-c-dlpack-ext, no JIT-built adapter
import torch
if hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
    del torch.Tensor.__dlpack_c_exchange_api__
assert not hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
"""


def run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    # The checkout first, then the caller's path (where the DSL may come from, as on the GPU machine).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "KERNEL_API_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": path}
    env.pop("KERNEL_API_NATIVE", None)
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_the_entry_points_stay_off_and_say_why(tmp_path):
    done = run("""
        import kernel_api
        from kernel_api import native
        assert native.entry() is None
        if native.table() is not None:  # built by this install: only the exchange API is missing
            assert "__dlpack_c_exchange_api__" in native.why_not_entry(), native.why_not_entry()
            print("table loaded, entry points off")
        # The Python paths: arguments (their summaries are remembered in Python), discovery, a compile.
        A = torch.empty(256, 128, dtype=torch.float16, device="meta")
        B = torch.empty(128, 64, dtype=torch.float16, device="meta")
        out = torch.empty(256, 64, dtype=torch.float16, device="meta")
        first = kernel_api.GemmArguments(A, B, out)
        again = kernel_api.GemmArguments(A, B, out)
        assert again.signature == first.signature
        kernels = kernel_api.get_kernels(first, cc=90, providers=["cuda_src"])
        print(len(kernels), "kernels")
        """, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    from kernel_api import native

    if native.module_path() is not None:
        assert "table loaded, entry points off" in done.stdout


@pytest.mark.gpu
def test_ops_and_run_are_correct_without_the_exchange_api(tmp_path):
    done = run("""
        import kernel_api
        from kernel_api import native
        torch.manual_seed(0)
        A = torch.randn(256, 128, dtype=torch.float16, device="cuda")
        B = torch.randn(128, 192, dtype=torch.float16, device="cuda")
        expected = (A.double() @ B.double())
        for _ in range(3):  # the first call and the repeated ones (no native table launch without entry points)
            out = torch.full((256, 192), float("nan"), dtype=torch.float16, device="cuda")
            kernel_api.ops.gemm(A, B, out=out)
            torch.cuda.synchronize()
            err = ((out.double() - expected).norm() / expected.norm()).item()
            assert err < 1e-2, err
        args = kernel_api.GemmArguments(A, B, torch.full((256, 192), float("nan"), dtype=torch.float16, device="cuda"))
        kernel = kernel_api.get_kernels(args)[0]
        kernel.run(args, compiled_artifact=kernel.compile(args))
        torch.cuda.synchronize()
        assert ((args.out.double() - expected).norm() / expected.norm()).item() < 1e-2
        assert native.entry() is None
        print("ok")
        """, tmp_path)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
