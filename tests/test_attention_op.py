"""ops.attention on the CPU: argument validation, discovery and explain, the torch provider's
kernel through ops.call and the generated op against a float64 reference, gradcheck and
tracing. The front door launches on CPU tensors because the tests add "cpu" to
`dispatch.LAUNCH_DEVICE_TYPES`."""

from __future__ import annotations

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import kernel_api
from kernel_api import ops
from kernel_api.arguments import AttentionArguments
from kernel_api.core.tensor_attributes import TensorAttributes
from kernel_api.metadata.attention import AttentionOperandsMetadata
from kernel_api.ops import dispatch

SENTINEL = 1234.5


@pytest.fixture
def cpu_launch(monkeypatch):
    monkeypatch.setattr(dispatch, "LAUNCH_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    ops.clear_dispatch_cache()
    yield
    ops.clear_dispatch_cache()


def reference(q, k, v, causal=False, scale=None, cu_q=None, cu_k=None):
    """softmax(q k^T * scale + mask) v per head in float64; GQA by head mapping, causal
    bottom-right (queries that see no key give 0), varlen by slicing."""
    if cu_q is not None:
        cq, ck = cu_q.tolist(), cu_k.tolist()
        out = torch.zeros(q.shape, dtype=torch.float64)
        for b in range(len(cq) - 1):
            out[cq[b]:cq[b + 1]] = reference(q[cq[b]:cq[b + 1]][None], k[ck[b]:ck[b + 1]][None],
                                             v[ck[b]:ck[b + 1]][None], causal, scale)[0]
        return out
    q, k, v = q.double(), k.double(), v.double()
    batch, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(batch, sq, hq, d, dtype=torch.float64)
    for b in range(batch):
        for h in range(hq):
            kv = h // (hq // hk)
            s = q[b, :, h] @ k[b, :, kv].T * scale
            if causal:
                i = torch.arange(sq)[:, None]
                j = torch.arange(sk)[None, :]
                s = s.masked_fill(j > i + sk - sq, -math.inf)
            for i in range(sq):
                if sk and torch.isfinite(s[i]).any():
                    out[b, i, h] = torch.softmax(s[i], -1) @ v[b, :, kv]
    return out


def _qkv(batch, sq, sk, hq, hk, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, sq, hq, d, generator=g).to(dtype)
    k = torch.randn(batch, sk, hk, d, generator=g).to(dtype)
    v = torch.randn(batch, sk, hk, d, generator=g).to(dtype)
    return q, k, v


def _varlen(lengths_q, lengths_k, hq, hk, d, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lengths_q), hq, d, generator=g).to(dtype)
    k = torch.randn(sum(lengths_k), hk, d, generator=g).to(dtype)
    v = torch.randn(sum(lengths_k), hk, d, generator=g).to(dtype)
    return q, k, v, cu_q, cu_k


# ---- validation: one line, naming the operand ----

