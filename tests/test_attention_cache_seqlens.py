"""Attention against a KV cache of per-row lengths (`AttentionArguments`' ``cache_seqlens``)
without a GPU: the arguments and their one-line errors, the problem key (the lengths' values
never in it), which kernels take the lengths and what `explain` says of the others, the torch
provider through ``ops.attention`` on the CPU against a float64 reference (rows of length 0, 1,
odd and the full cache, 1 to 16 queries, GQA, causal), and no gradient through it. The front door
launches on CPU tensors because the tests add "cpu" to `dispatch.LAUNCH_DEVICE_TYPES`. The GPU
half is tests/test_attention_cache_seqlens_gpu.py."""

from __future__ import annotations

import math

import pytest
import torch

import kernel_api
from kernel_api import ops
from kernel_api.arguments import AttentionArguments
from kernel_api.arguments.attention_backward import AttentionBackwardArguments
from kernel_api.arguments.attention_math import attention_with_lse, cache_mask, torch_attention

from test_attention_op import SENTINEL, cpu_launch  # noqa: F401 - cpu_launch: a fixture


def reference(q, k, v, lengths, causal=False, scale=None):
    """Row b attends to its first lengths[b] keys, its last query at key lengths[b] - 1 under the
    causal mask; float64, GQA by head mapping, rows that see no key 0. Written per row and
    query, independently of `cache_mask`."""
    q, k, v = q.double(), k.double(), v.double()
    batch, sq, hq, d = q.shape
    hk = k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(batch, sq, hq, d, dtype=torch.float64)
    for b in range(batch):
        n = max(0, min(int(lengths[b]), k.shape[1]))
        for h in range(hq):
            kv = h // (hq // hk)
            for i in range(sq):
                last = n - sq + i if causal else n - 1
                if last < 0:
                    continue
                s = k[b, :last + 1, kv] @ q[b, i, h] * scale
                out[b, i, h] = torch.softmax(s, -1) @ v[b, :last + 1, kv]
    return out


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _lengths(*values, device="meta"):
    return torch.tensor(values, dtype=torch.int32).to(device)


def _args(batch=4, lq=1, cache=1024, hq=32, hkv=8, d=128, lengths=None, **kw):
    q, k = _meta(batch, lq, hq, d), _meta(batch, cache, hkv, d)
    lengths = torch.empty(batch, dtype=torch.int32, device="meta") if lengths is None else lengths
    return AttentionArguments(q, k, k, _meta(batch, lq, hq, d), cache_seqlens=lengths, **kw)


# ---- arguments ---------------------------------------------------------------------------------

def test_arguments_keep_the_lengths_and_say_so():
    lengths = torch.empty(4, dtype=torch.int32, device="meta")
    args = _args(lengths=lengths)
    assert args.cache_seqlens is lengths and args.seqlen_k == 1024
    assert "cache_seqlens=given" in repr(args)
    assert "cache_seqlens" not in repr(_plain())
    # an operand (a recorded launch takes it as a tensor), after the output
    assert list(args.tensor_attributes) == ["q", "k", "v", "out", "cache_seqlens"]
    assert args.tensor_attributes["cache_seqlens"].dtype.name == "i32"


def _plain(batch=4, cache=1024):
    q, k = _meta(batch, 1, 32, 128), _meta(batch, cache, 8, 128)
    return AttentionArguments(q, k, k, _meta(batch, 1, 32, 128))


def test_the_problem_key_holds_no_value():
    q, k, out = torch.zeros(2, 1, 4, 64), torch.zeros(2, 100, 2, 64), torch.zeros(2, 1, 4, 64)
    on_cpu = [AttentionArguments(q, k, k, out, cache_seqlens=_lengths(*n, device="cpu"))
              for n in ((1, 100), (57, 3), (0, 0))]
    assert len({a.problem_key() for a in on_cpu}) == 1
    # ...but the lengths being given is in it: a kernel that attends to the whole cache never serves it
    assert _args().problem_key() != _plain().problem_key()
    # and the cache's size through its bucket only, as for any key length
    assert _args(cache=1000).problem_key() == _args(cache=1024).problem_key()


