"""Softmax for any row: peeled (any alignment) CUDA kernels, rows split across a cluster
(CudaSoftmaxSplit*), PickAny's ranking of them, and ops.softmax on any layout and dim.

CPU: discovery, support, naming, selection, the dispatch signature. GPU (@pytest.mark.gpu):
float64 references on fresh random data, outputs inside NaN-filled buffers whose margins must
stay untouched, for odd row lengths, misaligned base pointers and long rows, forward and
backward, all three dtypes."""

from __future__ import annotations

import math

import pytest
import torch

import kernel_api
from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments
from kernel_api.providers.cuda_src.kernels.softmax import CudaSoftmaxBackward, CudaSoftmaxForward
from kernel_api.providers.cuda_src.kernels.softmax_split import CudaSoftmaxSplitBackward, CudaSoftmaxSplitForward
from kernel_api.tuning.policies import rank_candidates

from memcheck import run_memcheck
from test_softmax import check_backward, check_forward, make_rows
from test_softmax import input_at as _input_at, margins_untouched as _margins_untouched, poisoned as _poisoned

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _names(kernels) -> list[str]:
    return [k.metadata.kernel_name for k in kernels]


# ---------------------------------------------------------------------------------- CPU
def test_split_instances_are_generated_for_sm90_only():
    fwd = _names(CudaSoftmaxSplitForward.generate_kernels(None, cc=90))
    bwd = _names(CudaSoftmaxSplitBackward.generate_kernels(None, cc=90))
    assert "CudaSoftmaxSplitForward_bf16_split_ept32_c4_peel8" in fwd
    assert "CudaSoftmaxSplitForward_f32_split_looped_c8_peel4" in fwd
    assert "CudaSoftmaxSplitBackward_f16_split_ept16_c2_peel8" in bwd
    assert len(fwd) == 3 * 7 and len(bwd) == 3 * 4
    assert not CudaSoftmaxSplitForward.generate_kernels(None, cc=80)  # clusters need sm_90


def test_peeled_instances_take_odd_rows_and_matching_misalignment():
    odd = torch.randn(4, 4097, dtype=torch.bfloat16)
    names = _names(kernel_api.get_kernels(SoftmaxArguments(odd, torch.empty_like(odd)), cc=90))
    assert "CudaSoftmaxForward_bf16_block_ept16_peel8" in names
    assert "CudaSoftmaxForward_bf16_block_ept16_a8" not in names
    # x and out one element past a 16-byte boundary, rows 4096 apart: one phase, peeled kernels take it
    xb, ob = torch.randn(4 * 4096 + 8, dtype=torch.bfloat16), torch.empty(4 * 4096 + 8, dtype=torch.bfloat16)
    x, out = xb[1:1 + 4 * 4096].view(4, 4096), ob[1:1 + 4 * 4096].view(4, 4096)
    names = _names(kernel_api.get_kernels(SoftmaxArguments(x, out), cc=90))
    assert "CudaSoftmaxForward_bf16_block_ept16_peel8" in names
    # out aligned but x not: no one split of a row serves both, only scalar kernels remain
    args = SoftmaxArguments(x, torch.empty(4, 4096, dtype=torch.bfloat16))
    kernels = kernel_api.get_kernels(args, cc=90)
    assert kernels and not any("peel" in n for n in _names(kernels))
    rejected = CudaSoftmaxForward.generate_kernels(None, cc=90)
    peel = next(k for k in rejected if k.metadata.kernel_name == "CudaSoftmaxForward_bf16_block_ept16_peel8")
    assert "different offsets from a 16-byte boundary" in peel.supports(args, 90).error


