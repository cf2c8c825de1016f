"""Hardening: compile-cache keys that follow every source they depend on, tuning
records that survive damage, locks and upgrades, and compile errors that read well."""

import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import kernel_api
from kernel_api.core import cache as kcache
from kernel_api.errors import CompilationError
from kernel_api.nvrtc import compiler
from kernel_api.nvrtc import compile_cuda
from kernel_api.tuning.records import TuningRecords

ROOT = Path(__file__).resolve().parents[1]


# ---- 1. artifact keys follow the sources and the toolchain -------------------------------

@pytest.fixture
def cutedsl_kernel_module():
    pytest.importorskip("cutlass")
    from kernel_api.providers.cutedsl import kernel as module

    yield module
    module._package_source_hash.cache_clear()
    module._toolchain_versions.cache_clear()


class _Impl:
    def __init__(self, tile):
        self.tile = tile


def _key(module):
    return module._artifact_key("k", _Impl(64), [1, "x"], "--gpu-arch sm_90a", "kernel_api.providers.cutedsl.gemm.simt")


@pytest.mark.parametrize("helper", ["gemm/implementations/epilogue.py", "gemm/implementations/gemm_utils.py",
                                    "softmax/implementations/row_softmax_impl.py"])
def test_artifact_key_changes_when_any_file_of_the_provider_package_does(cutedsl_kernel_module, tmp_path,
                                                                         monkeypatch, helper):
    module = cutedsl_kernel_module
    copy = tmp_path / "cutedsl"
    shutil.copytree(module._PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(module, "_PACKAGE_DIR", str(copy))
    module._package_source_hash.cache_clear()
    before = _key(module)
    assert _key(module) == before
    with open(copy / helper, "a") as f:
        f.write("\n# an edit to a helper the implementations import\n")
    module._package_source_hash.cache_clear()  # a new process
    assert _key(module) != before


def test_package_sources_are_hashed_once_per_process(cutedsl_kernel_module, monkeypatch):
    module = cutedsl_kernel_module
    calls = []
    real = module.tree_digest
    monkeypatch.setattr(module, "tree_digest", lambda *a: calls.append(a) or real(*a))
    module._package_source_hash.cache_clear()
    for _ in range(3):
        _key(module)
    assert len(calls) == 1


def test_artifact_key_includes_the_toolchain(cutedsl_kernel_module, monkeypatch):
    module = cutedsl_kernel_module
    pieces = dict(module._toolchain_versions())
    assert pieces["kernel_api"] == kernel_api.__version__
    dsl_version, variant = pieces["nvidia-cutlass-dsl"].split(" ")
    from importlib.metadata import version

    assert dsl_version == version("nvidia-cutlass-dsl")
    assert variant in ("cu12", "cu13", "cu12+cu13")
    assert version(f"nvidia-cutlass-dsl-libs-{variant.split('+')[0]}")
    assert pieces["python"].endswith("%d.%d.%d" % sys.version_info[:3])
    before = _key(module)
    monkeypatch.setattr(kernel_api, "__version__", "999.0")
    module._toolchain_versions.cache_clear()
    assert _key(module) != before


_COMPILE_SEED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {seed!r}); sys.path.insert(0, {root!r})
    import kernel_api, seed_notebook as s
    assert kernel_api.__file__.startswith({root!r}), kernel_api.__file__
    ks, args, *_ = s.run_notebook("cpu")
    art = ks[0].compile(args, cc=90)
    print("TYPE", type(art.compiled_obj).__module__)