@pytest.mark.parametrize("lengths,error,message", [
    (lambda: torch.empty(4, dtype=torch.int64, device="meta"), TypeError,
     "operand cache_seqlens: dtype torch.int64 but the cached lengths are torch.int32"),
    (lambda: torch.empty(5, dtype=torch.int32, device="meta"), ValueError,
     "operand cache_seqlens: shape (5,) but q's batch is 4 (expected (4,), one length per row)"),
    (lambda: torch.empty(4, 1, dtype=torch.int32, device="meta"), ValueError,
     "operand cache_seqlens: shape (4, 1) but q's batch is 4"),
    (lambda: torch.empty(4, dtype=torch.int32), ValueError, "operand cache_seqlens: on cpu but q is on meta"),
    (lambda: torch.empty(8, dtype=torch.int32, device="meta")[::2], ValueError,
     "operand cache_seqlens: must be contiguous, got stride 2"),
    (lambda: [3, 4, 5, 6], TypeError, "cache_seqlens"),
])
def test_bad_lengths_get_one_line_naming_them(lengths, error, message):
    with pytest.raises(error) as info:
        _args(lengths=lengths())
    text = str(info.value)
    assert message in text and "\n" not in text, text


def test_variable_length_takes_its_lengths_from_the_offsets():
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    q, k = torch.zeros(2, 4, 64), torch.zeros(30, 2, 64)
    with pytest.raises(ValueError, match="operand cache_seqlens: with the dense layout only"):
        AttentionArguments(q, k, k, torch.zeros_like(q), cu_seqlens_q=cu, cu_seqlens_k=torch.tensor(
            [0, 10, 30], dtype=torch.int32), cache_seqlens=_lengths(10, 20, device="cpu"))


def test_the_backward_takes_none():
    assert AttentionBackwardArguments.cache_seqlens is None


# ---- kernels -----------------------------------------------------------------------------------

def _names(args, provider):
    return sorted(k.metadata.kernel_name for k in kernel_api.get_kernels(args, cc=90, providers=provider))


def test_which_kernels_take_the_lengths():
    args = _args()
    assert _names(args, "cuda_src") == ["CudaAttentionDecode_bf16_d128"]
    assert _names(args, "torch") == ["TorchAttention_bf16_dense", "TorchAttention_bf16_dense_math"]


def test_explain_names_the_lengths_for_kernels_that_cannot_take_them():
    text = kernel_api.explain(_args(), cc=90).all()
    for name in ("TorchAttention_bf16_dense_cudnn", "TorchAttention_bf16_dense_flash"):
        line = next(line for line in text.splitlines() if name in line)
        assert "operand cache_seqlens: the kernel reads no per-row KV cache lengths" in line, line


# ---- the torch provider through ops.attention on the CPU --------------------------------------

