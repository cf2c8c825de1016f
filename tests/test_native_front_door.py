"""The C front doors (native/front_door.cc, kernel_api/ops/front_doors.py) and the call key's
torch-linked reads (native/torch_reads.cc): a repeated ops.gemm / attention / softmax call that the
replay serves runs no Python of kernel_api's; a call the replay does not serve runs the Python
front door less its replay attempt (the replay is asked once); the C function binds arguments as
the Python function does, has its name, signature and docstring, and Dynamo traces the Python
function in its place, whether Dynamo was imported before kernel_api or after. The torch-linked
reads are adopted only after they agree with torch's own readers.

Runs on CPU with the torch provider (its kernels record torch calls for the replay).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kernel_api
from kernel_api import native
from kernel_api.ops import dispatch as ops, front_doors

from test_hardening_host_cost import Frames

pytest.importorskip("tvm_ffi")
if native.module_path() is None or native.front_door_module() is None:
    pytest.skip("the native modules were not built by this install", allow_module_level=True)


@pytest.fixture
def torch_ops(cpu_ops):
    module = native.entry()
    if module is None:
        pytest.skip(f"no CPython entry points here: {native.why_not_entry()}")
    assert ops._load_entry()
    with kernel_api.settings(providers=["torch"]):
        yield module


def test_the_front_doors_are_c_functions_with_the_python_signatures():
    for door in (kernel_api.ops.gemm, kernel_api.ops.attention, kernel_api.ops.softmax, kernel_api.ops.softmax_backward):
        python = front_doors.python_front_door(door)
        assert inspect.isbuiltin(door) and inspect.isfunction(python), (door, python)
        assert door.__name__ == python.__name__ and door.__module__ == python.__module__
        bare = inspect.signature(python)
        bare = bare.replace(parameters=[p.replace(annotation=p.empty) for p in bare.parameters.values()],
                            return_annotation=bare.empty)
        assert inspect.signature(door) == bare
        assert door.__doc__ == inspect.getdoc(python)


def test_the_c_front_doors_pickle_and_copy_as_references():
    """As module-level Python functions do: a worker that unpickles one gets the front door itself."""
    import copy
    import pickle

    for door in (kernel_api.ops.gemm, kernel_api.ops.attention, kernel_api.ops.softmax):
        assert pickle.loads(pickle.dumps(door)) is door
        assert copy.deepcopy(door) is door


def test_a_replayed_gemm_and_attention_enter_no_python_of_kernel_apis(torch_ops):
    A, B, out = torch.randn(16, 8), torch.randn(8, 24), torch.empty(16, 24)
    q, k, v = (torch.randn(2, 5, 4, 8) for _ in range(3))
    calls = [lambda: kernel_api.ops.gemm(A, B, out=out), lambda: kernel_api.ops.gemm(A, B, None, alpha=1.0),
             lambda: kernel_api.ops.attention(q, k, v, causal=True)]
    for call in calls:
        call()
    for call in calls:
        with Frames() as frames:
            call()
        ours = [f for f in frames.of("kernel_api") if not f.startswith("kernel_api.providers.")]
        assert ours == [], frames.entered
    assert torch.allclose(out, A @ B, atol=1e-5)


def test_a_call_the_replay_does_not_serve_asks_it_once_then_runs_python(torch_ops):
    A, B, B2 = torch.randn(16, 8), torch.randn(8, 24), torch.randn(8, 12)
    kernel_api.ops.gemm(A, B)
    with Frames() as frames:
        y = kernel_api.ops.gemm(A, B2)  # another key: the Python path, which records it
    ours = frames.of("kernel_api.ops.dispatch")
    assert "kernel_api.ops.dispatch._gemm_unreplayed" in ours and "kernel_api.ops.dispatch.gemm" not in ours, ours
    assert torch.allclose(y, A @ B2, atol=1e-4)
    with Frames() as frames:
        kernel_api.ops.gemm(A, B2)
    assert frames.of("kernel_api.ops.dispatch") == []


def test_the_c_front_door_binds_arguments_as_python_does(torch_ops):
    A, B, out = torch.randn(4, 8), torch.randn(8, 6), torch.empty(4, 6)
    assert kernel_api.ops.gemm(A=A, B=B, out=out) is out
    assert kernel_api.ops.gemm(A, B, out) is out  # out by position
    assert torch.allclose(out, A @ B, atol=1e-5)
    with pytest.raises(TypeError, match="unexpected keyword 'bogus'"):
        kernel_api.ops.gemm(A, B, bogus=1)
    with pytest.raises(TypeError):
        kernel_api.ops.gemm(A)  # B missing: Python's own message
    with pytest.raises(TypeError):
        kernel_api.ops.gemm(A, B, out, 2.0)  # alpha is keyword-only
    with pytest.raises(TypeError):
        kernel_api.ops.gemm(A, B, A=A)  # A twice
    with pytest.raises(TypeError, match="A and B must be torch tensors"):
        kernel_api.ops.gemm([1.0], B)


def test_torch_reads_are_adopted_after_they_agree_with_torch(torch_ops):
    reads = native.torch_reads(torch_ops)
    if reads is None:
        pytest.skip(f"no torch-linked reads here: {native.why_not_torch_reads()}")
    assert torch_ops.uses_torch_reads()
    x = torch.randn(5, 7, dtype=torch.float64)
    awkward = [x[::2, 1:], x.t(), torch.randn(3, dtype=torch.float16), torch.zeros(()), x.unsqueeze(1).expand(5, 3, 7),
               torch.randn(4, requires_grad=True), torch._neg_view(x), torch.randn(2, dtype=torch.complex128).conj()]
    assert torch_ops.check_torch_reads(reads, *awkward) is None
    with torch.no_grad():
        assert torch_ops.check_torch_reads(reads) is None


def test_a_torch_read_that_disagrees_is_reported(torch_ops, monkeypatch):
    reads = native.torch_reads(torch_ops)
    if reads is None:
        pytest.skip(f"no torch-linked reads here: {native.why_not_torch_reads()}")
    lying = (ops._settings, lambda: False, ops._dispatch_modes, ops._function_modes, ops._autocast_any,
             ops._tf32_allowed, ops._increment_version)
    torch_ops.configure_replay(*lying)
    try:
        with torch.enable_grad():
            assert "grad mode" in torch_ops.check_torch_reads(reads)
    finally:
        torch_ops.configure_replay(ops._settings, ops._grad_enabled, ops._dispatch_modes, ops._function_modes,
                                   ops._autocast_any, ops._tf32_allowed, ops._increment_version)


def test_the_call_key_still_tells_torchs_states_apart(torch_ops):
    """Recorded in the plain state, a GEMM is not replayed under no_grad, autocast or a torch
    function mode (the torch-linked reads hold each in the key, as the Python readers did)."""
    from torch.overrides import TorchFunctionMode

    A, B, out = torch.randn(8, 8), torch.randn(8, 8), torch.empty(8, 8)
    kernel_api.ops.gemm(A, B, out=out)
    call = (A, B, out, 1.0, 0.0, None, None, None, None, None)
    assert torch_ops.recipe(ops.GEMM_OP, *call) is not None

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    for state in (torch.no_grad, lambda: torch.autocast("cpu"), Passing):
        with state():
            assert torch_ops.recipe(ops.GEMM_OP, *call) is None


_AFTER_KERNEL_API = textwrap.dedent("""
    import sys
    import torch
    import kernel_api
    assert "torch._dynamo" not in sys.modules
    targets = []

    def backend(gm, inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def f(a, b):
        return kernel_api.ops.gemm(a, b) * 2

    torch.compile(f, backend=backend, fullgraph=True)(torch.randn(4, 8, device="meta"), torch.randn(8, 4, device="meta"))
    assert any("kernel_api.gemm" in t for t in targets), targets
    print("traced")
""")


def test_dynamo_imported_after_kernel_api_traces_the_python_front_door():
    """kernel_api does not import Dynamo: the C front doors are registered for it when it loads."""
    done = subprocess.run([sys.executable, "-c", _AFTER_KERNEL_API], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "traced" in done.stdout, done.stderr[-3000:]


def test_dynamo_traces_the_python_front_doors_into_the_ops():
    targets = []

    def backend(gm, inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def f(a, b, q):
        return kernel_api.ops.gemm(a, b), kernel_api.ops.attention(q, q, q, causal=True), kernel_api.ops.softmax(a)

    meta = [torch.randn(4, 8, device="meta"), torch.randn(8, 4, device="meta"), torch.randn(1, 3, 2, 8, device="meta")]
    torch._dynamo.reset()
    torch.compile(f, backend=backend, fullgraph=True)(*meta)
    for op in ("kernel_api.gemm", "kernel_api.attention", "kernel_api.softmax"):
        assert any(op in t for t in targets), (op, targets)


def test_torch_reads_built_for_another_torch_are_refused(torch_ops, monkeypatch):
    """The module depends on torch's C++ ABI: built for another version, it is not adopted."""
    module = pytest.importorskip("kernel_api.native._torch_reads")
    adopted = native.torch_reads(torch_ops)
    monkeypatch.setattr(module, "torch_version", "0.0.0")
    monkeypatch.delitem(native._state, "torch_reads")
    try:
        assert native.torch_reads(torch_ops) is None
        assert "built for torch 0.0.0" in native.why_not_torch_reads()
    finally:
        native._state["torch_reads"] = adopted
        native._state.pop("torch_reads_error", None)


def test_without_the_native_modules_the_front_doors_are_the_python_functions():
    """KERNEL_API_NATIVE=0 (or no build): the Python front doors serve, as before."""
    code = ("import inspect, kernel_api\n"
            "for f in (kernel_api.ops.gemm, kernel_api.ops.attention, kernel_api.ops.softmax):\n"
            "    assert inspect.isfunction(f), f\n"
            "print('python')\n")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KERNEL_API_NATIVE": "0"})
    assert done.returncode == 0 and "python" in done.stdout, done.stderr[-3000:]
