"""ops.attention on a CUDA GPU in bf16 against the float64 reference of
tests/test_attention_op.py: dense, GQA / MQA, causal, decode, variable length, the backward,
and torch.compile(fullgraph=True); every forward kernel's row log-sum-exp and every backward
kernel (the torch provider's backends, FlashAttention-4's when its plugin's library is
installed) on its own, and the training step through each provider."""

from __future__ import annotations

import contextlib

import pytest
import torch

import kernel_api
from kernel_api import ops
from kernel_api.arguments import AttentionArguments, AttentionBackwardArguments

import plugin_packages as pp
from test_attention_op import (SENTINEL, _qkv, _varlen, count_backend_runs, reference, reference_grads,
                               reference_lse)

pytestmark = pytest.mark.gpu

BF16 = dict(atol=2e-2, rtol=2e-2)
GRAD = dict(atol=5e-2, rtol=5e-2)
LSE = dict(atol=2e-3, rtol=2e-3)
PROVIDERS = ("torch", *(("flash_attn",) if pp.installed("flash_attn") else ()))


@pytest.fixture(scope="module", autouse=True)
def flash_attn_plugin():
    """FlashAttention-4's plugin in the default registry when its library is installed."""
    loaded = pp.load_into_default("flash_attn") if "flash_attn" in PROVIDERS else {}
    ops.clear_dispatch_cache()
    yield loaded
    ops.clear_dispatch_cache()
    if loaded:
        pp.unload("flash_attn")


def _cuda(*tensors):
    return [t.cuda() for t in tensors]


