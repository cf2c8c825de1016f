"""The plugin packages' kernels on the GPU, each through `kernel_api.ops` with the policy's
providers restricted to its plugin's, against float64 references: fresh random data, outputs
written into views of sentinel-filled buffers (what lies around them must stay the sentinel),
odd sizes, batched and 3-D operands, misaligned pointers where the kernel takes them. Then one
ranking across every provider (PickAny and PickBest choose among all of them and the result is
right). The CPU half is tests/test_plugins.py."""

from __future__ import annotations

import math

import pytest
import torch

import kernel_api
from kernel_api import PickAny, PickBest, SoftmaxBackwardArguments, ops

import plugin_packages as pp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SENTINEL = 1234.5
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


INSTALLED = tuple(p for p in pp.PACKAGES if pp.installed(p))


@pytest.fixture(scope="module", autouse=True)
def plugins():
    """Every plugin whose library is installed, in the default registry for this module."""
    modules = pp.load_into_default(*INSTALLED)
    ops.clear_dispatch_cache()
    yield modules
    ops.clear_dispatch_cache()
    pp.unload(*INSTALLED)


def only(provider: str, policy=None):
    """A scope whose candidates are ``provider``'s kernels alone."""
    if provider not in INSTALLED:
        pytest.skip(f"{provider}'s library is not installed")
    ops.clear_dispatch_cache()
    return kernel_api.settings(policy=policy, providers=[provider])


def inside(shape, dtype, pad=3):
    """(buffer, view): a view of ``shape`` inside a sentinel-filled buffer with ``pad`` spare
    elements before and after (the view's pointer then is misaligned unless pad is 0)."""
    n = math.prod(shape)
    buffer = torch.full((n + 2 * pad,), SENTINEL, dtype=dtype, device="cuda")
    return buffer, buffer[pad:pad + n].view(shape)


def check_inside(buffer, view, expected, dtype, pad=3):
    torch.cuda.synchronize()
    torch.testing.assert_close(view.double(), expected, **TOL[dtype])
    n = view.numel()
    around = torch.cat([buffer[:pad], buffer[pad + n:]])
    assert bool((around == SENTINEL).all()), "a kernel wrote outside its output"


def norm_reference(kind, x, w, b=None, eps=1e-6, residual=None):
    s = x.double() + (residual.double() if residual is not None else 0)
    if kind == "layer_norm":
        c = s - s.mean(-1, keepdim=True)
        return c / torch.sqrt(c.square().mean(-1, keepdim=True) + eps) * w.double() + b.double(), s
    return s / torch.sqrt(s.square().mean(-1, keepdim=True) + eps) * w.double(), s


def norm_call(kind, x, w, b, eps, residual=None, out=None, residual_out=None):
    if kind == "layer_norm":
        return ops.layer_norm(x, w, b, eps, residual, out=out, residual_out=residual_out)
    return ops.rms_norm(x, w, eps, residual, out=out, residual_out=residual_out)


# ---- norms: Liger and QuACK ----------------------------------------------------------------------
# (QuACK and FA4 compile each configuration at its first call, seconds each: the cases are few)
NORM_CASES = [((3, 7), 0), ((2, 3, 768), 0), ((512, 4096), 0), ((5, 1000), 1)]
QUACK_SKIPS = ((2, 3, 768),)


@pytest.mark.parametrize("provider", ["liger", "quack"])
@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,offset", NORM_CASES)
@pytest.mark.parametrize("f32_weight", [False, True])
def test_norm_forward_against_float64(provider, kind, dtype, shape, offset, f32_weight):
    if provider == "quack" and kind == "layer_norm" and not f32_weight:
        pytest.skip("QuACK's LayerNorm takes f32 weight and bias only")
    if f32_weight and dtype == torch.float32:
        pytest.skip("(same as same-type weights)")
    if provider == "quack" and shape in QUACK_SKIPS:
        pytest.skip("(QuACK compiles each row length for seconds: fewer cases)")
    cols = shape[-1]
    wdtype = torch.float32 if f32_weight else dtype
    x = torch.empty(math.prod(shape) + offset, device="cuda", dtype=dtype)[offset:].view(shape).normal_()
    w = (1 + 0.1 * torch.randn(cols, device="cuda")).to(wdtype)
    b = torch.randn(cols, device="cuda").to(wdtype)
    buffer, out = inside(shape, dtype, pad=0 if offset == 0 and provider == "quack" else 3)
    with only(provider):
        kernel = kernel_api.get_kernels(_norm_args(kind, x, w, b, out), providers=provider)
        if not kernel:
            pytest.skip(f"{provider} offers no kernel for this case: "
                        f"{kernel_api.explain(_norm_args(kind, x, w, b, out), providers=provider)}")
        norm_call(kind, x, w, b, 1e-5, out=out)
    expected, _ = norm_reference(kind, x, w, b, 1e-5)
    check_inside(buffer, out, expected, dtype, pad=0 if offset == 0 and provider == "quack" else 3)


