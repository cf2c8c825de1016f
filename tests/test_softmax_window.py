"""Softmax for long rows in one launch whose second read comes from L2 (CudaSoftmaxWindow*).

CPU: registration and metadata, the plan (every vector of a row in exactly one part; a lag of at
least a row's parts, so no output waits on a later step; the window it keeps in L2), the
workspace's size and refusals, NVRTC compiles for sm_90a without local memory and with
registers for the launch bounds' CTAs per SM, the cooperative launch `_run` makes (grid of the
co-resident CTAs, parameters matching the kernels' signatures), peeling refusals, the ranking
against the row-group family. GPU (@pytest.mark.gpu): float64 references on fresh random rows
(with -inf rows and huge magnitudes), outputs inside NaN-filled buffers whose margins must stay
untouched, for the long benchmark shapes, odd and misaligned rows, many rows of few parts, small
parts, the smallest lag (a row's parts) and no slack, few CTAs; forward and backward, all three
dtypes; strided rows and 3-d batches; a workspace filled with garbage and one left by a launch of
another shape; repeated launches bit-identical; memcheck."""

from __future__ import annotations

import re

import pytest
import torch

from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments
from kernel_api.providers.cuda_src.kernels import softmax_window as sw
from kernel_api.providers.cuda_src.kernels.softmax_window import (CudaSoftmaxWindowBackward, CudaSoftmaxWindowForward,
                                                                  plan_window, ring_bytes, workspace_bytes)

from memcheck import SOFTMAX_PREAMBLE, run_memcheck
from test_softmax import check_backward, check_forward, input_at, make_rows, margins_untouched, poisoned
from test_softmax_smem import _nv_info

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CLASSES = (CudaSoftmaxWindowForward, CudaSoftmaxWindowBackward)
LONG = [(1, 2**20), (8, 2**20), (32, 2**20), (8, 2**22)]


def _kernel(cls, dtype: torch.dtype):
    (k,) = [k for k in cls.generate_kernels(None, cc=90) if k.dtype.to_torch() == dtype]
    return k


def _args(cls, x: torch.Tensor, out: torch.Tensor | None = None):
    out = torch.empty_like(x) if out is None else out
    return SoftmaxBackwardArguments(x, x, out) if cls.backward else SoftmaxArguments(x, out)


def _reset(k) -> None:
    k.threads, k.unroll, k.nslot, k.min_blocks = sw.THREADS, sw.UNROLL[k.backward], sw.NSLOT, sw.MIN_BLOCKS
    k.prefetch, k.peeks, k.by_problem = sw.PREFETCH, 0, True
    k.delay_rounds, k.slack_rounds, k.max_ctas_per_sm, k.align = sw.DELAY_ROUNDS, sw.SLACK_ROUNDS, None, sw.ALIGN


def test_instances_names_and_metadata():
    names = [k.metadata.kernel_name for cls in _CLASSES for k in cls.generate_kernels(None, cc=90)]
    assert names == [f"CudaSoftmaxWindow{d}_{t}_window_peel{v}" for d in ("Forward", "Backward")
                     for t, v in (("bf16", 8), ("f16", 8), ("f32", 4))]
    md = _kernel(CudaSoftmaxWindowForward, torch.bfloat16).metadata
    assert md.design.strategy == "window" and md.min_cc == 80 and md.design.min_cols == sw.long_rows_from(2)
    assert dict(md.design.extra)["cooperative"] is True and dict(md.design.extra)["passes"] == 2
    assert md.operands.x.divisibility == md.operands.out.divisibility == 1  # peeled: any element alignment


@pytest.mark.parametrize("rows,cols,elem", [(32, 2**20, 2), (8, 2**22, 4), (1, 2**20, 2), (1, 8, 2), (5, 3, 4),
                                            (4096, 50257, 2), (3, 1000003, 4), (100000, 33, 2)])
