"""kernel_api's Hopper attention forward (cutedsl: attention/sm90_attention.py) on an sm_90 GPU:
against the float64 definition on fresh random data, outputs inside sentinel-filled buffers,
odd sequence lengths (query and key lengths apart, fewer keys than queries under the causal mask),
MHA / GQA / MQA, head dims 64 and 128, bf16 and f16, strided views, the row log-sum-exp, every
plan (128- and 192-row tiles, persistent or a CTA per tile); then
through `kernel_api.ops.attention` with only the CuTe DSL provider allowed (repeated calls
replayed on new data), and memcheck. Variable-length batches the same way: empty sequences,
queries against no keys, odd lengths, query sequences longer and shorter than their keys, one
long sequence among short ones, outputs and lse inside buffers with sentinel rows after them
(no row written past the last sequence's end) and a slow sequence before a fast one (a store past
a sequence's end would land on the next sequence's finished rows). The CPU half is
tests/test_sm90_attention.py.
"""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api import ops
from kernel_api.arguments.attention import AttentionArguments
from kernel_api.providers.cutedsl.attention.sm90_attention import Sm90Attention

from attention_buffers import SENTINEL, TOL, out_in_sentinel, outside_untouched
from memcheck import run_memcheck

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                 reason="needs an sm_90 GPU")]


def _tensor(batch, seqlen, heads, d, dtype, view):
    """Fresh (batch, seqlen, heads, d) data: dense, or a view of a fused projection's output whose
    heads sit between others (strided seqlen and batch dims)."""
    if view:
        fused = torch.randn(batch, seqlen, heads + 3, d, device="cuda").to(dtype)
        return fused[:, :, 2:2 + heads]
    return torch.randn(batch, seqlen, heads, d, device="cuda").to(dtype)


def _kernel(args):
    found = [k for k in Sm90Attention.generate_kernels(None, cc=90) if k.supports(args)]
    assert len(found) == 1, kernel_api.explain(args)
    return found[0]


def _check(args, buf, what, untouched=outside_untouched):
    ref = args.reference_outputs()
    tol = TOL[args.q.dtype]
    torch.testing.assert_close(args.out.double(), ref["out"], atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")
    assert untouched(buf), f"{what}: the kernel wrote outside its output"
    if args.lse is not None:
        got, want = args.lse.double(), ref["lse"].double()
        empty = torch.isinf(want)  # rows that see no key: -inf, or +inf as FlashAttention-2 writes
        assert bool(torch.isinf(got[empty]).all()), f"{what}: a row without keys has a finite lse"
        torch.testing.assert_close(got[~empty], want[~empty], atol=1e-3, rtol=1e-4, msg=lambda m: f"{what} lse: {m}")


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, causal, strided views, lse)
CASES = [
    (2, 1000, 1000, 8, 2, 128, torch.bfloat16, True, False, True),
    (2, 1000, 1000, 8, 2, 64, torch.float16, True, False, False),
    (1, 77, 300, 4, 4, 64, torch.float16, True, True, True),       # fewer queries than keys: the last ones
    (1, 300, 77, 4, 1, 128, torch.bfloat16, True, False, True),    # more queries: the first 223 see no key
    (3, 1, 129, 8, 2, 64, torch.bfloat16, False, False, False),
    (2, 129, 129, 6, 3, 64, torch.float16, False, True, True),
    (2, 513, 1031, 4, 2, 128, torch.float16, False, False, False),
    (1, 4097, 4097, 2, 1, 128, torch.bfloat16, True, True, True),  # MQA, one ragged last block
    (4, 17, 5, 2, 2, 128, torch.bfloat16, False, False, True),     # a key block mostly past the keys
    (2, 256, 256, 4, 2, 64, torch.bfloat16, False, False, True),   # whole tiles only
    (1, 2000, 2000, 4, 2, 64, torch.bfloat16, True, False, True),  # long causal: 192-row tiles, a CTA each
    (8, 1024, 1024, 16, 4, 64, torch.bfloat16, True, False, True),  # 1024 tiles: each persistent CTA loops
    (8, 1024, 300, 16, 4, 128, torch.float16, True, True, True),  # ... over tiles that see no key, too
    (1, 3000, 1000, 4, 2, 64, torch.bfloat16, True, False, True),  # 192-row tiles, a CTA each: 2000 rows see no key
    (1, 2000, 5000, 4, 1, 128, torch.float16, True, False, True),  # 128-row tiles, a CTA each, 3000 keys before
    (2, 100, 256, 4, 2, 64, torch.bfloat16, True, False, True),    # persistent causal, whole key blocks only
]


