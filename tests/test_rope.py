"""RoPE on the CPU: the arguments' one-line refusals, the strides summary, discovery and explain,
the torch provider's kernels through `kernel_api.ops` (the tests add "cpu" to
`dispatch.LAUNCH_DEVICE_TYPES`) against float64 references written here (transformers'
``rotate_half`` formula), gradcheck in f64 through the generated ops, tracing (make_fx,
torch.compile), and the CUDA source kernels compiled for sm_90a without a GPU.
tests/test_rope_gpu.py runs the kernels on CUDA.
"""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api import ops
from kernel_api.arguments import RopeArguments, RopeBackwardArguments
from kernel_api.arguments.rope import HeadStrides
from kernel_api.ops import dispatch

SENTINEL = 1234.5
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=4e-3, rtol=4e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=2e-2), torch.float64: dict(atol=1e-12, rtol=1e-12)}


def make_tables(batch, seq, dim, device="cpu", dtype=torch.float32, base=10000.0):
    """cos and sin as transformers' rotary embedding makes them: (batch, seq, dim), the two
    halves equal, positions 0..seq-1 (each batch row shifted, to tell them apart)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
    pos = torch.arange(seq, dtype=torch.float64, device=device)[None, :] + 3 * torch.arange(
        batch, dtype=torch.float64, device=device)[:, None]
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def reference(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb in float64."""
    c, s = cos.double().unsqueeze(unsqueeze_dim), sin.double().unsqueeze(unsqueeze_dim)
    q, k = q.detach().double(), k.detach().double()
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def reference_backward(grad_q_out, grad_k_out, cos, sin, unsqueeze_dim=1):
    """(grad_q, grad_k) in float64, by autograd through `reference`'s formula."""
    q = torch.zeros(grad_q_out.shape, dtype=torch.float64, device=grad_q_out.device, requires_grad=True)
    k = torch.zeros(grad_k_out.shape, dtype=torch.float64, device=grad_k_out.device, requires_grad=True)
    c, s = cos.double().unsqueeze(unsqueeze_dim), sin.double().unsqueeze(unsqueeze_dim)
    outs = (q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s)
    return torch.autograd.grad(outs, (q, k), (grad_q_out.double(), grad_k_out.double()))


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


def _hf(b, h, s, d, dtype=torch.float32, gen=None):
    """(b, h, s, d) as transformers makes q and k: a transposed view of (b, s, h, d) memory."""
    return torch.randn(b, s, h, d, generator=gen).to(dtype).transpose(1, 2)


# ---- refusals: one line, naming the operand ----

