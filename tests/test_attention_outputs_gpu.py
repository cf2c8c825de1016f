"""The torch provider's attention on a CUDA GPU without copies (bf16): each forward and backward
kernel of torch's backends (SDPA, FlashAttention-2, cuDNN) runs no copy and no head repeat of its
own for (batch, seqlen, heads, head_dim)-dense operands, GQA included where torch's cuDNN takes
it, and hands the op-made outputs the backend's memory; the training step through the torch
provider likewise; a growing KV cache keeps its choice. Everything against the float64
references of tests/test_attention_op.py, outputs in sentinel-filled buffers."""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api import ops
from kernel_api.arguments import AttentionArguments, AttentionBackwardArguments
from kernel_api.providers.torch_ops.attention import cudnn_reads_gqa

from test_attention_op import SENTINEL, _qkv, reference, reference_grads, reference_lse
from test_attention_outputs import copies_of, counted_choices, own_ops

pytestmark = pytest.mark.gpu

BF16 = dict(atol=2e-2, rtol=2e-2)
GRAD = dict(atol=5e-2, rtol=5e-2)
LSE = dict(atol=2e-3, rtol=2e-3)
SHAPES = [(1, 130, 130, 8, 2, 128), (2, 64, 64, 32, 8, 128), (2, 100, 100, 8, 2, 64), (2, 48, 48, 4, 4, 64)]


def _unexpected(ran: list, kernel_names: list, gqa: bool, *tensors: torch.Tensor) -> list:
    """Copies, repeats or sums of q-, k- or v-shaped tensors (outputs, gradients, repeated heads)
    among ``ran``, less cuDNN's repeated heads and their gradients' sums where torch's cuDNN
    attention does not read GQA in place. (A copy of the log-sum-exp, whose layout the backend
    chooses, is not one.)"""
    found = copies_of(ran, *tensors)
    if gqa and any(n.endswith("_cudnn") for n in kernel_names) and not cudnn_reads_gqa(torch.device("cuda", 0)):
        found = [(name, shapes) for name, shapes in found if name not in ("aten::repeat_interleave", "aten::sum")]
    return found


def _torch_kernels(args) -> list:
    return [k for k in kernel_api.get_kernels(args) if k.name.startswith("TorchAttention")
            and not k.name.endswith("_math")]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_lse", [False, True])
def test_forward_kernels_run_no_copy(shape, causal, with_lse):
    q, k, v = _qkv(*shape, dtype=torch.bfloat16, seed=21)
    gq, gk, gv = (t.cuda() for t in (q, k, v))
    want = reference(q, k, v, causal)
    lse_shape = (shape[0], shape[3], shape[1])

    def arguments(out, lse):
        args = AttentionArguments(gq, gk, gv, out, lse, causal=causal)
        args.outputs_made = True
        return args

    probe = arguments(torch.empty_like(gq), torch.empty(lse_shape, device="cuda") if with_lse else None)
    kernels = _torch_kernels(probe)
    assert kernels
    for kernel in kernels:
        kernel.run(arguments(torch.empty_like(gq), torch.empty(lse_shape, device="cuda") if with_lse else None))
        out = torch.full_like(gq, SENTINEL)
        lse = torch.full(lse_shape, SENTINEL, device="cuda") if with_lse else None
        args = arguments(out, lse)
        ran = own_ops(lambda: kernel.run(args))
        assert not _unexpected(ran, [kernel.name], shape[3] != shape[4], gq, gk), (kernel.name, ran)
        assert args.out is out and out.shape == gq.shape and out.is_contiguous()
        torch.testing.assert_close(out.double().cpu(), want, **BF16, msg=lambda m: f"{kernel.name}: {m}")
        if with_lse:
            torch.testing.assert_close(lse.double().cpu(), reference_lse(q, k, causal), **LSE,
                                       msg=lambda m: f"{kernel.name}: lse: {m}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_kernels_run_no_copy(shape, causal):
    q, k, v = _qkv(*shape, dtype=torch.bfloat16, seed=22)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(23)).to(torch.bfloat16)
    out = reference(q, k, v, causal).to(torch.bfloat16)
    lse = reference_lse(q, k, causal).float()
    want = reference_grads(q, k, v, grad, causal)
    g = [t.cuda() for t in (grad, q, k, v, out, lse)]

    def arguments(*grads):
        args = AttentionBackwardArguments(*g, *grads, causal=causal)
        args.outputs_made = True
        return args

    kernels = [k for k in kernel_api.get_kernels(arguments(*(torch.empty_like(t) for t in g[1:4])))
               if k.name.startswith("TorchAttentionBackward") and not k.name.endswith("_math")]
    assert kernels
    for kernel in kernels:
        kernel.run(arguments(*(torch.empty_like(t) for t in g[1:4])))
        grads = [torch.full_like(t, SENTINEL) for t in g[1:4]]
        ran = own_ops(lambda: kernel.run(arguments(*grads)))
        assert not _unexpected(ran, [kernel.name], shape[3] != shape[4], g[1], g[2]), (kernel.name, ran)
        for name, got, expected in zip(("grad_q", "grad_k", "grad_v"), grads, want):
            torch.testing.assert_close(got.double().cpu(), expected, **GRAD,
                                       msg=lambda m: f"{kernel.name}: {name}: {m}")