def _name(case):
    b, lq, lk, hq, hkv, d, dt, causal, view, lse = case
    return (f"b{b}_q{lq}_k{lk}_h{hq}x{hkv}_d{d}_{str(dt)[6:]}{'_causal' if causal else ''}"
            f"{'_view' if view else ''}{'_lse' if lse else ''}")


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_kernel_run_against_float64(case):
    torch.manual_seed(0)
    b, lq, lk, hq, hkv, d, dtype, causal, view, with_lse = case
    q = _tensor(b, lq, hq, d, dtype, view)
    k, v = _tensor(b, lk, hkv, d, dtype, view), _tensor(b, lk, hkv, d, dtype, view)
    out, buf = out_in_sentinel(q)
    lse = torch.full((b, hq, lq), SENTINEL, device="cuda") if with_lse else None
    args = AttentionArguments(q, k, v, out, lse, causal=causal)
    kernel = _kernel(args)
    kernel.run(args)
    _check(args, buf, _name(case))
    # the same arguments again (the bound launch) on new data written in place
    for t in (q, k, v):
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(dtype))
    kernel.run(args)
    torch.cuda.synchronize()
    _check(args, buf, _name(case) + " (again)")


def test_scale_is_honoured():
    torch.manual_seed(2)
    q = _tensor(1, 200, 4, 64, torch.bfloat16, False)
    k, v = _tensor(1, 200, 2, 64, torch.bfloat16, False), _tensor(1, 200, 2, 64, torch.bfloat16, False)
    out, buf = out_in_sentinel(q)
    args = AttentionArguments(q, k, v, out, causal=True, scale=0.3)
    _kernel(args).run(args)
    _check(args, buf, "scale 0.3")


def test_no_keys_gives_zero_rows():
    """Without keys every row is 0 and its lse -inf, written on the launch's stream: a side stream
    busy for tens of milliseconds first, so the zeros land after a fill of 7 that the current
    stream runs at once (zeros written on the current stream would come before it)."""
    q = _tensor(2, 5, 4, 64, torch.bfloat16, False)
    k = torch.empty(2, 0, 4, 64, device="cuda", dtype=torch.bfloat16)
    (out, buf), lse = out_in_sentinel(q), torch.zeros(2, 4, 5, device="cuda")
    args = AttentionArguments(q, k, k, out, lse)
    kernel = _kernel(args)
    kernel.run(args)  # (compiles: the timed run below must launch at once, within the side stream's sleep)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
    kernel.run(args, stream=side)
    out.fill_(7.0)
    lse.fill_(7.0)
    torch.cuda.synchronize()
    assert bool((out == 0).all()) and bool(torch.isinf(lse).all()) and outside_untouched(buf)


def test_misaligned_operand_is_declined_by_name():
    base = torch.randn(2 * 100 * 4 * 64 + 1, device="cuda").to(torch.bfloat16)
    q = base[1:].view(2, 100, 4, 64)  # a pointer 2 bytes past a 16-byte boundary
    k = _tensor(2, 100, 4, 64, torch.bfloat16, False)
    args = AttentionArguments(q, k, k, torch.empty_like(k))
    verdicts = {k.metadata.kernel_name: k.supports(args) for k in Sm90Attention.generate_kernels(None, cc=90)}
    assert not any(verdicts.values())
    assert "operand q" in verdicts["Sm90Attention_bf16_d64"].error  # (the instance that fits but for alignment)


