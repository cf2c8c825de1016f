"""The native library (kernel_api.native): build, the call key's tensor part as fine as the
arguments' summary, recorded launches, bounds, errors and threads.

Runs on CPU: a Python callable converted to a TVM-FFI function stands in for a compiled
kernel, and CPU tensors for the operands.
"""

from __future__ import annotations

import sys

import pytest
import torch

import kernel_api
from kernel_api import native
from kernel_api.launcher import Launcher
from kernel_api.native import recipes
from kernel_api.ops import dispatch as ops  # the front door's module: its caches and launch records
from gemm_family_utils import operand_variants

tvm_ffi = pytest.importorskip("tvm_ffi")
if native.module_path() is None:
    pytest.skip("kernel_api.native._launch_table was not built by this install (pip install -e . with a C++ "
                "compiler builds it)", allow_module_level=True)


@pytest.fixture
def table():
    loaded = native.table()
    assert loaded is not None, native.why_not()
    if native.entry() is None:
        pytest.skip(f"no CPython entry points here: {native.why_not_entry()}")
    ops.clear_dispatch_cache()
    assert ops._load_entry()
    yield loaded
    ops.clear_dispatch_cache()


OP = recipes.op_number("tests.launch")


def _record(entry, fn, *args, output: int = -1):
    """Record ``fn``'s launch with the call's tensor arguments in order (the output ``output``)."""
    order = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    assert recipes.record(entry, OP, recipes.Launch(fn.function, order, output=output), *args)


class SeenTensor:
    """What a call saw of a tensor (tensors passed as DLTensor pointers live only during it)."""

    def __init__(self, tensor):
        self._data_ptr, self.shape = tensor.data_ptr(), tuple(tensor.shape)

    def data_ptr(self) -> int:
        return self._data_ptr


class Recorder:
    """A TVM-FFI function that remembers its calls."""

    def __init__(self):
        self.calls = []
        self.function = tvm_ffi.convert(
            lambda *args: self.calls.append(tuple(SeenTensor(a) if hasattr(a, "data_ptr") else a for a in args)))


def test_the_table_is_the_installed_module_built_from_these_sources(table):
    """Nothing is built at run time: the table is the module the install built, imported by
    Python and opened by TVM-FFI, and its sources and TVM-FFI are the ones present."""
    from kernel_api.native import sources

    module = sys.modules["kernel_api.native._launch_table"]
    assert native.module_path() == module.__file__
    assert module.source_digest == sources.digest() and module.tvm_ffi_version == tvm_ffi.__version__


def test_a_recorded_launch_forwards_tensors_then_constants_then_the_current_stream(table):
    entry = native.entry()
    fn = Recorder()
    A, B, out = torch.randn(4, 8), torch.randn(8, 3), torch.empty(4, 3)
    assert entry.replay(OP, A, B, out) is None and not fn.calls
    constants = (None, None, 1.0, 0.0, 132, None, 0)
    spec = recipes.Launch(fn.function, (0, 1, 2, *(recipes.constant(i) for i in range(7))), constants, output=2)
    assert recipes.record(entry, OP, spec, A, B, out) and entry.replays() == 1
    assert entry.replay(OP, A, B, out) is out
    (call,) = fn.calls
    assert len(call) == 11
    for given, passed in zip((A, B, out), call[:3]):
        assert passed.data_ptr() == given.data_ptr() and tuple(passed.shape) == tuple(given.shape)
    assert call[3:] == (*constants, None)  # CPU operands: no current stream


def test_other_ops_and_arguments_miss(table):
    entry = native.entry()
    fn = Recorder()
    A, B, out = torch.randn(4, 8), torch.randn(8, 3), torch.empty(4, 3)
    _record(entry, fn, A, B, out, output=2)
    for args in ((OP + 1, A, B, out), (OP, A, B, "out"), (OP, A, B), (OP, A, B, out, out)):
        assert entry.replay(*args) is None
    assert not fn.calls


