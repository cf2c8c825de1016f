"""A warm cache loads CuTe DSL kernels without the DSL: compiled functions are cached as shared
libraries that ``tvm_ffi.load_module`` opens, and a compile whose result is one cached function
is remembered under a key computed without the DSL, so a new process neither runs the kernel's
``compile`` nor imports ``cutlass``. Old and unlinkable entries still load, through the DSL."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("cutlass")

import kernel_api  # noqa: E402
from kernel_api.arguments import GemmArguments  # noqa: E402
from kernel_api.artifact import CompiledArtifact  # noqa: E402
from kernel_api.core.cache import DiskCache  # noqa: E402
from kernel_api.providers.cutedsl import artifact_loader  # noqa: E402
from kernel_api.providers.cutedsl import kernel as dsl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FAMILY = "Sm90WarpSpecializedGemm"

# What a new process runs: discovery and compile of the same kernel for cc 90 (no GPU needed).
NEW_PROCESS = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    import torch, kernel_api
    from kernel_api.arguments import GemmArguments
    A = torch.empty(256, 128, dtype=torch.bfloat16, device="meta")
    B = torch.empty(128, 512, dtype=torch.bfloat16, device="meta")
    out = torch.empty(256, 512, dtype=torch.bfloat16, device="meta")
    args = GemmArguments(A, B, out, accumulator_type=torch.float32)
    kernel = [k for k in kernel_api.get_kernels(args, cc=90) if k.name == {name!r}][0]
    artifact = kernel.compile(args, cc=90)
    print("CUTLASS", "cutlass" in sys.modules)
    print("TYPE", type(artifact.compiled_obj).__module__ + "." + type(artifact.compiled_obj).__qualname__)
    print("CALLABLE", callable(artifact.compiled_obj), artifact.cc)
""")


def gemm_args(device="meta"):
    A = torch.empty(256, 128, dtype=torch.bfloat16, device=device)
    B = torch.empty(128, 512, dtype=torch.bfloat16, device=device)
    out = torch.empty(256, 512, dtype=torch.bfloat16, device=device)
    return GemmArguments(A, B, out, accumulator_type=torch.float32)


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A cache folder holding one compiled sm_90 GEMM (compiled here, in this process), the
    kernel's name and the compiled (DSL) object."""
    folder = tmp_path_factory.mktemp("warm_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KERNEL_API_CACHE_DIR", str(folder))
        args = gemm_args()
        kernel = [k for k in kernel_api.get_kernels(args, cc=90) if type(k).__name__ == FAMILY][0]
        artifact = kernel.compile(args, cc=90)
    return folder, kernel.name, artifact.compiled_obj


def entries(folder, namespace="cutedsl"):
    cache = DiskCache(namespace, folder)
    return {p.stem: cache.get(p.stem) for p in (Path(folder) / namespace).glob("*.bin")}


