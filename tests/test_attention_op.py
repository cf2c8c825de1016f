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
    """On the CPU: SDPA and the materialised definition; torch's flash and cuDNN backends
    decline CPU tensors."""
    q, k, v = _qkv(1, 3, 3, 2, 2, 64, torch.float16)
    names = [kern.name for kern in kernel_api.get_kernels(AttentionArguments(q, k, v, torch.empty_like(q)))]
    assert names == ["TorchAttention_f16_dense", "TorchAttention_f16_dense_math"]
    vq, vk, vv, cq, ck = _varlen([2, 3], [4, 1], 2, 1, 64, torch.bfloat16)
    varlen = AttentionArguments(vq, vk, vv, torch.empty_like(vq), cu_seqlens_q=cq, cu_seqlens_k=ck)
    assert [kern.name for kern in kernel_api.get_kernels(varlen)] == ["TorchAttention_bf16_varlen",
                                                                       "TorchAttention_bf16_varlen_math"]
    explained = kernel_api.explain(varlen)
    assert "TorchAttention_bf16_varlen" in str(explained)
    assert "TorchAttention_bf16_dense: operand q: variable-length layout but the kernel takes dense" in str(
        explained.all())
    assert "TorchAttention_bf16_varlen_flash: operand q: on cpu, torch's flash attention runs on CUDA tensors only" \
        in str(explained.all())


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


def test_offsets_read_drop_the_empty_sequences_after_the_last(cpu_launch):
    """With no longest lengths the offsets are read: a fixed-size offsets tensor padded with the
    token count (as a traced model makes it) runs as its non-empty prefix; an empty sequence
    between two is kept. On a device the same values come from one transfer (`_device_summary`)."""
    from kernel_api.arguments.attention import _device_summary
    q, k, v, cq, ck = _varlen([3, 0, 7, 1], [5, 0, 7, 33], 8, 2, 64)
    padded_q, padded_k = torch.cat([cq, cq[-1:].expand(4)]), torch.cat([ck, ck[-1:].expand(4)])
    args = AttentionArguments(q, k, v, torch.empty_like(q), cu_seqlens_q=padded_q, cu_seqlens_k=padded_k)
    assert (args.batch, args.seqlen_q, args.seqlen_k) == (4, 7, 33)
    assert args.cu_seqlens_q.tolist() == cq.tolist() and args.cu_seqlens_k.tolist() == ck.tolist()
    given = AttentionArguments(q, k, v, torch.empty_like(q), cu_seqlens_q=padded_q, cu_seqlens_k=padded_k,
                               max_seqlen_q=7, max_seqlen_k=33)
    assert given.batch == 8 and given.cu_seqlens_q is padded_q  # (given lengths: the offsets as they are)
    out = torch.full_like(q, SENTINEL)
    ops.attention(q, k, v, causal=True, cu_seqlens_q=padded_q, cu_seqlens_k=padded_k, out=out)
    torch.testing.assert_close(out.double(), reference(q, k, v, True, None, cq, ck), atol=2e-5, rtol=2e-5)
    assert _device_summary(padded_q, padded_k) == [[0, 0, 7, 11, 4], [0, 0, 33, 45, 4]]
    assert _device_summary(torch.tensor([0], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)) == [[0] * 5] * 2
    meta = torch.tensor([0, 2], dtype=torch.int32, device="meta")
    t = torch.empty(2, 2, 4, device="meta")
    with pytest.raises(ValueError, match="^max_seqlen_q: required with cu_seqlens_q whose values cannot be read"):
        AttentionArguments(t, t, t, torch.empty_like(t), cu_seqlens_q=meta, cu_seqlens_k=meta)


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


# ---- the row log-sum-exp and the backward's arguments ----

