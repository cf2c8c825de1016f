"""Framework integration on the CPU: custom ops, fake impls, tracing, autograd wiring, workspaces.

Meta tensors stand in for GPU tensors: they reach the fake implementations, so tracing and
autograd wiring are checked without running a kernel (the numbers are checked on a GPU in
test_integration_gpu.py).
"""

import pytest
import torch

import kernel_api
from kernel_api.ops import dispatch as ops  # the front door's module: its caches and launch records
from kernel_api.errors import DeviceError
from kernel_api.kernel import _allocate_workspace
from gemm_family_utils import operand_variants
from integration_kernels import workspace_kernel


def _meta(*shape, dtype=torch.float16, grad=False):
    return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=grad)


@pytest.mark.parametrize("op,args", [
    ("gemm", lambda: (_meta(64, 32), _meta(32, 48))),
    ("gemm", lambda: (_meta(2, 64, 32), _meta(2, 32, 48), _meta(2, 64, 48), _meta(48), 0.5, 1.0, None)),
    ("softmax", lambda: (_meta(8, 100, dtype=torch.float32), -1)),
    ("softmax_backward", lambda: (_meta(8, 100, dtype=torch.float32), _meta(8, 100, dtype=torch.float32), -1)),
])
def test_custom_ops_pass_opcheck(op, args):
    result = torch.library.opcheck(getattr(torch.ops.kernel_api, op).default, args())
    assert all(v == "SUCCESS" for v in result.values()), result


def test_fake_gemm_shapes_and_errors():
    assert torch.ops.kernel_api.gemm(_meta(3, 64, 32), _meta(3, 32, 48)).shape == (3, 64, 48)
    with pytest.raises(ValueError, match="K mismatch"):
        torch.ops.kernel_api.gemm(_meta(64, 32), _meta(31, 48))