@pytest.mark.parametrize("shape", [(1, 1, 1, 2, 2, 64), (2, 7, 7, 4, 4, 128), (1, 33, 33, 8, 2, 128),
                                   (2, 7, 33, 8, 1, 64), (2, 16, 100, 8, 2, 64), (2, 1, 100, 8, 2, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_ops_call_bf16(shape, causal):
    q, k, v = _qkv(*shape, dtype=torch.bfloat16)
    cq, ck, cv = _cuda(q, k, v)
    out = torch.full_like(cq, SENTINEL)
    assert ops.call(AttentionArguments(cq, ck, cv, out, causal=causal)) is out
    torch.testing.assert_close(out.double().cpu(), reference(q, k, v, causal), **BF16)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_bf16(causal):
    q, k, v, cu_q, cu_k = _varlen([3, 0, 7, 1], [5, 0, 7, 33], 8, 2, 64, torch.bfloat16)
    gq, gk, gv, gcu_q, gcu_k = _cuda(q, k, v, cu_q, cu_k)
    out = torch.full_like(gq, SENTINEL)
    ops.attention(gq, gk, gv, causal=causal, cu_seqlens_q=gcu_q, cu_seqlens_k=gcu_k, max_seqlen_q=7,
                  max_seqlen_k=33, out=out)
    torch.testing.assert_close(out.double().cpu(), reference(q, k, v, causal, None, cu_q, cu_k), **BF16)


def test_varlen_on_gpu_reads_the_offsets_when_no_longest_length_is_given():
    """No max_seqlen: the offsets are read from the device (checked, the longest found, the empty
    sequences after the last non-empty one dropped); the forward and backward match the float64
    reference. One longest length alone, or offsets that go down, are one line."""
    q, k, v, cu_q, cu_k = _varlen([3, 0, 7, 1], [5, 0, 7, 33], 8, 2, 64, torch.bfloat16)
    pad = lambda cu, n: torch.cat([cu, cu[-1:].expand(n)]).contiguous()  # noqa: E731
    gq, gk, gv, gcu_q, gcu_k = _cuda(q, k, v, pad(cu_q, 5), pad(cu_k, 5))
    args = AttentionArguments(gq, gk, gv, torch.empty_like(gq), cu_seqlens_q=gcu_q, cu_seqlens_k=gcu_k)
    assert (args.batch, args.seqlen_q, args.seqlen_k) == (4, 7, 33)
    assert args.cu_seqlens_q.tolist() == cu_q.tolist() and args.cu_seqlens_k.tolist() == cu_k.tolist()
    out = torch.full_like(gq, SENTINEL)
    ops.attention(gq, gk, gv, causal=True, cu_seqlens_q=gcu_q, cu_seqlens_k=gcu_k, out=out)
    torch.testing.assert_close(out.double().cpu(), reference(q, k, v, True, None, cu_q, cu_k), **BF16)
    leaves = [t.clone().requires_grad_() for t in (gq, gk, gv)]
    out = ops.attention(*leaves, causal=True, cu_seqlens_q=gcu_q, cu_seqlens_k=gcu_k)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    out.backward(grad.cuda())
    want = reference_grads(q, k, v, grad, True, None, cu_q, cu_k)
    for leaf, w in zip(leaves, want):
        torch.testing.assert_close(leaf.grad.double().cpu(), w, **GRAD)
    with pytest.raises(ValueError, match="^max_seqlen_k: required with cu_seqlens_k when the other"):
        AttentionArguments(gq, gk, gv, torch.empty_like(gq), cu_seqlens_q=gcu_q, cu_seqlens_k=gcu_k, max_seqlen_q=7)
    down = torch.tensor([0, 3, 2, 11], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="^operand cu_seqlens_q: must be non-decreasing"):
        AttentionArguments(gq, gk, gv, torch.empty_like(gq), cu_seqlens_q=down, cu_seqlens_k=gcu_k[:4])


def test_backward_bf16():
    q, k, v = _qkv(2, 7, 33, 8, 2, 64, dtype=torch.bfloat16)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    reference_grads = torch.autograd.grad(_differentiable_reference(*ref), ref, grad.double())
    gpu = [t.cuda().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(ops.attention(*gpu, causal=True), gpu, grad.cuda())
    for got, want in zip(grads, reference_grads):
        torch.testing.assert_close(got.double().cpu(), want, atol=5e-2, rtol=5e-2)


def _differentiable_reference(q, k, v):
    """The causal bottom-right reference with autograd (seqlen_q <= seqlen_k: every query sees a key)."""
    sq, sk, groups = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    mask = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + sk - sq
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s.masked_fill(mask, float("-inf")), -1), v)


def test_torch_compile_fullgraph():
    q, k, v = _cuda(*_qkv(2, 16, 100, 8, 2, 64, dtype=torch.bfloat16))
    compiled = torch.compile(lambda a, b, c: ops.attention(a, b, c, causal=True), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v).double().cpu(),
                               reference(q.cpu(), k.cpu(), v.cpu(), True), **BF16)


# ---- every forward kernel's log-sum-exp, every backward kernel, on its own ----

LSE_SHAPES = [(2, 7, 7, 4, 4, 128), (1, 33, 33, 8, 2, 64), (2, 16, 100, 8, 2, 64), (1, 130, 130, 4, 1, 128),
              (2, 37, 19, 4, 2, 64)]


def _sentinel_like(t, dtype=None):
    return torch.full(t.shape, SENTINEL, dtype=dtype or t.dtype, device=t.device)


def _kernels(args):
    found = kernel_api.get_kernels(args)
    assert found, kernel_api.explain(args)
    return found


@pytest.mark.parametrize("shape", LSE_SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_kernels_write_the_lse(shape, causal):
    q, k, v = _qkv(*shape, dtype=torch.bfloat16, seed=11)
    gq, gk, gv = _cuda(q, k, v)
    want_out, want_lse = reference(q, k, v, causal), reference_lse(q, k, causal)
    names = []
    for kernel in _kernels(AttentionArguments(gq, gk, gv, torch.empty_like(gq), torch.empty(want_lse.shape,
                                                                                             device="cuda"),
                                              causal=causal)):
        out, lse = _sentinel_like(gq), _sentinel_like(want_lse, torch.float32).cuda()
        kernel.run(AttentionArguments(gq, gk, gv, out, lse, causal=causal))
        torch.cuda.synchronize()
        torch.testing.assert_close(out.double().cpu(), want_out, **BF16, msg=lambda m: f"{kernel.name}: out: {m}")
        got = lse.double().cpu()
        empty = torch.isinf(want_lse)  # rows that see no key: -inf, or +inf as FlashAttention-2 writes
        assert torch.isinf(got[empty]).all(), kernel.name
        torch.testing.assert_close(got[~empty], want_lse[~empty], **LSE, msg=lambda m: f"{kernel.name}: lse: {m}")
        names.append(kernel.name)
    assert any(n.endswith("_flash") for n in names) and any(n.endswith("_math") for n in names), names


def _backward_operands(q, k, v, causal, cu_q=None, cu_k=None, seed=12):
    """grad_out, out and lse of the float64 reference (rounded as a forward kernel's), on the GPU."""
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q.dtype)
    out = reference(q, k, v, causal, None, cu_q, cu_k).to(q.dtype)
    lse = reference_lse(q, k, causal, None, cu_q, cu_k).float()
    return grad, out, lse


@pytest.mark.parametrize("shape", LSE_SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_kernels_against_float64(shape, causal):
    """Each backward kernel from the reference's out and lse, gradients written into
    sentinel-filled buffers."""
    q, k, v = _qkv(*shape, dtype=torch.bfloat16, seed=13)
    grad, out, lse = _backward_operands(q, k, v, causal)
    want = reference_grads(q, k, v, grad, causal)
    g = _cuda(grad, q, k, v, out, lse)
    names = []
    for kernel in _kernels(AttentionBackwardArguments(*g, *(torch.empty_like(t) for t in g[1:4]), causal=causal)):
        grads = [_sentinel_like(t) for t in g[1:4]]
        kernel.run(AttentionBackwardArguments(*g, *grads, causal=causal))
        torch.cuda.synchronize()
        for name, got, expected in zip(("grad_q", "grad_k", "grad_v"), grads, want):
            torch.testing.assert_close(got.double().cpu(), expected, **GRAD,
                                       msg=lambda m: f"{kernel.name}: {name}: {m}")
        names.append(kernel.name)
    assert any(n.endswith("_flash") for n in names), names
    if "flash_attn" in PROVIDERS:
        assert any(n.startswith("FlashAttnBackward") for n in names), names


def test_varlen_backward_kernels_with_an_empty_sequence():
    q, k, v, cu_q, cu_k = _varlen([3, 0, 7, 1, 40], [5, 0, 7, 33, 40], 8, 2, 64, torch.bfloat16)
    grad, out, lse = _backward_operands(q, k, v, True, cu_q, cu_k)
    want = reference_grads(q, k, v, grad, True, None, cu_q, cu_k)
    g = _cuda(grad, q, k, v, out, lse)
    offsets = dict(causal=True, cu_seqlens_q=cu_q.cuda(), cu_seqlens_k=cu_k.cuda(), max_seqlen_q=40, max_seqlen_k=40)
    names = []
    for kernel in _kernels(AttentionBackwardArguments(*g, *(torch.empty_like(t) for t in g[1:4]), **offsets)):
        grads = [_sentinel_like(t) for t in g[1:4]]
        kernel.run(AttentionBackwardArguments(*g, *grads, **offsets))
        torch.cuda.synchronize()
        for name, got, expected in zip(("grad_q", "grad_k", "grad_v"), grads, want):
            torch.testing.assert_close(got.double().cpu(), expected, **GRAD,
                                       msg=lambda m: f"{kernel.name}: {name}: {m}")
        names.append(kernel.name)
    assert any(n.endswith("_flash") for n in names), names


def test_misaligned_views_take_the_materialised_kernels():
    """A q whose pointer is 3 elements off 16 bytes: only the alignment-1 kernels take it."""
    q, k, v = _qkv(1, 9, 9, 2, 2, 64, dtype=torch.bfloat16, seed=14)
    buffer = torch.full((q.numel() + 3,), SENTINEL, dtype=torch.bfloat16, device="cuda")
    gq = buffer[3:].view(q.shape)
    gq.copy_(q.cuda())
    gk, gv = _cuda(k, v)
    leaves = [gq.detach().requires_grad_(), gk.requires_grad_(), gv.requires_grad_()]
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(15)).to(torch.bfloat16)
    out = ops.attention(*leaves, causal=True)
    grads = torch.autograd.grad(out, leaves, grad.cuda())
    for got, want in zip(grads, reference_grads(q, k, v, grad, True)):
        torch.testing.assert_close(got.double().cpu(), want, **GRAD)


# ---- the training step through each provider ----

STEP_SHAPES = [(1, 300, 300, 4, 4, 128), (2, 100, 100, 8, 2, 64), (1, 77, 77, 4, 1, 128), (2, 16, 100, 8, 2, 64)]


def only(provider):
    """A scope whose candidates are ``provider``'s, over the backward too: autograd's engine runs
    a CUDA backward on a thread of its own, which `kernel_api.settings` (a context variable) does
    not reach, so the backward runs in this thread."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autograd.set_multithreading_enabled(False))
    stack.enter_context(kernel_api.settings(providers=[provider]))
    return stack


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("shape", STEP_SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_training_step_through_each_provider(provider, shape, causal):
    q, k, v = _qkv(*shape, dtype=torch.bfloat16, seed=16)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(17)).to(torch.bfloat16)
    ops.clear_dispatch_cache()
    with only(provider):
        leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
        out = ops.attention(*leaves, causal=causal)
        grads = torch.autograd.grad(out, leaves, grad.cuda())
    ops.clear_dispatch_cache()
    torch.testing.assert_close(out.detach().double().cpu(), reference(q, k, v, causal), **BF16)
    for got, want in zip(grads, reference_grads(q, k, v, grad, causal)):
        torch.testing.assert_close(got.double().cpu(), want, **GRAD)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_varlen_training_step_through_each_provider(provider):
    q, k, v, cu_q, cu_k = _varlen([3, 0, 7, 1, 40], [5, 0, 7, 33, 40], 8, 2, 64, torch.bfloat16)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(18)).to(torch.bfloat16)
    ops.clear_dispatch_cache()
    with only(provider):
        leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
        out = ops.attention(*leaves, causal=True, cu_seqlens_q=cu_q.cuda(), cu_seqlens_k=cu_k.cuda(), max_seqlen_q=40,
                            max_seqlen_k=40)
        grads = torch.autograd.grad(out, leaves, grad.cuda())
    ops.clear_dispatch_cache()
    for got, want in zip(grads, reference_grads(q, k, v, grad, True, None, cu_q, cu_k)):
        torch.testing.assert_close(got.double().cpu(), want, **GRAD)


def test_one_forward_per_training_step_on_the_gpu(monkeypatch):
    """Through the torch provider: one forward kernel run (writing lse) and one backward run."""
    calls = count_backend_runs(monkeypatch, ("sdpa", "math", "flash", "cudnn"))
    with only("torch"):
        leaves = [t.cuda().requires_grad_() for t in _qkv(2, 64, 64, 8, 8, 128, dtype=torch.bfloat16)]
        ops.attention(*leaves, causal=True).sum().backward()
        assert [(c, lse) for c, _, lse in calls] == [("TorchAttention", True), ("TorchAttentionBackward", True)], calls
        calls.clear()
        with torch.no_grad():
            ops.attention(*leaves, causal=True)
        assert [(c, lse) for c, _, lse in calls] == [("TorchAttention", False)], calls
    ops.clear_dispatch_cache()