def test_signature_tells_whether_the_operands_rows_share_a_phase():
    """The dispatch cache is keyed by the signature: a peeled kernel chosen for operands of one
    phase must not be reused for operands whose divisibility is the same but phases differ."""
    xb = torch.randn(3 * 4099 + 16, dtype=torch.float32)
    ob = torch.empty(3 * 4099 + 16, dtype=torch.float32)
    x = xb[1:1 + 3 * 4099].view(3, 4099)
    same = SoftmaxArguments(x, ob[1:1 + 3 * 4099].view(3, 4099))
    other = SoftmaxArguments(x, ob[2:2 + 3 * 4099].view(3, 4099))
    assert same.tensor_attributes == other.tensor_attributes
    assert same.signature != other.signature
    g = SoftmaxBackwardArguments(x, x, ob[1:1 + 3 * 4099].view(3, 4099))
    g2 = SoftmaxBackwardArguments(x, x, ob[3:3 + 3 * 4099].view(3, 4099))
    assert g.signature != g2.signature


def test_split_row_limits_and_refusals():
    by_name = {k.metadata.kernel_name: k for k in CudaSoftmaxSplitForward.generate_kernels(None, cc=90)}
    c2 = by_name["CudaSoftmaxSplitForward_bf16_split_ept16_c2_peel8"]
    assert c2.metadata.design.max_cols == 2 * 1024 * 16 and c2.metadata.design.strategy == "cluster"
    x = torch.randn(2, 2 * 16384 + 1, dtype=torch.bfloat16)
    status = c2.supports(SoftmaxArguments(x, torch.empty_like(x)), 90)
    assert not status and "exceed its 32,768" in status.error
    looped = by_name["CudaSoftmaxSplitForward_bf16_split_looped_c8_peel8"]
    assert looped.supports(SoftmaxArguments(x, torch.empty_like(x)), 90)
    # one artifact per thread count the row needs
    short = torch.randn(2, 1000, dtype=torch.bfloat16)
    assert c2.name_expression(SoftmaxArguments(short, torch.empty_like(short))).endswith("128, 2, true>")
    assert c2.name_expression(SoftmaxArguments(x[:, :32768], torch.empty(2, 32768, dtype=torch.bfloat16))) \
        .endswith("1024, 2, true>")


def test_split_kernels_compile_for_sm90a_without_a_gpu():
    for cls, make in ((CudaSoftmaxSplitForward, lambda x: SoftmaxArguments(x, torch.empty_like(x))),
                      (CudaSoftmaxSplitBackward, lambda x: SoftmaxBackwardArguments(x, x, torch.empty_like(x)))):
        for name, cols in (("f16_split_ept16_c4", 50257), ("bf16_split_looped_c8", 2**20 + 3)):
            kernel = next(k for k in cls.generate_kernels(None, cc=90)
                          if k.metadata.kernel_name.startswith(f"{cls.__name__}_{name}"))
            x = torch.randn(1, cols).to(kernel.dtype.to_torch())
            artifact = kernel.compile(make(x), cc=90)
            assert artifact.extra.cluster == kernel.cluster


