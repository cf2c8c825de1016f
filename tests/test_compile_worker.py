"""PickBest's compile workers (CPU): started through our own entry point, so a script without
a main guard runs once; they compile into the shared disk cache with the parent's environment
and import path; a failing, crashing or hanging compile is one kernel's failure; no worker
outlives its parent."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import kernel_api
from kernel_api import GemmArguments
from kernel_api.tuning.compile_worker import _Worker, worker_environment, CompileRequest, describe_arguments
from kernel_api.providers.cuda_src import CudaSourceProvider
from kernel_api.tuning.policies import PickBest

REPO = Path(__file__).resolve().parents[1]

# A user's kernel module (written next to the script): a naive f32 GEMM in two variants, one
# that does not compile, one whose compile kills its process, one whose compile hangs.
KERNELS_MODULE = textwrap.dedent(r'''
    import os
    import time

    import torch

    from kernel_api import GemmArguments, GemmOperandsMetadata, TensorAttributes
    from kernel_api.providers.cuda_src import CudaSourceProvider
    from kernel_api.providers.cuda_src.kernel import CudaSourceKernel

    SOURCE = r"""
    template <int TILE>
    __global__ void worker_gemm(const float* A, const float* B, float* C, int M, int N, int K) {
      int m = blockIdx.y * TILE + threadIdx.y, n = blockIdx.x * TILE + threadIdx.x;
      if (m < M && n < N) {
        float acc = 0.f;
        for (int k = 0; k < K; ++k) acc += A[m * K + k] * B[k * N + n];
        C[m * N + n] = acc;
      }
    }
    """
    ROW = (0, 0, 1)


    class _Base(CudaSourceKernel):
        source = SOURCE
        kernel_name = "worker_gemm<{tile}>"
        variants = [{"tile": 16}]
        supported_args_type = GemmArguments
        operands = GemmOperandsMetadata(*(TensorAttributes(torch.float32, ROW, 1) for _ in range(3)),
                                        accumulator_type=torch.float32)

        def launch_config(self, args):
            t = self.params["tile"]
            return ((args.N + t - 1) // t, (args.M + t - 1) // t), (t, t)

        def kernel_arguments(self, args):
            return args.A, args.B, args.out, args.M, args.N, args.K


    @CudaSourceProvider.register
    class WorkerGemm(_Base):
        variants = [{"tile": 16}, {"tile": 32}]


    @CudaSourceProvider.register
    class BrokenWorkerGemm(_Base):
        source = SOURCE.replace("acc +=", "acc += undefined_name +")


    @CudaSourceProvider.register
    class CrashingWorkerGemm(_Base):
        def compile(self, args, cc=None):
            os._exit(7)


    @CudaSourceProvider.register
    class HangingWorkerGemm(_Base):
        def compile(self, args, cc=None):
            time.sleep(120)
''')

# Tunes at module level, without an `if __name__ == "__main__":` guard; each run of the body
# appends a line to the marker file.
UNGUARDED_SCRIPT = textwrap.dedent('''
    import json
    import os
    import sys

    import torch

    import kernel_api
    from kernel_api import GemmArguments
    from kernel_api.tuning.policies import PickBest
    import worker_kernels

    with open(os.environ["MARKER"], "a") as f:
        f.write("ran\\n")
    meta = dict(device="meta", dtype=torch.float32)
    args = GemmArguments(torch.empty(64, 32, **meta), torch.empty(32, 48, **meta), torch.empty(64, 48, **meta),
                         accumulator_type=torch.float32)
    kernels = kernel_api.get_kernels(args, cc=90, providers="cuda_src",
                                     metadata_filter=lambda m: m.kernel_class is worker_kernels.WorkerGemm)
    assert len(kernels) == 2, kernels
    with kernel_api.settings(num_workers=2):
        results = PickBest()._precompile(args, kernels, 90)
    print("RESULTS " + json.dumps(results))
''')


def _meta_args():
    meta = dict(device="meta", dtype=torch.float32)
    return GemmArguments(torch.empty(64, 32, **meta), torch.empty(32, 48, **meta), torch.empty(64, 48, **meta),
                         accumulator_type=torch.float32)


@pytest.fixture
def kernels_module(tmp_path, monkeypatch):
    """The user's kernel module on the import path of this process (so also of the workers)."""
    (tmp_path / "worker_kernels.py").write_text(KERNELS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import worker_kernels

    yield worker_kernels
    for cls in (worker_kernels.WorkerGemm, worker_kernels.BrokenWorkerGemm, worker_kernels.CrashingWorkerGemm,
                worker_kernels.HangingWorkerGemm):
        CudaSourceProvider.unregister(cls)
    sys.modules.pop("worker_kernels", None)


def _cubins(cache: Path) -> list[Path]:
    return sorted((cache / "cubin").glob("*.bin"))


def _children() -> set[int]:
    """Ids of this process's live (not zombie) children, read from /proc."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def _run_script(script: Path, marker: Path, cache: Path, timeout: int) -> subprocess.CompletedProcess:
    """Run a user script as a plain `python script.py`, with this checkout ahead of the caller's
    PYTHONPATH (which may hold the DSL, as on the GPU machine)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, MARKER=str(marker), KERNEL_API_CACHE_DIR=str(cache), PYTHONPATH=path)
    return subprocess.run([sys.executable, str(script)], cwd=script.parent, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_unguarded_script_runs_once_and_workers_fill_the_cache(tmp_path):
    (tmp_path / "worker_kernels.py").write_text(KERNELS_MODULE)
    script = tmp_path / "tune_script.py"
    script.write_text(UNGUARDED_SCRIPT)
    marker, cache = tmp_path / "ran.txt", tmp_path / "cache"
    done = _run_script(script, marker, cache, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert marker.read_text().splitlines() == ["ran"], done.stderr[-3000:]
    results = json.loads(done.stdout.split("RESULTS ", 1)[1])
    assert results == {"WorkerGemm_tile16": None, "WorkerGemm_tile32": None}
    # The script's process compiled nothing itself: the two cubins are the workers'.
    assert len(_cubins(cache)) == 2


def test_worker_failures_are_reported_per_kernel(kernels_module, tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path / "cache"))

    @CudaSourceProvider.register
    class LocalWorkerGemm(kernels_module._Base):  # defined in a function: no worker can import it
        pass

    try:
        args = _meta_args()
        pool = kernel_api.get_kernels(args, cc=90, providers="cuda_src",
                                      metadata_filter=lambda m: m.kernel_class in (
                                          kernels_module.WorkerGemm, kernels_module.BrokenWorkerGemm,
                                          kernels_module.CrashingWorkerGemm, kernels_module.HangingWorkerGemm,
                                          LocalWorkerGemm))
        assert len(pool) == 6
        seen = []
        earlier_children = _children()  # other tests' processes, not ours to judge
        picker = PickBest(num_workers=2, compile_timeout=20, progress=lambda d, t, label: seen.append((d, t)))
        results = picker._precompile(args, pool, 90)
    finally:
        CudaSourceProvider.unregister(LocalWorkerGemm)
    assert set(results) == {"WorkerGemm_tile16", "WorkerGemm_tile32", "BrokenWorkerGemm_tile16",
                            "CrashingWorkerGemm_tile16", "HangingWorkerGemm_tile16"}
    assert results["WorkerGemm_tile16"] is None and results["WorkerGemm_tile32"] is None
    assert "CompilationError" in results["BrokenWorkerGemm_tile16"]
    assert "undefined_name" in results["BrokenWorkerGemm_tile16"]
    assert "died while compiling (exit code 7)" in results["CrashingWorkerGemm_tile16"]
    assert "longer than 20 s" in results["HangingWorkerGemm_tile16"]
    assert sorted(seen) == [(i, 5) for i in range(1, 6)]
    assert len(_cubins(tmp_path / "cache")) == 2
    deadline = time.monotonic() + 5  # a killed worker leaves /proc once it is reaped
    while _children() - earlier_children and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _children() - earlier_children, "a compile worker outlived the call"


def test_pool_size_follows_num_workers(kernels_module, monkeypatch, tmp_path):
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path / "cache"))  # (cached kernels start no worker)
    started = []
    real = _Worker.__init__

    def counting(self, env):
        started.append(1)
        real(self, env)

    monkeypatch.setattr(_Worker, "__init__", counting)
    args = _meta_args()
    pool = kernel_api.get_kernels(args, cc=90, providers="cuda_src",
                                  metadata_filter=lambda m: m.kernel_class is kernels_module.WorkerGemm)
    with kernel_api.settings(num_workers=1):
        assert PickBest()._precompile(args, pool, 90) == {}  # one worker: compiled in-process
    assert not started
    with kernel_api.settings(num_workers=3):
        results = PickBest()._precompile(args, pool, 90)
    assert results == {"WorkerGemm_tile16": None, "WorkerGemm_tile32": None}
    assert len(started) == 2  # never more workers than kernels


