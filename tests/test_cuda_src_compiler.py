"""NVRTC compiler of the cuda_src provider: sm_90a cubins on a CPU-only machine, template
instances by name expression, error reporting, and the on-disk cubin cache."""

import json
import os
import subprocess
import sys

import pytest

from kernel_api.errors import CompilationError
from kernel_api.nvrtc import compiler
from kernel_api.nvrtc import compile_cuda

SOURCE = r"""
template <typename T, int N>
__global__ void scale(const T* __restrict__ x, T* __restrict__ y, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * T(N);
}
extern "C" __global__ void plain(float* y) { y[threadIdx.x] = 1.f; }
"""


@pytest.fixture(autouse=True)
def _fresh_memory():
    compiler.clear_memory_cache()
    yield
    compiler.clear_memory_cache()


def _elf_machine_is_cuda(cubin: bytes) -> bool:
    return cubin[:4] == b"\x7fELF" and int.from_bytes(cubin[18:20], "little") == 190  # EM_CUDA


def test_compiles_for_sm90a_without_gpu():
    c = compile_cuda(SOURCE, cc=90, name_expressions=["scale<float, 2>", "plain"], use_cache=False)
    assert c.arch == "sm_90a"
    assert _elf_machine_is_cuda(c.cubin)
    assert c.symbols["plain"] == "plain"
    assert c.symbols["scale<float, 2>"].startswith("_Z")  # a mangled template instance
    assert not c.cache_hit


def test_defines_and_options_reach_nvrtc():
    src = "#if KA_VALUE != 7\n#error KA_VALUE must be 7\n#endif\n__global__ void k() {}\n"
    compile_cuda(src, cc=90, name_expressions=["k"], defines={"KA_VALUE": 7}, use_cache=False)
    with pytest.raises(CompilationError, match="KA_VALUE must be 7"):
        compile_cuda(src, cc=90, name_expressions=["k"], defines={"KA_VALUE": 8}, use_cache=False)


def test_syntax_error_reports_file_and_line():
    bad = "__global__ void k(float* y) {\n  y[0] = 1.f\n}\n"
    with pytest.raises(CompilationError) as info:
        compile_cuda(bad, cc=90, name_expressions=["k"], source_name="user_kernel.cu", use_cache=False)
    msg = str(info.value)
    assert "user_kernel.cu" in msg and "sm_90a" in msg
    assert "user_kernel.cu(3)" in msg or "user_kernel.cu(2)" in msg  # NVRTC's file(line) marker


def test_missing_kernel_name_is_a_clear_error():
    with pytest.raises(CompilationError, match=r"kernel name\(s\) \['nothere'\] not found"):
        compile_cuda(SOURCE, cc=90, name_expressions=["nothere"], use_cache=False)
    with pytest.raises(CompilationError, match="not found"):
        compile_cuda(SOURCE, cc=90, name_expressions=["scale<float>"], use_cache=False)


def test_bad_requests():
    with pytest.raises(CompilationError, match="non-empty"):
        compile_cuda("  ", cc=90, name_expressions=["k"])
    with pytest.raises(CompilationError, match="name at least one"):
        compile_cuda(SOURCE, cc=90, name_expressions=[])
    with pytest.raises(ValueError):
        compile_cuda(SOURCE, cc=7, name_expressions=["plain"])


def test_disk_cache_hit_miss_and_corruption(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path))
    first = compile_cuda(SOURCE, cc=90, name_expressions=["scale<float, 3>"])
    assert not first.cache_hit
    path = compiler.disk_cache().path(first.key)
    assert path.exists()
    compiler.clear_memory_cache()
    second = compile_cuda(SOURCE, cc=90, name_expressions=["scale<float, 3>"])
    assert second.cache_hit and second.cubin == first.cubin and second.symbols == first.symbols
    # Different arch, source or defines are different entries.
    other = compile_cuda(SOURCE, cc=80, name_expressions=["scale<float, 3>"])
    assert other.key != first.key and not other.cache_hit
    # A corrupted entry is discarded and rebuilt, never loaded.
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])
    compiler.clear_memory_cache()
    corrupt_before = compiler.disk_cache().stats["corrupt"]
    rebuilt = compile_cuda(SOURCE, cc=90, name_expressions=["scale<float, 3>"])
    assert not rebuilt.cache_hit and rebuilt.cubin == first.cubin
    assert compiler.disk_cache().stats["corrupt"] == corrupt_before + 1
    assert path.read_bytes() == blob


def test_cache_disabled(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KERNEL_API_CACHE", "0")
    c = compile_cuda(SOURCE, cc=90, name_expressions=["plain"])
    assert not c.cache_hit
    assert not (tmp_path / "cubin").exists()


_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from kernel_api.providers.cuda_src.kernels.softmax import CudaSoftmaxForward
from kernel_api.nvrtc import compile_cuda
t1 = time.perf_counter()
c = compile_cuda(CudaSoftmaxForward.get_source(), cc=90, name_expressions=[sys.argv[1]],
                 source_name="softmax.cu")
t2 = time.perf_counter()
print(json.dumps({"hit": c.cache_hit, "compile_s": t2 - t1,
                  "nvrtc_loaded": "cuda.bindings.nvrtc" in sys.modules or "cuda.core" in sys.modules}))
"""


def test_second_process_is_a_cache_hit(tmp_path):
    """Compile a softmax instance in one process, then again in a fresh one: the second
    loads the cubin from disk (the times are printed with -s)."""
    env = dict(os.environ, KERNEL_API_CACHE_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                           os.environ.get("PYTHONPATH", "")]))
    name = "ka_softmax::fwd_block<ka_softmax::BF16, 8, 4, 1024>"
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _CHILD, name], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0]["hit"] is False and runs[1]["hit"] is True
    if any(compiler._installed_nvrtc_wheel()):
        # the hit is keyed by the NVRTC wheel's version: neither NVRTC nor cuda.core is loaded
        assert runs[1]["nvrtc_loaded"] is False
    print(f"\nsoftmax cubin: cold compile {runs[0]['compile_s'] * 1e3:.1f} ms, "
          f"cache hit in a new process {runs[1]['compile_s'] * 1e3:.2f} ms")
    assert runs[1]["compile_s"] < runs[0]["compile_s"]


def test_toolchain_version_is_known():
    major, minor = compiler.nvrtc_version()
    assert major >= 12


def test_the_cache_key_names_the_nvrtc_wheel_and_follows_its_version(monkeypatch):
    wheel = compiler._installed_nvrtc_wheel()
    compiler._toolchain_versions.cache_clear()
    try:
        if wheel:
            assert compiler._toolchain_versions() == ("nvrtc-wheel", *wheel)
            # the wheel's version matches the library NVRTC reports (major.minor)
            assert tuple(int(p) for p in wheel[1].split(".")[:2]) == compiler.nvrtc_version()
        monkeypatch.setattr(compiler, "_installed_nvrtc_wheel", lambda: ())
        compiler._toolchain_versions.cache_clear()
        assert compiler._toolchain_versions() == ("nvrtc", compiler.nvrtc_version())
    finally:
        compiler._toolchain_versions.cache_clear()
