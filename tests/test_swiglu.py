"""SwiGLU and GeGLU on the CPU: the arguments' one-line refusals, the row summary, discovery and
explain, the torch provider's kernels through `kernel_api.ops` (the tests add "cpu" to
`dispatch.LAUNCH_DEVICE_TYPES`) against float64 references written here, gradcheck in f64
through the generated ops, tracing (make_fx, torch.compile), and the CUDA source kernels compiled
for sm_90a without a GPU. tests/test_swiglu_gpu.py runs the kernels on CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

import kernel_api
from kernel_api import ops
from kernel_api.arguments import GatedActivationArguments, GatedActivationBackwardArguments
from kernel_api.ops import dispatch

SENTINEL = 1234.5
TOL = {torch.float32: dict(atol=5e-5, rtol=5e-5), torch.float16: dict(atol=4e-3, rtol=4e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=2e-2), torch.float64: dict(atol=1e-12, rtol=1e-12)}


def _act64(g: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return g / (1 + torch.exp(-g))
    if activation == "gelu_tanh":
        return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
    return 0.5 * g * (1 + torch.erf(g / math.sqrt(2)))


def reference(gate, up, activation="silu"):
    """act(gate) * up in float64, written out (not torch's silu/gelu)."""
    return _act64(gate.detach().double(), activation) * up.detach().double()


def reference_grads(dy, gate, up, activation="silu"):
    """(grad_gate, grad_up) in float64, by autograd through `reference`'s formula."""
    g = gate.detach().double().requires_grad_()
    u = up.detach().double().requires_grad_()
    return torch.autograd.grad(_act64(g, activation) * u, (g, u), dy.double())


@pytest.fixture
def cpu_ops(monkeypatch):
    """The front door launching on CPU tensors with the torch provider (which computes anywhere;
    the CUDA source kernels fit CPU tensors' metadata too, and would be chosen)."""
    monkeypatch.setattr(dispatch, "LAUNCH_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    ops.clear_dispatch_cache()
    with kernel_api.settings(providers="torch"):
        yield
    monkeypatch.undo()
    ops.clear_dispatch_cache()


# ---- refusals: one line, naming the operand ----

def _bad_cases():
    g, u = torch.randn(4, 8), torch.randn(4, 8)
    out = torch.empty(4, 8)
    return [
        (lambda: GatedActivationArguments([1.0], u, out), TypeError, "operand gate: expected a torch.Tensor"),
        (lambda: GatedActivationArguments(torch.tensor(1.0), torch.tensor(1.0), torch.tensor(1.0)), ValueError,
         "operand gate: needs at least one dimension"),
        (lambda: GatedActivationArguments(g, torch.randn(4, 7), out), ValueError, "operand up: shape (4, 7) must equal"),
        (lambda: GatedActivationArguments(g, u.double(), out), TypeError, "operand up: dtype torch.float64"),
        (lambda: GatedActivationArguments(g, u, torch.empty(4, 8, device="meta")), ValueError, "operand out: on meta"),
        (lambda: GatedActivationArguments(torch.randn(8, 4).t(), torch.randn(8, 4).t(), out), ValueError,
         "operand gate: the last dimension must have stride 1"),
        (lambda: GatedActivationArguments(torch.randn(4, 3, 8)[:, :2].transpose(0, 1), torch.randn(2, 4, 8),
                                          torch.empty(2, 4, 8)), ValueError, "operand gate: rows of shape (2, 4, 8)"),
        (lambda: GatedActivationArguments(torch._neg_view(g), u, out), ValueError, "operand gate: has torch's lazy"),
        (lambda: GatedActivationArguments(g, u, torch.empty(1, 8).expand(4, 8)), ValueError, "operand out: rows overlap"),
        (lambda: GatedActivationArguments(g, u, out, activation="relu"), ValueError, "activation: expected one of"),
        (lambda: GatedActivationArguments(g.to(torch.complex64), u, out), TypeError, "operand gate: dtype"),
        (lambda: GatedActivationBackwardArguments(torch.randn(4, 7), g, u, out, out.clone()), ValueError,
         "operand grad_out: shape (4, 7)"),
        (lambda: GatedActivationBackwardArguments(g, g, u, out, None), TypeError, "operand grad_up: expected a torch"),
        (lambda: ops.geglu(g, u, approximate="erf"), ValueError, "approximate: expected 'tanh' or 'none'"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_refusals_name_the_operand_in_one_line(case):
    build, error, text = _bad_cases()[case]
    with pytest.raises(error) as info:
        build()
    message = str(info.value)
    assert text in message and "\n" not in message


def test_outputs_overlapping_inputs_are_refused(cpu_ops):
    g, u = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="operand out: overlaps gate"):
        GatedActivationArguments(g, u, g).check_memory()
    with pytest.raises(ValueError, match="operand out: overlaps up"):
        ops.swiglu(g, u, out=u)
    same = torch.empty(4, 8)
    with pytest.raises(ValueError, match="operand grad_gate: overlaps grad_up"):
        GatedActivationBackwardArguments(g, g.clone(), u, same, same).check_memory()


# ---- the summary, discovery and explain ----

def test_dense_operands_are_one_row_and_chunked_halves_keep_their_rows():
    x = torch.randn(6, 2, 10)
    args = GatedActivationArguments(x[:, 0], x[:, 1], torch.empty(6, 10))
    assert (args.rows, args.cols) == (6, 10) and args.row_strides == {"gate": 20, "up": 20, "out": 10}
    dense = GatedActivationArguments(torch.randn(2, 3, 5), torch.randn(2, 3, 5), torch.empty(2, 3, 5))
    assert (dense.rows, dense.cols) == (1, 30)
    assert list(dense.tensor_attributes) == ["gate", "up", "out"]
    assert dense.tensor_attributes["gate"].stride == (0, 1)
    assert dense.problem_key() != args.problem_key()
    assert repr(dense) == "GatedActivationArguments(rows=1, cols=30, dtype=f32, activation=silu, device=cpu)"
    assert GatedActivationBackwardArguments.output_names == ("grad_gate", "grad_up")


def test_alignment_is_pointer_and_row_stride():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    aligned = GatedActivationArguments(*x.chunk(2, -1), torch.empty(4, 16, dtype=torch.bfloat16))
    assert aligned.tensor_attributes["gate"].divisibility >= 8 and aligned.tensor_attributes["up"].divisibility >= 8
    odd = GatedActivationArguments(x[:, 1:9], x[:, 17:25], torch.empty(4, 8, dtype=torch.bfloat16))
    assert odd.tensor_attributes["gate"].divisibility == 1


@pytest.mark.parametrize("dtype, names", [
    (torch.bfloat16, ["CudaGatedActivation_bf16_v8", "CudaGatedActivation_bf16_v1", "TorchGatedActivation_bf16"]),
    (torch.float32, ["CudaGatedActivation_f32_v4", "CudaGatedActivation_f32_v1", "TorchGatedActivation_f32"]),
    (torch.float64, ["TorchGatedActivation_f64"])])
def test_discovery_for_sm90(dtype, names):
    g = torch.randn(3, 64, dtype=dtype)
    args = GatedActivationArguments(g, g.clone(), torch.empty_like(g), activation="gelu")
    assert [k.name for k in kernel_api.get_kernels(args, cc=90)] == names
    bwd = GatedActivationBackwardArguments(g, g.clone(), g.clone(), torch.empty_like(g), torch.empty_like(g))
    assert [k.name for k in kernel_api.get_kernels(bwd, cc=90)] == [n.replace("Activation_", "ActivationBackward_")
                                                                   for n in names]


def test_explain_names_the_misaligned_operand():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    args = GatedActivationArguments(x[:, 1:9], x[:, 17:25], torch.empty(4, 8, dtype=torch.bfloat16))
    text = str(kernel_api.explain(args, cc=90))
    assert "cuda_src/CudaGatedActivation: " in text and "gate" in text
    assert "CudaGatedActivation_bf16_v1" in text
    ints = torch.zeros(3, 4, dtype=torch.int32)
    refused = GatedActivationArguments(ints, ints.clone(), torch.empty_like(ints))
    assert kernel_api.get_kernels(refused) == []
    assert "operand gate" in str(kernel_api.registry.no_kernel_error(refused))


# ---- the operations on CPU tensors against float64 ----

@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (3, 7), (2, 3, 33)])
def test_forward_and_backward_against_float64(cpu_ops, activation, dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape) + len(activation))
    gate = (3 * torch.randn(shape, generator=gen)).to(dtype)
    up = torch.randn(shape, generator=gen).to(dtype)
    out = torch.full(shape, SENTINEL, dtype=dtype)
    y = ops.gated_activation(gate, up, activation, out=out)
    assert y is out
    torch.testing.assert_close(out.double(), reference(gate, up, activation), **TOL[dtype])
    dy = torch.randn(shape, generator=gen).to(dtype)
    dg, du = ops.gated_activation_backward(dy, gate, up, activation)
    want_dg, want_du = reference_grads(dy, gate, up, activation)
    torch.testing.assert_close(dg.double(), want_dg, **TOL[dtype])
    torch.testing.assert_close(du.double(), want_du, **TOL[dtype])