def _norm_args(kind, x, w, b, out, **kw):
    if kind == "layer_norm":
        return kernel_api.LayerNormArguments(x, w, b, out, eps=1e-5, **kw)
    return kernel_api.RMSNormArguments(x, w, out, eps=1e-5, **kw)


@pytest.mark.parametrize("provider,kind", [("quack", "rms_norm"), ("quack", "layer_norm"), ("liger", "rms_norm")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_with_the_residual_add(provider, kind, dtype):
    shape = (3, 5, 1024)
    x, r = torch.randn(shape, device="cuda").to(dtype), torch.randn(shape, device="cuda").to(dtype)
    w = (1 + 0.1 * torch.randn(1024, device="cuda")).float()
    b = torch.randn(1024, device="cuda").float()
    out = torch.full(shape, SENTINEL, dtype=dtype, device="cuda")
    r_out = torch.full(shape, SENTINEL, dtype=dtype, device="cuda")
    with only(provider):
        y, s = norm_call(kind, x, w, b, 1e-5, r, out=out, residual_out=r_out)
    expected, s_ref = norm_reference(kind, x, w, b, 1e-5, r)
    torch.cuda.synchronize()
    assert y is out and s is r_out
    torch.testing.assert_close(r_out.double(), s_ref, **TOL[dtype])
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])


# ---- gated activations: Liger -------------------------------------------------------------------
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype,shape,offset", [(torch.float32, (3, 7), 0), (torch.bfloat16, (2, 5, 1000), 0),
                                                (torch.float16, (64, 11008), 0), (torch.bfloat16, (9, 333), 1)])
def test_liger_gated_activation_against_float64(activation, dtype, shape, offset):
    gate = torch.empty(math.prod(shape) + offset, device="cuda", dtype=dtype)[offset:].view(shape).normal_()
    up = torch.randn(shape, device="cuda").to(dtype)
    buffer, out = inside(shape, dtype)
    with only("liger"):
        if activation == "silu":
            ops.swiglu(gate, up, out=out)
        else:
            ops.geglu(gate, up, approximate="tanh", out=out)
    g = gate.double()
    act = torch.nn.functional.silu(g) if activation == "silu" else torch.nn.functional.gelu(g, approximate="tanh")
    check_inside(buffer, out, act * up.double(), dtype)


# ---- softmax: QuACK ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,shape", [(torch.float32, (37, 1000)), (torch.bfloat16, (3, 7, 4096)),
                                         (torch.float16, (64, 1024)), (torch.float32, (16, 32000)),
                                         (torch.float32, (5, 1001))])
def test_quack_softmax_forward_and_backward(dtype, shape):
    x = (3 * torch.randn(shape, device="cuda")).to(dtype)
    buffer, out = inside(shape, dtype, pad=0)
    with only("quack"):
        if not kernel_api.get_kernels(kernel_api.SoftmaxArguments(x, out), providers="quack"):
            pytest.skip("QuACK takes no such rows (alignment)")
        ops.softmax(x, out=out)
        expected = torch.softmax(x.double(), -1)
        check_inside(buffer, out, expected, dtype, pad=0)
        dy = torch.randn(shape, device="cuda").to(dtype)
        grad_in = torch.full(shape, SENTINEL, dtype=dtype, device="cuda")
        ops.call(SoftmaxBackwardArguments(dy, out, grad_in))
    y = out.double()
    expected_grad = y * (dy.double() - (dy.double() * y).sum(-1, keepdim=True))
    torch.cuda.synchronize()
    torch.testing.assert_close(grad_in.double(), expected_grad, **TOL[dtype])


# ---- cross-entropy: QuACK ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,rows,classes,target_dtype", [(torch.float32, (37,), 1000, torch.int64),
                                                             (torch.bfloat16, (4, 33), 32000, torch.int32),
                                                             (torch.float16, (8,), 50264, torch.int64)])