def reference_lse(q, k, causal=False, scale=None, cu_q=None, cu_k=None):
    """The row log-sum-exp in float64 in kernel_api's form ((batch, heads_q, seqlen_q); varlen
    (heads_q, total_q)); -inf for rows that see no key."""
    if cu_q is not None:
        cq, ck = cu_q.tolist(), cu_k.tolist()
        out = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float64)
        for b in range(len(cq) - 1):
            out[:, cq[b]:cq[b + 1]] = reference_lse(q[cq[b]:cq[b + 1]][None], k[ck[b]:ck[b + 1]][None], causal,
                                                    scale)[0]
        return out
    q, k = q.double(), k.double()
    batch, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    kk = k.repeat_interleave(hq // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if causal:
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + sk - sq, -math.inf)
    return torch.logsumexp(s, -1) if sk else torch.full((batch, hq, sq), -math.inf, dtype=torch.float64)


def reference_grads(q, k, v, grad, causal=False, scale=None, cu_q=None, cu_k=None):
    """d(out . grad)/d(q, k, v) of the float64 reference, by autograd (rows that see no key give 0)."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        out = _differentiable(*leaves, causal, scale, cu_q, cu_k)
        return torch.autograd.grad(out, leaves, grad.double())


def _differentiable(q, k, v, causal, scale, cu_q, cu_k):
    if cu_q is not None:
        cq, ck = cu_q.tolist(), cu_k.tolist()
        parts = [_differentiable(q[cq[b]:cq[b + 1]][None], k[ck[b]:ck[b + 1]][None], v[ck[b]:ck[b + 1]][None],
                                 causal, scale, None, None)[0] for b in range(len(cq) - 1)]
        return torch.cat(parts) if parts else q * 0
    batch, sq, hq, d = q.shape
    sk, groups = k.shape[1], hq // k.shape[2]
    if sk == 0:
        return q * 0
    scale = 1 / math.sqrt(d) if scale is None else scale
    kk, vv = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if causal:
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + sk - sq, -math.inf)
    seen = torch.isfinite(s).any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~seen, 0.0), -1) * seen
    return torch.einsum("bhqk,bkhd->bqhd", p, vv)


def _bad_lse_cases():
    q, k, v = _qkv(2, 5, 6, 4, 2, 16)
    out = torch.empty_like(q)
    vq, vk, vv, cq, ck = _varlen([3, 4], [2, 5], 4, 2, 16)
    return [
        ((q, k, v, out, torch.empty(2, 4, 5, dtype=torch.float64)), {}, "operand lse", "float32"),
        ((q, k, v, out, torch.empty(2, 5, 4)), {}, "operand lse", "(batch, heads_q, seqlen_q)"),
        ((q, k, v, out, torch.empty(2, 5, 4).transpose(1, 2)), {}, "operand lse", "contiguous"),
        ((q, k, v, out, "lse"), {}, "operand lse", "torch.Tensor"),
        ((vq, vk, vv, torch.empty_like(vq), torch.empty(2, 4, 4)), {"cu_seqlens_q": cq, "cu_seqlens_k": ck},
         "operand lse", "(heads_q, total_q)"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_lse_cases())))
def test_invalid_lse_names_the_operand(case):
    tensors, kw, operand, words = _bad_lse_cases()[case]
    with pytest.raises((TypeError, ValueError)) as info:
        AttentionArguments(*tensors, **kw)
    assert "\n" not in str(info.value) and operand in str(info.value) and words in str(info.value), str(info.value)


def test_lse_is_part_of_the_signature_and_forward_kernels_without_it_decline():
    q, k, v = _qkv(1, 4, 6, 4, 2, 16, torch.bfloat16)
    plain = AttentionArguments(q, k, v, torch.empty_like(q))
    training = AttentionArguments(q, k, v, torch.empty_like(q), torch.empty(1, 4, 4))
    assert plain.signature != training.signature and "lse" not in plain.tensor_attributes
    assert isinstance(training, AttentionArguments) and type(training).output_names == ("out", "lse")
    assert type(plain) is AttentionArguments and plain.output_names == ("out",)
    assert list(training.tensor_attributes) == ["q", "k", "v", "out", "lse"]
    assert [kern.name for kern in kernel_api.get_kernels(training)] == ["TorchAttention_bf16_dense_math"]
    text = kernel_api.explain(training).all()
    assert "TorchAttention_bf16_dense: operand lse: the kernel does not write the row log-sum-exp" in text
    attrs = TensorAttributes("bf16", (0, 0, 0, 1), 1)
    assert not AttentionOperandsMetadata(attrs, attrs, attrs, attrs).supports(training)
    assert AttentionOperandsMetadata(attrs, attrs, attrs, attrs, lse=True).supports(training)
    assert AttentionOperandsMetadata(attrs, attrs, attrs, attrs).supports(plain)


def _backward_operands(batch=2, sq=5, sk=6, hq=4, hk=2, d=16, dtype=torch.float32):
    q, k, v = _qkv(batch, sq, sk, hq, hk, d, dtype)
    return dict(grad_out=torch.randn_like(q), q=q, k=k, v=v, out=torch.randn_like(q), lse=torch.zeros(batch, hq, sq),
                grad_q=torch.empty_like(q), grad_k=torch.empty_like(k), grad_v=torch.empty_like(v))


def _bad_backward_cases():
    base = _backward_operands()
    cases = []

    def case(words, operand, **changes):
        cases.append(({**base, **changes}, operand, words))

    case("dtype", "operand grad_out", grad_out=base["grad_out"].double())
    case("shape", "operand grad_out", grad_out=base["grad_out"][:, :4])
    case("shape", "operand out", out=base["out"][..., :8])
    case("shape", "operand grad_k", grad_k=torch.empty_like(base["q"]))
    case("dtype", "operand grad_v", grad_v=base["grad_v"].half())
    case("shape", "operand grad_q", grad_q=base["grad_q"][:1])
    case("(batch, heads_q, seqlen_q)", "operand lse", lse=torch.zeros(2, 5, 4))
    case("float32", "operand lse", lse=torch.zeros(2, 4, 5, dtype=torch.bfloat16))
    case("head_dim must be contiguous", "operand grad_q", grad_q=torch.empty(2, 5, 16, 4).transpose(-1, -2))
    case("torch.Tensor", "operand grad_k", grad_k=None)
    case("multiple", "operand k", k=base["k"][:, :, :1].expand(2, 6, 3, 16), v=base["v"][:, :, :1].expand(2, 6, 3, 16),
         grad_k=torch.empty(2, 6, 3, 16), grad_v=torch.empty(2, 6, 3, 16))
    return cases


@pytest.mark.parametrize("case", range(len(_bad_backward_cases())))
def test_invalid_backward_arguments_name_the_operand(case):
    from kernel_api.arguments import AttentionBackwardArguments
    operands, operand, words = _bad_backward_cases()[case]
    with pytest.raises((TypeError, ValueError)) as info:
        AttentionBackwardArguments(**operands, causal=True)
    message = str(info.value)
    assert "\n" not in message and operand in message and words in message, message


def test_backward_arguments_summary_key_and_overlap():
    from kernel_api.arguments import AttentionBackwardArguments
    operands = _backward_operands(hq=8, hk=2)
    a = AttentionBackwardArguments(**operands, causal=True, scale=0.5)
    assert a.output_names == ("grad_q", "grad_k", "grad_v")
    assert list(a.tensor_attributes) == ["grad_out", "q", "k", "v", "out", "lse", "grad_q", "grad_k", "grad_v"]
    assert (a.batch, a.seqlen_q, a.seqlen_k, a.heads_q, a.heads_kv, a.scale) == (2, 5, 6, 8, 2, 0.5)
    assert "AttentionBackwardArguments(batch=2" in repr(a) and "heads_kv=2" in repr(a)
    assert a.problem_key() != AttentionBackwardArguments(**operands, causal=False, scale=0.5).problem_key()
    a.check_memory()
    with pytest.raises(ValueError, match="operand grad_q: overlaps grad_out"):
        AttentionBackwardArguments(**{**operands, "grad_q": operands["grad_out"]}).check_memory()
    names = [kern.name for kern in kernel_api.get_kernels(a)]
    assert names == ["TorchAttentionBackward_f32_dense_math"]


# ---- the ops: schemas, fake shapes, tracing ----

def test_op_schemas():
    forward = torch.ops.kernel_api.attention_forward.default._schema
    backward = torch.ops.kernel_api.attention_backward.default._schema
    assert [a.name for a in forward.arguments][:3] == ["q", "k", "v"] and len(forward.returns) == 2
    assert [a.name for a in backward.arguments][:6] == ["grad_out", "q", "k", "v", "out", "lse"]
    assert len(backward.returns) == 3
    assert len(torch.ops.kernel_api.attention.default._schema.returns) == 1


def test_fake_shapes_on_meta():
    q, k, v = (t.to("meta") for t in _qkv(2, 5, 7, 8, 2, 64, torch.bfloat16))
    out, lse = torch.ops.kernel_api.attention_forward(q, k, v, True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, 8, 5) and lse.dtype == torch.float32
    gq, gk, gv = torch.ops.kernel_api.attention_backward(out, q, k, v, out, lse, True)
    assert (gq.shape, gk.shape, gv.shape) == (q.shape, k.shape, v.shape)
    vq, vk, vv, cq, ck = _varlen([3, 0, 4], [2, 5, 1], 4, 2, 32, torch.bfloat16)
    vq, vk, vv = vq.to("meta"), vk.to("meta"), vv.to("meta")
    cq, ck = cq.to("meta"), ck.to("meta")
    out, lse = torch.ops.kernel_api.attention_forward(vq, vk, vv, False, None, cq, ck, 4, 5)
    assert out.shape == vq.shape and lse.shape == (4, 7)


def test_make_fx_training_step_has_forward_and_backward_ops(cpu_launch):
    q, k, v = _qkv(1, 4, 6, 4, 2, 16)

    def step(a, b, c):
        a, b, c = (t.requires_grad_() for t in (a, b, c))
        out = ops.attention(a, b, c, causal=True)
        return torch.autograd.grad(out.sum(), (a, b, c))

    graph = make_fx(step, tracing_mode="fake")(q, k, v)
    assert "kernel_api.attention_forward" in graph.code and "kernel_api.attention_backward" in graph.code
    assert "kernel_api.attention.default" not in graph.code
    for got, want in zip(graph(q, k, v), reference_grads(q, k, v, torch.ones_like(q), True)):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_torch_compile_backward_traces_the_backward_op(cpu_launch):
    import torch._dynamo
    from torch._dynamo.backends.debugging import aot_eager
    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):
        return aot_eager(gm, example_inputs, fw_compiler=_recording(seen), bw_compiler=_recording(seen))

    q, k, v = (t.requires_grad_() for t in _qkv(1, 4, 9, 4, 2, 16))
    compiled = torch.compile(lambda a, b, c: ops.attention(a, b, c, causal=True), backend=backend, fullgraph=True)
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    targets = {str(n.target) for gm in seen for n in gm.graph.nodes}
    assert "kernel_api.attention_forward.default" in targets and "kernel_api.attention_backward.default" in targets
    for got, want in zip(grads, reference_grads(q.detach(), k.detach(), v.detach(), torch.ones_like(q), True)):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    torch._dynamo.reset()


def _recording(seen):
    def compiler(gm, example_inputs):
        seen.append(gm)
        return gm.forward
    return compiler


# ---- gradients through the torch provider on the CPU ----

@pytest.mark.parametrize("shape", [(2, 7, 7, 4, 4, 16), (1, 5, 9, 8, 2, 32), (1, 9, 5, 4, 1, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_against_float64(cpu_launch, shape, causal):
    """GQA / MQA, seqlen_q above seqlen_k (causal: rows that see no key get zero gradients)."""
    q, k, v = _qkv(*shape)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ops.attention(*leaves, causal=causal, scale=0.3)
    torch.testing.assert_close(out.detach().double(), reference(q, k, v, causal, 0.3), atol=2e-5, rtol=2e-5)
    grads = torch.autograd.grad(out, leaves, grad)
    for got, want in zip(grads, reference_grads(q, k, v, grad, causal, 0.3)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_varlen_gradients_with_an_empty_sequence(cpu_launch):
    q, k, v, cq, ck = _varlen([3, 0, 7, 1], [5, 0, 7, 33], 8, 2, 16)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(6))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ops.attention(*leaves, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck)
    for got, want in zip(torch.autograd.grad(out, leaves, grad), reference_grads(q, k, v, grad, True, None, cq, ck)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_training_forward_writes_the_lse(cpu_launch):
    q, k, v = _qkv(2, 9, 5, 4, 2, 16)
    out, lse = torch.full_like(q, SENTINEL), torch.full((2, 4, 9), SENTINEL)
    result = ops.call(AttentionArguments(q, k, v, out, lse, causal=True, scale=0.3))
    assert result[0] is out and result[1] is lse
    torch.testing.assert_close(lse.double(), reference_lse(q, k, True, 0.3), atol=1e-5, rtol=1e-5)
    out, lse = torch.ops.kernel_api.attention_forward.default(q, k, v, True, 0.3)
    torch.testing.assert_close(out.double(), reference(q, k, v, True, 0.3), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), reference_lse(q, k, True, 0.3), atol=1e-5, rtol=1e-5)
    vq, vk, vv, cq, ck = _varlen([3, 0, 7], [5, 2, 7], 4, 2, 16)
    _, lse = torch.ops.kernel_api.attention_forward.default(vq, vk, vv, False, None, cq, ck)
    torch.testing.assert_close(lse.double(), reference_lse(vq, vk, False, None, cq, ck), atol=1e-5, rtol=1e-5)


def count_backend_runs(monkeypatch, backends=("math", "sdpa")):
    """Record each torch attention kernel run as (class, backend, whether lse was written):
    the backend methods of `TorchAttention` and `TorchAttentionBackward` wrapped."""
    from kernel_api.providers.torch_ops.attention import TorchAttention
    from kernel_api.providers.torch_ops.attention_backward import TorchAttentionBackward
    calls = []
    for cls in (TorchAttention, TorchAttentionBackward):
        for backend in backends:
            real = getattr(cls, f"_run_{backend}", None)
            if real is None:
                continue

            def counting(args, *tensors, _real=real, _name=(cls.__name__, backend)):
                lse = tensors[4] if _name[0] == "TorchAttention" else tensors[5]
                calls.append((*_name, lse is not None))
                return _real(args, *tensors)

            monkeypatch.setattr(cls, f"_run_{backend}", staticmethod(counting))
    ops.clear_dispatch_cache()
    return calls


def test_one_forward_per_training_step(cpu_launch, monkeypatch):
    """The backward reads the saved lse: one forward (writing lse) and one backward per step;
    inference writes no lse."""
    calls = count_backend_runs(monkeypatch)
    q, k, v = (t.requires_grad_() for t in _qkv(1, 6, 6, 4, 2, 16))
    ops.attention(q, k, v, causal=True).sum().backward()
    assert calls == [("TorchAttention", "math", True), ("TorchAttentionBackward", "math", True)]
    calls.clear()
    with torch.no_grad():
        ops.attention(q, k, v, causal=True)
    assert calls == [("TorchAttention", "sdpa", False)]


def test_inference_op_called_directly_still_differentiates(cpu_launch):
    q, k, v = _qkv(1, 5, 5, 2, 2, 8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.ops.kernel_api.attention(*leaves, True)
    grads = torch.autograd.grad(out.sum(), leaves)
    for got, want in zip(grads, reference_grads(q, k, v, torch.ones_like(q), True)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_out_with_grad_is_refused(cpu_launch):
    q, k, v = (t.requires_grad_() for t in _qkv(1, 3, 3, 2, 2, 8))
    with pytest.raises(ValueError, match="given outputs"):
        ops.attention(q, k, v, out=torch.empty(q.shape))


# ---- FlashAttention-4's plugin (when its library is installed): discovery, lse, explain ----

def test_flash_attn_plugin_offers_forward_with_lse_and_backward():
    import plugin_packages as pp
    from kernel_api import CompilationError
    from kernel_api.arguments import AttentionBackwardArguments
    if not pp.installed("flash_attn"):
        pytest.skip("flash-attn-4 is not installed")
    modules = pp.load_into_default("flash_attn")
    try:
        def meta(*shape, dtype=torch.bfloat16):
            return torch.empty(shape, dtype=dtype, device="meta")

        q, k = meta(2, 64, 8, 128), meta(2, 64, 2, 128)
        forward = AttentionArguments(q, k, k, meta(2, 64, 8, 128), meta(2, 8, 64, dtype=torch.float32), causal=True)
        # (FA4's own tile choice first; the plugin's fixed-tile instances follow it)
        assert [kern.name for kern in kernel_api.get_kernels(forward, providers="flash_attn", cc=90)][0] == \
            "FlashAttnForward_bf16_dense_a16"
        backward = AttentionBackwardArguments(q, q, k, k, q, meta(2, 8, 64, dtype=torch.float32), meta(*q.shape),
                                              meta(*k.shape), meta(*k.shape), causal=True)
        found = kernel_api.get_kernels(backward, providers="flash_attn", cc=90)
        assert [kern.name for kern in found] == ["FlashAttnBackward_bf16_dense_a16"]
        assert kernel_api.get_kernels(backward, providers="flash_attn", cc=80) == []
        odd = AttentionBackwardArguments(*(meta(1, 9, 2, 36) for _ in range(5)), meta(1, 2, 9, dtype=torch.float32),
                                         *(meta(1, 9, 2, 36) for _ in range(3)))
        text = kernel_api.explain(odd, providers="flash_attn", cc=90).all()
        assert "FlashAttnBackward_bf16_dense_a16: operand grad_out: aligned to 4 element(s) but the kernel needs 8" \
            in text, text
        with pytest.raises(CompilationError, match="FlashAttention-4 compiles for the GPU it runs on"):
            found[0].compile(backward, cc=100)
        assert modules["flash_attn"].__version__ == pp.library("flash_attn").PLUGIN_VERSION
    finally:
        pp.unload("flash_attn")
        ops.clear_dispatch_cache()


def test_patched_llama_training_step_runs_one_attention_forward_per_layer(cpu_launch, monkeypatch):
    """kernel_api.nn.patch's attention (transformers' attention interface) in a training step:
    each layer's attention runs its forward once, writing lse, and its backward from it."""
    pytest.importorskip("transformers")
    from kernel_api.nn import patch, unpatch
    from test_nn_llama import _ids, small_model
    calls = count_backend_runs(monkeypatch)
    eager, model = small_model("llama"), small_model("llama")
    ids = _ids(seed=3)
    want = eager(input_ids=ids, labels=ids).loss
    patch(model, kinds=["attention"])
    try:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.testing.assert_close(loss, want, atol=2e-5, rtol=2e-5)
        layers = len(model.model.layers)
        assert calls == [("TorchAttention", "math", True)] * layers + [("TorchAttentionBackward", "math", True)] * layers
    finally:
        unpatch(model)