# (batch lengths, seqlen_q, cache size, heads q/kv, causal)
CASES = [
    ((1, 37, 64, 0), 1, 64, (8, 2), False),
    ((1, 37, 64, 0), 1, 64, (8, 2), True),
    ((5, 64, 1, 17), 4, 64, (4, 4), True),      # a row shorter than its queries: its first ones see nothing
    ((16, 9, 33), 16, 33, (6, 1), True),         # MQA, 16 queries
    ((3, 2), 5, 7, (2, 2), False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{'-'.join(map(str, c[0]))}_q{c[1]}_k{c[2]}_"
                                                      f"h{c[3][0]}x{c[3][1]}{'_causal' if c[4] else ''}")
def test_ops_attention_on_the_cpu_against_float64(cpu_launch, case):
    lengths, lq, cache, (hq, hkv), causal = case
    g = torch.Generator().manual_seed(len(lengths) * 7 + lq)
    batch, d = len(lengths), 16
    q = torch.randn(batch, lq, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(batch, cache, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(batch, cache, hkv, d, generator=g, dtype=torch.float64)
    n = _lengths(*lengths, device="cpu")
    buf = torch.full((batch, lq, hq + 2, d), SENTINEL, dtype=torch.float64)
    out = buf[:, :, 1:1 + hq]
    got = ops.attention(q, k, v, causal=causal, cache_seqlens=n, out=out)
    want = reference(q, k, v, lengths, causal)
    assert got is out
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    assert bool((buf[:, :, 0] == SENTINEL).all()) and bool((buf[:, :, -1] == SENTINEL).all())
    torch.testing.assert_close(ops.attention(q, k, v, causal=causal, cache_seqlens=n), want, atol=1e-10, rtol=1e-10)


def test_the_definitions_agree_with_the_reference():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 20, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    lengths = (20, 2, 11)
    n = _lengths(*lengths, device="cpu")
    for causal in (False, True):
        want = reference(q, k, v, lengths, causal, 0.3)
        torch.testing.assert_close(torch_attention(q, k, v, causal, 0.3, cache_seqlens=n), want)
        out, lse = attention_with_lse(q, k, v, causal, 0.3, cache_seqlens=n)
        torch.testing.assert_close(out, want)
        # row 1 holds 2 keys: under the causal mask its first two of 4 queries see none (-inf)
        assert lse.shape == (3, 4, 4) and bool(torch.isinf(lse[1, :, :2]).all()) == causal
    assert cache_mask(n, 4, 20, True).shape == (3, 1, 4, 20)
    assert cache_mask(n, 4, 20, True)[2, 0].sum(-1).tolist() == [8, 9, 10, 11]


def test_a_growing_cache_keeps_its_choice(cpu_launch):
    q, k = torch.randn(2, 1, 4, 16, dtype=torch.float64), torch.randn(2, 50, 2, 16, dtype=torch.float64)
    lengths, out = _lengths(3, 10, device="cpu"), torch.empty_like(q)
    for step in range(5):
        lengths += 1  # (in place, as a decode loop grows its cache)
        ops.attention(q, k, k, cache_seqlens=lengths, out=out)
        torch.testing.assert_close(out, reference(q, k, k, lengths.tolist()), atol=1e-10, rtol=1e-10)
        # (a new tensor of lengths each step, as a server batching requests makes them)
        ops.attention(q, k, k, cache_seqlens=lengths.clone() + 7, out=out)
        torch.testing.assert_close(out, reference(q, k, k, (lengths + 7).tolist()), atol=1e-10, rtol=1e-10)
    chosen = [problem for problem, _ in ops.chosen_kernels()
              if isinstance(problem[0], tuple) and problem[0][0] == "attention"]
    assert len(chosen) == 1, chosen


def test_no_gradient_through_a_kv_cache(cpu_launch):
    q = torch.randn(2, 1, 4, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 50, 2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="cache_seqlens: attention against a KV cache has no backward"):
        ops.attention(q, k, k, cache_seqlens=_lengths(3, 10, device="cpu"))
    with torch.no_grad():
        assert ops.attention(q, k, k, cache_seqlens=_lengths(3, 10, device="cpu")).shape == q.shape


def test_the_reference_a_tuner_verifies_with_reads_the_lengths():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 2, 4, 8, generator=g, dtype=torch.float16)
    k, v = (torch.randn(3, 30, 2, 8, generator=g, dtype=torch.float16) for _ in range(2))
    lengths = (30, 0, 7)
    args = AttentionArguments(q, k, v, torch.empty_like(q), causal=True, cache_seqlens=_lengths(*lengths, device="cpu"))
    got = args.reference_outputs()["out"]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, reference(q, k, v, lengths, True))
    with_lse = AttentionArguments(q, k, v, torch.empty_like(q), torch.empty(3, 4, 2), causal=True,
                                  cache_seqlens=_lengths(*lengths, device="cpu")).reference_outputs()
    torch.testing.assert_close(with_lse["out"].double(), reference(q, k, v, lengths, True))
    assert bool(torch.isinf(with_lse["lse"][1]).all()) and bool(torch.isfinite(with_lse["lse"][0]).all())


def test_traced_and_compiled_calls_take_the_lengths_as_an_input(cpu_launch):
    from torch.fx.experimental.proxy_tensor import make_fx

    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 3, 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 40, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))

    def step(a, b, c, n):
        return ops.attention(a, b, c, causal=True, cache_seqlens=n)

    graph = make_fx(step, tracing_mode="fake")(q, k, v, _lengths(9, 40, device="cpu"))
    assert "kernel_api.attention" in graph.code
    compiled = torch.compile(step, fullgraph=True)
    for lengths in ((9, 40), (2, 17)):  # (other values, same graph)
        n = _lengths(*lengths, device="cpu")
        want = reference(q, k, v, lengths, True)
        torch.testing.assert_close(graph(q, k, v, n), want, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(compiled(q, k, v, n), want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("lse", [False, True])
def test_each_torch_instance_that_takes_the_lengths(backend, lse):
    from kernel_api.providers.torch_ops.attention import TorchAttention

    g = torch.Generator().manual_seed(13)
    q = torch.randn(3, 2, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 25, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    lengths = (25, 1, 0)
    out = torch.full_like(q, SENTINEL)
    args = AttentionArguments(q, k, v, out, torch.empty(3, 4, 2, dtype=torch.float32) if lse else None, causal=True,
                              cache_seqlens=_lengths(*lengths, device="cpu"))
    name = "TorchAttention_f64_dense" + ("" if backend == "sdpa" else "_math")
    kernel = next(k for k in TorchAttention.generate_kernels(lambda m: m.kernel_name == name))
    if lse and backend == "sdpa":
        assert not kernel.supports(args)  # (SDPA writes no log-sum-exp)
        return
    kernel._run(args, None, None)  # (the launch `Kernel.run` makes, which refuses CPU tensors)
    torch.testing.assert_close(out, reference(q, k, v, lengths, True), atol=1e-10, rtol=1e-10)
    if lse:
        assert bool(torch.isinf(args.lse[2]).all()) and bool(torch.isfinite(args.lse[0]).all())