def test_cached_candidates_are_loaded_here_and_start_no_worker(kernels_module, monkeypatch, tmp_path):
    """Candidates whose artifact is in the disk cache are loaded in this process (compiling
    nothing: `compile_from_cache_only`); only the others go to workers. A class that overrides
    compile without declaring `compiles_from_cache_only` is never probed here (this one would
    end the process)."""
    from kernel_api.kernel import compile_from_cache_only
    from kernel_api.nvrtc import compiler
    from kernel_api.tuning import compile_worker

    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path / "cache"))
    compiler.clear_memory_cache()
    args = _meta_args()
    pool = kernel_api.get_kernels(args, cc=90, providers="cuda_src", metadata_filter=lambda m: m.kernel_class in (
        kernels_module.WorkerGemm, kernels_module.CrashingWorkerGemm))
    names = [k.metadata.kernel_name for k in pool]
    assert names == ["WorkerGemm_tile16", "WorkerGemm_tile32", "CrashingWorkerGemm_tile16"]
    assert compile_from_cache_only(pool[0], args, 90) is None and _cubins(tmp_path / "cache") == []  # nothing compiled
    pool[0].compile(args, 90)
    compiler.clear_memory_cache()  # (a new process: only the disk cache holds it)
    assert compile_from_cache_only(pool[0], args, 90) is not None
    sent = []
    monkeypatch.setattr(compile_worker, "compile_requests",
                        lambda requests, workers, **kw: sent.extend(r.kernel_name for r in requests) or [None] * len(requests))
    results = compile_worker.compile_in_workers(args, pool, 90, num_workers=2)
    assert sent == ["WorkerGemm_tile32", "CrashingWorkerGemm_tile16"]
    assert results == {name: None for name in names}


