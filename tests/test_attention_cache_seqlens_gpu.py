"""Attention against a KV cache of per-row lengths (``cache_seqlens``) on a GPU: the CUDA C++
decode kernel and the torch provider against a float64 reference on fresh random data, outputs
inside sentinel-filled buffers; rows holding 0, 1, an odd number of keys and the whole cache in
one batch (ties, and batches past the kernel's longest-first ranking too); 1, 4 and 16 queries
(causal: each row's last query at its last key); MHA / GQA / MQA, head dims 64 and 128, bf16 and
f16; caches read through strided views; every split count; a decode loop whose cache grows in
place through ``ops.attention`` keeping one choice, its repeated calls replayed from C with the
lengths they pass, and in one CUDA graph captured once; PickBest verifying candidates with the
lengths; memcheck.
The CPU half is tests/test_attention_cache_seqlens.py."""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api import ops
from kernel_api.arguments.attention import AttentionArguments
from kernel_api.providers.cuda_src.kernels.attention_decode import SPLITS, CudaAttentionDecode
from kernel_api.providers.torch_ops.attention import TorchAttention

from memcheck import run_memcheck
from attention_buffers import TOL, check_out, out_in_sentinel
from test_attention_decode_gpu import decode_kernel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs a CUDA device of sm_90 or later")]

