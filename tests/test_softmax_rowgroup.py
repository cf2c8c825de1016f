"""Softmax for very long rows on a cooperative persistent grid (CudaSoftmaxRowGroup*), and the
cuda_src launcher's cooperative launches.

Both variants of each dtype and direction: one CTA per SM (512 consumers) and two (256
consumers, ``rowgroup2``).

CPU: registration and metadata, refusals, the launch plan (CTAs per row, waves, slices,
staging) and the slices' cover of a row, the two-CTA fit (the largest ring two CTAs share an
SM with) against a fake launcher, NVRTC compiles for sm_90a without local memory (traced
builds too) and their defines, the launch arguments `_run` assembles (against the kernel's
signature), the trace's sizing and parsing, the launcher's cooperative configuration and its
refusal of grids that cannot all be resident, PickAny's ranking. GPU (@pytest.mark.gpu):
float64 references on fresh random rows (with -inf rows and huge magnitudes), outputs inside
NaN-filled buffers whose margins must stay untouched, for 1x1M, 8x1M, 32x1M, 8x4M, odd rows,
misaligned base pointers, strided rows, small rings that overflow, forward and backward, all
three dtypes, both variants; back-to-back launches on one stream, repeated launches on the
same buffers, two CTAs per SM really resident, the traced build's output and stamps, and
ops.softmax choosing the family."""

from __future__ import annotations

import re
import types

import pytest
import torch

import kernel_api
from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments
from kernel_api.providers.cuda_src.kernels import softmax_rowgroup as rg
from kernel_api.providers.cuda_src.kernels.softmax_rowgroup import (CudaSoftmaxRowGroupBackward,
                                                                     CudaSoftmaxRowGroupForward, plan_rows)
from kernel_api.tuning.policies import rank_candidates

from memcheck import SOFTMAX_PREAMBLE, run_memcheck
from test_softmax import check_backward, check_forward, make_rows
from test_softmax import input_at as _input_at, margins_untouched as _margins_untouched, poisoned as _poisoned
from test_softmax_smem import _resources

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CLASSES = (CudaSoftmaxRowGroupForward, CudaSoftmaxRowGroupBackward)
#: CTAs per SM of the two instances per dtype and direction
VARIANTS = (1, 2)
_ELEM = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
#: benchmarks/softmax.py's "long" case
LONG = [(1, 2**20), (8, 2**20), (32, 2**20), (8, 2**22)]


def _args(cls, x: torch.Tensor, out: torch.Tensor | None = None):
    out = torch.empty_like(x) if out is None else out
    if cls.backward:
        return SoftmaxBackwardArguments(x, x, out)
    return SoftmaxArguments(x, out)


def _kernel(cls, dtype: torch.dtype, ctas_per_sm: int = 1):
    """A fresh instance (its limits and trace switch are its own)."""
    return next(k for k in cls.generate_kernels(None, cc=90)
                if k.dtype.to_torch() == dtype and k.ctas_per_sm == ctas_per_sm)


def _ranked_without_window(args) -> list:
    """PickAny's order with the L2-window family left out (it ranks first on most long rows;
    test_softmax_window.py checks where): the order among the families before it."""
    return [k for k in rank_candidates(kernel_api.get_kernels(args, cc=90), args)
            if "Window" not in k.metadata.kernel_name]


def _first(rows: int, cols: int, dtype: torch.dtype, backward: bool) -> str:
    x = torch.empty(rows, cols, dtype=dtype, device="meta")
    args = SoftmaxBackwardArguments(x, x, torch.empty_like(x)) if backward else SoftmaxArguments(x, torch.empty_like(x))
    return _ranked_without_window(args)[0].metadata.kernel_name


# ----------------------------------------------------------------------------------- CPU
def test_instances_names_and_metadata():
    fwd = {k.metadata.kernel_name: k for k in CudaSoftmaxRowGroupForward.generate_kernels(None, cc=90)}
    bwd = {k.metadata.kernel_name: k for k in CudaSoftmaxRowGroupBackward.generate_kernels(None, cc=90)}
    assert sorted(fwd) == [f"CudaSoftmaxRowGroupForward_{d}_rowgroup{n}_peel{v}"
                           for d, v in (("bf16", 8), ("f16", 8), ("f32", 4)) for n in ("2", "")]
    assert sorted(bwd) == [n.replace("Forward", "Backward") for n in sorted(fwd)]
    # the one-CTA instances (the names tuning records use) come first
    assert [k.ctas_per_sm for k in CudaSoftmaxRowGroupForward.generate_kernels(None, cc=90)] == [1, 1, 1, 2, 2, 2]
    for name, ctas_per_sm, consumers in [("CudaSoftmaxRowGroupForward_bf16_rowgroup_peel8", 1, 512),
                                         ("CudaSoftmaxRowGroupForward_bf16_rowgroup2_peel8", 2, 256)]:
        k = fwd[name]
        md = k.metadata
        # the forward's storer warp (its bulk-store build) besides the producer warp
        assert (k.ctas_per_sm, k.consumers, k.threads) == (ctas_per_sm, consumers, consumers + 64)
        assert k.bulk_out and not bwd[name.replace("Forward", "Backward")].bulk_out
        assert bwd[name.replace("Forward", "Backward")].threads == consumers + 32
        assert md.provider == "cuda_src" and md.min_cc == 90
        assert md.design.strategy == "rowgroup" and md.design.max_cols is None
        assert md.design.min_cols == rg.long_rows_from(2) == 116104  # (one past the smem family's bf16 rows)
        extra = dict(md.design.extra)
        assert extra["cooperative"] and extra["peel"]
        assert md.design.threads_per_row == extra["consumers"] == consumers and extra["ctas_per_sm"] == ctas_per_sm
        assert md.operands.x.divisibility == 1  # any alignment (peeled)
    assert (rg.CONSUMERS, rg.THREADS) == (512, 544)  # (the one-CTA instances')
    assert not CudaSoftmaxRowGroupForward.generate_kernels(None, cc=80)  # TMA bulk copies, mbarriers: sm_90+
    # discovered through the registry, for both directions
    x = torch.empty(4, 2**20, dtype=torch.bfloat16)
    assert "CudaSoftmaxRowGroupForward_bf16_rowgroup_peel8" in {
        k.metadata.kernel_name for k in kernel_api.get_kernels(_args(CudaSoftmaxRowGroupForward, x), cc=90)}
    assert {"CudaSoftmaxRowGroupBackward_bf16_rowgroup_peel8", "CudaSoftmaxRowGroupBackward_bf16_rowgroup2_peel8"} <= {
        k.metadata.kernel_name for k in kernel_api.get_kernels(_args(CudaSoftmaxRowGroupBackward, x), cc=90)}