def test_an_output_sharing_memory_with_an_operand_is_left_to_python(table):
    entry = native.entry()
    fn = Recorder()
    pool = torch.randn(4096)
    start = (-pool.data_ptr() % 1024) // 4
    A, B = pool[start:start + 256].view(16, 16), torch.randn(16, 16)
    disjoint = pool[start + 1024:start + 1280].view(16, 16)  # the same alignment class as A
    _record(entry, fn, A, B, disjoint, output=2)
    assert entry.replay(OP, A, B, disjoint) is disjoint
    assert entry.replay(OP, A, B, A) is None  # same metadata as the recording, but out is A
    assert len(fn.calls) == 1
    with pytest.raises(ValueError, match="operand out: shares memory with operand A"):
        kernel_api.GemmArguments(A, B, A).check_memory()
    with pytest.raises(ValueError, match="operand out: shares memory with operand B"):
        kernel_api.GemmArguments(A, B, B.t()).check_memory()
    in_place = kernel_api.GemmArguments(A, B, A)
    kernel = kernel_api.get_kernels(in_place, cc=90)[0]
    with pytest.raises(ValueError, match="operand out: shares memory with operand A"):
        kernel.run(in_place)  # run's checks include it
    wide = torch.empty(16, 32)  # interleaved column blocks share a byte range, not elements
    kernel_api.GemmArguments(wide[:, :16], B, wide[:, 16:]).check_memory()
    meta = torch.empty(16, 16, device="meta")  # no memory to share: describing problems stays possible
    kernel_api.GemmArguments(meta, meta, meta).check_memory()


def test_hits_exactly_when_the_raw_gemm_keys_are_equal(table):
    """The call key's tensor part must be as fine as ops' raw key, which is as fine as the
    arguments' summary (test_integration): a hit then always means the signature and shape of
    the recording."""
    entry = native.entry()
    policy = kernel_api.PickAny()
    fn = Recorder()
    variants = operand_variants()
    triples = []
    for A in variants:
        for B in variants:
            if A.shape[1] == B.shape[0]:
                for out in (torch.empty(A.shape[0], B.shape[1], dtype=A.dtype),
                            torch.empty(B.shape[1], A.shape[0], dtype=A.dtype).t()):
                    triples.append((A, B, out))
    recorded = triples[::7]
    keys = set()
    for A, B, out in recorded:
        _record(entry, fn, A, B, out, output=2)
        keys.add(ops._raw_gemm_key(policy, A, B, out))
    hits = misses = 0
    for A, B, out in triples:
        expected = ops._raw_gemm_key(policy, A, B, out) in keys
        assert (entry.replay(OP, A, B, out) is not None) is expected, (A.shape, A.stride(), B.stride(), out.stride())
        hits += expected
        misses += not expected
    assert hits >= len(recorded) and misses > 100


def test_the_recipes_are_bounded(table):
    entry = native.entry()
    fn = Recorder()
    B, out = torch.randn(8, 3), torch.empty(1, 3)
    for i in range(4100):
        _record(entry, fn, torch.randn(1, 8), B, out, i)
        assert entry.replays() <= 4096


def test_policies_kept_alive_for_recipes_are_bounded(table, monkeypatch):
    entry = native.entry()
    fn = Recorder()
    A, B, out = torch.randn(4, 8), torch.randn(8, 3), torch.empty(4, 3)
    monkeypatch.setattr(ops, "_FAST_LIMIT", 8)
    for _ in range(20):  # a new policy object per call
        with kernel_api.settings(policy=kernel_api.PickAny()):
            ops._tag_policy(kernel_api.tuning.settings.current().scope_token)
            _record(entry, fn, A, B, out, output=2)
        assert len(ops._tagged_policies) <= 8 and entry.replays() <= 8