def _bad_cases():
    q, k, v = _qkv(2, 5, 6, 4, 2, 16)
    out = torch.empty_like(q)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    vq, vk, vv = q.reshape(10, 4, 16), k.reshape(12, 2, 16), v.reshape(12, 2, 16)
    cuk = torch.tensor([0, 6, 12], dtype=torch.int32)
    return [
        ((q, k.double(), v, out), {}, "operand k", "dtype"),
        ((q, k, v, out.half()), {}, "operand out", "dtype"),
        ((q, k[..., :8], v, out), {}, "operand k", "head_dim"),
        ((q, k, v[..., :8], out), {}, "operand v", "shape"),
        ((q, _qkv(2, 5, 6, 4, 3, 16)[1], _qkv(2, 5, 6, 4, 3, 16)[2], out), {}, "operand k", "multiple"),
        ((q, k, v, out[:, :4]), {}, "operand out", "shape"),
        ((q[0], k, v, out), {}, "operand q", "rank 4"),
        ((q.transpose(-1, -2), k, v, out), {}, "operand q", "head_dim must be contiguous"),
        ((q, k[:1], v[:1], out), {}, "operand k", "batch"),
        (("q", k, v, out), {}, "operand q", "torch.Tensor"),
        ((vq, vk, vv, torch.empty_like(vq)), {"cu_seqlens_q": cu.long(), "cu_seqlens_k": cuk}, "operand cu_seqlens_q",
         "int32"),
        ((vq, vk, vv, torch.empty_like(vq)), {"cu_seqlens_q": cu, "cu_seqlens_k": cuk[:2]}, "operand cu_seqlens_k",
         "length"),
        ((vq, vk, vv, torch.empty_like(vq)), {"cu_seqlens_q": torch.tensor([0, 6, 5], dtype=torch.int32),
                                             "cu_seqlens_k": cuk}, "operand cu_seqlens_q", "non-decreasing"),
        ((vq, vk, vv, torch.empty_like(vq)), {"cu_seqlens_q": torch.tensor([1, 3, 10], dtype=torch.int32),
                                             "cu_seqlens_k": cuk}, "operand cu_seqlens_q", "start at 0"),
        ((vq, vk, vv, torch.empty_like(vq)), {"cu_seqlens_q": torch.tensor([0, 3, 9], dtype=torch.int32),
                                             "cu_seqlens_k": cuk}, "operand cu_seqlens_q", "10 tokens"),
        ((vq, vk, vv, torch.empty_like(vq)), {"cu_seqlens_q": cu}, "operand cu_seqlens_q", "both"),
        ((vq, vk, vv, torch.empty_like(vq)), {"cu_seqlens_q": cu, "cu_seqlens_k": cuk, "max_seqlen_q": 2},
         "max_seqlen_q", "below"),
        ((q, k, v, out), {"max_seqlen_q": 5}, "max_seqlen_q", "variable length"),
        ((q, k, v, out), {"scale": float("nan")}, "scale", "finite"),
        ((q, k, v, out), {"causal": 1}, "causal", "bool"),
        ((q, k, v, out), {"cu_seqlens_q": cu, "cu_seqlens_k": cuk}, "operand q", "rank 3"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_invalid_arguments_name_the_operand(case):
    tensors, kw, operand, words = _bad_cases()[case]
    with pytest.raises((TypeError, ValueError)) as info:
        AttentionArguments(*tensors, **kw)
    message = str(info.value)
    assert "\n" not in message
    assert operand in message and words in message, message


def test_arguments_summary_and_key():
    q, k, v = _qkv(2, 5, 6, 8, 2, 16, torch.bfloat16)
    a = AttentionArguments(q, k, v, torch.empty_like(q), causal=True)
    assert (a.batch, a.seqlen_q, a.seqlen_k, a.heads_q, a.heads_kv, a.head_dim) == (2, 5, 6, 8, 2, 16)
    assert a.scale == pytest.approx(0.25) and a.output_names == ("out",)
    assert list(a.tensor_attributes) == ["q", "k", "v", "out"]
    assert "heads_kv=2" in repr(a) and "causal=True" in repr(a)
    b = AttentionArguments(q, k, v, torch.empty_like(q), causal=False)
    assert a.problem_key() != b.problem_key()
    assert a.problem_key() == AttentionArguments(q, k, v, torch.empty_like(q), causal=True).problem_key()


# ---- discovery and explain ----

def test_discovery_finds_torch_attention():
    q, k, v = _qkv(1, 3, 3, 2, 2, 64, torch.float16)
    names = [kern.name for kern in kernel_api.get_kernels(AttentionArguments(q, k, v, torch.empty_like(q)))]
    assert names == ["TorchAttention_f16_dense"]
    vq, vk, vv, cq, ck = _varlen([2, 3], [4, 1], 2, 1, 64, torch.bfloat16)
    varlen = AttentionArguments(vq, vk, vv, torch.empty_like(vq), cu_seqlens_q=cq, cu_seqlens_k=ck)
    assert [kern.name for kern in kernel_api.get_kernels(varlen)] == ["TorchAttention_bf16_varlen"]
    explained = kernel_api.explain(varlen)
    assert "TorchAttention_bf16_varlen" in str(explained)
    assert "TorchAttention_bf16_dense: operand q: variable-length layout but the kernel takes dense" in str(
        explained.all())


def test_metadata_reasons():
    q, k, v = _qkv(1, 3, 3, 4, 1, 96, torch.bfloat16)
    args = AttentionArguments(q, k, v, torch.empty_like(q), causal=True)
    attrs = TensorAttributes("bf16", (0, 0, 0, 1), 1)
    assert AttentionOperandsMetadata(attrs, attrs, attrs, attrs, head_dims=(64, 128)).supports(args).error == \
        "head_dim 96 not in (64, 128)"
    assert "causal" in AttentionOperandsMetadata(attrs, attrs, attrs, attrs, causal=False).supports(args).error
    assert "no GQA" in AttentionOperandsMetadata(attrs, attrs, attrs, attrs, gqa=False).supports(args).error
    assert "256" in AttentionOperandsMetadata(attrs, attrs, attrs, attrs, max_head_dim=256).supports(
        AttentionArguments(*_qkv(1, 2, 2, 1, 1, 320, torch.bfloat16), torch.empty(1, 2, 1, 320, dtype=torch.bfloat16))
    ).error
    assert AttentionOperandsMetadata(attrs, attrs, attrs, attrs).supports(args)


# ---- running: ops.call and ops.attention against float64 ----

SHAPES = [  # batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim
    (1, 1, 1, 2, 2, 64), (2, 7, 7, 4, 4, 64), (1, 33, 33, 8, 2, 128), (2, 7, 33, 8, 1, 64), (1, 33, 7, 2, 1, 32)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_ops_call_into_sentinel_out(cpu_launch, shape, causal):
    q, k, v = _qkv(*shape)
    out = torch.full_like(q, SENTINEL)
    result = ops.call(AttentionArguments(q, k, v, out, causal=causal))
    assert result is out
    torch.testing.assert_close(out.double(), reference(q, k, v, causal), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ops_attention_half_types(cpu_launch, dtype):
    q, k, v = _qkv(2, 7, 33, 8, 2, 64, dtype)
    out = ops.attention(q, k, v, causal=True, scale=0.1)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), reference(q, k, v, True, 0.1), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("sq", [1, 2, 5, 16])
def test_decode_against_kv_cache(cpu_launch, sq):
    q, k, v = _qkv(2, sq, 100, 8, 2, 64)
    out = torch.full_like(q, SENTINEL)
    ops.attention(q, k, v, causal=True, out=out)
    torch.testing.assert_close(out.double(), reference(q, k, v, True), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_with_an_empty_sequence(cpu_launch, causal):
    q, k, v, cq, ck = _varlen([3, 0, 7, 1], [5, 0, 7, 33], 8, 2, 64)
    out = torch.full_like(q, SENTINEL)
    ops.attention(q, k, v, causal=causal, cu_seqlens_q=cq, cu_seqlens_k=ck, out=out)
    torch.testing.assert_close(out.double(), reference(q, k, v, causal, None, cq, ck), atol=2e-5, rtol=2e-5)


def test_mqa_and_empty_keys(cpu_launch):
    q, k, v = _qkv(1, 4, 0, 4, 1, 16)
    torch.testing.assert_close(ops.attention(q, k, v), torch.zeros_like(q))


# ---- autograd and tracing through the generated op ----

@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(cpu_launch, causal):
    q, k, v = (t.requires_grad_() for t in _qkv(1, 3, 5, 4, 2, 8, torch.float64))
    assert torch.autograd.gradcheck(lambda a, b, c: ops.attention(a, b, c, causal=causal, scale=0.3), (q, k, v))


def test_gradcheck_varlen(cpu_launch):
    q, k, v, cq, ck = _varlen([2, 0, 3], [3, 1, 3], 2, 1, 4, torch.float64)
    q, k, v = q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b, c: ops.attention(a, b, c, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck), (q, k, v))


def test_make_fx_fake_shows_the_op(cpu_launch):
    q, k, v = _qkv(1, 4, 6, 4, 2, 16)
    graph = make_fx(lambda a, b, c: ops.attention(a, b, c, causal=True), tracing_mode="fake")(q, k, v)
    assert "kernel_api.attention" in graph.code
    out = torch.full_like(q, SENTINEL)
    ops.attention(q, k, v, causal=True, out=out)
    torch.testing.assert_close(graph(q, k, v), out)


def test_torch_compile_fullgraph(cpu_launch):
    q, k, v = _qkv(1, 4, 9, 4, 2, 16)
    compiled = torch.compile(lambda a, b, c: ops.attention(a, b, c, causal=True), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v).double(), reference(q, k, v, True), atol=2e-5, rtol=2e-5)
