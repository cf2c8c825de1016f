"""CuTe DSL compiled artifacts persist on disk: a new process loads instead of compiling."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {seed!r}); sys.path.insert(0, {root!r})
    import seed_notebook as s
    ks, args, *_ = s.run_notebook("cpu")
    t0 = time.perf_counter()
    art = ks[0].compile(args, cc=90)
    print("SECONDS", time.perf_counter() - t0)
    print("TYPE", type(art.compiled_obj).__module__)
""")


def compile_in_new_process(cache_dir, extra_env=None):
    env = dict(os.environ, KERNEL_API_CACHE_DIR=str(cache_dir), **(extra_env or {}))
    code = SCRIPT.format(seed=str(ROOT / "tests" / "seed"), root=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def result(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    fields = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("SECONDS", "TYPE")))
    return float(fields["SECONDS"]), fields["TYPE"]


def entries(cache_dir):
    return list((Path(cache_dir) / "cutedsl").glob("*.bin"))


def test_second_process_loads_from_disk_and_corruption_is_rebuilt(tmp_path):
    cold, cold_type = result(compile_in_new_process(tmp_path))
    assert len(entries(tmp_path)) == 1 and cold_type.startswith("cutlass")
    warm, warm_type = result(compile_in_new_process(tmp_path))
    assert warm_type.startswith("tvm_ffi"), "second process should load the cached object"
    print(f"cold compile {cold * 1e3:.0f} ms, warm load {warm * 1e3:.0f} ms")
    # Truncate the entry: it must be detected, discarded and rebuilt by a real compile.
    entry = entries(tmp_path)[0]
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    _, rebuilt_type = result(compile_in_new_process(tmp_path))
    assert rebuilt_type.startswith("cutlass")
    _, again_type = result(compile_in_new_process(tmp_path))
    assert again_type.startswith("tvm_ffi")


def test_two_processes_compiling_at_once_both_succeed(tmp_path):
    procs = [compile_in_new_process(tmp_path) for _ in range(2)]
    for p in procs:
        result(p)
    assert len(entries(tmp_path)) == 1
    assert not list((Path(tmp_path) / "cutedsl").glob(".tmp-*"))


def test_cache_can_be_disabled(tmp_path):
    result(compile_in_new_process(tmp_path, {"KERNEL_API_CACHE": "0"}))
    assert entries(tmp_path) == []


def test_later_loads_skip_the_dsl_library_search_and_fall_back_when_refused(monkeypatch, tmp_path):
    """The first cached artifact loads through ``cute.runtime.load_module`` (which finds and loads
    the DSL's runtime libraries); later ones construct its module class directly; a class that
    refuses the call sends loads back through the function."""
    import cutlass.cute as cute

    from kernel_api.providers.cutedsl import kernel as dsl

    calls = []

    class Module:
        def __init__(self, path, enable_tvm_ffi=False):
            calls.append(("class", path, enable_tvm_ffi))

    Module.__name__ = "ExternalBinaryModule"

    def load_module(path, enable_tvm_ffi=False):
        calls.append(("function", path, enable_tvm_ffi))
        return Module.__new__(Module)

    monkeypatch.setattr(cute.runtime, "load_module", load_module)
    monkeypatch.setattr(dsl, "_module_class", [])
    dsl._load_module("a.o")
    dsl._load_module("b.o")
    assert calls == [("function", "a.o", True), ("class", "b.o", True)]

    class Refusing:
        def __init__(self, path, **kwargs):
            raise TypeError("unexpected keyword argument 'enable_tvm_ffi'")

    dsl._module_class[:] = [Refusing]
    calls.clear()
    dsl._load_module("c.o")
    assert calls == [("function", "c.o", True)] and dsl._module_class == [Module]