def test_swiglu_and_geglu_front_doors(cpu_ops):
    g, u = torch.randn(5, 9), torch.randn(5, 9)
    torch.testing.assert_close(ops.swiglu(g, u).double(), reference(g, u, "silu"), **TOL[torch.float32])
    torch.testing.assert_close(ops.geglu(g, u).double(), reference(g, u, "gelu_tanh"), **TOL[torch.float32])
    torch.testing.assert_close(ops.geglu(g, u, "none").double(), reference(g, u, "gelu"), **TOL[torch.float32])


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_gradcheck_f64(cpu_ops, activation):
    g = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    u = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda g, u: ops.gated_activation(g, u, activation), (g, u))


def test_gradients_of_chunked_halves(cpu_ops):
    x = torch.randn(4, 2 * 6, dtype=torch.float64, requires_grad=True)
    gate, up = x.chunk(2, dim=-1)
    ops.swiglu(gate, up).sum().backward()  # an expanded gradient reaches the backward
    xr = x.detach().requires_grad_()
    g, u = xr.chunk(2, -1)
    (g / (1 + torch.exp(-g)) * u).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)


# ---- tracing and compiling without a GPU ----

def test_make_fx_shows_the_ops():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(g, u):
        return ops.swiglu(g, u) + ops.geglu(g, u)

    code = make_fx(f, tracing_mode="fake")(torch.randn(2, 8), torch.randn(2, 8)).code
    assert code.count("kernel_api.gated_activation.default") == 2

    def grads(g, u):
        return torch.autograd.grad(ops.swiglu(g, u).sum(), (g, u))

    g, u = torch.randn(2, 8, requires_grad=True), torch.randn(2, 8, requires_grad=True)
    assert "kernel_api.gated_activation_backward.default" in make_fx(grads, tracing_mode="fake")(g, u).code


def test_torch_compile_fullgraph_on_cpu(cpu_ops):
    torch._dynamo.reset()
    g, u = torch.randn(4, 16), torch.randn(4, 16)
    y = torch.compile(lambda g, u: ops.swiglu(g, u) * 2, fullgraph=True, backend="aot_eager")(g, u)
    torch.testing.assert_close(y.double(), 2 * reference(g, u), **TOL[torch.float32])


@pytest.mark.parametrize("backward", [False, True])
def test_cuda_kernels_compile_for_sm90_without_a_gpu(backward):
    g = torch.randn(16, 64, dtype=torch.bfloat16)
    if backward:
        args = GatedActivationBackwardArguments(g, g.clone(), g.clone(), torch.empty_like(g), torch.empty_like(g),
                                                activation="gelu_tanh")
    else:
        args = GatedActivationArguments(g, g.clone(), torch.empty_like(g), activation="gelu_tanh")
    kernels = [k for k in kernel_api.get_kernels(args, cc=90) if k.name.startswith("Cuda")]
    assert len(kernels) == 2
    for kernel in kernels:
        artifact = kernel.compile(args, cc=90)
        assert artifact.compiled_obj.compiled.arch.endswith("90a")