def test_worker_gets_the_parents_environment_and_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path / "cache"))
    env = worker_environment()
    assert env["KERNEL_API_CACHE_DIR"] == str(tmp_path / "cache")
    paths = env["PYTHONPATH"].split(os.pathsep)
    assert str(REPO) in paths and paths.index(str(tmp_path / "plugins")) < paths.index(str(REPO))


def test_worker_exits_when_its_parent_dies(kernels_module, tmp_path):
    # A parent that starts a worker on a hanging compile and dies without closing anything.
    code = textwrap.dedent(f'''
        import dataclasses, os, sys, time
        sys.path[:0] = [{str(REPO)!r}, {str(tmp_path)!r}]
        from kernel_api.tuning.compile_worker import _Worker, _encode, worker_environment, CompileRequest
        from kernel_api.tuning.compile_worker import describe_arguments
        import torch
        from kernel_api import GemmArguments
        meta = dict(device="meta", dtype=torch.float32)
        args = GemmArguments(torch.empty(64, 32, **meta), torch.empty(32, 48, **meta),
                             torch.empty(64, 48, **meta), accumulator_type=torch.float32)
        kind, description = describe_arguments(args)
        worker = _Worker(worker_environment())
        worker.process.stdin.write(_encode(dataclasses.asdict(CompileRequest(
            "worker_kernels", "HangingWorkerGemm", "HangingWorkerGemm_tile16", 90, kind, description))))
        print(worker.process.pid, flush=True)
        time.sleep(8)  # the worker is importing, then compiling (sleeping)
        os._exit(0)
    ''')
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    parent.wait(timeout=60)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists() and "Z" not in _state(pid):
        time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid), "the worker outlived its parent"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_undescribable_arguments_and_main_classes_stay_in_process(kernels_module):
    from kernel_api.tuning.compile_worker import importable_class

    class Main:  # what a class defined in a script or notebook cell looks like
        pass

    Main.__module__, Main.__qualname__ = "__main__", "Main"
    assert not importable_class(Main)
    assert importable_class(kernels_module.WorkerGemm)
    meta = dict(device="meta", dtype=torch.float32)
    with_epilogue = GemmArguments(torch.empty(8, 8, **meta), torch.empty(8, 8, **meta), torch.empty(8, 8, **meta),
                                  epilogue=kernel_api.EpilogueArguments(activation="relu"))
    assert describe_arguments(with_epilogue) is None
    kind, description = describe_arguments(_meta_args())
    assert CompileRequest("m", "C", "k", 90, kind, description).arguments["A"]["shape"] == [64, 32]


# Tunes through the front door at module level, without a main guard.
UNGUARDED_OPS_SCRIPT = textwrap.dedent('''
    import os

    import torch

    import kernel_api
    from kernel_api import PickBest

    with open(os.environ["MARKER"], "a") as f:
        f.write("ran\\n")
    torch.manual_seed(0)
    A = torch.randn(96, 64, device="cuda", dtype=torch.float64)
    B = torch.randn(64, 80, device="cuda", dtype=torch.float64)
    with kernel_api.settings(policy=PickBest, num_workers=2):
        out = kernel_api.ops.gemm(A, B)
    ref = A.cpu() @ B.cpu()
    error = ((out.cpu() - ref).norm() / ref.norm()).item()
    assert error < 1e-12, error
    print("ERROR", error)
''')


@pytest.mark.gpu
def test_unguarded_script_tunes_with_pick_best_on_the_gpu(tmp_path):
    # f64: about ten candidates (SimtGemm, Sm80TensorOpGemm's DMMA), so tuning stays short.
    script = tmp_path / "ops_script.py"
    script.write_text(UNGUARDED_OPS_SCRIPT)
    marker, cache = tmp_path / "ran.txt", tmp_path / "cache"
    done = _run_script(script, marker, cache, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert marker.read_text().splitlines() == ["ran"]
    assert "ERROR" in done.stdout
    # The workers compiled the candidates into the script's cache folder.
    assert len(list((cache / "cutedsl").glob("*.bin"))) >= 2