@pytest.mark.parametrize("grid", [1, 7, 264, 528])
@pytest.mark.parametrize("delay,slack", [(0.0, 0.0), (0.5, 0.5), (2.5, 1.0)])
@pytest.mark.parametrize("align", [False, True])
def test_plan_covers_rows_and_orders_the_steps(rows, cols, elem, grid, delay, slack, align):
    p = plan_window(rows, cols, elem, grid, 1024, delay, slack, align)
    vec = 16 // elem
    nvec = -(-cols // vec)
    assert p.parts == rows * p.parts_per_row and p.part_vectors == 1024
    assert p.parts_per_row * p.part_vectors >= nvec > (p.parts_per_row - 1) * p.part_vectors
    assert 1 <= p.grid <= min(grid, p.parts)
    base = p.parts_per_row + p.delay + int(slack * p.grid + 0.5)
    assert p.delay == int(delay * p.grid + 0.5)
    # aligned: the least whole number of grids past the base, so part w's output step is on its statistics' CTA
    assert p.lag == (-(-base // p.grid) * p.grid if align else base)
    # Row r's combination (step (r + 1) * bpr - 1 + delay) comes after its last statistics part and
    # before its first output part (step r * bpr + lag): every wait is for an earlier step.
    for r in {0, rows // 2, rows - 1}:
        last_stats = (r + 1) * p.parts_per_row - 1
        combine = last_stats + p.delay
        assert last_stats <= combine < r * p.parts_per_row + p.lag
    assert p.window_bytes(True) == 2 * p.window_bytes(False) == 2 * p.lag * 1024 * 16


def test_plans_for_the_long_benchmark_shapes():
    # bf16 1M rows: 64 parts of 32 KB, combined 0.3 grids after their last part; the lag one grid (64 + 79
    # + 26 steps, rounded up): each CTA outputs, one step later, the part it took the statistics of.
    p = plan_window(32, 2**20, 2, 264)
    assert (p.parts_per_row, p.parts, p.grid, p.delay, p.lag) == (64, 2048, 264, 79, 264)
    assert p.window_bytes(False) == 264 * 32 * 1024
    assert plan_window(8, 2**22, 2, 264).lag == 2 * 264  # (256 parts a row: two grids)
    p = plan_window(8, 2**22, 4, 264, 1024)  # the f32 backward of 4M rows: 1024 parts of 16 KB a row
    assert (p.parts_per_row, p.lag) == (1024, 5 * 264) and p.window_bytes(True) == 2 * 5 * 264 * 16 * 1024


def test_workspace_and_ring_bytes():
    assert workspace_bytes(3, 7) == 160
    k = _kernel(CudaSoftmaxWindowForward, torch.bfloat16)
    # (sized for the smallest parts any build cuts: the deep ring's 6 x 256 vectors, 86 a row)
    assert k.get_workspace_size(_args(CudaSoftmaxWindowForward, torch.empty(32, 2**20, dtype=torch.bfloat16,
                                                                            device="meta"))) == (86 * 32 + 32) * 16
    k.by_problem = False
    try:
        assert k.get_workspace_size(_args(CudaSoftmaxWindowForward, torch.empty(32, 2**20, dtype=torch.bfloat16,
                                                                                device="meta"))) == (2048 + 32) * 16
    finally:
        _reset(k)
    # Two CTAs per SM fit the 227 KB an H100 / H200 SM lends: 96 KB of ring each, both directions.
    assert ring_bytes(2048, 3, False) == 96 * 1024 == ring_bytes(1024, 3, True)
    assert k.smem_bytes == 96 * 1024 == _kernel(CudaSoftmaxWindowBackward, torch.float32).smem_bytes


@pytest.mark.parametrize("cls", _CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(4, 100000), (32, 2**20), (8, 2**22)])
def test_compiles_for_sm90a_without_spills(cls, dtype, rows, cols):
    """No local memory, and registers for the launch bounds' two CTAs per SM: the default build,
    the deep ring (32x1M) and the peeking combination (8x4M, f32 and the 16-bit backward)."""
    k = _kernel(cls, dtype)
    artifact = k.compile(_args(cls, torch.empty(rows, cols, dtype=dtype, device="meta")), cc=90)
    compiled = artifact.compiled_obj.compiled
    assert compiled.arch == "sm_90a"
    res = _nv_info(compiled.cubin)[compiled.symbols[artifact.compiled_obj.name_expression]]
    assert res.get(0x11, 0) == 0 and res.get(0x12, 0) == 0, res
    assert 0 < res[0x2f] <= 65536 // (sw.MIN_BLOCKS * sw.THREADS), res


@pytest.mark.parametrize("cc,arch", [(80, "sm_80"), (100, "sm_100a")])
def test_compiles_for_other_architectures(cc, arch):
    """Nothing in the kernels is Hopper's own: cp.async, plain stores, relaxed 64-bit accesses."""
    for cls in _CLASSES:
        k = _kernel(cls, torch.bfloat16)
        assert k.compile(_args(cls, torch.empty(4, 100000, dtype=torch.bfloat16)), cc=cc).compiled_obj.compiled.arch == arch


def test_tuning_attributes_reach_the_compile_key():
    k = _kernel(CudaSoftmaxWindowForward, torch.float16)
    args = _args(CudaSoftmaxWindowForward, torch.empty(64, 70000, dtype=torch.float16))
    try:
        base = k.compile_key(args, 90)
        k.by_problem = False
        assert k.compile_key(args, 90) == base  # (this problem's own build is the attributes' defaults)
        k.threads, k.unroll, k.min_blocks, k.nslot = 256, 4, 3, 2
        assert k.name_expression(args) == "ka_softmax::fwd_window<ka_softmax::F16, 8, 4, 256, 2, 1>"
        assert k.defines_for(args) == {"WN_MIN_BLOCKS": 3} and k.compile_key(args, 90) != base
        k.peeks = 2
        assert k.defines_for(args) == {"WN_MIN_BLOCKS": 3, "WN_PEEKS": 2}
        # the delay is planned from the build stored with the artifact: a cached artifact of
        # another delay must not serve (the compile key names it)
        before = k.compile_key(args, 90)
        k.delay_rounds = 1.0
        assert k.compile_key(args, 90) != before and k.compile_key(args, 90)[:2] == before[:2]
    finally:
        _reset(k)


class _FakeLauncher:
    def __init__(self, calls, per_sm=2):
        self.calls, self.per_sm = calls, per_sm

    def max_coresident(self, device, threads, smem):
        return self.per_sm * 132

    def launch(self, stream, device, grid, block, smem, params, cooperative=False):
        self.calls.append((grid, block, smem, params, cooperative))


def _signature_params(kernel_name: str) -> int:
    m = re.search(rf"\b{kernel_name}\(([^)]*)\)", CudaSoftmaxWindowForward.get_source())
    return len(m.group(1).split(","))


@pytest.mark.parametrize("cls", _CLASSES)
def test_run_launches_cooperatively_on_the_resident_grid(cls, monkeypatch):
    monkeypatch.setattr(sw, "stream_handle", lambda stream, device: 0)
    monkeypatch.setattr(sw, "_sm_count", lambda device: 132)
    k = _kernel(cls, torch.bfloat16)
    args = _args(cls, torch.empty(8, 2**20, dtype=torch.bfloat16))
    monkeypatch.setattr(type(args), "device", property(lambda self: torch.device("cuda", 0)), raising=False)
    calls = []
    artifact = type("A", (), {"compiled_obj": _FakeLauncher(calls)})()
    ws = torch.empty(k.get_workspace_size(args) // 4, dtype=torch.float32)
    try:
        k._run(args, artifact, None, ws)
        k.max_ctas_per_sm = 1
        k._run(args, artifact, None, ws)
    finally:
        _reset(k)
    (grid, block, smem, params, coop), second = calls
    p = k.plan(args, 264)
    assert (grid, block, smem, coop) == (264, sw.THREADS, 96 * 1024, True) and second[0] == 132
    assert len(params) == _signature_params(f"{'bwd' if cls.backward else 'fwd'}_window")
    assert params[-5:-1] == (ws.data_ptr(), p.parts_per_row, p.lag, p.delay)
    assert 0 <= params[-1] < 2**32 and second[3][-1] != params[-1]  # a new epoch per launch


@pytest.mark.parametrize("cls", _CLASSES)
def test_workspace_refusals(cls, monkeypatch):
    monkeypatch.setattr(sw, "_sm_count", lambda device: 132)
    k = _kernel(cls, torch.float32)
    args = _args(cls, torch.empty(4, 2**17, dtype=torch.float32))
    need = k.get_workspace_size(args)
    artifact = type("A", (), {"compiled_obj": None})()
    with pytest.raises(ValueError, match=f"needs a 16-byte aligned workspace of {need} bytes.*got none"):
        k._run(args, artifact, None, None)
    with pytest.raises(ValueError, match=f"workspace of {need} bytes"):
        k._run(args, artifact, None, torch.empty(need // 4 - 1, dtype=torch.float32))
    with pytest.raises(ValueError, match="16-byte aligned"):
        k._run(args, artifact, None, torch.empty(need // 4 + 4, dtype=torch.float32)[1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_pick_any_takes_long_rows(dtype):
    """PickAny puts the window family first on every long row (1x1M to 8x4M: measured the fastest
    on 22 of 24 long cases on an H200), and never on rows one CTA or cluster holds."""
    from kernel_api.tuning.policies import rank_candidates

    import kernel_api

    for backward in (False, True):
        for rows, cols, first_is_window in ([(r, c, True) for r, c in LONG + [(64, 2**20), (4, 2**21), (256, 2**18)]]
                                            + [(r, c, False) for r, c in [(32768, 4096), (16384, 16384), (65536, 1024),
                                                                          (4096, 50257), (8192, 4097), (2, 65536)]]):
            x = torch.empty(rows, cols, dtype=dtype, device="meta")
            args = _args(_CLASSES[backward], x)
            first = rank_candidates(kernel_api.get_kernels(args, cc=90), args)[0].metadata.kernel_name
            assert ("Window" in first) == first_is_window, (rows, cols, backward, first)


@pytest.mark.parametrize("cls", _CLASSES)
def test_refuses_problems_past_32_bit_step_numbers(cls):
    """2^30 rows of 2 parts each: 2^31 parts, more than the kernel's int step numbers reach;
    refused with the count. 2^26 rows of 2 parts are taken."""
    k = _kernel(cls, torch.bfloat16)
    cols = k.part_vectors * 8 + 1  # (two parts a row)
    status = k.supports(_args(cls, torch.empty(2**30, cols, dtype=torch.bfloat16, device="meta")))
    assert not status and "2,147,483,648 parts" in status.error and "step numbers" in status.error
    assert k.supports(_args(cls, torch.empty(2**26, cols, dtype=torch.bfloat16, device="meta")))


def test_peeling_needs_one_offset():
    k = _kernel(CudaSoftmaxWindowForward, torch.bfloat16)
    flat = torch.empty(2 * 50001 + 16, dtype=torch.bfloat16)
    x = flat[1:1 + 2 * 50001].view(2, 50001)
    status = k.supports(SoftmaxArguments(x, flat[:2 * 50001].view(2, 50001)))
    assert not status and "different offsets" in status.error
    other = torch.empty(2 * 50001 + 16, dtype=torch.bfloat16)[9:9 + 2 * 50001].view(2, 50001)  # same phase
    assert k.supports(SoftmaxArguments(x, other))


# ----------------------------------------------------------------------------------- GPU
def _check(cls, k, rows: int, cols: int, dtype: torch.dtype, offset: int, workspace=None) -> None:
    """One launch of ``k`` against float64 inside a poisoned buffer, then a second one bit for
    bit (the partials combine in a fixed order); ``workspace`` is passed to both runs. The
    message names this family's settings and the build the launch takes."""
    settings = (f"{k.threads} threads {'by problem' if k.by_problem else 'attributes'} slack {k.slack_rounds} "
                f"cap {k.max_ctas_per_sm} align {k.align} ahead {k.prefetch}")
    what = f"{k.metadata.kernel_name} {rows}x{cols}+{offset}"
    buf, out = poisoned(rows, cols, dtype, offset)
    if cls.backward:
        g = input_at(rows, cols, dtype, offset)
        g.copy_(torch.randn(rows, cols, device="cuda") * 4)
        y = input_at(rows, cols, dtype, offset)
        y.copy_(torch.softmax(torch.randn(rows, cols, device="cuda") * 2, -1))
        args = SoftmaxBackwardArguments(g, y, out)
    else:
        x = input_at(rows, cols, dtype, offset)
        args = SoftmaxArguments(x, out)
    assert k.supports(args), k.supports(args).error
    what += f" {settings} {k.build(args)}"
    k.run(args, workspace=workspace)
    torch.cuda.synchronize()
    if cls.backward:
        check_backward(out, g, y, what)
    else:
        check_forward(out, x, what)
    margins_untouched(buf, rows, cols, offset, what)
    first = out.clone()
    k.run(args, workspace=workspace)  # again on the same buffers: the same bits
    torch.cuda.synchronize()
    bits = torch.uint8 if out.dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(bits), first.view(bits)), what


# (rows, cols, element offset past a 16-byte boundary): the long benchmark shapes, odd rows
# (every row at another phase), misaligned bases, many rows of a few parts, short rows (one
# part, mostly edges), a row shorter than a vector.
_SHAPES = [(*s, 0) for s in LONG] + [(3, 1000003, 0), (2, 2**20 + 5, 3), (257, 131075, 1), (67, 4097, 5),
                                     (5, 3, 1), (4, 50257, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("cls", _CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shapes(cls, dtype):
    k = _kernel(cls, dtype)
    torch.manual_seed(len(str(dtype)) + 7 * cls.backward)
    for rows, cols, offset in _SHAPES:
        _check(cls, k, rows, cols, dtype, offset)
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("cls", _CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_plans_at_the_edges(cls, dtype):
    """Parts of 2 KB (hundreds per row), no delay and no slack (outputs wait on rows just
    combined, combinations on parts just published), long delays, rings of two to four steps with
    copies one or two steps ahead, lags of one grid (the output from the ring) and more (from L2),
    unaligned lags, one CTA per SM and other CTA shapes."""
    k = _kernel(cls, dtype)
    torch.manual_seed(11 + cls.backward)
    try:
        # (the aligned plans with a lag of one grid and a ring of three output from the ring; the others re-read)
        # (then the deep ring: lags of two and three grids still in the ring; partials asked for
        # early, two a thread with more parts a row than that covers, and with no delay)
        for threads, unroll, nslot, delay, slack, cap, align, ahead, peeks in [
                (128, 1, 3, 0.5, 0.5, None, True, 1, 0), (512, 1, 3, 0.0, 0.0, None, False, 1, 0),
                (256, 8, 2, 0.0, 0.0, 1, True, 1, 0), (256, 2, 3, 3.0, 1.0, None, True, 1, 0),
                (512, 1, 4, 0.2, 0.0, 1, True, 1, 0), (256, 4, 3, 0.0, 0.0, 1, True, 1, 0),
                (256, 4, 4, 0.3, 0.1, None, True, 2, 0), (256, 2, 3, 0.0, 0.0, 1, False, 2, 0),
                (256, 3, 4, 1.0, 0.1, None, True, 1, 0), (256, 1, 5, 2.0, 0.1, None, True, 1, 0),
                (128, 1, 3, 0.3, 0.1, None, True, 1, 2), (256, 2, 3, 0.0, 0.0, 1, True, 1, 1)]:
            k.threads, k.unroll, k.nslot, k.delay_rounds, k.slack_rounds, k.max_ctas_per_sm, k.align = (
                threads, unroll, nslot, delay, slack, cap, align)
            k.prefetch, k.peeks, k.by_problem = ahead, peeks, False
            for rows, cols, offset in [(5, 300007, 3), (2, 2**20, 0), (33, 40003, 1)]:
                _check(cls, k, rows, cols, dtype, offset)
    finally:
        _reset(k)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_batches(dtype):
    """Rows of a wider buffer (row stride 8 elements past the row: the same phase from a 16-byte
    boundary as the dense output's rows, which peeling needs) and a 3-d batch, forward and
    backward, against float64."""
    torch.manual_seed(3)
    cols = 200003
    wide = make_rows(6, cols + 8, dtype)
    x = wide[:, :cols]
    out = torch.full((6, cols), float("nan"), device="cuda", dtype=dtype)
    k = _kernel(CudaSoftmaxWindowForward, dtype)
    assert k.supports(SoftmaxArguments(x, out))
    k.run(SoftmaxArguments(x, out))
    torch.cuda.synchronize()
    check_forward(out, x, f"{k.metadata.kernel_name} strided")
    x3 = make_rows(2 * 3, 150001, dtype).view(2, 3, 150001)
    out3 = torch.full_like(x3, float("nan"))
    k.run(SoftmaxArguments(x3, out3))
    torch.cuda.synchronize()
    check_forward(out3.view(6, -1), x3.view(6, -1), f"{k.metadata.kernel_name} batched")
    kb = _kernel(CudaSoftmaxWindowBackward, dtype)
    y = torch.softmax(torch.randn(6, cols, device="cuda") * 2, -1).to(dtype)
    g_wide = (torch.randn(6, cols + 8, device="cuda") * 4).to(dtype)
    g = g_wide[:, :cols]
    gi = torch.full((6, cols), float("nan"), device="cuda", dtype=dtype)
    args = SoftmaxBackwardArguments(g, y, gi)
    assert kb.supports(args), kb.supports(args).error
    kb.run(args)
    torch.cuda.synchronize()
    check_backward(gi, g, y, f"{kb.metadata.kernel_name} strided")
    y3 = torch.softmax(torch.randn(2, 3, 150001, device="cuda") * 2, -1).to(dtype)
    g3 = (torch.randn(2, 3, 150001, device="cuda") * 4).to(dtype)
    gi3 = torch.full_like(y3, float("nan"))
    kb.run(SoftmaxBackwardArguments(g3, y3, gi3))
    torch.cuda.synchronize()
    check_backward(gi3.view(6, -1), g3.view(6, -1), y3.view(6, -1), f"{kb.metadata.kernel_name} batched")


@pytest.mark.gpu
@pytest.mark.parametrize("cls", _CLASSES)
def test_any_workspace_contents(cls):
    """A workspace of random bits, then one left by a launch of another shape (other parts per
    row, other counters' totals): the tags make both read as stale."""
    k = _kernel(cls, torch.bfloat16)
    torch.manual_seed(5)
    ws = torch.randint(-2**31, 2**31 - 1, (2**22,), dtype=torch.int32, device="cuda")
    for rows, cols, offset in [(7, 300007, 3), (9, 2**20, 0), (7, 300007, 3), (40, 131075, 1)]:
        _check(cls, k, rows, cols, torch.bfloat16, offset, workspace=ws)


@pytest.mark.gpu
def test_ops_pick_any_runs_long_rows_here():
    """ops.softmax and its backward on 32x1M (PickAny: this family) match the references."""
    import math

    import kernel_api
    from kernel_api.tuning.policies import rank_candidates

    x = make_rows(32, 2**20, torch.bfloat16)
    args = SoftmaxArguments(x, torch.empty_like(x))
    assert "Window" in rank_candidates(kernel_api.get_kernels(args), args)[0].metadata.kernel_name
    y = kernel_api.ops.softmax(x)
    check_forward(y, x, "ops.softmax 32x1M")
    assert math.isclose(float(y[-1].double().sum()), 1.0, rel_tol=1e-2)
    y = kernel_api.ops.softmax((torch.randn(32, 2**20, device="cuda") * 2).to(torch.bfloat16))
    g = torch.randn_like(y)
    check_backward(kernel_api.ops.softmax_backward(g, y, -1), g, y, "ops.softmax_backward 32x1M")


_SANITIZED = SOFTMAX_PREAMBLE + r"""
from kernel_api.providers.cuda_src.kernels.softmax_window import CudaSoftmaxWindowBackward, CudaSoftmaxWindowForward
for cls in (CudaSoftmaxWindowForward, CudaSoftmaxWindowBackward):
    for k in cls.generate_kernels(None, cc=90):
        dtype = k.dtype.to_torch()
        for unroll, nslot, delay, rows, cols, offset in [(4, 3, 0.3, 3, 200003, 3), (1, 3, 0.3, 5, 30011, 1),
                                                         (1, 4, 1.0, 3, 200003, 3)]:
            k.by_problem, k.unroll, k.nslot, k.delay_rounds = False, unroll, nslot, delay
            launch(k, cls.backward, rows, cols, dtype, offset)
torch.cuda.synchronize()
print("launches", n)
"""


@pytest.mark.gpu
def test_memcheck():
    """Both directions, every dtype, two part sizes and the deep ring (a lag of two grids from the
    ring), misaligned rows, under compute-sanitizer memcheck (each operand and workspace its own
    allocation)."""
    out = run_memcheck(_SANITIZED)
    assert int(out.split("launches")[-1].split()[0]) == 18, out[-3000:]


@pytest.mark.parametrize("rows,cols,dtype,backward,want", [
    # (the deep ring on at least eight grids of parts, rows of at least an eighth of a grid, and a
    # lag of two grids)
    (32, 2**20, torch.bfloat16, True, (3, 4, 0, 1.0)), (32, 2**20, torch.float32, False, (6, 4, 0, 1.0)),
    (32, 2**20, torch.bfloat16, False, (6, 4, 0, 1.0)), (16, 2**20, torch.float32, False, (6, 4, 0, 1.0)),
    (256, 2**18, torch.float32, True, (3, 4, 0, 1.0)), (257, 262147, torch.float16, True, (3, 4, 0, 1.0)),
    # (16-bit forwards of 16x1M: 5.2 grids of parts; rows of 22 parts, a twelfth of a grid)
    (16, 2**20, torch.bfloat16, False, (8, 3, 0, 0.3)), (257, 131075, torch.float16, False, (8, 3, 0, 0.3)),
    (128, 2**17, torch.bfloat16, True, (4, 3, 0, 0.3)), (128, 2**17, torch.float32, False, (8, 3, 0, 0.3)),
    # (f32 backward 1M rows: 342 deep parts a row make the lag three grids; default parts, from the ring)
    (32, 2**20, torch.float32, True, (4, 3, 0, 0.3)),
    # (rows of more parts than a CTA has threads: the combinations peek; the output re-reads from L2)
    (8, 2**22, torch.float32, False, (8, 3, 1, 0.3)), (8, 2**22, torch.float32, True, (4, 3, 1, 0.3)),
    (8, 2**22, torch.bfloat16, True, (4, 3, 1, 0.3)), (8, 2**22, torch.bfloat16, False, (8, 3, 0, 0.3)),
    # (too few parts for the deep ring's longer ramp)
    (8, 2**20, torch.bfloat16, False, (8, 3, 0, 0.3)), (1, 2**20, torch.float32, True, (4, 3, 0, 0.3)),
    (5, 3, torch.float32, False, (8, 3, 0, 0.3))])
def test_build_by_problem(rows, cols, dtype, backward, want, monkeypatch):
    """`choose_build` on 132 SMs (an H100 / H200): which build each benchmark shape gets, that the
    compile key follows it, and that a launch plans for the build its artifact holds (not for the
    args it is given) with that build's ring."""
    monkeypatch.setattr(sw, "_sm_count", lambda device: 132)
    monkeypatch.setattr(sw, "stream_handle", lambda stream, device: 0)
    cls = _CLASSES[backward]
    k = _kernel(cls, dtype)
    args = _args(cls, torch.empty(rows, cols, dtype=dtype, device="meta"))
    b = k.build(args)
    assert (b.unroll, b.nslot, b.peeks, b.delay_rounds) == want
    assert f", {b.unroll}, {sw.THREADS}, {b.nslot}, {sw.PREFETCH}>" in k.name_expression(args)
    assert k.defines_for(args).get("WN_PEEKS", 0) == b.peeks
    assert k.launch_config(args)[2] == ring_bytes(b.unroll * sw.THREADS, b.nslot, backward) <= 96 * 1024
    # every build's parts fit the workspace the args ask for
    for unroll in (sw.UNROLL[backward], sw.RING2_UNROLL[backward]):
        parts = plan_window(rows, cols, k.dtype.bytes, 1, unroll * sw.THREADS).parts
        assert k.get_workspace_size(args) >= workspace_bytes(rows, parts)
    other = sw.WindowBuild(2, 5, 1, 2.0)  # (an artifact compiled for other args)
    calls = []
    artifact = type("A", (), {"compiled_obj": _FakeLauncher(calls), "extra": other})()
    cpu = _args(cls, torch.empty(rows, cols, dtype=dtype))
    monkeypatch.setattr(type(cpu), "device", property(lambda self: torch.device("cuda", 0)), raising=False)
    k._run(cpu, artifact, None, torch.empty(k.get_workspace_size(args) // 4 + 4, dtype=torch.float32))
    ((grid, _, smem, params, _),) = calls
    p = k.plan(args, 264, other)
    assert smem == ring_bytes(2 * sw.THREADS, 5, backward) and grid == p.grid
    assert params[-4:-1] == (p.parts_per_row, p.lag, p.delay)


@pytest.mark.parametrize("rows,cols,dtype,backward,first", [
    # (rows one CTA's shared memory stages: the smem families)
    (2048, 65536, torch.bfloat16, False, "SmemForward"), (2048, 100000, torch.float16, True, "SmemYBackward"),
    # (past them and shorter than 2^17: the long-row families, measured 15-33 % faster than the
    # register and cluster-split kernels there; forwards of fewer than 9 window parts a row on
    # the row-group kernel)
    (2048, 128256, torch.bfloat16, False, "RowGroupForward"), (8192, 128256, torch.float16, True, "WindowBackward"),
    (2048, 65536, torch.float32, False, "RowGroupForward"), (2048, 100000, torch.float32, False, "WindowForward"),
    (2048, 128256, torch.float32, False, "WindowForward"), (2048, 65536, torch.float32, True, "WindowBackward"),
    (2048, 100000, torch.float32, True, "WindowBackward"),
    # (and the long rows: 16-bit forwards of 152064, 10 parts a row, on the window)
    (2048, 152064, torch.bfloat16, False, "WindowForward"),
    # (few rows: the cluster splits below 16, the long-row families from 16)
    (8, 100000, torch.float32, True, "SplitBackward"), (2, 65536, torch.bfloat16, False, "SplitForward"),
    (32, 100000, torch.float32, False, "WindowForward"), (64, 128256, torch.float32, False, "WindowForward"),
    # (few rows of lengths the smem families reach: the cluster splits while one wave
    # of clusters holds the rows, the long-row families past it, the smem kernels from 48-64 rows)
    (8, 100000, torch.bfloat16, True, "SplitBackward"), (24, 82000, torch.bfloat16, True, "WindowBackward"),
    (64, 100000, torch.bfloat16, True, "SmemYBackward"), (32, 65536, torch.bfloat16, False, "SplitForward"),
    (64, 82000, torch.bfloat16, False, "SmemForward"), (128, 50000, torch.bfloat16, False, "SmemForward"),
    (24, 100000, torch.float32, False, "WindowForward"), (128, 32768, torch.float32, True, "SmemYBackward")])
def test_pick_any_between_shared_memory_rows_and_long_rows(rows, cols, dtype, backward, first):
    """PickAny's first choice on the LM-head rows of the vocabulary sweep (H200: the measured
    fastest family, or within 7 % of it) and the few-row sweeps (the fastest family on the H100
    and the H200, within 2 %; tests/data/measured_softmax_times.json), on 132 SMs. Rows between the smem
    families' reach and 2^17 elements go to the long-row families from 16 rows
    (`softmax_rowgroup.LONG_ROWS_MIN_ROWS`), and so do 16-47 rows of 128 KB or more
    (`ranks_long_rows`); fewer stay with the cluster splits."""
    from kernel_api.tuning.policies import rank_candidates

    import kernel_api

    args = _args(_CLASSES[backward], torch.empty(rows, cols, dtype=dtype, device="meta"))
    top = rank_candidates(kernel_api.get_kernels(args, cc=90), args, sm_count=132)[0].metadata.kernel_name
    assert top.startswith("CudaSoftmax" + first), top