""")


def _compiled_type(root, cache):
    code = _COMPILE_SEED.format(seed=str(ROOT / "tests" / "seed"), root=str(root))
    env = dict(os.environ, KERNEL_API_CACHE_DIR=str(cache), KERNEL_API_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return next(line.split(" ", 1)[1] for line in out.stdout.splitlines() if line.startswith("TYPE"))


def test_editing_a_helper_module_makes_a_new_process_recompile(tmp_path):
    """The reported bug: edit implementations/epilogue.py, and a new process loaded the old object."""
    pytest.importorskip("cutlass")
    root = tmp_path / "src"
    shutil.copytree(ROOT / "kernel_api", root / "kernel_api", ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "cache"
    assert _compiled_type(root, cache).startswith("cutlass")  # compiled
    assert _compiled_type(root, cache).startswith("tvm_ffi")  # loaded from the disk cache
    helper = root / "kernel_api" / "providers" / "cutedsl" / "gemm" / "implementations" / "epilogue.py"
    helper.write_text(helper.read_text() + "\n# edited\n")
    assert _compiled_type(root, cache).startswith("cutlass")  # the edit is compiled, not the old object


# ---- 1. cubin keys follow the headers of include folders ---------------------------------

_INCLUDING = '#include "ka_value.cuh"\n#if KA_VALUE != 1\n#error KA_VALUE changed\n#endif\n__global__ void k() {}\n'


@pytest.fixture
def fresh_compiler():
    compiler.clear_memory_cache()
    yield
    compiler.clear_memory_cache()


@pytest.mark.parametrize("new_process", [False, True])
def test_editing_a_header_makes_a_new_cubin(tmp_path, monkeypatch, fresh_compiler, new_process):
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path / "cache"))
    include = tmp_path / "include"
    include.mkdir()
    (include / "ka_value.cuh").write_text("#define KA_VALUE 1\n")
    first = compile_cuda(_INCLUDING, cc=90, name_expressions=["k"], include_dirs=[str(include)])
    (include / "ka_value.cuh").write_text("#define KA_VALUE 22\n")
    if new_process:
        compiler.clear_memory_cache()  # only the disk cache remains, as for a new process
    with pytest.raises(CompilationError, match="KA_VALUE changed"):
        compile_cuda(_INCLUDING, cc=90, name_expressions=["k"], include_dirs=[str(include)])
    (include / "ka_value.cuh").write_text("#define KA_VALUE 1\n")
    again = compile_cuda(_INCLUDING, cc=90, name_expressions=["k"], include_dirs=[str(include)])
    assert again.key == first.key


def test_header_digest_sees_nested_and_same_size_edits(tmp_path):
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    header = tmp_path / "sub" / "deeper" / "impl.hpp"
    header.write_text("int f() { return 1; }\n")
    (tmp_path / "notes.txt").write_text("not a header")
    suffixes = compiler._HEADER_SUFFIXES
    before = kcache.tree_digest(tmp_path, suffixes)
    assert kcache.tree_digest(tmp_path, suffixes) == before
    (tmp_path / "notes.txt").write_text("still not a header, but longer")
    assert kcache.tree_digest(tmp_path, suffixes) == before
    header.write_text("int f() { return 2; }\n")  # same size
    stat = header.stat()
    os.utime(header, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    changed = kcache.tree_digest(tmp_path, suffixes)
    assert changed != before
    (tmp_path / "type_traits").write_text("// a libcu++-style header without a suffix\n")
    assert kcache.tree_digest(tmp_path, suffixes) != changed
    assert kcache.tree_digest(tmp_path / "missing", suffixes) != kcache.tree_digest(tmp_path / "sub", ("none",))


# ---- 12. compiling for an architecture the kernel excludes --------------------------------

def _sm90_kernel_and_args():
    pytest.importorskip("cutlass")
    from kernel_api.providers.cutedsl.gemm.sm90_warpspecialized import Sm90WarpSpecializedGemm

    A, B, out = torch.empty(256, 128).half(), torch.empty(128, 256).half(), torch.empty(256, 256).half()
    args = kernel_api.GemmArguments(A, B, out, accumulator_type=torch.float32)
    kernel = next(k for k in Sm90WarpSpecializedGemm.generate_kernels(lambda m: True, cc=90) if k.supports(args, 90))
    return kernel, args


@pytest.mark.parametrize("cc", [80, "sm_80", 100])
def test_compile_for_an_excluded_cc_is_refused_before_compiling(monkeypatch, cc):
    from kernel_api.providers.cutedsl.kernel import CuteDslKernel

    kernel, args = _sm90_kernel_and_args()

    def compiled(*a, **k):
        raise AssertionError("the DSL should not be reached")

    monkeypatch.setattr(CuteDslKernel, "cute_compile", compiled)
    with pytest.raises(CompilationError) as info:
        kernel.compile(args, cc=cc)
    message = str(info.value)
    assert kernel.metadata.kernel_name in message
    assert "compute capability 90 only" in message and ("80" in message or "100" in message)
    assert "\x1b" not in message and "CUTE_DSL_ARCH" not in message


def test_dsl_errors_are_readable(monkeypatch):
    """A kernel whose metadata does not exclude the target reaches the DSL, whose coloured
    error comes back without colour codes and without its CUTE_DSL_ARCH hint."""
    kernel, args = _sm90_kernel_and_args()
    monkeypatch.setattr(kernel.metadata, "max_cc", None)
    monkeypatch.setattr(kernel.metadata, "min_cc", 0)
    with pytest.raises(CompilationError) as info:
        kernel.compile(args, cc=80)
    message = str(info.value)
    assert "sm_90a" in message and "sm_80" in message
    assert "\x1b" not in message and "CUTE_DSL_ARCH" not in message


_DSL_MESSAGE = ("\n\x1b[91m\x1b[1merror:\x1b[0m expects arch to be sm_90a, but got sm_80\n   \x1b[94m-->\x1b[0m "
                "impl.py:143\n    |\n143 |         tiled_mma = make_trivial_tiled_mma(\n    |         \x1b[91m^\x1b[0m\n"
                "  \x1b[92msuggestion:\x1b[0m Ensure env CUTE_DSL_ARCH matches your GPU architecture\n")


def test_strip_ansi():
    from kernel_api.errors import strip_ansi

    assert strip_ansi(_DSL_MESSAGE) == (
        "\nerror: expects arch to be sm_90a, but got sm_80\n   --> impl.py:143\n    |\n143 |         tiled_mma = "
        "make_trivial_tiled_mma(\n    |         ^\n  suggestion: Ensure env CUTE_DSL_ARCH matches your GPU architecture\n")
    assert strip_ansi("a\x1b]8;;http://x\x07link\x1b]8;;\x1b\\ b\x1b(B c\x1b[?25l\x1b") == "alink b c"
    assert strip_ansi("plain [91m text") == "plain [91m text"


def test_dsl_message_drops_the_arch_hint():
    pytest.importorskip("cutlass")
    from kernel_api.providers.cutedsl.kernel import dsl_message

    text = dsl_message(RuntimeError(_DSL_MESSAGE))
    assert text.startswith("error: expects arch to be sm_90a, but got sm_80")
    assert "\x1b" not in text and "CUTE_DSL_ARCH" not in text and "suggestion" not in text


def test_nvrtc_errors_carry_no_escape_codes(fresh_compiler):
    source = "#error \x1b[91mcoloured\x1b[0m text\n__global__ void k() {}\n"
    with pytest.raises(CompilationError, match="coloured text") as info:
        compile_cuda(source, cc=90, name_expressions=["k"], use_cache=False)
    assert "\x1b" not in str(info.value) and "\x00" not in str(info.value)


# ---- 9. tuning records: damage, locks, toolchains -----------------------------------------

def _fill(records, rows=400):
    for i in range(rows):
        records.record("dev", 90, f"op{i}-" + "x" * 200, "s", f"kernel{i}", 1.0, {"other": 2.0}, {})


def test_damaged_pages_are_set_aside_and_lookups_recover(tmp_path):
    path = tmp_path / "tuning.sqlite"
    records = TuningRecords(path)
    _fill(records)
    records.close()
    page = sqlite3.connect(path).execute("PRAGMA page_size").fetchone()[0]
    blob = bytearray(path.read_bytes())
    assert len(blob) > 8 * page
    blob[page:] = bytes([0xA5]) * (len(blob) - page)  # the header page intact, every other damaged
    path.write_bytes(bytes(blob))
    assert path.read_bytes()[:16] == b"SQLite format 3\x00"

    damaged = TuningRecords(path)
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert damaged.lookup("dev", 90, "op7-" + "x" * 200, "s") is None
    assert len(list(tmp_path.glob("tuning.sqlite.corrupt-*"))) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # recovered: no more warnings, no more errors
        assert damaged.lookup("dev", 90, "op7-" + "x" * 200, "s") is None
        damaged.record("dev", 90, "op", "s", "winner", 1.0, {}, {})
        assert damaged.lookup("dev", 90, "op", "s").kernel_name == "winner"
        assert TuningRecords(path).lookup("dev", 90, "op", "s").kernel_name == "winner"


def test_damage_found_by_a_write_is_recovered_too(tmp_path):
    path = tmp_path / "tuning.sqlite"
    records = TuningRecords(path)
    _fill(records)
    records.close()
    page = sqlite3.connect(path).execute("PRAGMA page_size").fetchone()[0]
    blob = bytearray(path.read_bytes())
    blob[page:] = os.urandom(len(blob) - page)
    path.write_bytes(bytes(blob))
    damaged = TuningRecords(path)
    with pytest.warns(RuntimeWarning, match="unreadable"):
        damaged.record("dev", 90, "op", "s", "winner", 1.0, {}, {})
    assert TuningRecords(path).lookup("dev", 90, "op", "s").kernel_name == "winner"


def test_a_record_under_a_locked_database_warns_and_keeps_the_choice(tmp_path):
    path = tmp_path / "tuning.sqlite"
    TuningRecords(path).record("dev", 90, "warm-up", "s", "k", 1.0, {}, {})
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process in the middle of a long write
    try:
        records = TuningRecords(path, timeout=0.05)
        with pytest.warns(RuntimeWarning, match="could not save the tuning record.*keeps winner"):
            saved = records.record("dev", 90, "op", "s", "winner", 1.5, {"loser": 2.0}, {"torch": "2"})
        assert saved.kernel_name == "winner"
        found = records.lookup("dev", 90, "op", "s")  # this process still has the choice
        assert found is not None and found.kernel_name == "winner" and found.runners_up == {"loser": 2.0}
    finally:
        holder.rollback()
        holder.close()
    # Once the lock is gone, writes reach the file again.
    records.record("dev", 90, "op", "s", "winner", 1.5, {}, {})
    assert TuningRecords(path).lookup("dev", 90, "op", "s").kernel_name == "winner"


def test_records_use_wal_and_a_busy_timeout(tmp_path):
    records = TuningRecords(tmp_path / "tuning.sqlite")
    records.record("dev", 90, "op", "s", "k", 1.0, {}, {})
    conn = records._connect()
    assert conn.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal"
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 30_000


def test_a_record_of_another_toolchain_counts_as_missing(tmp_path):
    path = tmp_path / "tuning.sqlite"
    TuningRecords(path, toolchain_key="kernel_api 0.0.1; nvidia-cutlass-dsl 4.0.0 cu12").record(
        "dev", 90, "op", "s", "old_winner", 1.0, {}, {})
    current = TuningRecords(path)
    assert current.toolchain_key == kernel_api.core.toolchain.tuning_toolchain()
    assert kernel_api.__version__ in current.toolchain_key and "nvidia-cutlass-dsl" in current.toolchain_key
    assert current.lookup("dev", 90, "op", "s") is None
    current.record("dev", 90, "op", "s", "new_winner", 1.0, {}, {})
    assert current.lookup("dev", 90, "op", "s").kernel_name == "new_winner"
    # Both toolchains keep their own winner (two environments sharing one cache folder).
    old = TuningRecords(path, toolchain_key="kernel_api 0.0.1; nvidia-cutlass-dsl 4.0.0 cu12")
    assert old.lookup("dev", 90, "op", "s").kernel_name == "old_winner"
    assert sorted(r.kernel_name for r in current.all()) == ["new_winner", "old_winner"]


def test_records_of_the_first_schema_count_as_missing(tmp_path):
    path = tmp_path / "tuning.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE records (device TEXT NOT NULL, cc INTEGER NOT NULL, operation TEXT NOT NULL, "
                 "shape TEXT NOT NULL, kernel_name TEXT NOT NULL, median_ms REAL NOT NULL, runners_up TEXT NOT NULL, "
                 "toolchain TEXT NOT NULL, created TEXT NOT NULL, PRIMARY KEY (device, cc, operation, shape))")
    conn.execute("INSERT INTO records VALUES ('dev', 90, 'op', 's', 'stale', 1.0, '{}', '{}', '2024-01-01')")
    conn.commit()
    conn.close()
    records = TuningRecords(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert records.lookup("dev", 90, "op", "s") is None
        records.record("dev", 90, "op", "s", "fresh", 1.0, {}, {})
        assert records.lookup("dev", 90, "op", "s").kernel_name == "fresh"
    assert records.clear() == 2


@pytest.mark.gpu
def test_pick_best_keeps_its_winner_when_the_records_are_locked(tmp_path):
    """PickBest measures, fails to save under a lock, warns, and still uses (and reuses) the winner."""
    from kernel_api.tuning.reference import tolerance
    from kernel_api.tuning.policies import PickBest

    A = torch.randn(96, 80, device="cuda")
    B = torch.randn(80, 72, device="cuda")
    args = kernel_api.GemmArguments(A, B, torch.full((96, 72), float("nan"), device="cuda"),
                                    accumulator_type=torch.float32)
    pool = kernel_api.get_kernels(args)[:3]
    assert pool
    path = tmp_path / "tuning.sqlite"
    TuningRecords(path).record("dev", 0, "warm-up", "s", "k", 1.0, {}, {})
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        picker = PickBest(num_workers=1, records=TuningRecords(path, timeout=0.05), repeat=3)
        with pytest.warns(RuntimeWarning, match="could not save"):
            result = picker.tune(args, pool)
        assert not result.from_record
        again = picker.tune(args, pool)
        assert again.from_record and again.winner.metadata.kernel_name == result.winner.metadata.kernel_name
    finally:
        holder.rollback()
        holder.close()
    again.winner.run(args)
    torch.cuda.synchronize()
    ref = A.double() @ B.double()
    assert ((args.out.double() - ref).norm() / ref.norm()).item() <= tolerance(args, again.winner)