def test_quack_cross_entropy_against_float64(dtype, rows, classes, target_dtype):
    from kernel_api.arguments.cross_entropy import CrossEntropyArguments, CrossEntropyBackwardArguments

    x = (2 * torch.randn(*rows, classes, device="cuda")).to(dtype)
    t = torch.randint(0, classes, rows, device="cuda", dtype=target_dtype)
    t.view(-1)[::5] = -100  # ignored rows: loss 0, lse 0, gradient 0
    loss = torch.full(rows, SENTINEL, device="cuda")
    lse = torch.full(rows, SENTINEL, device="cuda")
    with only("quack"):
        ops.call(CrossEntropyArguments(x, t, loss, lse))
        grad_loss = torch.rand(rows, device="cuda")
        grad = torch.full_like(x, SENTINEL)
        ops.call(CrossEntropyBackwardArguments(grad_loss, x, t, lse, grad))
    xd = x.double()
    kept = t != -100
    lse_ref = torch.logsumexp(xd, -1) * kept
    picked = xd.gather(-1, t.clamp(min=0).long().unsqueeze(-1)).squeeze(-1)
    loss_ref = (lse_ref - picked) * kept
    p = torch.softmax(xd, -1)
    onehot = torch.nn.functional.one_hot(t.clamp(min=0).long(), classes).double()
    grad_ref = (p - onehot) * (grad_loss.double() * kept).unsqueeze(-1)
    torch.cuda.synchronize()
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(loss.double(), loss_ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(grad.double(), grad_ref, **TOL[dtype])


# ---- fused linear cross-entropy: Liger --------------------------------------------------------------
@pytest.mark.parametrize("dtype,tokens,hidden,vocab,bias,smoothing,z", [
    (torch.float32, 300, 256, 5000, False, 0.0, 0.0), (torch.bfloat16, 1000, 512, 32000, True, 0.1, 1e-4)])
def test_liger_linear_cross_entropy_against_float64(dtype, tokens, hidden, vocab, bias, smoothing, z):
    from kernel_api.arguments.cross_entropy import LinearCrossEntropyArguments

    h = (torch.randn(tokens, hidden, device="cuda") / hidden ** 0.25).to(dtype)
    w = (torch.randn(vocab, hidden, device="cuda") / hidden ** 0.25).to(dtype)
    b = torch.randn(vocab, device="cuda").to(dtype) if bias else None
    t = torch.randint(0, vocab, (tokens,), device="cuda")
    t[::7] = -100
    grad_loss = torch.rand(tokens, device="cuda")
    loss = torch.full((tokens,), SENTINEL, device="cuda")
    grads = {"grad_hidden": torch.full_like(h, SENTINEL), "grad_weight": torch.full_like(w, SENTINEL)}
    if bias:
        grads["grad_bias"] = torch.full_like(b, SENTINEL)
    with only("liger"):
        ops.call(LinearCrossEntropyArguments(h, w, t, loss, bias=b, grad_loss=grad_loss, ignore_index=-100,
                                             label_smoothing=smoothing, z_loss=z, **grads))
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    bd = b.double().requires_grad_() if bias else None
    logits = hd @ wd.T + (bd if bias else 0)
    kept = t != -100
    lse = torch.logsumexp(logits, -1)
    picked = logits.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ref = ((1 - smoothing) * (lse - picked) + smoothing * (lse - logits.mean(-1)) + z * lse ** 2) * kept
    (ref * grad_loss.double()).sum().backward()
    torch.cuda.synchronize()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(loss.double(), ref.detach(), atol=tol * 10, rtol=tol)
    for name, ref_grad in (("grad_hidden", hd.grad), ("grad_weight", wd.grad), ("grad_bias", bd.grad if bias else None)):
        if ref_grad is None:
            continue
        err = (grads[name].double() - ref_grad).norm() / ref_grad.norm()
        assert err < (5e-2 if dtype == torch.bfloat16 else 1e-4), (name, err.item())


# ---- GEMM: QuACK and cutlass.operators -----------------------------------------------------------
def _operand(rows, cols, dtype, major, batch=None):
    """(rows, cols) [batched] with the given major: "t" row-major, "n" column-major."""
    lead = () if batch is None else (batch,)
    if major == "t":
        return torch.randn(*lead, rows, cols, device="cuda").to(dtype)
    return torch.randn(*lead, cols, rows, device="cuda").to(dtype).transpose(-1, -2)


@pytest.mark.parametrize("provider", ["quack", "cutlass_operators"])
@pytest.mark.parametrize("dtype,layout,mnk,batch", [
    (torch.bfloat16, "tt", (256, 384, 512), None), (torch.bfloat16, "nn", (1000, 136, 264), None),
    (torch.float16, "tn", (128, 64, 256), 3), (torch.bfloat16, "nt", (1000, 136, 264), None)])
def test_gemm_against_float64(provider, dtype, layout, mnk, batch):
    m, n, k = mnk
    A = _operand(m, k, dtype, layout[0], batch)
    B = _operand(k, n, dtype, layout[1], batch)
    lead = () if batch is None else (batch,)
    buffer, out = inside((*lead, m, n), dtype, pad=0)
    with only(provider):
        if not kernel_api.get_kernels(kernel_api.GemmArguments(A, B, out), providers=provider):
            pytest.skip(f"{provider} takes no such GEMM")
        ops.gemm(A, B, out=out)
    expected = A.double() @ B.double()
    torch.cuda.synchronize()
    err = (out.double() - expected).abs().max().item() / expected.abs().max().item()
    assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3), err