def test_an_expanded_output_is_refused_and_expanded_inputs_are_keyed():
    """An output with a stride 0 (from expand) would be written by racing threads: refused by
    name. Expanded inputs are taken, and their arguments keyed apart from dense ones (a kernel
    may decline them: its choice must not be reused for the other)."""
    q = torch.randn(2, 5, 4, 16)
    shared = torch.empty(2, 5, 1, 16).expand(2, 5, 4, 16)
    with pytest.raises(ValueError, match=r"operand out: elements overlap .*a zero stride"):
        AttentionArguments(q, q, q, shared).check_memory()
    k = torch.randn(2, 5, 1, 16).expand(2, 5, 4, 16)
    dense, wide = AttentionArguments(q, q, q, torch.empty_like(q)), AttentionArguments(q, k, k, torch.empty_like(q))
    dense.check_memory()
    wide.check_memory()
    assert dense.problem_key() != wide.problem_key()


def test_an_output_meeting_another_operand_is_refused_and_q_itself_is_taken():
    """Other query tiles still read k and v while one writes its output: an output over k, v or
    part of q is refused by name, as is an lse over any operand and an output whose strides
    interleave; q itself (the same view, a fused projection's too) is written in place."""
    q, k, v = (torch.randn(1, 64, 8, 64) for _ in range(3))
    shared, out, wide = torch.randn(q.numel() + 64), torch.empty_like(q), torch.empty(q.numel() * 2)
    refused = [
        ("operand out: overlaps k", (q, k, v, k)),
        ("operand out: overlaps v", (q, k, v, v)),
        ("operand out: overlaps k", (q, q, q, q)),
        ("operand out: overlaps q", (shared[:q.numel()].view(q.shape), k, v, shared[64:].view(q.shape))),
        ("operand lse: overlaps q", (q, k, v, out, q.flatten()[:512].view(1, 8, 64))),
        ("operand out: overlaps lse", (q, k, v, out, out.flatten()[:512].view(1, 8, 64))),
        ("operand out: elements overlap .*strides that interleave",
         (q, k, v, wide.as_strided(q.shape, (64 * 8 * 32, 8 * 32, 32, 1)))),
    ]
    for message, operands in refused:
        with pytest.raises(ValueError, match=message):
            AttentionArguments(*operands).check_memory()
    fused = torch.randn(1, 64, 24, 64)
    for operands in [(q, k, v, q), (fused[:, :, :8], fused[:, :, 8:16], fused[:, :, 16:], fused[:, :, :8]),
                     (q, k, v, out, torch.empty(1, 8, 64))]:
        AttentionArguments(*operands).check_memory()