def run_new_process(folder, name):
    env = dict(os.environ, KERNEL_API_CACHE_DIR=str(folder))
    done = subprocess.run([sys.executable, "-c", NEW_PROCESS.format(root=str(ROOT), name=name)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.split(" ", 1)[0].isupper())


def test_warm_cache_loads_in_a_new_process_without_importing_the_dsl(warm):
    folder, name, _ = warm
    found = run_new_process(folder, name)
    assert found["CUTLASS"] == "False"
    assert found["TYPE"] == "tvm_ffi.core.Function"
    assert found["CALLABLE"] == "True 90"


def test_importing_kernel_api_imports_no_dsl_and_no_compiler():
    """Neither the CuTe DSL nor Dynamo/Inductor (about 1 s of imports) nor cuda.core (NVRTC's
    driver, 50-120 ms) loads with kernel_api."""
    code = ("import sys, torch; before = set(sys.modules); import kernel_api; "
            "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] == 'cutlass' "
            "or m in ('torch._dynamo', 'torch._inductor', 'sympy', 'cuda.core')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


def test_functions_are_marked_constant_the_way_torch_marks_them():
    """`core.tracing.assume_constant_result` sets what ``torch.compiler.assume_constant_result``
    sets, without importing Dynamo; the lowering rule carries the mark."""
    from kernel_api.core import tracing
    from kernel_api.nn import lowering

    def probe():
        return 0

    def ours():
        return 0

    marked = torch.compiler.assume_constant_result(probe)
    flags = {k: v for k, v in vars(marked).items() if k.startswith("_dynamo")}
    tracing.assume_constant_result(ours)
    assert flags and {k: v for k, v in vars(ours).items() if k.startswith("_dynamo")} == flags
    assert all(getattr(lowering.choose, k, None) == v for k, v in flags.items())


def test_the_cache_holds_a_shared_library_and_the_remembered_compile(warm):
    folder, _, _ = warm
    found = entries(folder)
    shared = [k for k, v in found.items() if artifact_loader.is_shared_entry(v)]
    remembered = globals()["remembered"](folder)
    assert len(shared) == 1 and len(remembered) == 1 and len(found) == 1
    assert remembered[0][len(dsl._REMEMBERED):].decode() == shared[0]


def test_the_library_is_loaded_from_a_private_file_removed_after_load(warm, tmp_path, monkeypatch):
    import tempfile

    import tvm_ffi

    folder, _, _ = warm
    data = next(v for v in entries(folder).values() if artifact_loader.is_shared_entry(v))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    modes = []
    real = tvm_ffi.load_module

    def load_module(path, *a, **k):
        modes.append((os.path.dirname(path), os.stat(path).st_mode & 0o777))
        return real(path, *a, **k)

    monkeypatch.setattr(tvm_ffi, "load_module", load_module)
    function = artifact_loader.load(data, dsl._FUNCTION_NAME)
    assert isinstance(function, tvm_ffi.Function)
    assert modes == [(str(tmp_path), 0o600)]
    assert list(tmp_path.iterdir()) == []


def _with_runtime(data, **changes):
    header, library = artifact_loader._split(data)
    header["runtime"].update(changes)
    import json

    text = json.dumps(header).encode()
    return artifact_loader._MAGIC + len(text).to_bytes(4, "little") + text + library


def test_a_missing_runtime_library_falls_back_to_the_dsls(warm, monkeypatch, caplog):
    import tvm_ffi

    folder, _, _ = warm
    data = next(v for v in entries(folder).values() if artifact_loader.is_shared_entry(v))
    moved = _with_runtime(data, path="/nonexistent/libcute_dsl_runtime.so", package_relative=None)
    monkeypatch.setattr(artifact_loader, "_loaded_runtimes", {})
    monkeypatch.delenv("CUTE_DSL_LIBS", raising=False)
    with pytest.raises(artifact_loader.LoadError, match="not found"):
        artifact_loader.load(moved, dsl._FUNCTION_NAME)
    caplog.set_level("DEBUG", logger=dsl.__name__)
    assert isinstance(dsl._load_shared(moved, "k"), tvm_ffi.Function)
    assert "not loaded without the DSL" in caplog.text
    # A library of another size is another build: not loaded either.
    monkeypatch.setattr(artifact_loader, "_loaded_runtimes", {})
    with pytest.raises(artifact_loader.LoadError, match="bytes, not 1"):
        artifact_loader.load(_with_runtime(data, size=1), dsl._FUNCTION_NAME)


def test_without_a_c_compiler_the_object_file_is_cached_and_loads_through_the_dsl(warm, tmp_path, monkeypatch):
    import tvm_ffi

    _, _, compiled = warm
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(artifact_loader, "_compiler", lambda: None)
    assert dsl._store("k" * 64, compiled, "k")
    data = DiskCache("cutedsl", tmp_path).get("k" * 64)
    assert data[:4] == b"\x7fELF" and not artifact_loader.is_shared_entry(data)
    assert isinstance(dsl._load_cached("k" * 64, "k"), tvm_ffi.Function)


def test_an_unreadable_entry_is_deleted_as_a_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path))
    cache = DiskCache("cutedsl", tmp_path)
    cache.put("e" * 64, artifact_loader._MAGIC + b"\xff\x00\x00\x00not json")
    assert dsl._load_cached("e" * 64, "k") is None
    assert cache.get("e" * 64) is None


# ---- which compiles are remembered -------------------------------------------------------

class _Toy(dsl.CuteDslKernel):
    """A kernel whose compile is one cute_compile (the disk lookup answers with a stand-in)."""

    supported_args_type = GemmArguments

    @staticmethod
    def generate_kernels(metadata_filter, epilogue_args=None, cc=None):
        return []

    def _supports(self, args):
        return None

    def get_workspace_size(self, args):
        return 0

    def compile(self, args, cc=None):
        return CompiledArtifact(self.cute_compile(_ToyImpl(16), args.A, args.B, args.out), self)

    def _run(self, args, artifact, stream, workspace=None):
        pass


