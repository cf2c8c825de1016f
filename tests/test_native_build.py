"""The native module is built when kernel-api is installed (setup.py) and only imported at run
time: no compiler needed then, damaged or stale libraries refused instead of crashing a process,
the build for this interpreter found by Python's import system.

Each check runs in a fresh process (what a new process does with a library is the point) with
no C++ compiler on PATH, CXX=/bin/false and an empty cache directory.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from kernel_api import native

tvm_ffi = pytest.importorskip("tvm_ffi")
ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "kernel_api" / "native"
COMPILERS = ("c++", "g++", "gcc", "cc", "clang++", "clang")
installed = pytest.mark.skipif(
    native.module_path() is None,
    reason="kernel_api.native._launch_table was not built by this install (pip install -e . with a C++ compiler builds it)")


def run_without_compiler(code: str, tmp_path: Path, root: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    """Runs ``code`` in a new Python importing kernel_api from ``root``, with no compiler to be found."""
    empty = tmp_path / "bin"
    cache = tmp_path / "cache"
    empty.mkdir(exist_ok=True)
    cache.mkdir(exist_ok=True)
    environment = {**os.environ, "PATH": str(empty), "CXX": "/bin/false", "CC": "/bin/false",
                   "KERNEL_API_CACHE_DIR": str(cache), "PYTHONPATH": str(root), **env}
    for unset in ("KERNEL_API_NATIVE", "PYTHON_GIL"):
        environment.pop(unset, None)
    prelude = f"import shutil; assert not any(shutil.which(c) for c in {COMPILERS!r})\n"
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=root, env=environment,
                          capture_output=True, text=True, timeout=300)


@installed
def test_the_fast_path_loads_without_a_compiler_at_run_time(tmp_path):
    """After an install that built the module, a process with no compiler and
    an empty cache directory has the table and the entry points."""
    done = run_without_compiler(
        "import kernel_api.native as n; assert n.table() is not None and n.entry() is not None, n.why_not_entry()",
        tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list((tmp_path / "cache").iterdir())  # nothing built or cached at run time


@installed
def test_the_import_system_finds_the_build_for_this_interpreter():
    """The module's file carries this interpreter's ABI tag (a free-threaded Python's differs),
    and `entry()` is that module as Python imported it."""
    path = Path(native.module_path())
    assert path.parent == Path(native.__file__).parent
    assert path.name == "_launch_table" + sysconfig.get_config_var("EXT_SUFFIX")
    assert native.table() is not None, native.why_not()
    assert native.entry() is sys.modules["kernel_api.native._launch_table"], native.why_not_entry()
    assert native.entry().tvm_ffi_version == tvm_ffi.__version__


def _old_cache_library(cache: Path) -> Path:
    """Where kernel_api kept its first-use build of these sources before it was built at install."""
    key = hashlib.sha256()
    for name in ("launch_table.cc", "launch_table.h", "python_entry.cc"):
        key.update((NATIVE / name).read_bytes())
    key.update(f"{tvm_ffi.__version__}|{sys.platform}|{sys.implementation.cache_tag}|python".encode())
    return cache / "native" / f"launch_table-{key.hexdigest()[:16]}.so"


def _library_bytes() -> bytes:
    return Path(native.module_path() or tvm_ffi.libinfo.find_libtvm_ffi()).read_bytes()


@pytest.mark.parametrize("size", [0, 4096], ids=["empty", "truncated"])
def test_a_damaged_library_in_the_old_cache_cannot_crash_or_disable_a_new_process(tmp_path, size):
    """A truncated library there killed every new process with SIGBUS, an empty one disabled the
    table for good. Nothing reads that folder now."""
    library = _old_cache_library(tmp_path / "cache")
    library.parent.mkdir(parents=True)
    library.write_bytes(_library_bytes()[:size])
    done = run_without_compiler(
        "import kernel_api.native as n; t = n.table(); print('table', t is not None, n.why_not())", tmp_path)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    if native.module_path() is not None:
        assert "table True" in done.stdout, done.stdout + done.stderr[-3000:]
    else:
        assert "not built" in done.stdout


def _copied_package(tmp_path: Path) -> Path:
    """A copy of the kernel_api package (with its built module) to damage."""
    root = tmp_path / "copy"
    shutil.copytree(NATIVE.parent, root / "kernel_api", ignore=shutil.ignore_patterns("__pycache__"))
    return root


@installed
@pytest.mark.parametrize("keep", [0, 63, 1000, -200], ids=lambda k: f"keep{k}")
def test_a_damaged_installed_module_is_refused_not_loaded(tmp_path, keep):
    """dlopen of a truncated library raises SIGBUS in the importing process; the module's
    extents are checked first, and the fast path is reported unavailable."""
    root = _copied_package(tmp_path)
    module = root / "kernel_api" / "native" / Path(native.module_path()).name
    whole = module.read_bytes()
    module.write_bytes(whole[:keep] if keep >= 0 else whole[:len(whole) + keep])
    done = run_without_compiler(
        "import kernel_api.native as n; assert n.table() is None and n.entry() is None; print(n.why_not())",
        tmp_path, root)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert str(module) in done.stdout and "reinstall kernel-api" in done.stdout
    assert ("damaged" in done.stdout) and ("truncated" in done.stdout or "not an ELF library" in done.stdout)
    assert done.stderr.count("the native library is unavailable") == 1  # one warning


@installed
@pytest.mark.parametrize("change, reason", [
    ("sources", "built from other sources than those beside it"),
    ("tvm_ffi", "was built for TVM-FFI"),
])
def test_a_module_built_for_other_sources_or_another_tvm_ffi_is_refused(tmp_path, change, reason):
    root = _copied_package(tmp_path)
    code = "import kernel_api.native as n; assert n.table() is None, 'loaded'; print(n.why_not())"
    if change == "sources":  # a source tree edited since it was installed
        with open(root / "kernel_api" / "native" / "launch_table.cc", "a") as f:
            f.write("// edited\n")
    else:
        code = "import tvm_ffi; tvm_ffi.__version__ = '0.0.1'\n" + code
    done = run_without_compiler(code, tmp_path, root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert reason in done.stdout and "reinstall kernel-api" in done.stdout


@installed
@pytest.mark.skipif(not sysconfig.get_config_var("Py_GIL_DISABLED"), reason="not a free-threaded Python")
def test_on_free_threaded_python_the_module_keeps_the_gil(tmp_path):
    """python_entry.cc declares Py_MOD_GIL_USED: its globals are guarded by the GIL only."""
    done = run_without_compiler(
        "import sys, warnings; warnings.simplefilter('ignore')\n"
        "import kernel_api.native as n; assert n.entry() is not None, n.why_not_entry()\n"
        "assert sys._is_gil_enabled()", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]


def _build(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[Path]]:
    """setup.py's build_ext, into tmp_path (the source tree is left alone)."""
    lib, temp = tmp_path / "lib", tmp_path / "temp"
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(lib), "--build-temp", str(temp)],
                          cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    return done, sorted(lib.rglob("_launch_table*"))


def test_setup_builds_the_module_with_a_compiler(tmp_path):
    if not (os.environ.get("CXX") or any(shutil.which(c) for c in COMPILERS)):
        pytest.skip("no C++ compiler here")
    done, built = _build(tmp_path)
    assert done.returncode == 0 and len(built) == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert built[0].name == "_launch_table" + sysconfig.get_config_var("EXT_SUFFIX")
    assert built[0].relative_to(tmp_path / "lib").parent == Path("kernel_api", "native")
    assert native._damage(str(built[0])) is None


def test_setup_warns_and_goes_on_without_a_compiler(tmp_path):
    done, built = _build(tmp_path, CXX="/bin/false", CC="/bin/false")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not built
    assert "the native module kernel_api.native._launch_table was not built" in done.stdout + done.stderr