def test_the_signature_ends_with_the_device_index():
    """The compile worker moves arguments to its device by rewriting the signature's last field."""
    q = torch.randn(2, 5, 4, 16)
    args = AttentionArguments(q, q, q, torch.empty_like(q))
    assert args.signature[-1] == args.device_index == -1


def test_torchs_sequence_by_sequence_varlen_ranks_behind_flashattention2s():
    """SDPA runs a packed batch one sequence at a time after reading the offsets on the host, so
    for variable length it ranks behind FlashAttention-2's varlen kernel; dense, ahead of it."""
    from kernel_api.providers.torch_ops.attention import TorchAttention
    kernels = {k.backend: k for k in TorchAttention.generate_kernels(
        lambda m: m.operands.q.dtype.name == "bf16", cc=90)}
    q = torch.empty(1000, 8, 128, dtype=torch.bfloat16, device="meta")
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    packed = AttentionArguments(q, q, q, torch.empty_like(q), None, causal=True, cu_seqlens_q=cu,
                                cu_seqlens_k=cu.clone(), max_seqlen_q=700, max_seqlen_k=700)
    dense_q = torch.empty(2, 500, 8, 128, dtype=torch.bfloat16, device="meta")
    dense = AttentionArguments(dense_q, dense_q, dense_q, torch.empty_like(dense_q), None, causal=True)
    for args, faster, slower in ((packed, "flash", "sdpa"), (dense, "sdpa", "flash")):
        assert kernels[faster].estimated_cost(args, 132) < kernels[slower].estimated_cost(args, 132)