def _reference(q, k, v, lengths, causal, scale):
    """Row b attends to its first lengths[b] keys (its last query at key lengths[b] - 1 under the
    causal mask), in float64: each row on its own slice of the cache, GQA by repeating k and v,
    queries that see no key 0."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lq = q.shape[1]
    group = q.shape[2] // k.shape[2]
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        qd = q[b:b + 1].double()
        kd = k[b:b + 1, :n].double().repeat_interleave(group, dim=2)
        vd = v[b:b + 1, :n].double().repeat_interleave(group, dim=2)
        s = torch.einsum("blhd,bshd->bhls", qd, kd) * scale
        if causal:
            i = torch.arange(lq, device=q.device).view(-1, 1)
            j = torch.arange(n, device=q.device).view(1, -1)
            s = s.masked_fill(j > n - lq + i, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        out[b] = torch.einsum("bhls,bshd->blhd", p, vd)[0]
    return out


def _cache(batch, capacity, heads_kv, d, dtype, view):
    """A KV cache of ``capacity`` tokens a row: dense k and v, or views of a packed (batch,
    capacity + 5, 2, heads, d) cache (strided in the batch and seqlen dims)."""
    if view:
        packed = torch.randn(batch, capacity + 5, 2, heads_kv, d, device="cuda").to(dtype)
        return packed[:, :capacity, 0], packed[:, :capacity, 1]
    return (torch.randn(batch, capacity, heads_kv, d, device="cuda").to(dtype),
            torch.randn(batch, capacity, heads_kv, d, device="cuda").to(dtype))


def _lengths(values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


# (row lengths, seqlen_q, capacity, heads_q, heads_kv, head_dim, dtype, causal, strided views)
CASES = [
    ([1, 77, 1000, 0, 1000, 333], 1, 1000, 32, 8, 128, torch.bfloat16, False, True),
    ([1, 77, 1000, 0, 1000, 333], 1, 1000, 32, 8, 128, torch.bfloat16, True, False),
    ([4, 129, 4097, 3, 2048], 4, 4097, 16, 4, 128, torch.float16, True, True),    # rows shorter than their queries
    ([16, 1, 511, 64], 16, 511, 8, 1, 64, torch.float16, True, False),           # MQA: 128 rows, two row blocks
    ([257, 9, 300], 5, 300, 12, 4, 64, torch.bfloat16, False, True),
    ([4096, 1, 2049, 4095], 8, 4096, 32, 32, 128, torch.bfloat16, True, False),  # MHA, 8 queries
    ([(i * 7) % 50 + 100 for i in range(64)], 2, 160, 8, 2, 64, torch.float16, True, False),  # ties, longest first
    ([(i * 37) % 301 for i in range(130)], 1, 300, 8, 2, 64, torch.bfloat16, False, True),  # past the ranked rows
]


def _name(case):
    n, lq, cap, hq, hkv, d, dt, causal, view = case
    return (f"b{len(n)}_q{lq}_cap{cap}_h{hq}x{hkv}_d{d}_{str(dt)[6:]}{'_causal' if causal else ''}"
            f"{'_view' if view else ''}")


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_decode_kernel_against_float64(case):
    torch.manual_seed(len(case[0]) * 100 + case[1])
    lengths, lq, cap, hq, hkv, d, dtype, causal, view = case
    batch = len(lengths)
    q = torch.randn(batch, lq, hq, d, device="cuda").to(dtype)
    k, v = _cache(batch, cap, hkv, d, dtype, view)
    n = _lengths(lengths)
    out, buf = out_in_sentinel(q)
    args = AttentionArguments(q, k, v, out, causal=causal, cache_seqlens=n)
    kernel = decode_kernel(args)
    kernel.run(args)
    check_out(out, buf, _reference(q, k, v, lengths, causal, args.scale), dtype, _name(case))
    # the same arguments, other lengths written in place and fresh data: nothing recompiled
    grown = [min(cap, x + 3) for x in lengths]
    n.copy_(_lengths(grown))
    for t in (q, k, v):
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(dtype))
    kernel.run(args)
    torch.cuda.synchronize()
    check_out(out, buf, _reference(q, k, v, grown, causal, args.scale), dtype, _name(case) + " (grown)")


@pytest.mark.parametrize("splits", SPLITS)
def test_every_split_count_splits_each_row_alone(splits):
    torch.manual_seed(splits)
    dtype, lengths = torch.bfloat16, [1000, 1, 65, 0, 700]
    q = torch.randn(5, 3, 8, 128, device="cuda").to(dtype)
    k, v = _cache(5, 1000, 2, 128, dtype, True)
    out, buf = out_in_sentinel(q)
    args = AttentionArguments(q, k, v, out, causal=True, scale=0.3, cache_seqlens=_lengths(lengths))
    kernel = decode_kernel(args, splits)
    kernel.run(args)
    assert kernel.compile(args).extra.cl == splits
    check_out(out, buf, _reference(q, k, v, lengths, True, 0.3), dtype, f"splits={splits}")


def test_lengths_past_the_cache_are_clamped():
    torch.manual_seed(5)
    q = torch.randn(3, 1, 8, 64, device="cuda").to(torch.float16)
    k, v = _cache(3, 130, 2, 64, torch.float16, False)
    out, buf = out_in_sentinel(q)
    args = AttentionArguments(q, k, v, out, cache_seqlens=_lengths([500, -4, 130]))
    decode_kernel(args).run(args)
    check_out(out, buf, _reference(q, k, v, [130, 0, 130], False, args.scale), torch.float16, "clamped")


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_provider_against_float64(backend, causal):
    torch.manual_seed(7)
    dtype, lengths = torch.bfloat16, [1, 37, 0, 200, 129]
    q = torch.randn(5, 4, 16, 64, device="cuda").to(dtype)
    k, v = _cache(5, 200, 4, 64, dtype, True)
    out, buf = out_in_sentinel(q)
    args = AttentionArguments(q, k, v, out, causal=causal, cache_seqlens=_lengths(lengths))
    name = "TorchAttention_bf16_dense" + ("" if backend == "sdpa" else "_math")
    kernel = next(k for k in TorchAttention.generate_kernels(lambda m: m.kernel_name == name))
    assert kernel.supports(args), kernel_api.explain(args)
    kernel.run(args)
    check_out(out, buf, _reference(q, k, v, lengths, causal, args.scale), dtype, name)


@pytest.mark.parametrize("providers", ["cuda_src", None])
def test_a_growing_cache_through_ops_attention(providers):
    torch.manual_seed(11)
    dtype, cap = torch.bfloat16, 600
    k, v = _cache(4, cap, 8, 128, dtype, False)
    lengths = [1, 200, 511, 590]
    n = _lengths(lengths)
    ops.clear_dispatch_cache()
    with kernel_api.settings(providers=providers):
        for step in range(4):
            q = torch.randn(4, 1, 32, 128, device="cuda").to(dtype)
            out, buf = out_in_sentinel(q)
            assert ops.attention(q, k, v, causal=True, cache_seqlens=n, out=out) is out
            check_out(out, buf, _reference(q, k, v, lengths, True, 128 ** -0.5), dtype, f"step {step}")
            fresh = ops.attention(q, k, v, causal=True, cache_seqlens=n)
            torch.testing.assert_close(fresh.double(), _reference(q, k, v, lengths, True, 128 ** -0.5),
                                       atol=TOL[dtype], rtol=TOL[dtype])
            lengths = [x + 3 for x in lengths]
            n += 3  # (in place: the decode loop's next step)
    chosen = [kernel for problem, kernel in ops.chosen_kernels()
              if isinstance(problem[0], tuple) and problem[0][0] == "attention"]
    # one choice for the calls given out and one for the allocating ones, whatever the lengths
    assert 1 <= len(chosen) <= 2, chosen
    if providers == "cuda_src":
        assert all(isinstance(kernel, CudaAttentionDecode) for kernel in chosen)


def test_repeated_calls_replay_from_c_with_the_lengths_they_pass(monkeypatch):
    """A decode loop's calls after the first replay the recorded launch (no `Kernel.run`), the
    lengths read from the tensor each call passes: grown in place, or a new tensor each step
    (the call key holds its metadata and pointer alignment, as the made output's: at most a
    Python-path run per alignment class the allocator gives them)."""
    from kernel_api import native

    if native.entry() is None:
        pytest.skip(f"no native replay here: {native.why_not_entry()}")
    runs = []
    real = CudaAttentionDecode._run

    def counting(self, *rest, **named):
        runs.append(self.name)
        return real(self, *rest, **named)

    monkeypatch.setattr(CudaAttentionDecode, "_run", counting)
    torch.manual_seed(19)
    dtype, cap = torch.bfloat16, 1024
    k, v = _cache(8, cap, 8, 128, dtype, False)
    q = torch.randn(8, 1, 32, 128, device="cuda").to(dtype)
    lengths = [1, 64, 65, 300, 511, 1000, 7, 1023]
    n = _lengths(lengths)
    ops.clear_dispatch_cache()
    kept = []
    with kernel_api.settings(providers="cuda_src"):
        kept.append(ops.attention(q, k, v, cache_seqlens=n))
        for step in range(10):
            q.copy_(torch.randn_like(q, dtype=torch.float32).to(dtype))
            lengths = [x + 1 for x in lengths]
            if step % 2:
                n += 1  # grown in place
                given = n
            else:
                n.add_(1)
                given = n.clone()  # a new tensor of the same lengths
            got = ops.attention(q, k, v, cache_seqlens=given)
            kept.append((got, given))
            torch.cuda.synchronize()
            torch.testing.assert_close(got.double(), _reference(q, k, v, lengths, False, 128 ** -0.5),
                                       atol=TOL[dtype], rtol=TOL[dtype], msg=lambda m: f"step {step}: {m}")
    assert len(runs) <= 3, runs


def test_pick_best_verifies_every_candidate_with_the_lengths(tmp_path):
    """PickBest checks each candidate against the arguments' float64 reference, which reads the
    lengths: the decode kernel and the torch provider's verify, and the winner is right."""
    from kernel_api.tuning.policies import PickBest
    from kernel_api.tuning.records import TuningRecords

    torch.manual_seed(17)
    dtype, lengths = torch.bfloat16, [3, 1000, 0, 517]
    q = torch.randn(4, 2, 32, 128, device="cuda").to(dtype)
    k, v = _cache(4, 1024, 8, 128, dtype, False)
    out = torch.empty_like(q)
    args = AttentionArguments(q, k, v, out, causal=True, cache_seqlens=_lengths(lengths))
    with kernel_api.settings(providers=["cuda_src", "torch"]):
        result = PickBest(num_workers=1, repeat=10, settle_ms=20.0, records=TuningRecords(tmp_path / "t.sqlite")) \
            .tune(args)
    verified = {m.kernel_name for m in result.measurements if m.failure is None and m.median_ms is not None}
    assert {"CudaAttentionDecode_bf16_d128", "TorchAttention_bf16_dense"} <= verified, result.measurements
    result.winner.run(args)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.double(), _reference(q, k, v, lengths, True, args.scale), atol=TOL[dtype],
                               rtol=TOL[dtype])