def _bad_cases():
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = make_tables(1, 5, 8)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    return [
        (lambda: RopeArguments(None, k, cos, sin, qo, ko), TypeError, "operand q: expected a torch.Tensor"),
        (lambda: RopeArguments(q[0], k, cos, sin, qo, ko), ValueError, "operand q: expected 4 dimensions"),
        (lambda: RopeArguments(torch.randn(2, 4, 5, 7), k, cos, sin, qo, ko), ValueError, "operand q: head_dim 7 must be even"),
        (lambda: RopeArguments(q.transpose(2, 3), k, cos, sin, qo, ko), ValueError, "operand q: head_dim must have stride 1"),
        (lambda: RopeArguments(q, torch.randn(2, 2, 6, 8), cos, sin, qo, ko), ValueError, "operand k: shape (2, 2, 6, 8)"),
        (lambda: RopeArguments(q, k.double(), cos, sin, qo, ko), TypeError, "operand k: dtype torch.float64"),
        (lambda: RopeArguments(q, k, cos[0], sin, qo, ko), ValueError, "operand cos: shape (5, 8) must be (1 or 2, 5, 8)"),
        (lambda: RopeArguments(q, k, make_tables(3, 5, 8)[0], sin, qo, ko), ValueError, "operand cos: shape (3, 5, 8)"),
        (lambda: RopeArguments(q, k, cos, sin.double(), qo, ko), TypeError, "operand sin: dtype torch.float64 must equal"),
        (lambda: RopeArguments(q, k, cos, sin, torch.empty(2, 4, 5, 9), ko), ValueError, "operand q_out: shape"),
        (lambda: RopeArguments(q, k, cos, sin, qo, k.half()), TypeError, "operand k_out: dtype torch.float16"),
        (lambda: RopeArguments(q, k, cos, sin, qo, torch.empty(2, 1, 5, 8).expand(2, 2, 5, 8)), ValueError,
         "operand k_out: elements overlap"),
        (lambda: RopeArguments(torch._neg_view(q), k, cos, sin, qo, ko), ValueError, "operand q: has torch's lazy"),
        (lambda: RopeArguments(q, k, cos, sin, qo, ko, unsqueeze_dim=3), ValueError, "unsqueeze_dim: expected 1"),
        (lambda: RopeBackwardArguments(q, k, cos, sin, qo, torch.empty(2, 2, 5, 4)), ValueError, "operand grad_k: shape"),
        (lambda: RopeBackwardArguments(q[0], k, cos, sin, qo, ko), ValueError, "operand grad_q_out: expected 4"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_refusals_name_the_operand_in_one_line(case):
    build, error, text = _bad_cases()[case]
    with pytest.raises(error) as info:
        build()
    message = str(info.value)
    assert text in message and "\n" not in message


def test_outputs_overlapping_inputs_are_refused(cpu_ops):
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = make_tables(1, 5, 8)
    with pytest.raises(ValueError, match="operand q_out: overlaps q"):
        RopeArguments(q, k, cos, sin, q, torch.empty_like(k)).check_memory()
    with pytest.raises(ValueError, match="operand grad_k: overlaps grad_k_out"):
        RopeBackwardArguments(q, k, cos, sin, torch.empty_like(q), k).check_memory()


# ---- the summary, discovery and explain ----

def test_strides_of_transformers_layouts():
    q, k = _hf(2, 4, 5, 8), _hf(2, 2, 5, 8)
    cos, sin = make_tables(1, 5, 8)
    args = RopeArguments(q, k, cos, sin, torch.empty_like(q), torch.empty_like(k))
    assert (args.batch, args.heads_q, args.heads_k, args.seq, args.head_dim) == (2, 4, 2, 5, 8)
    assert args.strides["q"] == HeadStrides(5 * 4 * 8, 8, 4 * 8)
    assert args.strides["cos"] == HeadStrides(0, 0, 8)
    assert list(args.tensor_attributes) == ["q", "k", "cos", "sin", "q_out", "k_out"]
    same = RopeArguments(q.transpose(1, 2), k.transpose(1, 2), cos, sin, torch.empty_like(q).transpose(1, 2),
                         torch.empty_like(k).transpose(1, 2), unsqueeze_dim=2)
    assert same.strides == args.strides and same.problem_key() == args.problem_key()
    assert repr(args) == ("RopeArguments(batch=2, heads_q=4, heads_k=2, seq=5, head_dim=8, dtype=f32, cos=f32, "
                          "unsqueeze_dim=1, device=cpu)")
    bwd = RopeBackwardArguments(q, k, cos, sin, torch.empty_like(q), torch.empty_like(k))
    assert list(bwd.tensor_attributes) == ["grad_q_out", "grad_k_out", "cos", "sin", "grad_q", "grad_k"]
    assert bwd.problem_key() != args.problem_key()


def test_discovery_and_explain():
    q, k = _hf(2, 4, 5, 128, torch.bfloat16), _hf(2, 2, 5, 128, torch.bfloat16)
    cos, sin = make_tables(1, 5, 128, dtype=torch.bfloat16)
    args = RopeArguments(q, k, cos, sin, torch.empty_like(q), torch.empty_like(k))
    assert [kn.name for kn in kernel_api.get_kernels(args, cc=90)] == ["CudaRope_bf16_v8", "CudaRope_bf16_v1",
                                                                       "TorchRope_bf16"]
    f32_tables = RopeArguments(q, k, cos.float(), sin.float(), torch.empty_like(q), torch.empty_like(k))
    assert [kn.name for kn in kernel_api.get_kernels(f32_tables, cc=90)] == ["TorchRope_bf16_cosf32"]
    text = str(kernel_api.explain(f32_tables, cc=90))
    assert "cuda_src/CudaRope" in text and "needs cos bf16" in text
    odd = torch.randn(1, 2, 3, 129 * 8, dtype=torch.bfloat16)[..., 8:]
    odd_args = RopeArguments(odd, odd.clone(), make_tables(1, 3, 128 * 8, dtype=torch.bfloat16)[0],
                             make_tables(1, 3, 128 * 8, dtype=torch.bfloat16)[1], torch.empty_like(odd),
                             torch.empty_like(odd))
    assert "CudaRope_bf16_v8" in [kn.name for kn in kernel_api.get_kernels(odd_args, cc=90)]
    shifted = torch.randn(1 * 2 * 3 * 64 + 1, dtype=torch.bfloat16)[1:].view(1, 2, 3, 64)
    shifted_args = RopeArguments(shifted, odd[..., :64].contiguous(), *make_tables(1, 3, 64, dtype=torch.bfloat16),
                                 torch.empty_like(shifted), torch.empty(1, 2, 3, 64, dtype=torch.bfloat16))
    names = [kn.name for kn in kernel_api.get_kernels(shifted_args, cc=90)]
    assert "CudaRope_bf16_v8" not in names and "CudaRope_bf16_v1" in names
    assert "q: " in str(kernel_api.explain(shifted_args, cc=90))


# ---- the operations on CPU tensors against float64 ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 2), (2, 4, 2, 5, 8), (3, 5, 1, 7, 64)])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_forward_and_backward_against_float64(cpu_ops, dtype, shape, unsqueeze_dim):
    b, hq, hk, s, d = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q, k = _hf(b, hq, s, d, dtype, gen), _hf(b, hk, s, d, dtype, gen)
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = make_tables(b, s, d, dtype=dtype)
    qo, ko = ops.rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    want = reference(q, k, cos, sin, unsqueeze_dim)
    torch.testing.assert_close(qo.double(), want[0], **TOL[dtype])
    torch.testing.assert_close(ko.double(), want[1], **TOL[dtype])
    gq, gk = torch.randn(q.shape, generator=gen).to(dtype), torch.randn(k.shape, generator=gen).to(dtype)
    out_q = torch.full(q.shape, SENTINEL, dtype=dtype)
    dq, dk = ops.rope_backward(gq, gk, cos, sin, unsqueeze_dim, grad_q=out_q)
    assert dq is out_q
    want = reference_backward(gq, gk, cos, sin, unsqueeze_dim)
    torch.testing.assert_close(dq.double(), want[0], **TOL[dtype])
    torch.testing.assert_close(dk.double(), want[1], **TOL[dtype])


def test_backward_is_the_transpose_for_unequal_halves(cpu_ops):
    q, k = torch.randn(1, 2, 3, 8, dtype=torch.float64), torch.randn(1, 1, 3, 8, dtype=torch.float64)
    cos, sin = torch.randn(1, 3, 8, dtype=torch.float64), torch.randn(1, 3, 8, dtype=torch.float64)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    dq, dk = ops.rope_backward(gq, gk, cos, sin)
    want = reference_backward(gq, gk, cos, sin)
    torch.testing.assert_close(dq, want[0])
    torch.testing.assert_close(dk, want[1])


def test_gradcheck_f64(cpu_ops):
    q = torch.randn(2, 4, 3, 6, dtype=torch.float64).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 1, 4, 6, dtype=torch.float64, requires_grad=True)
    cos, sin = torch.randn(2, 4, 6, dtype=torch.float64), torch.randn(2, 4, 6, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, k: ops.rope(q, k, cos, sin), (q, k))


def test_tables_requiring_grad_get_gradients(cpu_ops):
    q, k = torch.randn(1, 2, 3, 4, dtype=torch.float64), torch.randn(1, 1, 3, 4, dtype=torch.float64)
    cos = torch.randn(1, 3, 4, dtype=torch.float64, requires_grad=True)
    sin = torch.randn(1, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda c, s: ops.rope(q, k, c, s), (cos, sin))


def test_position_ids_index_the_tables(cpu_ops):
    q, k = torch.randn(2, 2, 3, 8), torch.randn(2, 1, 3, 8)
    cos, sin = make_tables(1, 10, 8)
    pos = torch.tensor([[4, 5, 6], [0, 9, 2]])
    qo, ko = ops.rope(q, k, cos[0], sin[0], position_ids=pos)
    want = reference(q, k, cos[0][pos], sin[0][pos])
    torch.testing.assert_close(qo.double(), want[0], **TOL[torch.float32])
    torch.testing.assert_close(ko.double(), want[1], **TOL[torch.float32])


def test_outputs_keep_the_inputs_memory_order(cpu_ops):
    q, k = _hf(2, 4, 5, 8), _hf(2, 2, 5, 8)
    qo, ko = ops.rope(q, k, *make_tables(1, 5, 8))
    assert qo.stride() == q.stride() and ko.stride() == k.stride()


# ---- tracing and compiling without a GPU ----

def test_make_fx_shows_the_ops():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(q, k, cos, sin):
        return torch.autograd.grad(sum(t.sum() for t in ops.rope(q, k, cos, sin)), (q, k))

    q, k = torch.randn(2, 4, 5, 8, requires_grad=True), torch.randn(2, 2, 5, 8, requires_grad=True)
    code = make_fx(f, tracing_mode="fake")(q, k, *make_tables(1, 5, 8)).code
    assert "kernel_api.rope.default" in code and "kernel_api.rope_backward.default" in code


def test_torch_compile_fullgraph_on_cpu(cpu_ops):
    torch._dynamo.reset()
    q, k = _hf(2, 4, 5, 8), _hf(2, 2, 5, 8)
    cos, sin = make_tables(1, 5, 8)
    compiled = torch.compile(lambda q, k: ops.rope(q, k, cos, sin), fullgraph=True, backend="aot_eager")
    qo, ko = compiled(q, k)
    want = reference(q, k, cos, sin)
    torch.testing.assert_close(qo.double(), want[0], **TOL[torch.float32])


@pytest.mark.parametrize("cls", [RopeArguments, RopeBackwardArguments])
def test_cuda_kernels_compile_for_sm90_without_a_gpu(cls):
    q, k = _hf(2, 4, 5, 64, torch.float16), _hf(2, 2, 5, 64, torch.float16)
    cos, sin = make_tables(1, 5, 64, dtype=torch.float16)
    args = cls(q, k, cos, sin, torch.empty_like(q), torch.empty_like(k))
    kernels = [kn for kn in kernel_api.get_kernels(args, cc=90) if kn.name.startswith("Cuda")]
    assert len(kernels) == 2
    for kernel in kernels:
        assert kernel.compile(args, cc=90).compiled_obj.compiled.arch.endswith("90a")