def test_torch_compile_fullgraph_captures_the_custom_ops():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def model(a, b, x):
        h = ops.gemm(a, b, bias=None, alpha=0.5).float()
        return ops.softmax(h, -1) + ops.softmax(x)

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    y = compiled(_meta(64, 32), _meta(32, 48), _meta(64, 48, dtype=torch.float32))
    assert y.shape == (64, 48) and y.dtype == torch.float32
    targets = [str(n.target).removesuffix(".default") for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert len(graphs) == 1
    assert targets.count("kernel_api.softmax") == 2, targets
    assert "kernel_api.gemm" in targets


def test_torch_export_sees_gemm():
    class M(torch.nn.Module):
        def forward(self, a, b):
            return ops.gemm(a, b)

    ep = torch.export.export(M(), (torch.randn(4, 8), torch.randn(8, 2)))
    assert any(str(n.target) == "kernel_api.gemm.default" for n in ep.graph.nodes)


@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
def test_make_fx_traces_the_custom_ops(tracing_mode):
    """make_fx runs ops under its dispatch modes: they must reach the custom ops (traced, fake
    results), never a launch on fake tensors."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(a, b, x):
        return ops.gemm(a, b), ops.softmax(x), ops.softmax_backward(x, x)

    gm = make_fx(f, tracing_mode=tracing_mode)(torch.randn(4, 8).half(), torch.randn(8, 2).half(), torch.randn(3, 5))
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert {"kernel_api.gemm.default", "kernel_api.softmax.default", "kernel_api.softmax_backward.default"} <= set(targets)


def test_autograd_routes_through_the_backward_op():
    x = _meta(8, 100, dtype=torch.float32, grad=True)
    y = ops.softmax(x)
    assert y.requires_grad and y.grad_fn is not None
    y.sum().backward()
    assert x.grad.shape == x.shape
    a, b, bias = _meta(64, 32, grad=True), _meta(32, 48, grad=True), _meta(48, grad=True)
    ops.gemm(a, b, bias=bias).sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape and bias.grad.shape == bias.shape
    # With an activation the backward recomputes the pre-activation (one more GEMM).
    a2, b2, bias2 = _meta(64, 32, grad=True), _meta(32, 48, grad=True), _meta(48, grad=True)
    ops.gemm(a2, b2, bias=bias2, activation="gelu").sum().backward()
    assert a2.grad.shape == a2.shape and b2.grad.shape == b2.shape and bias2.grad.shape == bias2.shape


def test_out_with_grad_is_rejected():
    with pytest.raises(ValueError, match="out="):
        ops.softmax(_meta(4, 16, dtype=torch.float32, grad=True), out=_meta(4, 16, dtype=torch.float32))


def test_front_door_rejects_cpu_tensors():
    with pytest.raises(DeviceError, match="CUDA"):
        ops.gemm(torch.randn(16, 16).half(), torch.randn(16, 16).half())
    with pytest.raises(DeviceError, match="CUDA"):
        ops.softmax(torch.randn(4, 16))


def test_workspace_kernel_compiles_and_sizes_its_workspace():
    kernel = workspace_kernel()
    x = torch.randn(5, 33)
    args = kernel_api.SoftmaxArguments(x, torch.empty_like(x))
    assert kernel.supports(args)
    assert kernel.get_workspace_size(args) == 4 * 5 * 33
    artifact = kernel.compile(args, cc=90)
    assert artifact.compiled_obj.compiled.arch == "sm_90a"
    ws = _allocate_workspace(kernel.get_workspace_size(args), args.device, None)
    assert ws.dtype == torch.uint8 and ws.numel() == 4 * 5 * 33 and ws.device == x.device


def test_raw_gemm_key_is_as_fine_as_the_arguments_summary():
    """ops' fast path reuses a launcher for equal raw keys: equal keys must mean equal
    signatures and shapes (and so the same choice and support verdict)."""
    from kernel_api.ops.dispatch import _raw_gemm_key

    policy = kernel_api.PickAny()
    variants = operand_variants()
    seen: dict = {}
    checked = 0
    for A in variants:
        for B in variants:
            if A.shape[1] != B.shape[0]:
                continue
            for out in (torch.empty(A.shape[0], B.shape[1], dtype=A.dtype),
                        torch.empty(B.shape[1], A.shape[0], dtype=A.dtype).t()):
                try:
                    args = kernel_api.GemmArguments(A, B, out)
                except (ValueError, TypeError):
                    continue
                summary = (args.signature, args.problem_shape)
                key = _raw_gemm_key(policy, A, B, out)
                assert seen.setdefault(key, summary) == summary
                checked += 1
    assert checked > 100 and len(set(seen.values())) > 10
    assert _raw_gemm_key(policy, A, B, out) != _raw_gemm_key(kernel_api.PickAny(), A, B, out)


def test_ops_gemm_names_operands_that_are_not_tensors():
    with pytest.raises(TypeError, match="A and B must be torch tensors, got list and Tensor"):
        ops.gemm([[1.0]], torch.ones(1, 1))


def test_the_python_fast_path_never_launches_into_an_operand(monkeypatch):
    """Without the native replay, a recorded launcher is skipped when out may overlap an operand."""
    from kernel_api.launcher import Launcher
    from kernel_api.tuning.settings import current

    launched = []
    A, B = torch.randn(16, 16), torch.randn(16, 16)
    key = ops._raw_gemm_key(current().policy, A, B, A)
    monkeypatch.setattr(ops, "replay_call", None)
    extents = tuple(ops.byte_extent(t) for t in (A, B, A))
    entry = ops.PlainEntry(Launcher(lambda *t: launched.append(t)), -1, current().policy, extents)
    monkeypatch.setitem(ops._fast, key, entry)
    with pytest.raises(ValueError, match="operand out: shares memory with operand A"):
        ops.gemm(A, B, out=A)
    assert not launched
    other = torch.empty(16, 16)
    assert ops._may_overlap(A.data_ptr(), A.data_ptr(), B.data_ptr(), extents)
    assert not ops._may_overlap(other.data_ptr(), A.data_ptr(), B.data_ptr(), extents)