def test_kernels_offer_the_positional_ffi_function_behind_a_compiled_object():
    from types import SimpleNamespace

    from kernel_api.providers.cutedsl.kernel import ffi_function

    function = tvm_ffi.convert(lambda *args: None)
    assert ffi_function(function) is function
    wrapped = SimpleNamespace(__tvm_ffi_object__=lambda: function,
                              execution_args=SimpleNamespace(has_pointer_address_arg_specs=False))
    assert ffi_function(wrapped) is function  # a fresh compile's keyword-argument adapter
    assert ffi_function(SimpleNamespace(__tvm_ffi_object__=lambda: None)) is None  # no GPU function
    pointers = SimpleNamespace(__tvm_ffi_object__=lambda: function,
                               execution_args=SimpleNamespace(has_pointer_address_arg_specs=True))
    assert ffi_function(pointers) is None  # needs Python-side argument conversion
    assert ffi_function(lambda *args: None) is None
    # A Launcher calls the positional function behind an artifact's compiled object, where there is one.
    launcher = Launcher(kernel_api.CompiledArtifact(wrapped, None), (1.0,))
    assert launcher.function is function and launcher.ffi and launcher.tail == (1.0,)

    class PointerAdapter(SimpleNamespace):
        def __call__(self, *args):
            return None

    adapter = PointerAdapter(__tvm_ffi_object__=lambda: function,
                             execution_args=SimpleNamespace(has_pointer_address_arg_specs=True))
    launcher = Launcher(kernel_api.CompiledArtifact(adapter, None))
    assert launcher.function is adapter and not launcher.ffi  # called as it is: it converts its arguments


def test_launch_functions_keep_the_gil_unless_the_kernel_says_otherwise():
    from types import SimpleNamespace

    from kernel_api.providers.cutedsl.kernel import CuteDslKernel

    assert CuteDslKernel.keep_gil_during_launch
    for keep, released in ((True, False), (False, True)):
        function = tvm_ffi.convert(lambda *args: None)
        assert function.release_gil  # TVM-FFI's default
        kernel = SimpleNamespace(keep_gil_during_launch=keep)
        assert CuteDslKernel._launch_ready(kernel, function) is function
        assert function.release_gil is released


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("KERNEL_API_NATIVE", "0")
    # Restored afterwards rather than reset: a reload from this test's cache folder would load a
    # second copy of the library, with its own table, beside the one ops and arguments hold.
    loaded = dict(native._state)
    native._reset_for_tests()
    try:
        assert native.table() is None and "KERNEL_API_NATIVE" in native.why_not()
        assert native.entry() is None and "KERNEL_API_NATIVE" in native.why_not_entry()
    finally:
        native._state.clear()
        native._state.update(loaded)


_STRESS = """
import sys, threading, time
import torch, tvm_ffi
from kernel_api import native
from kernel_api.launcher import Launcher
from kernel_api.native import recipes
from kernel_api.ops import dispatch
assert dispatch._load_entry(), native.why_not_entry()
entry = native.entry()
tensors = [(torch.randn(4, 8), torch.randn(8, 3), torch.empty(4, 3)) for _ in range(4)]
stop = time.monotonic() + float(sys.argv[1])
errors, rounds = [], [0] * 4

def work(i):
    try:
        A, B, out = tensors[i]
        while time.monotonic() < stop:
            rounds[i] += 1
            # A new Python callable per record: the recipe it displaces drops the last reference to another.
            spec = recipes.Launch(tvm_ffi.convert(lambda *args: None), (0, 1, 2), output=2)
            recipes.record(entry, 5, spec, A, B, out)
            entry.replay(5, A, B, out)
            if rounds[i] % 50 == 0:
                entry.forget_replays()
    except BaseException as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
assert not errors, errors
print("rounds", sum(rounds))
"""


def test_record_forget_and_replay_from_four_threads(table, tmp_path):
    """Recipes are recorded, forgotten and replayed from four threads (releasing a recipe may
    release a Python object). Run in a subprocess: a hang or a crash fails the test."""
    import os
    import subprocess
    import sys

    from kernel_api.core.cache import cache_dir

    script = tmp_path / "stress.py"
    script.write_text(_STRESS)
    root = os.path.dirname(os.path.dirname(os.path.abspath(kernel_api.__file__)))  # this kernel_api, not another
    env = dict(os.environ, KERNEL_API_CACHE_DIR=str(cache_dir()),
               PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    try:
        done = subprocess.run([sys.executable, str(script), "3"], capture_output=True, text=True, timeout=60,
                              env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("record/forget/replay from four threads hung (no exit within 60 s of a 3 s run)")
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 100  # the threads did run concurrently