@pytest.mark.parametrize("causal", [False, True])
def test_ops_attention_with_only_this_provider(causal, monkeypatch):
    from kernel_api.ops import dispatch

    python_path = []
    launch = dispatch._launch
    monkeypatch.setattr(dispatch, "_launch", lambda *a, **kw: python_path.append(a[0]) or launch(*a, **kw))
    torch.manual_seed(1)
    dtype = torch.bfloat16
    q = _tensor(2, 333, 8, 128, dtype, False)
    k, v = _tensor(2, 333, 2, 128, dtype, True), _tensor(2, 333, 2, 128, dtype, True)
    out, buf = out_in_sentinel(q)
    with kernel_api.settings(providers="cutedsl"):
        for step in range(3):  # the first call chooses and records, the next ones replay it
            for t in (q, k, v):
                t.copy_(torch.randn_like(t, dtype=torch.float32).to(dtype))
            buf.fill_(SENTINEL)
            got = ops.attention(q, k, v, causal=causal, out=out)
            assert got is out
            _check(AttentionArguments(q, k, v, out, causal=causal), buf, f"ops.attention step {step}")
            assert len(python_path) == 1, f"step {step}: a repeated call took the Python path"
        fresh = ops.attention(q, k, v, causal=causal)  # allocating
        want = AttentionArguments(q, k, v, fresh, causal=causal).reference_outputs()["out"]
        torch.testing.assert_close(fresh.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    chosen = [kernel for problem, kernel in ops.chosen_kernels()
              if isinstance(problem[0], tuple) and problem[0][0] == "attention"]
    assert chosen and any(isinstance(kernel, Sm90Attention) for kernel in chosen)


def test_persistent_ctas_loop_over_many_tiles(monkeypatch):
    """A persistent plan on three CTAs: each loops over tens of tiles (carried pipeline phases,
    the output tile's shared memory reused, and under the causal mask tiles that see no key,
    which the longest-first order puts last)."""
    from kernel_api.providers.cutedsl.attention import sm90_attention

    monkeypatch.setattr(sm90_attention, "planning_sm_count", lambda device: 3)
    torch.manual_seed(3)
    for lq, lk, d, causal in ((300, 300, 64, False), (500, 200, 128, True), (200, 700, 64, True)):
        q = _tensor(2, lq, 6, d, torch.bfloat16, False)
        k, v = _tensor(2, lk, 3, d, torch.bfloat16, True), _tensor(2, lk, 3, d, torch.bfloat16, True)
        out, buf = out_in_sentinel(q)
        args = AttentionArguments(q, k, v, out, torch.full((2, 6, lq), SENTINEL, device="cuda"), causal=causal)
        kernel = _kernel(args)
        assert kernel.plan(args).persistent_ctas == 3
        kernel.run(args)
        _check(args, buf, f"3 persistent CTAs, q{lq} k{lk} d{d}{' causal' if causal else ''}")


def sanitizer_head(ctas: int) -> str:
    """The start of a compute-sanitizer script: the imports, a seed, the launch count ``n``, and
    ``ctas`` CTAs in a persistent launch, so that each loops over several tiles."""
    return f"""
import torch
from kernel_api.arguments.attention import AttentionArguments
from kernel_api.providers.cutedsl.attention import sm90_attention
from kernel_api.providers.cutedsl.attention.sm90_attention import Sm90Attention
torch.manual_seed(0)
n = 0
sm90_attention.planning_sm_count = lambda device: {ctas}
def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
"""


#: The end of a sanitizer script's loop over problems: every instance that takes ``args`` runs it
#: twice (the second replays), then the count is printed.
MEMCHECK_RUN = r"""
    for kern in Sm90Attention.generate_kernels(None, cc=90):
        if kern.supports(args):
            kern.run(args); kern.run(args); n += 1
torch.cuda.synchronize()
print("launched", n)
"""


def test_memcheck():
    code = sanitizer_head(5) + r"""
for b, lq, lk, hq, hkv, d, causal, lse in ((2, 300, 77, 4, 2, 128, True, True), (1, 77, 300, 4, 1, 64, True, False),
                                          (3, 129, 513, 6, 3, 64, False, True), (1, 5, 17, 2, 2, 128, False, False)):
    q = torch.randn(b, lq, hq, d, device="cuda").to(torch.bfloat16)
    k = torch.randn(b, lk, hkv, d, device="cuda").to(torch.bfloat16)
    v = torch.randn(b, lk, hkv, d, device="cuda").to(torch.bfloat16)
    l = torch.empty(b, hq, lq, device="cuda") if lse else None
    args = AttentionArguments(q, k, v, torch.empty_like(q), l, causal=causal)
""" + MEMCHECK_RUN
    out = run_memcheck(code)
    assert "launched 4" in out


def test_racecheck_on_persistent_ctas():
    """Shared memory hazards (the Q and output tiles reused across a persistent CTA's tiles, the
    K/V rings) under compute-sanitizer's racecheck, on three CTAs looping over several tiles."""
    code = sanitizer_head(3) + r"""
for lq, lk, d, causal in ((300, 300, 64, False), (200, 260, 128, True)):
    q = torch.randn(1, lq, 4, d, device="cuda").to(torch.bfloat16)
    k = torch.randn(1, lk, 2, d, device="cuda").to(torch.bfloat16)
    v = torch.randn(1, lk, 2, d, device="cuda").to(torch.bfloat16)
    args = AttentionArguments(q, k, v, torch.empty_like(q), torch.empty(1, 4, lq, device="cuda"), causal=causal)
""" + MEMCHECK_RUN
    out = run_memcheck(code, tool="racecheck")
    assert "launched 2" in out


# ---- variable length

#: Sentinel rows after a packed output and after its lse.
EXTRA_ROWS = 200


def _packed(lengths, heads, d, dtype, view):
    """Fresh packed (sum(lengths), heads, d) data: dense, or a view of a fused projection's output
    whose heads sit between others (a row stride of heads + 3 heads)."""
    total = sum(lengths)
    if view:
        return torch.randn(total, heads + 3, d, device="cuda").to(dtype)[:, 2:2 + heads]
    return torch.randn(total, heads, d, device="cuda").to(dtype)


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _packed_out_in_sentinel(q):
    """(out, buffer): out of q's shape inside a sentinel-filled buffer with a head on either side
    and `EXTRA_ROWS` rows after the last sequence."""
    total, h, d = q.shape
    buf = torch.full((total + EXTRA_ROWS, h + 2, d), SENTINEL, dtype=q.dtype, device=q.device)
    return buf[:total, 1:1 + h], buf


def _packed_untouched(buf) -> bool:
    """Whether the heads around a packed output and the rows after it still hold the sentinel."""
    return bool((buf[:, 0] == SENTINEL).all()) and bool((buf[:, -1] == SENTINEL).all()) and \
        bool((buf[-EXTRA_ROWS:] == SENTINEL).all())


def _varlen_args(lengths_q, lengths_k, hq, hkv, d, dtype, causal, view, with_lse):
    """Fresh variable-length arguments: out in `_packed_out_in_sentinel`, the lse (heads_q,
    total_q) at the head of a sentinel-filled buffer `EXTRA_ROWS` values longer. Returns (args,
    out buffer, lse buffer or None)."""
    q = _packed(lengths_q, hq, d, dtype, view)
    k, v = _packed(lengths_k, hkv, d, dtype, view), _packed(lengths_k, hkv, d, dtype, view)
    out, buf = _packed_out_in_sentinel(q)
    lse = lse_buf = None
    if with_lse:
        lse_buf = torch.full((hq * q.shape[0] + EXTRA_ROWS,), SENTINEL, device="cuda")
        lse = lse_buf[:hq * q.shape[0]].view(hq, q.shape[0])
    args = AttentionArguments(q, k, v, out, lse, causal=causal, cu_seqlens_q=_offsets(lengths_q),
                              cu_seqlens_k=_offsets(lengths_k), max_seqlen_q=max(lengths_q),
                              max_seqlen_k=max(lengths_k))
    return args, buf, lse_buf


def _check_varlen(args, buf, lse_buf, what):
    _check(args, buf, what, _packed_untouched)
    if lse_buf is not None:
        assert bool((lse_buf[-EXTRA_ROWS:] == SENTINEL).all()), f"{what}: the kernel wrote past the lse"


_RAGGED_Q = [100, 30, 0, 257, 3, 65]
_RAGGED_K = [4000, 5, 17, 300, 0, 64]   # (the first, slow sequence's last tile covers the second's rows)
_MANY_Q = [int(n) for n in torch.randint(0, 71, (40,), generator=torch.Generator().manual_seed(5))]
_MANY_K = [int(n) for n in torch.randint(0, 91, (40,), generator=torch.Generator().manual_seed(6))]

# (lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, causal, strided views, lse); the plans
# (132 SMs): up to 1024 queries causal, and full attention, persistent; 192-row tiles at head dim 64
# but for short causal problems
VARLEN_CASES = [
    (_RAGGED_Q, _RAGGED_K, 8, 2, 128, torch.bfloat16, True, False, True),    # 128 rows, persistent
    (_RAGGED_Q, _RAGGED_K, 4, 4, 64, torch.float16, False, True, True),      # 192 rows, persistent
    (_RAGGED_Q, _RAGGED_K, 6, 3, 64, torch.bfloat16, True, False, False),    # 128 rows, persistent
    ([5, 3000, 1, 64, 0, 129], [7, 2500, 1, 64, 9, 1], 4, 1, 64, torch.bfloat16, True, False, True),  # 192, a CTA each
    ([5, 3000, 1, 64, 0, 129], [7, 2500, 1, 64, 9, 1], 4, 4, 128, torch.float16, False, True, True),  # 128, persistent
    ([1500, 700, 2], [1500, 701, 2000], 8, 2, 128, torch.bfloat16, True, True, True),  # 128 rows, a CTA per tile
    ([1500, 700, 2], [1500, 701, 2000], 8, 2, 128, torch.float16, True, False, False),
    ([192, 191, 193, 0, 385], [192, 1, 193, 2, 385], 6, 2, 64, torch.float16, False, True, True),
    ([0, 0, 4], [3, 0, 0], 4, 2, 128, torch.bfloat16, True, False, True),    # the one query sequence has no key
    ([2, 3], [0, 0], 4, 2, 64, torch.bfloat16, False, False, True),         # no key at all
    (_MANY_Q, _MANY_K, 8, 1, 128, torch.bfloat16, False, False, True),       # MQA, 40 short sequences
    (_MANY_Q, _MANY_K, 8, 1, 64, torch.float16, True, True, True),
]


def _varlen_name(case):
    lq, lk, hq, hkv, d, dt, causal, view, lse = case
    return (f"q{len(lq)}x{max(lq)}_k{max(lk)}_h{hq}x{hkv}_d{d}_{str(dt)[6:]}{'_causal' if causal else ''}"
            f"{'_view' if view else ''}{'_lse' if lse else ''}")


@pytest.mark.parametrize("case", VARLEN_CASES, ids=_varlen_name)
def test_varlen_kernel_run_against_float64(case):
    torch.manual_seed(0)
    args, buf, lse_buf = _varlen_args(*case)
    kernel = _kernel(args)
    assert kernel.varlen
    kernel.run(args)
    _check_varlen(args, buf, lse_buf, _varlen_name(case))
    # again on new data written in place
    for t in (args.q, args.k, args.v):
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
    kernel.run(args)
    torch.cuda.synchronize()
    _check_varlen(args, buf, lse_buf, _varlen_name(case) + " (again)")


def test_varlen_persistent_ctas_loop_over_many_tiles(monkeypatch):
    """A persistent plan on three CTAs over variable-length batches: each CTA loops over tens of
    tiles, many of them past their sequence's end (skipped by the producer and the consumers
    alike, so the pipelines stay in phase), the output tile's shared memory reused."""
    from kernel_api.providers.cutedsl.attention import sm90_attention

    monkeypatch.setattr(sm90_attention, "planning_sm_count", lambda device: 3)
    torch.manual_seed(4)
    for lq, lk, d, causal in ((_RAGGED_Q, _RAGGED_K, 64, False), (_MANY_Q, _MANY_K, 128, True),
                              ([600, 0, 1, 300], [200, 5, 0, 900], 64, True)):
        args, buf, lse_buf = _varlen_args(lq, lk, 6, 3, d, torch.bfloat16, causal, True, True)
        kernel = _kernel(args)
        assert kernel.plan(args).persistent_ctas == 3
        kernel.run(args)
        _check_varlen(args, buf, lse_buf, f"3 persistent CTAs, q{max(lq)} k{max(lk)} d{d}{' causal' if causal else ''}")


@pytest.mark.parametrize("lengths_q, lengths_k, d, causal", [
    (_RAGGED_Q, _RAGGED_K, 128, True),                                    # 128 rows, persistent
    ([5, 3000, 1, 64, 0, 129], [7, 2500, 1, 64, 9, 1], 64, True),        # 192 rows, a CTA per tile
    ([192, 191, 193, 0, 385], [192, 1, 193, 2, 385], 64, False),          # 192 rows, persistent
], ids=["d128_causal_persistent", "d64_causal_a_cta_per_tile", "d64_full_persistent"])
def test_varlen_writes_nothing_past_a_sequences_end(lengths_q, lengths_k, d, causal):
    """The first b + 1 sequences of the packed tensors, the rest of the rows left out of the
    offsets: every output and lse row from the (b + 1)-th sequence's end on keeps the sentinel
    (deterministic, where a later sequence's own store could hide a stray write)."""
    torch.manual_seed(2)
    args, buf, lse_buf = _varlen_args(lengths_q, lengths_k, 4, 2, d, torch.bfloat16, causal, False, True)
    ends = _offsets(lengths_q).tolist()[1:]
    for b in range(len(lengths_q) - 1):
        buf.fill_(SENTINEL)
        lse_buf.fill_(SENTINEL)
        prefix = AttentionArguments(args.q, args.k, args.v, args.out, args.lse, causal=causal,
                                    cu_seqlens_q=args.cu_seqlens_q[:b + 2], cu_seqlens_k=args.cu_seqlens_k[:b + 2],
                                    max_seqlen_q=max(lengths_q[:b + 1]), max_seqlen_k=max(lengths_k[:b + 1]))
        _kernel(prefix).run(prefix)
        torch.cuda.synchronize()
        end = ends[b]
        assert bool((args.out[end:] == SENTINEL).all()), f"{b + 1} sequences: a write past row {end}"
        assert bool((args.lse[:, end:] == SENTINEL).all()), f"{b + 1} sequences: an lse write past row {end}"
        assert _packed_untouched(buf), f"{b + 1} sequences: a write outside the output"


@pytest.mark.parametrize("causal", [False, True])
def test_ops_attention_varlen_with_only_this_provider(causal):
    torch.manual_seed(1)
    lq, lk = [33, 0, 700, 5], [40, 3, 650, 0]
    q = _packed(lq, 8, 128, torch.bfloat16, False)
    k, v = _packed(lk, 2, 128, torch.bfloat16, True), _packed(lk, 2, 128, torch.bfloat16, True)
    cu_q, cu_k = _offsets(lq), _offsets(lk)
    out, buf = _packed_out_in_sentinel(q)
    with kernel_api.settings(providers="cutedsl"):
        for step in range(2):
            for t in (q, k, v):
                t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
            got = ops.attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq),
                                max_seqlen_k=max(lk), out=out)
            assert got is out
            _check(AttentionArguments(q, k, v, out, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      max_seqlen_q=max(lq), max_seqlen_k=max(lk)), buf, f"ops.attention step {step}",
                   _packed_untouched)
    chosen = [kernel for problem, kernel in ops.chosen_kernels()
              if isinstance(problem[0], tuple) and problem[0][0] == "attention"]
    assert any(isinstance(kernel, Sm90Attention) and kernel.varlen for kernel in chosen)