# ---- attention: FlashAttention-4 -----------------------------------------------------------------
def attention_reference(q, k, v, causal, scale):
    """float64, (batch, seq, heads, d), bottom-right causal, GQA."""
    q, k, v = q.double().transpose(1, 2), k.double().transpose(1, 2), v.double().transpose(1, 2)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        lq, lk = q.shape[2], k.shape[2]
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        s = s.masked_fill(j > i + lk - lq, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


@pytest.mark.parametrize("dtype,b,sq,sk,hq,hkv,d,causal", [
    (torch.bfloat16, 2, 128, 128, 8, 8, 64, False), (torch.bfloat16, 2, 200, 200, 8, 2, 128, True),
    (torch.float16, 1, 77, 300, 4, 1, 96, True), (torch.bfloat16, 3, 64, 64, 2, 2, 256, False)])
def test_flash_attn_dense_against_float64(dtype, b, sq, sk, hq, hkv, d, causal):
    q = torch.randn(b, sq, hq, d, device="cuda").to(dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda").to(dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda").to(dtype)
    buffer, out = inside((b, sq, hq, d), dtype, pad=0)
    with only("flash_attn"):
        ops.attention(q, k, v, causal=causal, out=out)
    expected = attention_reference(q, k, v, causal, d ** -0.5)
    check_inside(buffer, out, expected, dtype, pad=0)


@pytest.mark.parametrize("causal", [True])
def test_flash_attn_varlen_against_float64(causal):
    dtype, h, d = torch.bfloat16, 4, 128
    lengths_q, lengths_k = [17, 128, 1, 300], [17, 200, 64, 300]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lengths_q), h, d, device="cuda").to(dtype)
    k = torch.randn(sum(lengths_k), h, d, device="cuda").to(dtype)
    v = torch.randn(sum(lengths_k), h, d, device="cuda").to(dtype)
    out = torch.full_like(q, SENTINEL)
    with only("flash_attn"):
        ops.attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q),
                      max_seqlen_k=max(lengths_k), out=out)
    torch.cuda.synchronize()
    for i in range(len(lengths_q)):
        qs = slice(int(cu_q[i]), int(cu_q[i + 1]))
        ks = slice(int(cu_k[i]), int(cu_k[i + 1]))
        expected = attention_reference(q[None, qs], k[None, ks], v[None, ks], causal, d ** -0.5)[0]
        torch.testing.assert_close(out[qs].double(), expected, **TOL[dtype])


def test_flash_attn_runs_on_the_requested_stream():
    q = torch.randn(2, 256, 4, 64, device="cuda").to(torch.bfloat16)
    out = torch.full_like(q, SENTINEL)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with only("flash_attn"):
        ops.attention(q, q, q, causal=True, out=out, stream=side)
        torch.cuda.current_stream().wait_stream(side)
    check_inside(out.view(-1), out, attention_reference(q, q, q, True, 64 ** -0.5), torch.bfloat16, pad=0)


# ---- one ranking --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", [PickAny(), PickBest(num_workers=1, repeat=3, max_candidates=4)],
                         ids=["PickAny", "PickBest"])
def test_one_ranking_over_every_provider_chooses_and_computes_right(policy):
    """Softmax: ours (cuda_src, cutedsl), torch's and QuACK's kernels are all candidates."""
    if "quack" not in INSTALLED:
        pytest.skip("QuACK's library is not installed")
    x = (3 * torch.randn(256, 1024, device="cuda")).float()
    out = torch.full_like(x, SENTINEL)
    args = kernel_api.SoftmaxArguments(x, out)
    modules = {k.metadata.kernel_class.__module__.partition(".")[0] for k in kernel_api.get_kernels(args)}
    assert {"kernel_api", "kernel_api_quack"} <= modules
    ops.clear_dispatch_cache()
    with kernel_api.settings(policy=policy):
        ops.softmax(x, out=out)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.double(), torch.softmax(x.double(), -1), **TOL[torch.float32])
    ops.clear_dispatch_cache()


def test_pick_any_ranks_norms_of_every_provider():
    x = torch.randn(64, 4096, device="cuda").to(torch.bfloat16)
    w = torch.randn(4096, device="cuda").to(torch.bfloat16)
    out = torch.full_like(x, SENTINEL)
    args = kernel_api.RMSNormArguments(x, w, out)
    modules = {k.metadata.kernel_class.__module__.partition(".")[0] for k in kernel_api.get_kernels(args)}
    assert {"kernel_api"} < modules  # ours and at least one plugin's
    ops.clear_dispatch_cache()
    with kernel_api.settings(policy=PickAny()):
        ops.rms_norm(x, w, 1e-6, out=out)
    expected, _ = norm_reference("rms_norm", x, w, None, 1e-6)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.double(), expected, **TOL[torch.bfloat16])
