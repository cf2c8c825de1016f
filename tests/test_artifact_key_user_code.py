"""CuTe DSL artifact keys follow the code a user kernel runs: a kernel edited in a notebook (a
``__main__`` whose source cannot be read) or a helper edited in another module compiles afresh,
instead of loading the artifact of the old code."""

import inspect
import linecache
import sys
import types
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("cutlass")

from kernel_api import KernelMetadata, SoftmaxArguments  # noqa: E402
from kernel_api.core import fingerprint  # noqa: E402
from kernel_api.core.cache import decode_entry  # noqa: E402
from kernel_api.core.fingerprint import code_fingerprint  # noqa: E402
from kernel_api.metadata import softmax_operands  # noqa: E402
from kernel_api.providers.cutedsl import kernel as dsl  # noqa: E402

# A kernel as a notebook cell defines it: the implementation and the interface in __main__, a
# helper from another module. compile() goes through cute_compile, so its disk-cache key is the
# one a real compile uses.
CELL = '''
import {helper} as helpers
from kernel_api import SoftmaxArguments
from kernel_api.artifact import CompiledArtifact
from kernel_api.providers.cutedsl.kernel import CuteDslKernel

class Impl:
    def __init__(self, tile):
        self.tile = tile

    def __call__(self, x, y):
        return helpers.scale(x {op} y)

class CellKernel(CuteDslKernel):
    supported_args_type = SoftmaxArguments

    @staticmethod
    def generate_kernels(metadata_filter, epilogue_args=None, cc=None):
        return []

    def _supports(self, args):
        return None

    def get_workspace_size(self, args):
        return 0

    def compile(self, args, cc=None):
        return CompiledArtifact(self.cute_compile(Impl(16), args.x, args.out), self)

    def _run(self, args, artifact, stream, workspace=None):
        pass
'''


def run_cell(source, module=None, name="__main__", register_source=False):
    """Execute ``source`` into ``module`` (default: a fresh module called ``name``), as Jupyter
    does; the source is readable through linecache only with ``register_source`` (IPython
    registers cells there; a module's own source is never readable)."""
    module = module if module is not None else types.ModuleType(name)
    filename = f"<cell-{uuid.uuid4().hex}>"
    if register_source:
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


@pytest.fixture
def helper_module():
    name = f"nb_helpers_{uuid.uuid4().hex}"
    module = run_cell("def scale(v):\n    return v * 2\n", name=name)
    sys.modules[name] = module
    yield module
    del sys.modules[name]


@pytest.fixture
def keys(monkeypatch):
    """The disk-cache keys compiles ask for (each lookup answers with a stand-in object)."""
    asked = []
    monkeypatch.setattr(dsl, "_load_cached", lambda key, name="": asked.append(key) or object())
    return asked


def compile_key(module, keys):
    kernel = module.CellKernel(KernelMetadata("CellKernel", module.CellKernel, softmax_operands("f32", 1)))
    x = torch.randn(4, 8)
    kernel.compile(SoftmaxArguments(x, torch.empty_like(x)), cc=90)
    return keys[-1]


def notebook(helper, op):
    return run_cell(CELL.format(helper=helper.__name__, op=op), types.ModuleType("__main__"))


def test_kernel_edited_in_a_notebook_cell_gets_a_new_key(helper_module, keys):
    source_less = notebook(helper_module, "+")
    with pytest.raises((OSError, TypeError)):
        inspect.getsource(source_less)  # as for a notebook's __main__
    plus = compile_key(source_less, keys)
    assert compile_key(notebook(helper_module, "+"), keys) == plus  # the cell run again, unchanged
    assert compile_key(notebook(helper_module, "-"), keys) != plus


def test_helper_edited_in_another_module_gets_a_new_key(helper_module, keys):
    cell = notebook(helper_module, "+")
    before = compile_key(cell, keys)
    assert compile_key(cell, keys) == before
    run_cell("def scale(v):\n    return v * 3\n", helper_module)  # the helper's cell, edited and re-run
    assert compile_key(cell, keys) != before


def test_rebinding_a_global_or_a_method_gets_a_new_key(helper_module, keys):
    cell = notebook(helper_module, "+")
    before = compile_key(cell, keys)
    run_cell("def call(self, x, y):\n    return helpers.scale(x * y)\nImpl.__call__ = call\n", cell)
    after_method = compile_key(cell, keys)
    assert after_method != before
    cell.helpers = types.ModuleType("other")
    assert compile_key(cell, keys) != after_method


def test_fingerprints_are_cached_per_class():
    cls = run_cell("class K:\n    def f(self):\n        return 1\n").K
    first = code_fingerprint(cls)
    digest, reads = fingerprint._cache[cls]
    assert digest == first and reads
    assert code_fingerprint(cls) == first


def test_shipped_kernels_keep_the_package_source_key():
    from kernel_api.providers.cutedsl.gemm.simt import SimtGemm

    assert dsl._code_hash(SimtGemm) == "in-package"


# ---- end to end: the DSL compiles the edited cell ------------------------------------------

DSL_CELL = '''
import cutlass
import cutlass.cute as cute
from kernel_api import SoftmaxArguments
from kernel_api.artifact import CompiledArtifact
from kernel_api.providers.cutedsl.kernel import CuteDslKernel, fake_tensor

class AddOne:
    def __init__(self, threads):
        self.threads = threads

    @cute.jit
    def __call__(self, x: cute.Tensor):
        self.kernel(x).launch(grid=[1, 1, 1], block=[self.threads, 1, 1])

    @cute.kernel
    def kernel(self, x: cute.Tensor):
        i, _, _ = cute.arch.thread_idx()
        x[i] = x[i] {op} cutlass.Float32(1)

class CellKernel(CuteDslKernel):
    supported_args_type = SoftmaxArguments

    @staticmethod
    def generate_kernels(metadata_filter, epilogue_args=None, cc=None):
        return []

    def _supports(self, args):
        return None

    def get_workspace_size(self, args):
        return 0

    def compile(self, args, cc=None):
        return CompiledArtifact(self.cute_compile(AddOne(32), fake_tensor(cutlass.Float32, 1, 0, 1)), self)

    def _run(self, args, artifact, stream, workspace=None):
        pass
'''


def test_edited_notebook_kernel_is_recompiled_not_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KERNEL_API_CACHE", "1")
    x = torch.randn(4, 8)
    args = SoftmaxArguments(x, torch.empty_like(x))
    compiled = {}
    for op in ("+", "-"):
        cell = run_cell(DSL_CELL.replace("{op}", op), types.ModuleType("__main__"), register_source=True)
        kernel = cell.CellKernel(KernelMetadata("CellKernel", cell.CellKernel, softmax_operands("f32", 1)))
        compiled[op] = kernel.compile(args, cc=90).compiled_obj
    # The edited body was compiled by the DSL, not loaded from the first body's cache entry.
    assert type(compiled["-"]).__module__.startswith("cutlass")
    # (each compile also leaves the entry `_remembered` loads its artifact through)
    entries = sorted(p for p in Path(tmp_path, "cutedsl").glob("*.bin")
                     if not decode_entry(p.read_bytes()).startswith(dsl._REMEMBERED))
    assert len(entries) == 2
    assert entries[0].read_bytes() != entries[1].read_bytes()