def test_memcheck_varlen():
    """Variable-length batches under memcheck, every tensor its own allocation: the last
    sequence's tiles reach past the packed tensors' ends (TMA loads fill zeros; stores are
    predicated), empty sequences and a query sequence without keys among them."""
    code = sanitizer_head(5) + r"""
for lq, lk, hq, hkv, d, causal, lse in (([100, 0, 257, 3], [300, 17, 5, 0], 4, 2, 128, True, True),
                                        ([1, 130, 0, 77], [129, 0, 64, 300], 4, 1, 64, True, False),
                                        ([200, 3, 385], [1, 2, 450], 6, 3, 64, False, True),
                                        ([2000, 5], [1900, 9], 2, 2, 128, True, True)):
    q = torch.randn(sum(lq), hq, d, device="cuda").to(torch.bfloat16)
    k = torch.randn(sum(lk), hkv, d, device="cuda").to(torch.bfloat16)
    v = torch.randn(sum(lk), hkv, d, device="cuda").to(torch.bfloat16)
    l = torch.empty(hq, sum(lq), device="cuda") if lse else None
    args = AttentionArguments(q, k, v, torch.empty_like(q), l, causal=causal, cu_seqlens_q=offsets(lq),
                              cu_seqlens_k=offsets(lk), max_seqlen_q=max(lq), max_seqlen_k=max(lk))
""" + MEMCHECK_RUN
    out = run_memcheck(code)
    assert "launched 4" in out