def test_defines_and_compile_keys():
    """Consumers and launch bounds reach the source through defines (part of the compile key,
    so each variant and the traced build are artifacts of their own); the one-CTA defines are
    the source's defaults; the traced build adds RG_TRACE and its wave count."""
    args = _args(CudaSoftmaxRowGroupForward, torch.empty(3, 1000, dtype=torch.bfloat16))
    one, two = (_kernel(CudaSoftmaxRowGroupForward, torch.bfloat16, n) for n in VARIANTS)
    stagger = {"RG_STAGGER_NS": rg.STAGGER_NS_FORWARD}  # the forwards' (the backward measured no gain)
    assert one.defines_for(args) == {"RG_CONSUMERS": 512, "RG_MIN_BLOCKS": 1, "RG_BULK_OUT": 1, "RG_PACKED_MATH": 1,
                                     **stagger}
    assert two.defines_for(args) == {"RG_CONSUMERS": 256, "RG_MIN_BLOCKS": 2, "RG_BULK_OUT": 1, "RG_PACKED_MATH": 1,
                                     **stagger}
    f32 = _kernel(CudaSoftmaxRowGroupForward, torch.float32, 1)
    assert f32.defines_for(_args(CudaSoftmaxRowGroupForward, torch.empty(3, 1000))) == {
        "RG_CONSUMERS": 512, "RG_MIN_BLOCKS": 1, "RG_BULK_OUT": 1, **stagger}
    back = _kernel(CudaSoftmaxRowGroupBackward, torch.bfloat16, 1)
    assert back.defines_for(_args(CudaSoftmaxRowGroupBackward, torch.empty(3, 1000))) == {
        "RG_CONSUMERS": 512, "RG_MIN_BLOCKS": 1}
    src = CudaSoftmaxRowGroupForward.get_source()
    assert "#ifndef RG_CONSUMERS\n#define RG_CONSUMERS 512" in src
    assert "#ifndef RG_MIN_BLOCKS\n#define RG_MIN_BLOCKS 1" in src
    assert "__launch_bounds__(RG_THREADS, 1)" not in src
    assert src.count("__launch_bounds__(RG_THREADS, RG_MIN_BLOCKS)") == 2
    keys = {one.compile_key(args, 90), two.compile_key(args, 90)}
    one.trace = two.trace = True
    assert one.defines_for(args) == {"RG_CONSUMERS": 512, "RG_MIN_BLOCKS": 1, "RG_TRACE": 1,
                                     "RG_TRACE_WAVES": rg.TRACE_WAVES, "RG_BULK_OUT": 1, "RG_PACKED_MATH": 1,
                                     **stagger}
    keys |= {one.compile_key(args, 90), two.compile_key(args, 90)}
    assert len(keys) == 4
    assert len({k[0] for k in keys}) == 1  # one template instance, four builds



def test_one_cta_build_is_the_source_default():
    """The one-CTA instance's explicit defines compile the same cubin as none (the defaults the
    source had before they became parameters; RG_TRACE off adds nothing)."""
    from kernel_api.nvrtc import compile_cuda

    k = _kernel(CudaSoftmaxRowGroupBackward, torch.bfloat16)
    args = _args(CudaSoftmaxRowGroupBackward, torch.empty(3, 1000, dtype=torch.bfloat16))
    built = k.compile(args, cc=90).compiled_obj.compiled
    plain = compile_cuda(k.get_source(), cc=90, name_expressions=[k.name_expression(args)], defines={},
                         source_name=k.source_name())
    assert built.cubin == plain.cubin


def test_refusals_say_why():
    k = _kernel(CudaSoftmaxRowGroupForward, torch.bfloat16)
    # operands whose rows start at different offsets from a 16-byte boundary: no one peel
    xb = torch.randn(4 * 300000 + 8, dtype=torch.bfloat16)
    x = xb[1:1 + 4 * 300000].view(4, 300000)
    status = k.supports(SoftmaxArguments(x, torch.empty(4, 300000, dtype=torch.bfloat16)), 90)
    assert not status and "different offsets from a 16-byte boundary" in status.error
    # one phase (x and out one element past a boundary): taken
    out = torch.empty(4 * 300000 + 8, dtype=torch.bfloat16)[1:1 + 4 * 300000].view(4, 300000)
    assert k.supports(SoftmaxArguments(x, out), 90)
    # rows past the 32-bit row length
    big = torch.empty(1, 2**31, dtype=torch.bfloat16, device="meta")
    status = k.supports(SoftmaxArguments(big, torch.empty_like(big)), 90)
    assert not status and "exceed its 2^31-1" in status.error
    # any number of rows: the persistent grid takes them in waves
    many = torch.empty(2**31, 8, dtype=torch.bfloat16, device="meta")
    assert k.supports(SoftmaxArguments(many, torch.empty_like(many)), 90)


def test_plans_for_the_long_benchmark_shapes():
    """On 132 SMs with 14-chunk rings (H100/H200), the slices the sweeps ran fastest with:
    128 KB in the forward (32x1M bf16: S=16, 8 rows at once, 4 waves; 8x4M: S=64), 128 KB of
    dy and y in the backward (32x1M bf16: S=32, measured on an H200); a lone row on every
    SM; only the f32 backward of 4M columns (254 KB of dy and y per CTA) overflows the ring."""
    p = plan_rows(32, 2**20, 2, False)
    assert (p.ctas_per_row, p.groups, p.waves, p.grid) == (16, 8, 4, 128)
    assert p.slice_vectors == 2**17 // 16 and p.overflow_vectors == 0
    p = plan_rows(8, 2**22, 2, False)
    assert (p.ctas_per_row, p.groups, p.waves) == (64, 2, 4) and p.overflow_vectors == 0
    p = plan_rows(32, 2**20, 2, True)
    assert (p.ctas_per_row, p.groups, p.waves) == (32, 4, 8) and p.overflow_vectors == 0
    assert p.slice_vectors * 16 == 64 * 1024 and plan_rows(32, 2**20, 4, True).ctas_per_row == 64
    p = plan_rows(32, 2**20, 4, False)
    assert (p.ctas_per_row, p.groups, p.waves) == (32, 4, 8)
    p = plan_rows(1, 2**20, 2, False)
    assert p.waves == 1 and p.grid == 132
    p = plan_rows(4, 2**20, 2, False)
    assert (p.ctas_per_row, p.waves, p.grid) == (33, 1, 132)  # rows that fit one wave share the grid
    for eb in (2, 4):
        for backward in (False, True):
            for rows, cols in LONG:
                p = plan_rows(rows, cols, eb, backward)
                assert p.grid >= 128, (rows, cols, eb, backward, p)  # (nearly) every SM
                assert (p.overflow_vectors > 0) == (eb == 4 and backward and cols == 2**22), p
    p = plan_rows(8, 2**22, 4, True)
    cv = rg.chunk_vectors(True)
    assert p.staged_vectors == (p.ring_chunks - rg.PREFETCH_CHUNKS) * cv
    assert p.smem_bytes == rg.DEFAULT_RING * rg.CHUNK_BYTES <= 227 * 1024


def test_two_cta_plans_for_the_long_benchmark_shapes():
    """Two CTAs per SM (264 on 132 SMs, 7-chunk rings): the same measured slice targets as a
    share of the (halved) ring, so twice the CTAs per row with half the slices; the f32
    backward of 4M columns keeps the one-CTA ring's share of staged chunks (5 of 7)."""
    assert rg.default_ring(1) == rg.DEFAULT_RING == 14 and rg.default_ring(2) == 7
    assert [rg.prefetch_reserve(r) for r in (1, 2, 3, 6, 7, 14)] == [0, 1, 1, 2, 2, rg.PREFETCH_CHUNKS]
    p = plan_rows(32, 2**20, 2, False, 264, 7)
    assert (p.ctas_per_row, p.groups, p.waves, p.grid, p.slice_vectors * 16) == (32, 8, 4, 256, 64 * 1024)
    p = plan_rows(32, 2**20, 2, True, 264, 7)
    assert (p.ctas_per_row, p.groups, p.waves, p.grid) == (64, 4, 8, 256)
    p = plan_rows(1, 2**20, 2, False, 264, 7)
    assert p.grid == 264 and p.waves == 1
    for eb in (2, 4):
        for backward in (False, True):
            for rows, cols in LONG:
                p = plan_rows(rows, cols, eb, backward, 264, 7)
                assert 255 <= p.grid <= 264, (rows, cols, eb, backward, p)
                assert (p.overflow_vectors > 0) == (eb == 4 and backward and cols == 2**22), p
    p = plan_rows(8, 2**22, 4, True, 264, 7)
    assert p.staged_vectors == 5 * rg.chunk_vectors(True) and p.smem_bytes == 7 * rg.CHUNK_BYTES