def test_a_cuda_graph_replays_a_growing_cache():
    """The lengths are read on the device: one captured call serves every later step, its lengths
    updated in place."""
    torch.manual_seed(13)
    dtype, cap = torch.float16, 700
    k, v = _cache(3, cap, 2, 64, dtype, True)
    q = torch.randn(3, 4, 8, 64, device="cuda").to(dtype)
    lengths = [5, 300, 640]  # (the last step's 691 keys stay inside the 700-token cache)
    n = _lengths(lengths)
    out, buf = out_in_sentinel(q)
    with kernel_api.settings(providers="cuda_src"):
        ops.attention(q, k, v, causal=True, cache_seqlens=n, out=out)  # (chooses and compiles outside the capture)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ops.attention(q, k, v, causal=True, cache_seqlens=n, out=out)
    for step in range(3):
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(dtype))
        lengths = [x + 17 for x in lengths]
        n += 17
        graph.replay()
        torch.cuda.synchronize()
        check_out(out, buf, _reference(q, k, v, lengths, True, 64 ** -0.5), dtype, f"graph replay {step}")


def test_memcheck():
    code = r"""
import torch
from kernel_api.arguments.attention import AttentionArguments
from kernel_api.providers.cuda_src.kernels.attention_decode import CudaAttentionDecode
torch.manual_seed(0)
n = 0
for lengths, lq, cap, hq, hkv, d, splits, causal in (([1000, 1, 0, 77], 3, 1000, 8, 2, 128, 4, True),
                                                      ([1, 16, 9000, -3], 16, 31, 8, 1, 64, None, True),
                                                      ([4097], 1, 4097, 4, 4, 128, 8, False)):
    b = len(lengths)
    cache = torch.randn(b, cap, 2, hkv, d, device="cuda").to(torch.bfloat16)
    k, v = cache[:, :, 0], cache[:, :, 1]
    q = torch.randn(b, lq, hq, d, device="cuda").to(torch.bfloat16)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    args = AttentionArguments(q, k, v, torch.empty_like(q), causal=causal, cache_seqlens=lens)
    for kern in CudaAttentionDecode.generate_kernels(None, cc=90):
        if kern.supports(args):
            kern.splits = splits
            kern.run(args); kern.run(args); n += 1
torch.cuda.synchronize()
print("launched", n)
"""
    out = run_memcheck(code)
    assert "launched 3" in out