@pytest.mark.parametrize("cls", [CudaSoftmaxSplitForward, CudaSoftmaxSplitBackward])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cols", [4096, 16384, 32768, 100000])
def test_ctas_per_sm_matches_the_compiled_registers(cls, dtype, cols):
    """`ctas_per_sm` (PickAny's wave term) from `softmax_split.REGISTERS` names as many CTAs per
    SM as the compiled cubin's registers and threads allow, for every instance of the dtype."""
    from test_softmax_smem import _nv_info

    from kernel_api.providers.cuda_src.kernels import softmax_split as sp

    x = torch.empty(1, cols, dtype=dtype)
    args = SoftmaxBackwardArguments(x, x, torch.empty_like(x)) if cls.backward else SoftmaxArguments(x, torch.empty_like(x))
    for kernel in cls.generate_kernels(None, cc=90):
        if kernel.dtype.to_torch() != dtype or not kernel.supports(args, 90):
            continue
        artifact = kernel.compile(args, cc=90)
        compiled = artifact.compiled_obj.compiled
        regs = _nv_info(compiled.cubin)[compiled.symbols[artifact.compiled_obj.name_expression]][0x2f]
        threads = artifact.extra.threads
        granted = -(-regs // sp.REGISTER_GRANULE) * sp.REGISTER_GRANULE
        resident = max(1, min(sp.SM_THREADS // threads, sp.SM_REGISTERS // (threads * granted)))
        assert kernel.ctas_per_sm(cols) == resident, (kernel.metadata.kernel_name, cols, threads, regs)


def test_pick_any_charges_the_clusters_waves():
    """A wave holds about `CLUSTER_PACKING` of the SMs' clusters: the 8-CTA split of one
    1024-thread CTA per SM (bf16 backward, 100000 elements) costs the same per problem up to
    12 rows (one wave of fewer CTAs than SMs), twice that at 16 (two waves), as its measured
    times do (7-8 us, then 11-12 us on an H200). With two
    CTAs per SM (65536 elements) a wave holds 24 rows, past the SMs' count: no step."""
    kernel = next(k for k in CudaSoftmaxSplitBackward.generate_kernels(None, cc=90)
                  if k.metadata.kernel_name == "CudaSoftmaxSplitBackward_bf16_split_ept16_c8_peel8")
    assert kernel.ctas_per_sm(100000) == 1 and kernel.ctas_per_sm(65536) == 2

    def per_problem(rows: int, cols: int = 100000) -> float:  # (the cost is time over bytes)
        x = torch.empty(rows, cols, dtype=torch.bfloat16, device="meta")
        return kernel.estimated_cost(SoftmaxBackwardArguments(x, x, torch.empty_like(x)), 132) * rows

    assert per_problem(12) == pytest.approx(per_problem(4))
    assert per_problem(16) == pytest.approx(2 * per_problem(12))
    assert per_problem(48, 65536) == pytest.approx(2 * per_problem(24, 65536))


@pytest.mark.parametrize("dtype", DTYPES)
def test_pick_any_prefers_vectors_and_splits_long_or_few_rows(dtype):
    """PickAny (rank_candidates) on the benchmark's shapes, as measured on an H200
    (benchmarks/softmax.py): peeled 16-byte kernels for odd rows, one
    CTA per row while rows are many (clusters cost their barriers), a cluster split for few
    long rows, a CTA rather than a warp per row from 1024 elements."""
    def first(rows, cols, backward=False):
        x = torch.empty(rows, cols, dtype=dtype)
        args = SoftmaxBackwardArguments(x, x, torch.empty_like(x)) if backward else SoftmaxArguments(x, torch.empty_like(x))
        return rank_candidates(kernel_api.get_kernels(args, cc=90), args)[0].metadata.kernel_name

    for backward in (False, True):
        assert "peel" in first(8192, 4097, backward) and "Split" not in first(8192, 4097, backward)
        # rows one CTA's shared memory holds are staged there (test_softmax_smem); f32's
        # backward (two rows of 201 KB) stages y alone and re-reads dy from L2: 3.58 TB/s against
        # the 8-CTA split's 3.11 (H200)
        assert ("_smemy_peel" if backward and dtype == torch.float32 else "_smem_peel") in \
            first(4096, 50257, backward)
        # f32 rows too long for y's staging: the 8-CTA split ran 3.47 TB/s at 4096x65536; the
        # window family ranks first there (3.39 against the split's 3.47 at 2048x65536, H200;
        # 15-25 % faster than it on longer rows)
        if backward and dtype == torch.float32:
            assert "_window_peel" in first(4096, 65536, backward)
        assert "_block_" in first(65536, 1024, backward)
        assert "_warp_" in first(65536, 512, backward)
        # (1M-element rows, one or many, go to the window family:
        # test_softmax_window's test_pick_any_takes_long_rows)
        assert "_window_" in first(1, 2**20, backward)
        assert "_window_" in first(32, 2**20, backward)
        # aligned rows take a peeled 16-byte kernel (empty edges; policies.PEELED_ROWS)
        assert first(32768, 4096, backward).endswith(f"_peel{16 // torch.empty(0, dtype=dtype).element_size()}")
        assert "Split" in first(8, 32768, backward)  # 8 CTAs would leave most SMs idle


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pick_any_takes_register_rows_on_problems_too_small_to_fill_the_gpu(dtype, backward):
    """1-64 rows of 8192 elements take 5-7 us on any kernel: the one-pass register rows, whose
    loads are all in flight at once, ran 0.5-1.5 us faster than the cluster splits and the
    shared-memory kernels there (H200, the short-row sweeps of tests/data), which
    `policies.STAGED_ROW_LATENCY_BYTES` and `REGISTER_ROW_LONE_SHARE` now charge. Longer rows of
    few rows stay on the splits (their one row per CTA would take longer than the fixed time)."""
    from kernel_api.tuning.policies import STAGED_ROW_LATENCY_BYTES, fixed_row_cost, single_trip

    def ranked(rows, cols):
        x = torch.empty(rows, cols, dtype=dtype)
        args = SoftmaxBackwardArguments(x, x, torch.empty_like(x)) if backward else SoftmaxArguments(x, torch.empty_like(x))
        return args, rank_candidates(kernel_api.get_kernels(args, cc=90), args)

    # (f32 backwards of 1-32 such rows, 96 KB a row, stay on the split: 5.1-5.9 us against the
    # register rows' 4.8-5.2, within 10 % but at 32 rows)
    for rows in (64,) if dtype == torch.float32 and backward else (1, 4, 16, 64):
        args, kernels = ranked(rows, 8192)
        assert "_block_" in kernels[0].metadata.kernel_name, (rows, kernels[0].metadata.kernel_name)
        split = next(k for k in kernels if "Split" in k.metadata.kernel_name)
        assert not single_trip(split.metadata.design) and single_trip(kernels[0].metadata.design)
        assert fixed_row_cost(kernels[0], args) == 0.0
        nbytes = rows * 8192 * x_bytes(dtype) * (3 if backward else 2)
        assert fixed_row_cost(split, args) == pytest.approx(STAGED_ROW_LATENCY_BYTES / nbytes)
    assert "Split" in ranked(4, 32768)[1][0].metadata.kernel_name


def x_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pick_any_takes_peeled_kernels_for_aligned_rows(dtype):
    """On aligned rows the aligned 16-byte kernels ran 9-13 % slower than the peeled ones at
    65536x1024 forwards (H200: f32 3.57 against
    3.91 TB/s, PickAny's choice then) and never more than 6 % faster over 168 measured pairs."""
    x = torch.empty(65536, 1024, dtype=dtype)
    args = SoftmaxArguments(x, torch.empty_like(x))
    ranked = [k.metadata.kernel_name for k in rank_candidates(kernel_api.get_kernels(args, cc=90), args)]
    vec = 16 // x.element_size()
    assert ranked[0].endswith(f"_peel{vec}"), ranked[:3]
    aligned = ranked[0][: ranked[0].rindex("_peel")] + f"_a{vec}"
    assert aligned in ranked and ranked.index(aligned) > 0


def test_ops_moves_the_softmax_dim_last_only_when_needed():
    from kernel_api.ops.dispatch import _moved_dim

    x = torch.randn(4, 6, 8)
    assert _moved_dim(x, -1) is None and _moved_dim(x, 2) is None
    assert _moved_dim(x, 0) == 0 and _moved_dim(x, -2) == 1
    assert _moved_dim(x.transpose(1, 2), -1) == 2          # last dim not unit-stride
    assert _moved_dim(x[:, :, 1:], -1) is None             # rows one stride apart: taken as they are
    assert _moved_dim(x[:, 1:, :], -1) == 2                # rows not evenly spaced
    assert _moved_dim(x, 5) is None and _moved_dim(x, "a") is None  # invalid: the arguments explain


# ---------------------------------------------------------------------------------- GPU
_ODD = [(67, 1), (67, 3), (67, 7), (5, 4097), (3, 50257), (2, 65537)]
_PROVIDERS = ("cuda_src", "torch")  # (the CuTe DSL kernels' own tests cover them)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_forward_odd_rows_every_kernel(dtype, offset):
    for rows, cols in _ODD:
        x = _input_at(rows, cols, dtype, offset)
        buf, out = _poisoned(rows, cols, dtype, offset)
        args = SoftmaxArguments(x, out)
        kernels = kernel_api.get_kernels(args, providers=_PROVIDERS)
        assert any("peel" in n for n in _names(kernels)), (rows, cols, offset)
        for k in kernels:
            out.fill_(float("nan"))
            k.run(args)
            torch.cuda.synchronize()
            what = f"{k.metadata.kernel_name} {rows}x{cols} offset {offset}"
            check_forward(out, x, what)
            _margins_untouched(buf, rows, cols, offset, what)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_backward_odd_rows_every_kernel(dtype, offset):
    for rows, cols in _ODD:
        g = _input_at(rows, cols, dtype, offset)
        g.copy_(torch.randn(rows, cols, device="cuda") * 4)
        y = _input_at(rows, cols, dtype, offset)
        y.copy_(torch.softmax(torch.randn(rows, cols, device="cuda") * 2, -1))
        buf, grad_in = _poisoned(rows, cols, dtype, offset)
        args = SoftmaxBackwardArguments(g, y, grad_in)
        kernels = kernel_api.get_kernels(args, providers=_PROVIDERS)
        assert any("peel" in n for n in _names(kernels)), (rows, cols, offset)
        for k in kernels:
            grad_in.fill_(float("nan"))
            k.run(args)
            torch.cuda.synchronize()
            what = f"{k.metadata.kernel_name} {rows}x{cols} offset {offset}"
            check_backward(grad_in, g, y, what, slack=4.0 if k.metadata.provider == "torch" else 1.0)
            _margins_untouched(buf, rows, cols, offset, what)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_misaligned_strided_rows(dtype):
    """x = big[:, 1:] (rows cols+1 apart, one element past each boundary) into a contiguous out."""
    rows, cols = 9, 4103
    big = make_rows(rows, cols + 1, dtype)
    x = big[:, 1:]
    buf, out = _poisoned(rows, cols, dtype)
    args = SoftmaxArguments(x, out)
    kernels = kernel_api.get_kernels(args, providers=_PROVIDERS)
    assert kernels
    for k in kernels:
        out.fill_(float("nan"))
        k.run(args)
        torch.cuda.synchronize()
        check_forward(out, x, f"{k.metadata.kernel_name} big[:, 1:]")
        _margins_untouched(buf, rows, cols, 0, k.metadata.kernel_name)


_LONG = [(1, 2**20, 0), (3, 2**20 + 3, 0), (2, 2**20 + 3, 3), (8, 300001, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_rows_split_kernels(dtype):
    """Rows one CTA cannot hold, on every split instance that takes them, forward and backward."""
    for rows, cols, offset in _LONG:
        x = _input_at(rows, cols, dtype, offset)
        buf, out = _poisoned(rows, cols, dtype, offset)
        args = SoftmaxArguments(x, out)
        kernels = [k for k in kernel_api.get_kernels(args) if isinstance(k, CudaSoftmaxSplitForward)]
        assert kernels, (rows, cols)
        for k in kernels:
            out.fill_(float("nan"))
            k.run(args)
            torch.cuda.synchronize()
            what = f"{k.metadata.kernel_name} {rows}x{cols}+{offset}"
            check_forward(out, x, what)
            _margins_untouched(buf, rows, cols, offset, what)
        g = _input_at(rows, cols, dtype, offset)
        g.copy_(torch.randn(rows, cols, device="cuda") * 4)
        y = _input_at(rows, cols, dtype, offset)
        y.copy_(torch.softmax(torch.randn(rows, cols, device="cuda") * 2, -1))
        gbuf, grad_in = _poisoned(rows, cols, dtype, offset)
        bargs = SoftmaxBackwardArguments(g, y, grad_in)
        bk = [k for k in kernel_api.get_kernels(bargs) if isinstance(k, CudaSoftmaxSplitBackward)]
        assert bk
        for k in bk:
            grad_in.fill_(float("nan"))
            k.run(bargs)
            torch.cuda.synchronize()
            what = f"{k.metadata.kernel_name} {rows}x{cols}+{offset}"
            check_backward(grad_in, g, bargs.out, what)
            _margins_untouched(gbuf, rows, cols, offset, what)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_softmax_any_layout_and_dim(dtype):
    """ops.softmax (and its autograd backward) on transposed, sliced and batched inputs, along
    any dim, returns what torch.softmax returns."""
    base = torch.randn(6, 40, 333, device="cuda", dtype=torch.float32).to(dtype)
    cases = [(base.transpose(1, 2), -1), (base[:, 1:, :], -1), (base[:, :, ::2], -1), (base, 0), (base, 1),
             (base.transpose(0, 2), -2), (base[:, 3], 0)]
    for x, dim in cases:
        y = kernel_api.ops.softmax(x, dim)
        assert y.shape == x.shape
        check_forward(y.movedim(dim, -1).contiguous(), x.movedim(dim, -1).contiguous(),
                      f"ops.softmax strides {x.stride()} dim {dim}")
        out = torch.full(x.shape, float("nan"), device="cuda", dtype=dtype)
        assert kernel_api.ops.softmax(x, dim, out=out) is out
        assert torch.equal(out, y)
        # autograd: the backward through the registry's kernels, against torch's
        xg = x.detach().requires_grad_(True)
        grad = torch.randn(x.shape, device="cuda").to(dtype)
        kernel_api.ops.softmax(xg, dim).backward(grad)
        xr = x.detach().double().requires_grad_(True)
        torch.softmax(xr, dim).backward(grad.double())
        assert torch.allclose(xg.grad.double(), xr.grad, atol=2e-2, rtol=2e-2), (x.stride(), dim)
        # softmax_backward directly on non-contiguous operands
        gi = kernel_api.ops.softmax_backward(grad.transpose(0, -1).contiguous().transpose(0, -1), y, dim)
        yd = y.double()
        ref_g = yd * (grad.double() - (grad.double() * yd).sum(dim, keepdim=True))
        assert torch.allclose(gi.double(), ref_g, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_pick_any_choice_runs_long_rows_through_ops():
    """ops.softmax on 1x1M and 8x1M rows (PickAny: a cluster split) matches the reference."""
    for rows in (1, 8):
        x = make_rows(rows, 2**20, torch.bfloat16)
        y = kernel_api.ops.softmax(x)
        check_forward(y, x, f"ops.softmax {rows}x1M")
        assert math.isclose(float(y[-1].double().sum()), 1.0, rel_tol=1e-2)


_SANITIZED = r"""
import torch, kernel_api
from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments
torch.manual_seed(0)
def at(rows, cols, dtype, offset):  # its own allocation, offset elements in: rows at any alignment
    return torch.randn(rows * cols + offset, device="cuda").to(dtype)[offset:].view(rows, cols)
n = 0
for dtype, rows, cols, offset in [(torch.bfloat16, 3, 4097, 3), (torch.float32, 2, 70001, 1), (torch.float16, 2, 9, 1)]:
    x, out, gi = (at(rows, cols, dtype, offset) for _ in range(3))
    for args in (SoftmaxArguments(x, out), SoftmaxBackwardArguments(x, out, gi)):
        for k in kernel_api.get_kernels(args, providers="cuda_src"):
            if "peel" in k.metadata.kernel_name:
                k.run(args); n += 1
torch.cuda.synchronize()
print("launches", n)
"""


@pytest.mark.gpu
def test_memcheck_peeled_and_split_kernels():
    """The peeled and split kernels on misaligned odd rows under compute-sanitizer memcheck
    (caching allocator off: each operand is its own allocation, so an overrun is caught)."""
    out = run_memcheck(_SANITIZED, timeout=600)
    launches = int(out.split("launches")[-1].split()[0])
    assert launches >= 20, out[-3000:]
