"""kernel_api's logging: one ``kernel_api`` logger hierarchy, silent by default, a stderr handler
from ``KERNEL_API_LOG_LEVEL``, records for compiles, cache hits and misses and tuning choices,
and no ``print`` in library code."""

import ast
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernel_api
from kernel_api import GemmArguments, registry
from kernel_api.tuning.policies import PickAny, rank_candidates

from toy_kernels import ToyGemm, ToyProvider

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(kernel_api.__file__).parent


def run_python(code, **env_changes):
    env = dict(os.environ)
    env.pop("KERNEL_API_LOG_LEVEL", None)
    env.update(env_changes)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=str(ROOT))


# A library record at DEBUG (a disk-cache miss), and the handlers the kernel_api logger has.
PROBE = ("import logging, kernel_api\n"
         "from kernel_api.core.cache import DiskCache\n"
         "DiskCache('probe').get('nothing-here')\n"
         "logging.getLogger('kernel_api.probe').warning('a warning nobody configured')\n"
         "print('HANDLERS', sorted(type(h).__name__ for h in logging.getLogger('kernel_api').handlers))\n")


def test_log_level_from_the_environment_attaches_one_stderr_handler(tmp_path):
    done = run_python(PROBE, KERNEL_API_LOG_LEVEL="DEBUG", KERNEL_API_CACHE_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "HANDLERS ['NullHandler', 'StreamHandler']" in done.stdout
    assert "DEBUG kernel_api.core.cache: " in done.stderr and "probe" in done.stderr, done.stderr[-3000:]
    assert "a warning nobody configured" in done.stderr
    numeric = run_python(PROBE, KERNEL_API_LOG_LEVEL="20", KERNEL_API_CACHE_DIR=str(tmp_path))
    assert numeric.returncode == 0, numeric.stderr[-3000:]
    assert "kernel_api.core.cache" not in numeric.stderr  # INFO: the DEBUG miss is filtered out
    assert "WARNING kernel_api.probe: a warning nobody configured" in numeric.stderr


def test_without_the_variable_the_library_is_silent(tmp_path):
    done = run_python(PROBE, KERNEL_API_CACHE_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "HANDLERS ['NullHandler']" in done.stdout
    # Not even a warning: the NullHandler keeps logging's last-resort handler away.
    assert done.stderr == "", done.stderr[-3000:]


def test_a_bad_level_warns_once_and_is_ignored(tmp_path):
    done = run_python(PROBE, KERNEL_API_LOG_LEVEL="LOUD", KERNEL_API_CACHE_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "HANDLERS ['NullHandler']" in done.stdout
    assert done.stderr.count("KERNEL_API_LOG_LEVEL='LOUD' is not a logging level") == 1, done.stderr[-3000:]
    assert "kernel_api.core.cache" not in done.stderr


def test_the_package_logger_has_a_null_handler():
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("kernel_api").handlers)


@pytest.fixture
def toy():
    ToyProvider.register(ToyGemm)
    yield ToyGemm
    ToyProvider.unregister(ToyGemm)
    registry.unregister_provider("toy")


def test_pick_any_logs_its_choice_at_debug(toy, caplog):
    meta = dict(device="meta", dtype=torch.float16)
    args = GemmArguments(torch.empty(4096, 4096, **meta), torch.empty(4096, 4096, **meta),
                         torch.empty(4096, 4096, **meta))
    kernels = kernel_api.get_kernels(args, metadata_filter=lambda m: m.kernel_class is ToyGemm, cc=90)
    with caplog.at_level(logging.DEBUG, logger="kernel_api"):
        chosen = PickAny().choose(args, kernels)
    assert chosen is rank_candidates(kernels, args)[0]
    records = [r for r in caplog.records if r.name == "kernel_api.tuning.pick_any"]
    assert len(records) == 1 and records[0].levelno == logging.DEBUG
    assert chosen.metadata.kernel_name in records[0].getMessage()
    assert f"of {len(kernels)}" in records[0].getMessage()


def test_a_cutedsl_compile_logs_the_compile_and_a_cache_miss_then_a_hit(tmp_path, monkeypatch, caplog):
    pytest.importorskip("cutlass")
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KERNEL_API_CACHE", raising=False)
    A, B, out = torch.randn(64, 32), torch.randn(32, 48), torch.empty(64, 48)
    args = GemmArguments(A, B, out, accumulator_type=torch.float32)

    def simt():
        found = kernel_api.get_kernels(args, cc=90, metadata_filter=lambda m: m.kernel_class.__name__ == "SimtGemm")
        assert found, "no SimtGemm instance for f32"
        return found[0]

    def messages(logger):
        return [r.getMessage() for r in caplog.records if r.name == logger]

    kernel = simt()
    name = kernel.metadata.kernel_name
    with caplog.at_level(logging.DEBUG, logger="kernel_api"):
        kernel.compile(args, cc=90)
    compiled = messages("kernel_api.kernel")
    assert len(compiled) == 1 and name in compiled[0] and "sm_90a" in compiled[0] and " s" in compiled[0], compiled
    assert [r.levelno for r in caplog.records if r.name == "kernel_api.kernel"] == [logging.INFO]
    cache = messages("kernel_api.providers.cutedsl.kernel")
    assert any("miss" in m and name in m for m in cache), cache
    assert not any("hit" in m for m in cache), cache
    assert any("miss" in m and "cutedsl" in m for m in messages("kernel_api.core.cache"))
    assert any("stored" in m and "cutedsl" in m for m in messages("kernel_api.core.cache"))

    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="kernel_api"):
        simt().compile(args, cc=90)  # a new instance or not: cute_compile keeps nothing in memory
    cache = messages("kernel_api.providers.cutedsl.kernel")
    assert any("hit" in m and name in m for m in cache) and not any("miss" in m for m in cache), cache
    assert any("hit" in m and "cutedsl" in m for m in messages("kernel_api.core.cache"))
    assert len(messages("kernel_api.kernel")) == 1


def test_a_corrupt_disk_cache_entry_is_logged(tmp_path, caplog):
    from kernel_api.core.cache import DiskCache

    cache = DiskCache("logged", directory=tmp_path)
    cache.put("k", b"payload")
    cache.path("k").write_bytes(cache.path("k").read_bytes()[:10])
    with caplog.at_level(logging.DEBUG, logger="kernel_api.core.cache"):
        assert cache.get("k") is None
    assert any("corrupt" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records), caplog.text


# --- library code never prints (only kernel_api/cli does) ---

def print_calls(source: str) -> list[int]:
    """Lines of the calls to the builtin ``print`` in ``source``."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print")


def test_the_print_scan_finds_a_print():
    assert print_calls("import sys\n\ndef f():\n    if x:\n        print('hi', file=sys.stderr)\n") == [5]
    assert print_calls("log.print('x')\nprinter('y')\n") == []


def test_library_code_never_prints():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent)
        if relative.parts[:2] == ("kernel_api", "cli"):
            continue
        found += [f"{relative}:{line}" for line in print_calls(path.read_text())]
    assert not found, f"print() in library code (log with logging.getLogger(__name__) instead): {found}"


# --- why repeated ops calls cannot use the fast paths: said once, when a kernel is first chosen ---

class _StubKernel:
    """What `dispatch._log_fast_path` reads of a kernel: its name and its `_launcher`."""

    def __init__(self, launcher):
        self.metadata = type("M", (), {"kernel_name": "StubGemm_x"})()
        self.launcher = launcher

    def _launcher(self, args, artifact):
        return self.launcher


def test_ops_fast_path_fallbacks_are_logged_at_debug(caplog, monkeypatch):
    from kernel_api import native
    from kernel_api.launcher import Launcher
    from kernel_api.ops import dispatch

    A, B, out = torch.randn(4, 8), torch.randn(8, 2), torch.empty(4, 2)
    args = GemmArguments(A, B, out)

    def said(kernel):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="kernel_api.ops.dispatch"):
            dispatch._log_fast_path(kernel, None, args)
        return [r.getMessage() for r in caplog.records if r.name == "kernel_api.ops.dispatch"]

    assert "no fast path" in said(_StubKernel(None))[0]
    assert "neither a TVM-FFI function nor a torch call" in said(_StubKernel(Launcher(lambda *a: None, ())))[0]
    monkeypatch.setattr(native, "entry", lambda: None)
    monkeypatch.setattr(native, "why_not_entry", lambda: "a test says so")
    ffi = Launcher(lambda *a: None, ())
    object.__setattr__(ffi, "ffi", True)  # as a TVM-FFI function's launcher says
    assert "native entry points are unavailable (a test says so)" in said(_StubKernel(ffi))[0]


@pytest.mark.gpu
def test_ops_log_the_choice_once_and_repeated_calls_log_nothing(caplog):
    from kernel_api import ops

    ops.clear_dispatch_cache()
    A = torch.randn(256, 128, device="cuda", dtype=torch.float16)
    B = torch.randn(128, 64, device="cuda", dtype=torch.float16)
    out = torch.empty(256, 64, device="cuda", dtype=torch.float16)
    # (our providers: PickAny ranks cuBLAS first for a problem this small)
    with caplog.at_level(logging.DEBUG, logger="kernel_api"), kernel_api.settings(providers=["cutedsl", "cuda_src"]):
        ops.gemm(A, B, out, alpha=2.0)  # an epilogue without C: recorded with its alpha (epilogue_tail)
        ops.gemm(A, B, out)
        first = [r.getMessage() for r in caplog.records]
        caplog.clear()
        for _ in range(5):
            ops.gemm(A, B, out, alpha=2.0)
            ops.gemm(A, B, out)
        torch.cuda.synchronize()
    assert any("PickAny chose" in m for m in first), first
    assert caplog.records == [], [r.getMessage() for r in caplog.records]