@pytest.mark.parametrize("shape", [(2, 256, 256, 32, 8, 128), (2, 100, 100, 8, 2, 64)])
def test_training_step_through_the_torch_provider_runs_no_copy(shape):
    """Forward (with lse) and backward as a patched model runs them: after a first step, the
    step's own ops hold no copy and no repeated heads."""
    q, k, v = _qkv(*shape, dtype=torch.bfloat16, seed=24)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(25)).to(torch.bfloat16).cuda()
    ops.clear_dispatch_cache()
    with torch.autograd.set_multithreading_enabled(False), kernel_api.settings(providers="torch"):
        leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
        gqa = shape[3] != shape[4]

        def step():
            out = ops.attention(*leaves, causal=True)
            return out, torch.autograd.grad(out, leaves, grad)

        step()
        found = []
        ran = own_ops(lambda: found.append(step()))
        chosen = [kernel.name for _, kernel in ops.chosen_kernels()]
    ops.clear_dispatch_cache()
    assert not _unexpected(ran, chosen, gqa, leaves[0], leaves[1]), (chosen, ran)
    out, grads = found[0]
    torch.testing.assert_close(out.detach().double().cpu(), reference(q, k, v, True), **BF16)
    for got, want in zip(grads, reference_grads(q, k, v, grad.cpu(), True)):
        torch.testing.assert_close(got.double().cpu(), want, **GRAD)


def test_a_growing_kv_cache_keeps_its_choice_on_the_gpu(monkeypatch):
    """Decode steps (one query, GQA, d128) over a cache growing by a token: one choice per power of
    two of keys, whichever kernel the policy picks."""
    choices = counted_choices(monkeypatch)
    ops.clear_dispatch_cache()
    g = torch.Generator().manual_seed(26)
    cache_k = torch.randn(4, 300, 8, 128, generator=g).to(torch.bfloat16)
    cache_v = torch.randn(4, 300, 8, 128, generator=g).to(torch.bfloat16)
    ck, cv = cache_k.cuda(), cache_v.cuda()
    for n in range(129, 300, 7):
        q = torch.randn(4, 1, 32, 128, generator=g).to(torch.bfloat16)
        out = ops.attention(q.cuda(), ck[:, :n], cv[:, :n], causal=True)
        torch.testing.assert_close(out.double().cpu(), reference(q, cache_k[:, :n], cache_v[:, :n], True), **BF16)
    ops.clear_dispatch_cache()
    assert choices == [129, 262], choices


def test_cudnn_gqa_answer_is_one_per_device():
    device = torch.device("cuda", 0)
    assert cudnn_reads_gqa(device) is cudnn_reads_gqa(device)
