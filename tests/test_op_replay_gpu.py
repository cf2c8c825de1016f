"""The replay of the generated operations' repeated calls on CUDA, where the chosen kernels are
the CUDA source kernels (recorded ``cuLaunchKernel`` launches, `kernel_api.native.cuda_launch`):
replayed results equal the Python path's bit for bit and against float64, the replay serves
(counted Python-path launches), a side stream, given outputs; the norm backwards (a workspace
made per call, on a side stream and in a CUDA graph) and cross-entropy's backward replayed by
their CUDA kernels; the torch provider's norm backwards on CUDA. The CPU half, with the rules, is
tests/test_op_replay.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernel_api
from kernel_api import native, ops

from test_op_replay import _PACKAGE, _kernel_api_frames, _same, _settled, count_python_path

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture
def launches(monkeypatch):
    seen = count_python_path(monkeypatch)
    yield seen
    monkeypatch.undo()
    ops.clear_dispatch_cache()


def _cases():
    new = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    x, r, w, b = new(7, 1000), new(7, 1000), new(1000), new(1000)
    gu = new(5, 2 * 704)
    g, u = gu.chunk(2, dim=-1)  # halves of one projection: strided rows
    q, k = new(2, 8, 9, 64), new(2, 2, 9, 64)
    cos, sin = new(1, 9, 64), new(1, 9, 64)
    logits, target = new(6, 5003), torch.randint(0, 5003, (6,), device="cuda")
    return {
        "rms_norm": (lambda: ops.rms_norm(x, w, 1e-6), lambda: F.rms_norm(x.double(), (1000,), w.double(), 1e-6)),
        "rms_norm_residual": (lambda: ops.rms_norm(x, w, 1e-6, r)[0],
                              lambda: F.rms_norm(x.double() + r.double(), (1000,), w.double(), 1e-6)),
        "layer_norm": (lambda: ops.layer_norm(x, w, b, 1e-5),
                       lambda: F.layer_norm(x.double(), (1000,), w.double(), b.double(), 1e-5)),
        "swiglu": (lambda: ops.swiglu(g, u), lambda: F.silu(g.double()) * u.double()),
        "geglu": (lambda: ops.geglu(g, u), lambda: F.gelu(g.double(), approximate="tanh") * u.double()),
        "rope": (lambda: ops.rope(q, k, cos, sin)[0],
                 lambda: q.double() * cos.double().unsqueeze(1)
                 + torch.cat((-q[..., 32:], q[..., :32]), -1).double() * sin.double().unsqueeze(1)),
        "cross_entropy": (lambda: ops.cross_entropy(logits, target, reduction="none"),
                          lambda: F.cross_entropy(logits.double(), target, reduction="none")),
    }


@pytest.mark.parametrize("name", ["cross_entropy", "geglu", "layer_norm", "rms_norm", "rms_norm_residual", "rope",
                                  "swiglu"])
def test_replayed_calls_match_the_python_path(launches, name):
    f, reference = _cases()[name]
    first = f().clone()
    torch.testing.assert_close(first.double(), reference(), atol=3e-2, rtol=3e-2)
    _settled(f, launches, first)
    assert len(launches) <= 5  # the caching allocator aligns to 512 bytes: two alignments per output


def test_a_side_stream_and_given_outputs(launches):
    x, w = torch.randn(33, 512, device="cuda", dtype=torch.bfloat16), torch.randn(512, device="cuda",
                                                                                    dtype=torch.bfloat16)
    out = torch.full_like(x, 7.0)
    expected = ops.rms_norm(x, w, 1e-6).clone()
    ops.rms_norm(x, w, 1e-6, out=out)
    made = len(launches)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the current stream, replayed on it
        for _ in range(3):
            out.fill_(7.0)
            assert ops.rms_norm(x, w, 1e-6, out=out) is out
    side.synchronize()
    _same(out, expected)
    assert len(launches) == made
    with pytest.raises(ValueError, match="operand out: overlaps x"):
        ops.rms_norm(x, w, 1e-6, out=x)


def _backward_cases():
    new = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    dy, x, w, b = new(7, 1000), new(7, 1000), new(1000), new(1000)
    logits, target = new(6, 5003), torch.randint(0, 5003, (6,), device="cuda")
    target[2] = -100
    lse = torch.logsumexp(logits.float(), -1)
    grad_loss = torch.rand(6, device="cuda")

    def grads(forward, inputs, grad):
        leaves = [t.double().requires_grad_() for t in inputs]
        return torch.autograd.grad(forward(*leaves), leaves, grad.double())

    return {
        "rms_norm_backward": (lambda: ops.rms_norm_backward(dy, x, w, 1e-6),
                              lambda: grads(lambda x, w: F.rms_norm(x, (1000,), w, 1e-6), (x, w), dy)),
        "layer_norm_backward": (lambda: ops.layer_norm_backward(dy, x, w, 1e-5),
                                lambda: grads(lambda x, w, b: F.layer_norm(x, (1000,), w, b, 1e-5), (x, w, b), dy)),
        "cross_entropy_backward": (lambda: (ops.cross_entropy_backward(grad_loss, logits, target, lse),),
                                   lambda: grads(lambda z: F.cross_entropy(z, target, reduction="none"), (logits,),
                                                 grad_loss)),
    }


@pytest.mark.parametrize("name", ["cross_entropy_backward", "layer_norm_backward", "rms_norm_backward"])
def test_the_backwards_are_replayed_by_our_cuda_kernels(launches, name):
    # The norms' backwards take a workspace, made per call by their launcher.
    f, reference = _backward_cases()[name]
    first = tuple(t.clone() for t in f())
    for got, want in zip(first, reference()):
        torch.testing.assert_close(got.double(), want, atol=6e-2, rtol=3e-2)
    _settled(f, launches, first)
    assert len(launches) <= 1 + 2 ** len(first)  # (the made outputs' alignments: 512 or 1024 bytes each)
    assert [type(k).__name__ for _, k in ops.chosen_kernels()] == [
        {"rms_norm_backward": "CudaRMSNormBackward", "layer_norm_backward": "CudaLayerNormBackward",
         "cross_entropy_backward": "CudaCrossEntropyBackward"}[name]]


def test_the_norm_backwards_workspace_on_a_side_stream_and_in_a_cuda_graph(launches):
    dy, x = torch.randn(33, 4096, device="cuda", dtype=torch.bfloat16), torch.randn(33, 4096, device="cuda",
                                                                                     dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    grad_x, grad_w = torch.empty_like(x), torch.empty_like(w)
    expected = tuple(t.clone() for t in ops.layer_norm_backward(dy, x, w, 1e-5))
    grad_b = torch.empty_like(w)
    ops.layer_norm_backward(dy, x, w, 1e-5, grad_x=grad_x, grad_weight=grad_w, grad_bias=grad_b)
    made = len(launches)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # replayed on the side stream, its workspace that stream's
        for _ in range(3):
            grad_x.fill_(7.0)
            ops.layer_norm_backward(dy, x, w, 1e-5, grad_x=grad_x, grad_weight=grad_w, grad_bias=grad_b)
    side.synchronize()
    assert len(launches) == made
    for got, want in zip((grad_x, grad_w, grad_b), expected):
        _same(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the replay captured, its workspace from the graph's pool
        ops.layer_norm_backward(dy, x, w, 1e-5, grad_x=grad_x, grad_weight=grad_w, grad_bias=grad_b)
    assert len(launches) == made
    for t in (grad_x, grad_w, grad_b):
        t.fill_(7.0)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip((grad_x, grad_w, grad_b), expected):
        _same(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_torch_providers_norm_backwards_on_cuda_against_float64(launches, dtype):
    # torch's own norm kernels (native_layer_norm, _fused_rms_norm and their backwards) on CUDA
    import kernel_api

    dy, x = torch.randn(9, 1000, device="cuda", dtype=dtype), torch.randn(9, 1000, device="cuda", dtype=dtype)
    w = torch.randn(1000, device="cuda", dtype=torch.float32)
    leaves = [t.double().requires_grad_() for t in (x, w, torch.zeros(1000, device="cuda"))]
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    with kernel_api.settings(providers=["torch"]):
        for _ in range(2):  # the Python path, then replayed
            rms = ops.rms_norm_backward(dy, x, w, 1e-6)
            want = torch.autograd.grad(F.rms_norm(leaves[0], (1000,), leaves[1], 1e-6), leaves[:2], dy.double())
            for got, expected in zip(rms, want):
                torch.testing.assert_close(got.double(), expected, **tol)
            layer = ops.layer_norm_backward(dy, x, w, 1e-5)
            want = torch.autograd.grad(F.layer_norm(leaves[0], (1000,), leaves[1], leaves[2], 1e-5), leaves,
                                       dy.double())
            for got, expected in zip(layer, want):
                torch.testing.assert_close(got.double(), expected, **tol)
    assert all(type(k).__name__.startswith("Torch") for _, k in ops.chosen_kernels())


@pytest.mark.parametrize("causal", [False, True])
def test_a_repeated_attention_call_is_sdpas_call_replayed_from_c(launches, causal):
    """Where SDPA serves (the torch provider), a repeated ops.attention call on CUDA runs from C
    as the one SDPA call: no Python frame of kernel_api's beyond ops.attention and the launcher's
    SDPA call, no output made to be replaced; the Python path's results, and float64's."""
    if native.entry() is None:
        pytest.skip(f"native entry points unavailable: {native.why_not_entry()}")
    new = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = new(2, 77, 8, 64), new(2, 77, 8, 64), new(2, 77, 8, 64)  # (an odd length)
    with kernel_api.settings(providers=["torch"]):
        first = ops.attention(q, k, v, causal=causal).clone()
        result, seen = _kernel_api_frames(lambda: ops.attention(q, k, v, causal=causal))
        again = ops.attention(q, k, v, causal=causal)
    torch.cuda.synchronize()
    assert len(launches) == 1
    ours = [name for file, name in seen if file.startswith(_PACKAGE)]
    front_door = [] if native.front_door_module() is not None else ["attention"]  # (a C function: no frame)
    assert ours == front_door + ["call"], seen
    assert not {"empty_like", "new_empty", "empty", "set_", "copy_"} & {name for file, name in seen if file == "<C>"}
    _same(first, result)
    _same(first, again)
    _near_float64(result, q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_repeated_gqa_attention_calls_give_the_python_paths_results(launches, causal):
    """GQA (fewer k and v heads, read in place): repeated calls, replayed from C or in Python as
    SDPA's backend lays its output out, give the Python path's results, dense."""
    new = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = new(2, 77, 8, 64), new(2, 77, 2, 64), new(2, 77, 2, 64)
    with kernel_api.settings(providers=["torch"]):
        first = ops.attention(q, k, v, causal=causal).clone()
        results = [ops.attention(q, k, v, causal=causal) for _ in range(3)]
    torch.cuda.synchronize()
    assert len(launches) == 1
    for r in results:
        assert r.is_contiguous()
        _same(first, r)
    _near_float64(first, q, k, v, causal)


def _near_float64(result, q, k, v, causal):
    reference = F.scaled_dot_product_attention(q.transpose(1, 2).double(), k.transpose(1, 2).double(),
                                               v.transpose(1, 2).double(), is_causal=causal,
                                               enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
    torch.testing.assert_close(result.double(), reference, rtol=2e-2, atol=2e-2)