@pytest.mark.parametrize("ctas,ring", [(132, 14), (148, 14), (16, 3), (1, 1), (7, 2)])
def test_plan_invariants(ctas, ring):
    """What the kernel relies on (else it traps): the grid fits, every row has a group, the
    staged part of a slice fits the ring; and the slices cover the row."""
    import random

    rnd = random.Random(ctas * 100 + ring)
    shapes = [(1, 1), (3, 7), (67, 4097), (1, 2**20), (5, 2**22 + 3), (300, 131075), (2**20, 9)]
    shapes += [(rnd.randint(1, 3000), rnd.randint(1, 3 * 2**20)) for _ in range(30)]
    for rows, cols in shapes:
        for eb in (2, 4):
            for backward in (False, True):
                p = plan_rows(rows, cols, eb, backward, ctas, ring)
                cv = rg.chunk_vectors(backward)
                nvec = rg.row_vectors(cols, eb)
                what = (rows, cols, eb, backward, p)
                assert 1 <= p.grid <= ctas and 1 <= p.groups <= rows, what
                assert p.waves == -(-rows // p.groups), what
                assert p.slice_vectors * p.ctas_per_row >= nvec and p.slice_vectors == -(-nvec // p.ctas_per_row)
                assert 0 <= p.staged_vectors <= min(p.slice_vectors, ring * cv), what
                if p.overflow_vectors:
                    # (chunks left for the next wave's copies)
                    reserve = rg.prefetch_reserve(ring)
                    assert 0 <= reserve < ring
                    assert p.slice_vectors > ring * cv and -(-p.staged_vectors // cv) == ring - reserve, what
                assert p.workspace_bytes == p.grid * rg.SLOT_BYTES
                chunks = rg.wave_chunks(p.staged_vectors, backward)
                assert not p.ahead or (p.ctas_per_row > 1 and 3 * chunks <= ring), what  # two waves held, one coming


def test_slices_cover_every_vector_once():
    """The kernel's balanced split (`slice_bounds`): consecutive, disjoint, covering [0, nvec),
    each at most the plan's slice."""
    for nvec in (0, 1, 7, 131072, 131071, 524288, 1000003 // 8):
        for S in (1, 2, 3, 33, 66, 132, 148):
            bounds = [rg.slice_bounds(nvec, S, r) for r in range(S)]
            assert bounds[0][0] == 0 and bounds[-1][1] == nvec
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [v1 - v0 for v0, v1 in bounds]
            assert max(sizes) - min(sizes) <= 1 and max(sizes) <= -(-nvec // S)


@pytest.mark.parametrize("trace", [False, True])
@pytest.mark.parametrize("ctas_per_sm", VARIANTS)
@pytest.mark.parametrize("cls", _CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiles_for_sm90a_without_spills(cls, dtype, ctas_per_sm, trace):
    """One artifact per dtype, direction and variant (any shape), and a traced one; the cubin's
    report: no local memory, registers that let `ctas_per_sm` CTAs share an SM's 64K."""
    k = _kernel(cls, dtype, ctas_per_sm)
    k.trace = trace
    args = _args(cls, torch.empty(3, 1000, dtype=dtype))
    artifact = k.compile(args, cc=90)
    assert artifact.compiled_obj.compiled.arch == "sm_90a"
    assert artifact.extra == rg.RowGroupBuild(k.consumers, ctas_per_sm, trace, not cls.backward)
    op = "bwd" if cls.backward else "fwd"
    assert artifact.compiled_obj.name_expression == f"ka_softmax::{op}_rowgroup<{rg._TYPES[k.dtype]}, {k.vec}>"
    assert k.compile_key(_args(cls, torch.empty(8, 2**20, dtype=dtype)), 90) == k.compile_key(args, 90)
    res = _resources(artifact)
    assert res.get(0x11, 0) == 0 and res.get(0x12, 0) == 0, f"{k.metadata.kernel_name}: local memory {res}"
    assert 0 < res[0x2f] <= 65536 // (ctas_per_sm * k.threads) // 8 * 8, res


@pytest.mark.parametrize("ctas_per_sm", VARIANTS)
def test_compiles_for_sm100a(ctas_per_sm):
    k = _kernel(CudaSoftmaxRowGroupBackward, torch.bfloat16, ctas_per_sm)
    assert k.compile(_args(CudaSoftmaxRowGroupBackward, torch.empty(3, 1000, dtype=torch.bfloat16)),
                     cc=100).compiled_obj.compiled.arch == "sm_100a"


def _signature_params(kernel_name: str) -> int:
    """Parameters of a __global__ function of softmax_rowgroup.cu."""
    m = re.search(rf"\b{kernel_name}\(([^)]*)\)", CudaSoftmaxRowGroupForward.get_source())
    return len(m.group(1).split(","))


class _FakeLauncher:
    """Stands for an artifact's CudaLauncher: the device's room, and the launches asked for."""

    def __init__(self, ctas: int = 132, smem: int = 232448 - 520) -> None:
        self.ctas, self.smem, self.launches = ctas, smem, []

    def max_dynamic_smem(self, device: int) -> int:
        return self.smem

    def max_coresident(self, device: int, threads: int, smem: int) -> int:
        return self.ctas

    def launch(self, stream, device, grid, block, smem, params, cooperative=False):
        self.launches.append(dict(stream=stream, device=device, grid=grid, block=block, smem=smem, params=params,
                                  cooperative=cooperative))


class _OccupancyLauncher(_FakeLauncher):
    """An H100-like device: CTAs per SM from registers (``regs`` per thread, by warp), threads,
    and ``smem_per_sm`` shared memory (the ring, 896 bytes static, 1 KB reserved per CTA; a
    CTA may have all but 1 KB of it), at most ``cap``."""

    def __init__(self, sms: int = 132, regs: int = 96, cap: int = 32, smem_per_sm: int = 233472) -> None:
        super().__init__(sms, smem_per_sm - 1024 - 896)
        self.sms, self.regs, self.cap, self.smem_per_sm, self.asked = sms, regs, cap, smem_per_sm, []

    def max_coresident(self, device: int, threads: int, smem: int) -> int:
        self.asked.append((threads, smem))
        warps = -(-threads // 32)
        per_sm = min(65536 // (warps * 32 * self.regs), 2048 // threads, self.smem_per_sm // (smem + 896 + 1024),
                     self.cap)
        return per_sm * self.sms


def test_two_cta_fit_takes_the_largest_ring_two_share():
    """`_fit`: the one-CTA instances take the full ring (one per SM); the two-CTA ones the
    largest ring for which two CTAs of 288 threads reside per SM (7 chunks on an H100's
    228 KB), and the grid of 2 x SMs; where registers allow only one, a full ring for one per
    SM (logged), still a valid plan."""
    one = _kernel(CudaSoftmaxRowGroupForward, torch.bfloat16, 1)
    two = _kernel(CudaSoftmaxRowGroupForward, torch.bfloat16, 2)
    fake = _OccupancyLauncher()
    f1, f2 = one._fit(fake, 0), two._fit(fake, 0)
    assert (f1.ctas, f1.ring_chunks, f1.sms) == (132, 14, 132)
    assert (f2.ctas, f2.ring_chunks, f2.sms) == (264, 7, 132)
    assert {t for t, _ in fake.asked} == {576, 320}  # each asked with its own block size (and storer warp)
    assert two._fit(fake, 0) is f2  # (once per device)
    # other devices: 148 SMs; 200 KB of shared memory per SM (a full ring of 12 chunks)
    assert two._fit(_OccupancyLauncher(sms=148), 1) == rg._DeviceFit(296, 7, 148)
    assert two._fit(_OccupancyLauncher(smem_per_sm=200 * 1024), 2) == rg._DeviceFit(264, 6, 132)
    assert one._fit(_OccupancyLauncher(smem_per_sm=200 * 1024), 2) == rg._DeviceFit(132, 12, 132)
    # registers for one CTA per SM only: the full ring, SMs CTAs
    assert two._fit(_OccupancyLauncher(regs=128), 3) == rg._DeviceFit(132, 14, 132)


@pytest.mark.parametrize("cls", _CLASSES)
def test_two_cta_group_plan_and_overrides(cls, monkeypatch):
    """The plan a two-CTA launch takes is made for its ring and 2 x SMs; `limit_ring` below it
    plans for what that ring lets reside (at most two per SM: the workspace's room),
    `limit_ctas` caps the grid, `ctas_per_row` fixes S; the launch uses 288 threads."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    k = _kernel(cls, torch.bfloat16, 2)
    args = _args(cls, torch.empty(32, 2**20, dtype=torch.bfloat16))
    fake = _OccupancyLauncher(cap=4)  # (small rings would let 4 reside by shared memory alone)
    plan, resident = k.group_plan(args, fake, 0)
    assert resident == 264 and plan == plan_rows(32, 2**20, 2, cls.backward, 264, 7)
    assert plan.grid > 132 and plan.ring_chunks == 7
    ws = torch.empty(k.get_workspace_size(args), dtype=torch.uint8)
    assert ws.numel() >= rg.SLOT_BYTES * 264
    k._run(args, types.SimpleNamespace(compiled_obj=fake), 0x1, ws)
    launch = fake.launches[-1]
    assert (launch["grid"], launch["block"], launch["smem"]) == (plan.grid, 288 + 32 * k.bulk_out, 7 * rg.CHUNK_BYTES)
    assert launch["cooperative"]
    k.limit_ring = 2
    plan, resident = k.group_plan(args, fake, 0)
    assert resident == 264 and plan.ring_chunks == 2  # capped at two per SM
    k.limit_ring = 12  # above the fit's ring: the fit stands
    assert k.group_plan(args, fake, 0)[0].ring_chunks == 7
    k.limit_ring, k.limit_ctas, k.ctas_per_row = 3, 50, 7
    plan, resident = k.group_plan(args, fake, 0)
    assert (plan.ctas_per_row, plan.groups, plan.ring_chunks, plan.grid) == (7, 7, 3, 49)
    k._run(args, types.SimpleNamespace(compiled_obj=fake), 0x1, ws)
    S, G, cap, ring, ahead = fake.launches[-1]["params"][-5:]
    assert (S, G, ring, fake.launches[-1]["grid"]) == (7, 7, 3, 49)
    # the one-CTA instance with a 7-chunk ring (registers let only one of 544 threads reside)
    k1 = _kernel(cls, torch.bfloat16, 1)
    k1.limit_ring = 7
    assert k1.group_plan(args, fake, 0)[1] == 132


@pytest.mark.parametrize("cls", _CLASSES)
def test_run_launches_the_plan_cooperatively(cls, monkeypatch):
    """`_run` (no GPU: a fake launcher) launches the plan for the device's room, cooperatively,
    with the kernel's parameters in its signature's order, a fresh epoch each launch."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    k = _kernel(cls, torch.bfloat16)
    cols = 2**20 + 2
    # strided rows one element past a 16-byte boundary, into an output at the same phases
    x = torch.empty(32, cols + 8, dtype=torch.bfloat16)[:, 1:cols + 1]
    out = torch.empty(32 * cols + 8, dtype=torch.bfloat16)[1:32 * cols + 1].view(32, cols)
    args = SoftmaxBackwardArguments(x, x, out) if cls.backward else SoftmaxArguments(x, out)
    assert k.supports(args, 90), k.supports(args, 90).error
    fake = _FakeLauncher(ctas=120)
    artifact = types.SimpleNamespace(compiled_obj=fake)
    ws = torch.empty(k.get_workspace_size(args), dtype=torch.uint8)
    k._run(args, artifact, 0x1234, ws)
    k._run(args, artifact, 0x1234, ws)
    p = plan_rows(32, cols, 2, cls.backward, 120, (232448 - 520) // rg.CHUNK_BYTES)
    first, second = fake.launches
    assert first["cooperative"] and first["grid"] == p.grid <= 120 and first["block"] == k.threads
    assert k.threads == rg.THREADS + (0 if cls.backward else 32)  # (the forward's storer warp)
    assert first["smem"] == p.smem_bytes == 14 * rg.CHUNK_BYTES and first["stream"] == 0x1234
    params = first["params"]
    assert len(params) == _signature_params("bwd_rowgroup" if cls.backward else "fwd_rowgroup")
    ws_ptr, epoch, S, G, cap, ring, ahead = params[-7:]
    assert (ws_ptr, S, G, cap, ring, ahead) == (ws.data_ptr(), p.ctas_per_row, p.groups, p.staged_vectors,
                                                p.ring_chunks, int(p.ahead))
    assert second["params"][-6] != epoch and 0 <= epoch < 2**32
    if cls.backward:  # dy, y, dx, rows, cols, their row strides
        assert params[:8] == (x.data_ptr(), x.data_ptr(), out.data_ptr(), 32, cols, cols + 8, cols + 8, cols)
    else:  # x, out, rows, cols, their row strides
        assert params[:6] == (x.data_ptr(), out.data_ptr(), 32, cols, cols + 8, cols)
    # a workspace too small (or none) is refused before launching
    with pytest.raises(ValueError, match="needs a 16-byte aligned workspace"):
        k._run(args, artifact, 0x1234, ws[: p.workspace_bytes - 1])
    with pytest.raises(ValueError, match="workspace"):
        k._run(args, artifact, 0x1234, None)
    assert len(fake.launches) == 2
    # no rows: nothing launched
    empty = _args(cls, torch.empty(0, 2**20, dtype=torch.bfloat16))
    k._run(empty, artifact, 0x1234, ws)
    assert len(fake.launches) == 2


def test_caps_and_a_fixed_split_reach_the_launch(monkeypatch):
    """`limit_ctas`, `limit_ring` and `ctas_per_row` (tests, experiments) shape the plan launched."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    k = _kernel(CudaSoftmaxRowGroupBackward, torch.float32)
    k.limit_ctas, k.limit_ring, k.ctas_per_row = 12, 3, 5
    args = _args(CudaSoftmaxRowGroupBackward, torch.empty(7, 150001))
    fake = _FakeLauncher()
    k._run(args, types.SimpleNamespace(compiled_obj=fake), 0x1, torch.empty(k.get_workspace_size(args), dtype=torch.uint8))
    launch = fake.launches[0]
    S, G, cap, ring, ahead = launch["params"][-5:]
    assert (S, G, ring, launch["grid"], launch["smem"]) == (5, 2, 3, 10, 3 * rg.CHUNK_BYTES)
    p = plan_rows(7, 150001, 4, True, 12, 3, 5)
    assert cap == p.staged_vectors < p.slice_vectors and ahead == int(p.ahead)  # (the slice overflows 3 chunks)


def test_a_smaller_ring_plans_for_the_ctas_it_lets_reside(monkeypatch):
    """`limit_ring` below the device's ring: the plan is made for the CTAs that ring lets
    reside (asked of the launcher; two per SM at most, the workspace's room), and launched."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    class TwoPerSm(_FakeLauncher):
        def max_coresident(self, device, threads, smem):
            return 132 * (2 if smem <= 7 * rg.CHUNK_BYTES else 1) * (3 if smem <= rg.CHUNK_BYTES else 1)

    k = _kernel(CudaSoftmaxRowGroupForward, torch.bfloat16)
    args = _args(CudaSoftmaxRowGroupForward, torch.empty(32, 2**20, dtype=torch.bfloat16))
    fake = TwoPerSm()
    plan, resident = k.group_plan(args, fake, 0)
    assert resident == 132 and plan.ring_chunks == rg.DEFAULT_RING  # the device's own ring
    k.limit_ring = 7
    plan, resident = k.group_plan(args, fake, 0)
    assert resident == 264 and plan.ring_chunks == 7 and 0.96 * 264 <= plan.grid <= 264
    k.limit_ring = 1
    assert k.group_plan(args, fake, 0)[1] == 264  # capped at two per SM (of the full ring's CTAs)
    k.limit_ring = 7
    ws = torch.empty(k.get_workspace_size(args), dtype=torch.uint8)
    k._run(args, types.SimpleNamespace(compiled_obj=fake), 0x1, ws)
    assert fake.launches[-1]["grid"] == plan.grid and fake.launches[-1]["smem"] == 7 * rg.CHUNK_BYTES


@pytest.mark.parametrize("ctas_per_sm", VARIANTS)
def test_workspace_and_launch_config_without_a_gpu(ctas_per_sm):
    k = _kernel(CudaSoftmaxRowGroupForward, torch.float32, ctas_per_sm)
    args = _args(CudaSoftmaxRowGroupForward, torch.empty(8, 2**20))
    grid, block, smem = k.launch_config(args)
    p = k.plan(args)
    assert p == plan_rows(8, 2**20, 4, False, 132 * ctas_per_sm, rg.default_ring(ctas_per_sm))
    assert (grid, block, smem) == (p.grid, 64 + (512 if ctas_per_sm == 1 else 256), p.smem_bytes)
    # room for two CTAs per SM of the device (here: the planning bound without a GPU)
    assert k.get_workspace_size(args) == rg.SLOT_BYTES * rg.MAX_CTAS_PER_SM * 2 * rg.DEFAULT_SMS >= p.workspace_bytes
    e1, e2 = rg.next_epoch(), rg.next_epoch()
    assert e1 != e2 and 0 <= e1 < 2**32 and 0 <= e2 < 2**32


# ---- the trace (RG_TRACE builds) --------------------------------------------------------
def _fake_trace(plan, waves_of=lambda cta: 3, tag=0xABC, base=10**12) -> torch.Tensor:
    """A workspace as a traced launch of ``plan`` leaves it: slots (garbage), then per CTA its
    head and stamps increasing by phase."""
    ws = torch.full((plan.traced_workspace_bytes + 64,), 0x5A, dtype=torch.uint8)
    words = ws[plan.workspace_bytes:plan.traced_workspace_bytes].view(torch.int64).view(plan.grid, rg.TRACE_WORDS)
    words.zero_()
    for cta in range(plan.grid):
        waves = waves_of(cta)
        t = base + 1000 * cta
        head = (rg.TRACE_MAGIC << 32) | waves
        words[cta, :8] = torch.tensor([head, t, t + 1, t + 10**6, t + 2, t + 3, tag, cta // 2])
        for w in range(min(waves, rg.TRACE_WAVES)):
            words[cta, 8 + 4 * w:12 + 4 * w] = torch.tensor([t + 100 * w + 10, t + 100 * w + 20, t + 100 * w + 30,
                                                             t + 100 * w + 5])
    return ws


def test_trace_sizing_and_reading(monkeypatch):
    """A traced instance: its own artifact (defines), a workspace with `TRACE_CTA_BYTES` more
    per CTA of the largest grid, `_run` asking for the traced size whenever the artifact is
    traced (whatever `trace` says now), `clear_trace` zeroing the trace alone, `read_trace`
    parsing records, bounding recorded waves at `TRACE_WAVES` and refusing stale ones."""
    assert rg.TRACE_WORDS == 8 + 4 * rg.TRACE_WAVES and rg.TRACE_CTA_BYTES == 8 * rg.TRACE_WORDS == 576
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    k = _kernel(CudaSoftmaxRowGroupForward, torch.bfloat16, 2)
    args = _args(CudaSoftmaxRowGroupForward, torch.empty(32, 2**20, dtype=torch.bfloat16))
    plain = k.get_workspace_size(args)
    k.trace = True
    traced = k.get_workspace_size(args)
    assert traced == plain + rg.TRACE_CTA_BYTES * rg.MAX_CTAS_PER_SM * 2 * rg.DEFAULT_SMS
    p = k.plan(args)
    assert p.traced_workspace_bytes == p.grid * (rg.SLOT_BYTES + rg.TRACE_CTA_BYTES) <= traced
    # the build decides the size _run asks for
    fake = _OccupancyLauncher()
    traced_artifact = types.SimpleNamespace(compiled_obj=fake, extra=rg.RowGroupBuild(256, 2, True))
    plain_artifact = types.SimpleNamespace(compiled_obj=fake, extra=rg.RowGroupBuild(256, 2, False))
    k.trace = False
    small = torch.empty(plain, dtype=torch.uint8)
    with pytest.raises(ValueError, match="with trace"):
        k._run(args, traced_artifact, 0x1, small)
    k._run(args, plain_artifact, 0x1, small)
    k._run(args, traced_artifact, 0x1, torch.empty(traced, dtype=torch.uint8))
    assert len(fake.launches) == 2
    # parsing
    plan = plan_rows(40, 3000, 2, False, 12, 3, 4)  # 3 groups of 4, 14 waves
    ws = _fake_trace(plan, waves_of=lambda cta: 20 if cta < 4 else 5)
    recs = rg.read_trace(ws, plan)
    assert len(recs) == plan.grid == 12
    r = recs[5]
    assert (r["cta"], r["rank"], r["group"], r["sm"], r["waves"], r["tag"]) == (5, 1, 1, 2, 5, 0xABC)
    assert r["entry"] == 10**12 + 5000 and r["exit"] == r["entry"] + 10**6 and r["issue_first"] == r["entry"] + 2
    assert r["stats"] == [r["entry"] + 100 * w + 10 for w in range(5)] and len(r["issued"]) == 5
    assert recs[0]["waves"] == 20 and len(recs[0]["met"]) == rg.TRACE_WAVES  # (later waves not recorded)
    # clear_trace zeroes the trace and leaves the slots
    rg.clear_trace(ws, plan)
    assert int(ws[plan.workspace_bytes:plan.traced_workspace_bytes].sum()) == 0
    assert bool((ws[:plan.workspace_bytes] == 0x5A).all()) and bool((ws[plan.traced_workspace_bytes:] == 0x5A).all())
    with pytest.raises(ValueError, match="CTA 0 left no complete trace record"):
        rg.read_trace(ws, plan)
    ws = _fake_trace(plan)
    ws[plan.workspace_bytes + 11 * rg.TRACE_CTA_BYTES + 48] ^= 1  # CTA 11's tag
    with pytest.raises(ValueError, match="2 launch tags"):
        rg.read_trace(ws, plan)
    with pytest.raises(ValueError, match="holds"):
        rg.read_trace(ws[:plan.traced_workspace_bytes - 8], plan)


# ---- PickAny ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_pick_any_takes_long_rows_only(dtype):
    """Among the families before the L2-window one (which test_softmax_window.py places first),
    the long shapes (benchmarks/softmax.py's "long" case and a few more) go to the row-group
    family, its one-CTA instance first and the two-CTA one right after (the reverse for 16-bit
    forwards of 4+ groups in two waves or more: 8x1M, one wave, keeps the one-CTA instance
    first, with the bulk stores). Measured (the "H200 window", "H200 final" and "H100 final" runs
    of tests/data/measured_softmax_times.json): the fastest of those families on 23 of the 24
    long cases of each run; on the f32 backward of 8x4M the looped cluster split, which reads the
    rows twice, ran 1-8 % faster. The ordinary shapes keep the kernels measured best there
    (register, shared-memory, looped and cluster-split)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    for backward in (False, True):
        for rows, cols in LONG + [(4, 2**21), (64, 2**20), (256, 2**18)]:
            first = _first(rows, cols, dtype, backward)
            # (16-bit forwards of 4+ row groups in 2+ waves: the two-CTA instance first, measured
            # 2-5 % faster)
            plan = plan_rows(rows, cols, elem, backward, 132, rg.DEFAULT_RING)
            two_first = elem == 2 and not backward and plan.groups >= 4 and plan.waves >= 2
            lead, then = ("_rowgroup2_peel", "_rowgroup_peel") if two_first else ("_rowgroup_peel", "_rowgroup2_peel")
            assert "RowGroup" in first and lead in first, (rows, cols, backward, first)
            x = torch.empty(rows, cols, dtype=dtype, device="meta")
            args = (SoftmaxBackwardArguments(x, x, torch.empty_like(x)) if backward
                    else SoftmaxArguments(x, torch.empty_like(x)))
            ranked = _ranked_without_window(args)
            assert then in ranked[1].metadata.kernel_name, (rows, cols, backward)
        for rows, cols in [(32768, 4096), (16384, 16384), (65536, 1024), (4096, 50257), (8192, 4097),
                           (16384, 4095), (8, 32768), (65536, 512), (2, 65536)]:
            assert "RowGroup" not in _first(rows, cols, dtype, backward), (rows, cols, backward)


# ----------------------------------------------------------------------------------- GPU
def _check_forward_at(rows: int, cols: int, dtype: torch.dtype, offset: int, kernel) -> None:
    x = _input_at(rows, cols, dtype, offset)
    buf, out = _poisoned(rows, cols, dtype, offset)
    args = SoftmaxArguments(x, out)
    assert kernel.supports(args), kernel.supports(args).error
    kernel.run(args)
    torch.cuda.synchronize()
    what = f"{kernel.metadata.kernel_name} {rows}x{cols}+{offset}"
    check_forward(out, x, what)
    _margins_untouched(buf, rows, cols, offset, what)


def _backward_operands(rows: int, cols: int, dtype: torch.dtype, offset: int):
    g = _input_at(rows, cols, dtype, offset)
    g.copy_(torch.randn(rows, cols, device="cuda") * 4)
    y = _input_at(rows, cols, dtype, offset)
    y.copy_(torch.softmax(torch.randn(rows, cols, device="cuda") * 2, -1))
    return g, y


def _check_backward_at(rows: int, cols: int, dtype: torch.dtype, offset: int, kernel) -> None:
    g, y = _backward_operands(rows, cols, dtype, offset)
    buf, grad_in = _poisoned(rows, cols, dtype, offset)
    args = SoftmaxBackwardArguments(g, y, grad_in)
    assert kernel.supports(args), kernel.supports(args).error
    kernel.run(args)
    torch.cuda.synchronize()
    what = f"{kernel.metadata.kernel_name} {rows}x{cols}+{offset}"
    check_backward(grad_in, g, y, what)
    _margins_untouched(buf, rows, cols, offset, what)


# (rows, cols, element offset of the operands past a 16-byte boundary): the benchmark's long
# shapes, odd rows (every row at another phase), misaligned bases, many waves (the ring wraps
# many times), short rows (one CTA per row), a row shorter than a vector.
_SHAPES = LONG + [(3, 1000003, 0), (2, 2**20 + 5, 3), (257, 131075, 1), (67, 4097, 5), (5, 3, 1)]
_SHAPES = [s if len(s) == 3 else (*s, 0) for s in _SHAPES]


@pytest.mark.gpu
@pytest.mark.parametrize("ctas_per_sm", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_shapes(dtype, ctas_per_sm):
    k = _kernel(CudaSoftmaxRowGroupForward, dtype, ctas_per_sm)
    torch.manual_seed(len(str(dtype)))
    for rows, cols, offset in _SHAPES:
        _check_forward_at(rows, cols, dtype, offset, k)
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("ctas_per_sm", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_shapes(dtype, ctas_per_sm):
    """(f32 8x4M: slices past the ring, the overflow read twice; also misaligned, 2x(4M+3).)"""
    k = _kernel(CudaSoftmaxRowGroupBackward, dtype, ctas_per_sm)
    torch.manual_seed(len(str(dtype)) + 1)
    shapes = _SHAPES + ([(2, 2**22 + 3, 1)] if dtype == torch.float32 else [])
    for rows, cols, offset in shapes:
        _check_backward_at(rows, cols, dtype, offset, k)
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("ctas_per_sm", VARIANTS)
def test_stagger_changes_timing_only(ctas_per_sm):
    """The forward's stagger (the upper half of the groups starting late with 4+ waves) gives the
    same bits as none, on a grid of 4 groups and 10 waves."""
    import copy

    k = _kernel(CudaSoftmaxRowGroupForward, torch.bfloat16, ctas_per_sm)
    assert k.stagger_ns == rg.STAGGER_NS_FORWARD
    plain = copy.copy(k)
    plain.stagger_ns = 0
    x = _input_at(40, 70001, torch.bfloat16, 1)
    outs = []
    for kernel in (k, plain):
        kernel.limit_ctas, kernel.ctas_per_row = 12, 3
        try:
            _, out = _poisoned(40, 70001, torch.bfloat16, 1)  # rows at x's phase
            kernel.run(SoftmaxArguments(x, out))
            torch.cuda.synchronize()
            outs.append(out)
        finally:
            kernel.limit_ctas = kernel.ctas_per_row = None
    check_forward(outs[0], x, "staggered 40x70001")
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))  # bits (NaN margins)


# (limit_ctas, limit_ring, ctas_per_row, rows, cols, offset): slices overflowing rings of 1-3
# chunks (the overflow read twice), rings wrapping many times, both consumer schedules (with
# and without the look-ahead), odd groupings, one CTA per row. (A limit_ring above the
# instance's own ring, 14 for the two-CTA one, leaves its ring of 7.)
_SMALL = [(7, 3, None, 9, 70001, 3), (12, 3, 3, 10, 150001, 1), (5, 2, 5, 4, 99999, 0), (16, 6, 1, 33, 40003, 5),
          (24, 1, None, 3, 400001, 0), (9, 14, 4, 11, 9001, 7)]


@pytest.mark.gpu
@pytest.mark.parametrize("ctas_per_sm", VARIANTS)
@pytest.mark.parametrize("cls", _CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_small_rings_and_grids(cls, dtype, ctas_per_sm):
    k = _kernel(cls, dtype, ctas_per_sm)
    torch.manual_seed(len(str(dtype)) + 3 * cls.backward)
    try:
        for ctas, ring, S, rows, cols, offset in _SMALL:
            k.limit_ctas, k.limit_ring, k.ctas_per_row = ctas, ring, S
            if cls.backward:
                _check_backward_at(rows, cols, dtype, offset, k)
            else:
                _check_forward_at(rows, cols, dtype, offset, k)
    finally:
        k.limit_ctas = k.limit_ring = k.ctas_per_row = None


@pytest.mark.gpu
@pytest.mark.parametrize("ctas_per_sm", VARIANTS)
@pytest.mark.parametrize("cls", _CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_other_store_build(cls, dtype, ctas_per_sm):
    """Each direction's other build, an experiment switch (`bulk_out`): the forward storing from
    its consumer threads, the backward through a storer warp's TMA bulk stores (measured
    slower on an H200). The long and odd shapes,
    then small rings and grids (overflowing slices, rings wrapping many times, with and without
    the look-ahead), each output inside a poisoned margin."""
    k = _kernel(cls, dtype, ctas_per_sm)
    k.bulk_out = not k.bulk_out
    torch.manual_seed(len(str(dtype)) + 5 * cls.backward)
    _check_shapes_and_small_rings(k, dtype)


def _check_shapes_and_small_rings(k, dtype: torch.dtype) -> None:
    """``k`` (a build of its own) on `_SHAPES`, then on `_SMALL`'s rings and grids."""
    check = _check_backward_at if k.backward else _check_forward_at
    for rows, cols, offset in _SHAPES:
        check(rows, cols, dtype, offset, k)
        torch.cuda.empty_cache()
    try:
        for ctas, ring, S, rows, cols, offset in _SMALL:
            k.limit_ctas, k.limit_ring, k.ctas_per_row = ctas, ring, S
            check(rows, cols, dtype, offset, k)
    finally:
        k.limit_ctas = k.limit_ring = k.ctas_per_row = None


@pytest.mark.gpu
@pytest.mark.parametrize("ctas_per_sm", VARIANTS)
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_scalar_math_build(dtype, ctas_per_sm):
    """The 16-bit forwards without their RG_PACKED_MATH (the slice's max and bf16's output
    scaling in f32, an experiment switch; the packed build is the instances' own): the long and
    odd shapes and small rings, each output inside a poisoned margin, against float64."""
    k = _kernel(CudaSoftmaxRowGroupForward, dtype, ctas_per_sm)
    assert k.packed_math
    k.packed_math = False
    torch.manual_seed(11 + len(str(dtype)))
    _check_shapes_and_small_rings(k, dtype)


_SANITIZED = SOFTMAX_PREAMBLE + r"""
from kernel_api.providers.cuda_src.kernels.softmax_rowgroup import CudaSoftmaxRowGroupBackward, CudaSoftmaxRowGroupForward
for cls in (CudaSoftmaxRowGroupForward, CudaSoftmaxRowGroupBackward):
    for k in cls.generate_kernels(None, cc=90):
        dtype = k.dtype.to_torch()
        for ctas, ring, S, rows, cols, offset in [(None, None, None, 3, 200003, 3), (6, 2, 3, 5, 30011, 1)]:
            k.limit_ctas, k.limit_ring, k.ctas_per_row = ctas, ring, S
            launch(k, cls.backward, rows, cols, dtype, offset)
torch.cuda.synchronize()
print("launches", n)
"""


@pytest.mark.gpu
def test_memcheck():
    """Both directions, every dtype, both variants, a row split over many CTAs and a small
    ring whose slices overflow, misaligned, under compute-sanitizer memcheck (caching
    allocator off: each operand and workspace is its own allocation, so an overrun is caught)."""
    out = run_memcheck(_SANITIZED)
    assert int(out.split("launches")[-1].split()[0]) == 24, out[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("ctas_per_sm", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows(dtype, ctas_per_sm):
    """Rows of a wider buffer, three elements past a 16-byte boundary and of odd length (each
    row at another phase), into a poisoned contiguous output: taken when the row stride keeps
    every operand's rows at one phase (stride cols + 3 vectors), refused otherwise; the
    backward's dy and y strided alike."""
    rows, cols, offset = 6, 2**20 + 1, 3
    vec = 16 // _ELEM[dtype]
    k = _kernel(CudaSoftmaxRowGroupForward, dtype, ctas_per_sm)
    bufo, out = _poisoned(rows, cols, dtype, offset)

    def strided(stride: int) -> torch.Tensor:
        flat = torch.empty(rows * stride + offset, device="cuda", dtype=dtype)
        return flat[offset:].as_strided((rows, cols), (stride, 1))

    refused = k.supports(SoftmaxArguments(strided(cols + 13), out))
    assert not refused and "different offsets" in refused.error
    x = strided(cols + 3 * vec)
    x.copy_(make_rows(rows, cols, dtype))
    args = SoftmaxArguments(x, out)
    assert k.supports(args), k.supports(args).error
    k.run(args)
    torch.cuda.synchronize()
    check_forward(out, x, f"{k.metadata.kernel_name} strided")
    _margins_untouched(bufo, rows, cols, offset, f"{k.metadata.kernel_name} strided")
    kb = _kernel(CudaSoftmaxRowGroupBackward, dtype, ctas_per_sm)
    g, y = strided(cols + 3 * vec), strided(cols + 5 * vec)
    g.copy_(torch.randn(rows, cols, device="cuda") * 4)
    y.copy_(torch.softmax(torch.randn(rows, cols, device="cuda") * 2, -1))
    bufg, grad_in = _poisoned(rows, cols, dtype, offset)
    bargs = SoftmaxBackwardArguments(g, y, grad_in)
    assert kb.supports(bargs), kb.supports(bargs).error
    kb.run(bargs)
    torch.cuda.synchronize()
    check_backward(grad_in, g, y, f"{kb.metadata.kernel_name} strided")
    _margins_untouched(bufg, rows, cols, offset, f"{kb.metadata.kernel_name} strided")


@pytest.mark.gpu
@pytest.mark.parametrize("ctas_per_sm", VARIANTS)
@pytest.mark.parametrize("cls", _CLASSES)
def test_back_to_back_and_repeated_launches(cls, ctas_per_sm):
    """Launches queued on one stream without synchronising (each finds the workspace as the
    previous left it), a different shape between them, and the same buffers run again:
    every result right, the repeat bit-identical."""
    dtype = torch.bfloat16
    k = _kernel(cls, dtype, ctas_per_sm)
    shapes = [(32, 2**20), (5, 300007), (32, 2**20), (1, 2**20)]
    runs = []
    for rows, cols in shapes:
        if cls.backward:
            g, y = _backward_operands(rows, cols, dtype, 0)
            out = torch.full_like(g, float("nan"))
            args = SoftmaxBackwardArguments(g, y, out)
            runs.append((args, out, (g, y)))
        else:
            x = make_rows(rows, cols, dtype)
            out = torch.full_like(x, float("nan"))
            runs.append((SoftmaxArguments(x, out), out, (x,)))
    artifact = k.compile(runs[0][0])
    for args, _, _ in runs:  # back to back: no synchronisation between them
        k.run(args, compiled_artifact=artifact)
    torch.cuda.synchronize()
    for args, out, inputs in runs:
        what = f"{k.metadata.kernel_name} {tuple(out.shape)} back to back"
        if cls.backward:
            check_backward(out, *inputs, what)
        else:
            check_forward(out, inputs[0], what)
    args, out, inputs = runs[0]
    first = out.clone()
    for _ in range(3):  # the same buffers (and arguments) again, one workspace allocation after another
        out.fill_(float("nan"))
        k.run(args, compiled_artifact=artifact)
        k.run(args, compiled_artifact=artifact)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), first.view(torch.int16)), "a repeated launch differs"


@pytest.mark.gpu
@pytest.mark.parametrize("ctas_per_sm", VARIANTS)
def test_side_stream_and_fresh_data(ctas_per_sm):
    """One artifact over new data each call on a side stream."""
    k = _kernel(CudaSoftmaxRowGroupForward, torch.float16, ctas_per_sm)
    x = torch.empty(8, 2**20, device="cuda", dtype=torch.float16)
    out = torch.empty_like(x)
    args = SoftmaxArguments(x, out)
    artifact = k.compile(args)
    stream = torch.cuda.Stream()
    for _ in range(3):
        x.copy_(make_rows(8, 2**20, torch.float16))
        out.fill_(float("nan"))
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            k.run(args, compiled_artifact=artifact, stream=stream, assume_supported_args=True)
        stream.synchronize()
        check_forward(out, x, f"{k.metadata.kernel_name} side stream")


@pytest.mark.gpu
@pytest.mark.parametrize("cls", _CLASSES)
def test_two_ctas_per_sm_reside(cls):
    """On the device: the two-CTA fit is two per SM with a ring of at least 6 chunks (7
    expected on an H100 / H200), the one-CTA fit one per SM with the full ring; a traced launch
    of the whole grid puts exactly two (one) CTAs on every SM it uses (%smid)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = make_rows(2, 2**20, torch.bfloat16)
    for ctas_per_sm in VARIANTS:
        k = _kernel(cls, torch.bfloat16, ctas_per_sm)
        k.trace = True
        g, y = _backward_operands(2, 2**20, torch.bfloat16, 0)
        args = (SoftmaxBackwardArguments(g, y, torch.empty_like(g)) if cls.backward
                else SoftmaxArguments(x, torch.empty_like(x)))
        artifact = k.compile(args)
        fit = k._fit(artifact.compiled_obj, torch.cuda.current_device())
        if ctas_per_sm == 1:
            assert (fit.ctas, fit.sms, fit.ring_chunks) == (sms, sms, rg.DEFAULT_RING), fit
        else:
            assert fit.ctas == 2 * sms and fit.sms == sms and 6 <= fit.ring_chunks <= 7, fit
        k.ctas_per_row = fit.ctas  # (every resident CTA on row 0, then row 1)
        plan, resident = k.group_plan(args, artifact.compiled_obj, torch.cuda.current_device())
        assert plan.grid == resident == fit.ctas
        ws = torch.empty(k.get_workspace_size(args), dtype=torch.uint8, device="cuda")
        rg.clear_trace(ws, plan)
        k.run(args, compiled_artifact=artifact, workspace=ws)
        torch.cuda.synchronize()
        per_sm: dict[int, int] = {}
        for r in rg.read_trace(ws, plan):
            per_sm[r["sm"]] = per_sm.get(r["sm"], 0) + 1
        assert set(per_sm.values()) == {ctas_per_sm} and len(per_sm) == sms, per_sm


def _check_trace(records: list, plan, rows: int) -> None:
    """Per CTA: the waves its group took, and stamps in causal order (consumer thread 0's:
    entry <= ready <= stats <= met <= stored <= exit, wave after wave; the producer's: after
    entry, in issue order)."""
    assert len(records) == plan.grid
    for r in records:
        what = f"CTA {r['cta']}: {r}"
        waves = -(-(rows - r["group"]) // plan.groups) if r["group"] < rows else 0
        assert r["waves"] == waves and len(r["stats"]) == min(waves, rg.TRACE_WAVES), what
        assert 0 < r["entry"] <= r["ready"] <= r["exit"], what
        last = r["ready"]
        for w in range(len(r["stats"])):
            assert last <= r["stats"][w] <= r["met"][w] <= r["stored"][w] <= r["exit"], (w, what)
            last = r["stats"][w]
        issued = [r["issue_first"]] + r["issued"] + [r["producer_done"]]
        assert r["entry"] <= r["issue_first"] and issued == sorted(issued), what


# (limit_ctas, limit_ring, ctas_per_row, rows, cols, offset): a long case, waves past those the
# trace records (20 of 16), slices overflowing a 2-chunk ring, a lone row on the whole grid.
_TRACED = [(None, None, None, 32, 2**20, 0), (6, 3, 2, 60, 70001, 3), (9, 2, 3, 7, 150001, 1),
           (None, None, None, 1, 2**20, 0)]


@pytest.mark.gpu
@pytest.mark.parametrize("ctas_per_sm", VARIANTS)
@pytest.mark.parametrize("cls", _CLASSES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_traced_build_is_correct_and_its_stamps_ordered(cls, dtype, ctas_per_sm):
    """The RG_TRACE build: the float64 reference, untouched margins, bit for bit the plain
    build's output, and a complete trace per CTA with ordered stamps."""
    torch.manual_seed(7 + ctas_per_sm)
    plain = _kernel(cls, dtype, ctas_per_sm)
    traced = _kernel(cls, dtype, ctas_per_sm)
    traced.trace = True
    device = torch.cuda.current_device()
    for ctas, ring, S, rows, cols, offset in _TRACED:
        for k in (plain, traced):
            k.limit_ctas, k.limit_ring, k.ctas_per_row = ctas, ring, S
        if cls.backward:
            g, y = _backward_operands(rows, cols, dtype, offset)
            buf, out = _poisoned(rows, cols, dtype, offset)
            args = SoftmaxBackwardArguments(g, y, out)
        else:
            x = _input_at(rows, cols, dtype, offset)
            buf, out = _poisoned(rows, cols, dtype, offset)
            args = SoftmaxArguments(x, out)
        assert traced.supports(args), traced.supports(args).error
        artifact = traced.compile(args)
        assert artifact.extra.traced
        plan, _ = traced.group_plan(args, artifact.compiled_obj, device)
        ws = torch.empty(traced.get_workspace_size(args), dtype=torch.uint8, device="cuda")
        rg.clear_trace(ws, plan)
        traced.run(args, compiled_artifact=artifact, workspace=ws)
        torch.cuda.synchronize()
        what = f"{traced.metadata.kernel_name} traced {rows}x{cols}+{offset}"
        if cls.backward:
            check_backward(out, g, y, what)
        else:
            check_forward(out, x, what)
        _margins_untouched(buf, rows, cols, offset, what)
        _check_trace(rg.read_trace(ws, plan), plan, rows)
        first = out.clone()
        out.fill_(float("nan"))
        plain.run(args)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int8), first.view(torch.int8)), f"{what}: differs from the plain build"


def test_ranks_long_rows_where_the_few_row_sweep_measured_them_fastest():
    """`ranks_long_rows`: rows of 2^17 elements and more at any count; from `long_rows_from` at
    16 rows and more; from 128 KB (64K 16-bit, 32K f32 elements) at 16-47 rows, where the
    smem kernels leave most SMs idle and the cluster splits need two waves or more
    (the few-row sweeps of tests/data/measured_softmax_times.json)."""
    assert rg.ranks_long_rows(1, rg.MIN_COLS, 2) and rg.ranks_long_rows(1, rg.MIN_COLS, 4)
    assert not rg.ranks_long_rows(15, rg.long_rows_from(2), 2) and rg.ranks_long_rows(16, rg.long_rows_from(2), 2)
    assert rg.ranks_long_rows(4096, rg.long_rows_from(4), 4)
    for elem in (2, 4):
        few = rg.FEW_ROWS_FROM_BYTES // elem
        assert rg.ranks_long_rows(16, few, elem) and rg.ranks_long_rows(47, few, elem)
        assert not rg.ranks_long_rows(16, few - 1, elem)
        assert not rg.ranks_long_rows(15, few, elem) and not rg.ranks_long_rows(48, few, elem)
        # (the cost: four times plus 100 where the family does not rank)
        inside = rg.row_group_cost(32, few, elem, False, 132, 1.0)
        assert rg.row_group_cost(64, few, elem, False, 132, 1.0) > 100 > inside
