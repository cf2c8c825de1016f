"""kernel_api.nn on the GPU: Linear's forward and backward against float64 references,
gradcheck in float64, torch.compile(fullgraph=True), CUDA graphs, and patched models against
their unpatched selves (the GPT-2 stand-ins of test_nn.py, and transformers' GPT-2 when the
package is installed)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from kernel_api.nn import Linear, patch, patched_modules, unpatch

pytestmark = pytest.mark.gpu

ACTIVATIONS = [None, "relu", "gelu", "silu"]
_ACT = {None: lambda z: z, "relu": F.relu, "gelu": lambda z: F.gelu(z, approximate="tanh"), "silu": F.silu}


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _layer(dtype, activation, in_f=256, out_f=384, seed=0):
    torch.manual_seed(seed)
    return Linear(in_f, out_f, activation=activation, device="cuda", dtype=dtype)


def _reference(layer, x):
    """activation(x @ W^T + b) in float64, with gradients (leaves of its own)."""
    x64 = x.detach().double().requires_grad_()
    w64 = layer.weight.detach().double().requires_grad_()
    b64 = layer.bias.detach().double().requires_grad_()
    return _ACT[layer.activation](x64 @ w64.t() + b64), (x64, w64, b64)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-3)])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_forward_matches_float64(dtype, tol, activation):
    layer = _layer(dtype, activation)
    x = torch.randn(4, 33, 256, device="cuda", dtype=dtype)
    with torch.no_grad():
        y = layer(x)
    ref, _ = _reference(layer, x)
    assert y.shape == (4, 33, 384) and y.dtype == dtype
    assert _rel(y, ref) <= tol


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_backward_matches_float64_in_bf16(activation, fuse):
    layer = _layer(torch.bfloat16, activation, seed=1)
    layer.fuse_activation_when_training = fuse
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    ref, (x64, w64, b64) = _reference(layer, x)
    ref.backward(grad.double())
    assert _rel(y, ref) <= 2e-2
    for got, want in ((x.grad, x64.grad), (layer.weight.grad, w64.grad), (layer.bias.grad, b64.grad)):
        assert got.shape == want.shape and _rel(got, want) <= 2e-2


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_gradcheck_float64(activation, fuse):
    layer = _layer(torch.float64, activation, in_f=5, out_f=7, seed=2)
    layer.fuse_activation_when_training = fuse
    x = torch.randn(3, 5, device="cuda", dtype=torch.float64, requires_grad=True)

    def f(x, w, b):
        return torch.func.functional_call(layer, {"weight": w, "bias": b}, (x,))

    assert torch.autograd.gradcheck(f, (x, layer.weight, layer.bias))


def test_linear_under_torch_compile_fullgraph_forward_and_backward():
    layer = _layer(torch.bfloat16, "gelu", seed=3)
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(8, 40, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = compiled(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    ref, (x64, w64, b64) = _reference(layer, x)
    ref.backward(grad.double())
    assert _rel(y, ref) <= 2e-2
    assert _rel(x.grad, x64.grad) <= 2e-2 and _rel(layer.weight.grad, w64.grad) <= 2e-2
    assert _rel(layer.bias.grad, b64.grad) <= 2e-2
    with torch.no_grad():
        assert _rel(compiled(x), ref) <= 2e-2  # the inference graph (activation fused)


def test_linear_forward_under_cuda_graph_capture_and_replay():
    layer = _layer(torch.bfloat16, "silu", seed=4)
    static_x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):  # choose and compile outside the capture
            layer(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_y = layer(static_x)
    for seed in (5, 6):
        torch.manual_seed(seed)
        static_x.copy_(torch.randn(64, 256, device="cuda", dtype=torch.bfloat16))
        static_y.fill_(float("nan"))  # sentinel: the replay must write every element
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = _reference(layer, static_x)
        assert torch.isfinite(static_y).all() and _rel(static_y, ref) <= 2e-2


def test_patched_stand_in_block_matches_unpatched_forward_and_backward():
    from test_nn import Block  # the GPT-2 stand-ins (Conv1D, NewGELUActivation, GPT2MLP)
    torch.manual_seed(7)
    model = Block().to(device="cuda", dtype=torch.bfloat16)
    ref_model = copy.deepcopy(model)
    patch(model)
    x = torch.randn(4, 16, 16, device="cuda", dtype=torch.bfloat16)

    def run(m):
        out = m.head(m.mlp(m.attn(x)[..., :16]))
        out.float().square().sum().backward()
        return out, [p.grad for p in m.parameters()]

    out, grads = run(model)
    ref, ref_grads = run(ref_model)
    assert _rel(out, ref) <= 2e-2
    assert all(_rel(g, r) <= 3e-2 for g, r in zip(grads, ref_grads) if r is not None and r.norm() > 0)
    unpatch(model)
    assert not patched_modules(model)


def test_patched_transformers_gpt2_logits_match():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(8)
    config = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=1024)
    model = transformers.GPT2LMHeadModel(config).to(device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 1024, (2, 64), device="cuda")
    with torch.no_grad():
        ref = model(ids).logits
        patch(model)
        got = model(ids).logits
    assert _rel(got, ref) <= 2e-2


# ---- the hot paths of the nn layers' GEMMs ------------------------------------------------------
def test_repeated_epilogue_gemm_uses_the_fast_entry_with_each_calls_own_bias():
    """A bias + gelu GEMM called again with equal metadata is launched from ops' fast
    dictionary, or, where PickAny gives it to cuBLAS, from the C entry points' recorded torch
    call (which then serves calls before they reach the dictionary); each call's own bias (and
    input) is used, never the recorded one's."""
    from kernel_api import ops
    from kernel_api.ops import dispatch
    torch.manual_seed(10)
    A = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    W = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16) * 0.05
    dispatch.clear_dispatch_cache()
    alignments = set()
    for step in range(6):
        bias = torch.randn(384, device="cuda", dtype=torch.bfloat16)  # a new tensor (and values) each call
        x = torch.randn_like(A)
        out = ops.gemm(x, W, bias=bias, activation="gelu")
        ref = F.gelu(x.double() @ W.double() + bias.double(), approximate="tanh")
        assert _rel(out, ref) <= 2e-2, step
        # the fast key holds each pointer's bits below 1024 (the alignment arguments record)
        alignments.add((x.data_ptr() & 1023, out.data_ptr() & 1023, bias.data_ptr() & 1023))
    entries = [v for k, v in dispatch._fast.items() if len(k) == 4 and k[2] == "gelu"]
    # recorded at most once per pointer-alignment class the allocator happened to give, as
    # epilogue entries (fewer where the C entry points served calls first)
    assert 1 <= len(entries) <= len(alignments) < 6 and all(isinstance(e, dispatch.EpilogueEntry) for e in entries)
    # no tensor is kept by the entry (the bias goes in at each call)
    assert not any(isinstance(c, torch.Tensor) for c in entries[0].before + entries[0].after)