class _ToyImpl:
    def __init__(self, tile):
        self.tile = tile

    def __call__(self, a, b, out):
        return None


class _WithExtra(_Toy):
    def compile(self, args, cc=None):
        return CompiledArtifact(self.cute_compile(_ToyImpl(16), args.A, args.B, args.out), self, extra=1)


class _SetsState(_Toy):
    def compile(self, args, cc=None):
        self.seen = True
        return CompiledArtifact(self.cute_compile(_ToyImpl(16), args.A, args.B, args.out), self)


class _OptedOut(_Toy):
    warm_load_skips_compile = False


class _Outer(_Toy):
    def compile(self, args, cc=None):
        return CompiledArtifact(self.inner.compile(args, cc).compiled_obj, self)


def _toy(cls):
    from kernel_api.metadata import KernelMetadata

    operands = kernel_api.get_kernels(gemm_args(), cc=90)[0].metadata.operands
    return cls(KernelMetadata(cls.__name__, cls, operands, min_cc=90))


@pytest.fixture
def bodies(monkeypatch):
    """How many times a toy kernel's compile body ran (its cute_compile calls); disk lookups of
    artifacts answer with a new stand-in function each time."""
    count = []
    real = dsl.CuteDslKernel.cute_compile

    def cute_compile(self, *args, **kwargs):
        count.append(type(self).__name__)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(dsl.CuteDslKernel, "cute_compile", cute_compile)
    monkeypatch.setattr(dsl, "_load_cached", lambda key, name="": (lambda *a: None))
    return count


def _compile_twice(cls, setup=None):
    for _ in range(2):
        kernel = _toy(cls)
        if setup:
            setup(kernel)
        artifact = kernel.compile(gemm_args(), cc=90)
        assert type(artifact) is CompiledArtifact and artifact.cc == 90 and callable(artifact.compiled_obj)


def remembered(folder):
    return [v for v in entries(folder, "cutedsl-compiles").values() if v.startswith(dsl._REMEMBERED)]


def test_a_compile_of_one_cached_function_is_remembered(bodies):
    _compile_twice(_Toy)
    assert bodies == ["_Toy"]  # the second instance loaded without running compile
    assert len(remembered(os.environ["KERNEL_API_CACHE_DIR"])) == 1


@pytest.mark.parametrize("cls", [_WithExtra, _SetsState, _OptedOut], ids=["extra", "state", "opted-out"])
def test_compiles_that_do_more_are_not_remembered(bodies, cls):
    _compile_twice(cls)
    assert bodies == [cls.__name__] * 2
    assert remembered(os.environ["KERNEL_API_CACHE_DIR"]) == []


def test_a_compile_that_compiles_another_kernel_is_not_remembered_but_the_inner_one_is(bodies):
    _compile_twice(_Outer, setup=lambda outer: setattr(outer, "inner", _toy(_Toy)))
    assert bodies == ["_Toy"]
    assert len(remembered(os.environ["KERNEL_API_CACHE_DIR"])) == 1


def test_another_compile_key_is_another_entry(bodies):
    _toy(_Toy).compile(gemm_args(), cc=90)
    A = torch.empty(2, 256, 128, dtype=torch.bfloat16, device="meta")
    B = torch.empty(2, 128, 512, dtype=torch.bfloat16, device="meta")
    out = torch.empty(2, 256, 512, dtype=torch.bfloat16, device="meta")
    _toy(_Toy).compile(GemmArguments(A, B, out, accumulator_type=torch.float32), cc=90)
    assert bodies == ["_Toy", "_Toy"]


def test_state_descriptions_do_not_depend_on_set_order_or_addresses():
    assert dsl._stable(frozenset({"row", "column"})) == dsl._stable(frozenset({"column", "row"}))
    assert dsl._stable({"b": 1, "a": 2}) == dsl._stable({"a": 2, "b": 1})
    with pytest.raises(dsl._Undescribed):
        dsl._stable(lambda: None)
    with pytest.raises(dsl._Undescribed):
        dsl._stable([object()])