def test_memcheck_varlen_offsets_outside_the_tensors():
    """Offsets are trusted on the device (reading them would synchronise): ones past the packed
    tensors' ends, or decreasing, give wrong rows but no access outside the tensors (each sequence
    is clamped to them), under memcheck."""
    code = sanitizer_head(5) + r"""
bad = torch.tensor([0, 50, 10**6, 20], dtype=torch.int32, device="cuda")
for tokens_q, tokens_k, d, causal in ((100, 80, 128, True), (300, 7, 64, False)):
    q = torch.randn(tokens_q, 4, d, device="cuda").to(torch.bfloat16)
    k = torch.randn(tokens_k, 2, d, device="cuda").to(torch.bfloat16)
    v = torch.randn(tokens_k, 2, d, device="cuda").to(torch.bfloat16)
    args = AttentionArguments(q, k, v, torch.empty_like(q), torch.empty(4, tokens_q, device="cuda"), causal=causal,
                              cu_seqlens_q=bad, cu_seqlens_k=bad.flip(0).contiguous(), max_seqlen_q=tokens_q,
                              max_seqlen_k=tokens_k)
""" + MEMCHECK_RUN
    out = run_memcheck(code)
    assert "launched 2" in out


def test_racecheck_varlen_on_persistent_ctas():
    """Shared-memory hazards of the variable-length epilogue (the output tile stored from shared
    memory by the consumers, then reused by the CTA's next tile) under racecheck: three CTAs loop
    over tiles of which some lie past their sequence's end."""
    code = sanitizer_head(3) + r"""
for lq, lk, d, causal in (([300, 0, 77], [280, 5, 90], 64, False), ([200, 129], [260, 100], 128, True)):
    q = torch.randn(sum(lq), 4, d, device="cuda").to(torch.bfloat16)
    k = torch.randn(sum(lk), 2, d, device="cuda").to(torch.bfloat16)
    v = torch.randn(sum(lk), 2, d, device="cuda").to(torch.bfloat16)
    args = AttentionArguments(q, k, v, torch.empty_like(q), torch.empty(4, sum(lq), device="cuda"), causal=causal,
                              cu_seqlens_q=offsets(lq), cu_seqlens_k=offsets(lk), max_seqlen_q=max(lq),
                              max_seqlen_k=max(lk))
""" + MEMCHECK_RUN
    out = run_memcheck(code, tool="racecheck")
    assert "launched 2" in out