def test_lm_head_with_misaligned_vocab_forward_backward_and_compile():
    """GPT-2's lm_head in small: 1001 outputs (rows of 2002 bytes) at 512 rows in bf16. The
    output's rows are padded to 1008 (two GEMMs), the values and the gradients match float64,
    also under torch.compile(fullgraph=True) (whose generated code asserts the strides of the
    fake implementation on the real output)."""
    torch.manual_seed(11)
    layer = Linear(768, 1001, bias=False, device="cuda", dtype=torch.bfloat16)
    layer.compile_lowering = "kernel_api"  # the op (and its padded output) inside the compiled graph
    x = torch.randn(512, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for fn in (layer, torch.compile(layer, fullgraph=True)):
        x.grad = layer.weight.grad = None
        y = fn(x)
        assert y.shape == (512, 1001) and (fn is not layer or y.stride() == (1008, 1))
        grad = torch.randn(512, 1001, device="cuda", dtype=torch.bfloat16)
        y.backward(grad)
        x64 = x.detach().double().requires_grad_()
        w64 = layer.weight.detach().double().requires_grad_()
        ref = x64 @ w64.t()
        ref.backward(grad.double())
        assert _rel(y, ref) <= 2e-2
        assert _rel(x.grad, x64.grad) <= 2e-2 and _rel(layer.weight.grad, w64.grad) <= 2e-2


def test_gemm_op_without_grad_skips_autograd_wrappers():
    """torch.ops.kernel_api.gemm on CUDA tensors that need no gradient goes from its Autograd
    kernel straight to the implementation: no autograd node, and the values of the fused bias and
    gelu. (Its host cost per call is timed by benchmarks/host_latency.py, not here.)"""
    A = torch.randn(64, 768, device="cuda", dtype=torch.bfloat16)
    W = torch.randn(768, 2304, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2304, device="cuda", dtype=torch.bfloat16)
    y = torch.ops.kernel_api.gemm(A, W, None, b, 1.0, 0.0, "gelu")
    assert y.grad_fn is None
    ref = torch.nn.functional.gelu(A.double() @ W.double() + b.double())
    assert _rel(y, ref) <= 2e-2
