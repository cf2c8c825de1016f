"""Softmax for very long rows on a cooperative persistent grid (CudaSoftmaxRowGroup*), and the
cuda_src launcher's cooperative launches.

CPU: registration and metadata, refusals, the launch plan (CTAs per row, waves, slices,
staging) and the slices' cover of a row, NVRTC compiles for sm_90a without local memory,
the launch arguments `_run` assembles (against the kernel's signature), the launcher's
cooperative configuration and its refusal of grids that cannot all be resident, PickAny's
ranking. GPU (@pytest.mark.gpu): float64 references on fresh random rows (with -inf rows and
huge magnitudes), outputs inside NaN-filled buffers whose margins must stay untouched, for
1x1M, 8x1M, 32x1M, 8x4M, odd rows, misaligned base pointers, strided rows, forward and
backward, all three dtypes; back-to-back launches on one stream, repeated launches on the
same buffers, and ops.softmax choosing the family."""

from __future__ import annotations

import math
import re
import types

import pytest
import torch

import kernel_api
from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments
from kernel_api.errors import KernelLaunchError
from kernel_api.providers.cuda_src import launcher as launcher_mod
from kernel_api.providers.cuda_src.kernels import softmax_rowgroup as rg
from kernel_api.providers.cuda_src.kernels.softmax_rowgroup import (CudaSoftmaxRowGroupBackward,
                                                                     CudaSoftmaxRowGroupForward, plan_rows)
from kernel_api.tuning.policies import rank_candidates

from memcheck import run_memcheck
from test_softmax import check_backward, check_forward, make_rows
from test_softmax import input_at as _input_at, margins_untouched as _margins_untouched, poisoned as _poisoned
from test_softmax_smem import _resources

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CLASSES = (CudaSoftmaxRowGroupForward, CudaSoftmaxRowGroupBackward)
_ELEM = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
#: benchmarks/softmax.py's "long" case
LONG = [(1, 2**20), (8, 2**20), (32, 2**20), (8, 2**22)]


def _args(cls, x: torch.Tensor, out: torch.Tensor | None = None):
    out = torch.empty_like(x) if out is None else out
    if cls.backward:
        return SoftmaxBackwardArguments(x, x, out)
    return SoftmaxArguments(x, out)


def _kernel(cls, dtype: torch.dtype):
    return next(k for k in cls.generate_kernels(None, cc=90) if k.dtype.to_torch() == dtype)


def _first(rows: int, cols: int, dtype: torch.dtype, backward: bool) -> str:
    x = torch.empty(rows, cols, dtype=dtype, device="meta")
    args = SoftmaxBackwardArguments(x, x, torch.empty_like(x)) if backward else SoftmaxArguments(x, torch.empty_like(x))
    return rank_candidates(kernel_api.get_kernels(args, cc=90), args)[0].metadata.kernel_name


# ----------------------------------------------------------------------------------- CPU
def test_instances_names_and_metadata():
    fwd = {k.metadata.kernel_name: k for k in CudaSoftmaxRowGroupForward.generate_kernels(None, cc=90)}
    bwd = {k.metadata.kernel_name: k for k in CudaSoftmaxRowGroupBackward.generate_kernels(None, cc=90)}
    assert sorted(fwd) == ["CudaSoftmaxRowGroupForward_bf16_rowgroup_peel8", "CudaSoftmaxRowGroupForward_f16_rowgroup_peel8",
                           "CudaSoftmaxRowGroupForward_f32_rowgroup_peel4"]
    assert sorted(bwd) == [n.replace("Forward", "Backward") for n in sorted(fwd)]
    k = fwd["CudaSoftmaxRowGroupForward_bf16_rowgroup_peel8"]
    md = k.metadata
    assert md.provider == "cuda_src" and md.min_cc == 90
    assert md.design.strategy == "rowgroup" and md.design.max_cols is None and md.design.min_cols == rg.MIN_COLS
    assert dict(md.design.extra)["cooperative"] and dict(md.design.extra)["peel"]
    assert md.operands.x.divisibility == 1  # any alignment (peeled)
    assert not CudaSoftmaxRowGroupForward.generate_kernels(None, cc=80)  # TMA bulk copies, mbarriers: sm_90+
    # discovered through the registry, for both directions
    x = torch.empty(4, 2**20, dtype=torch.bfloat16)
    assert "CudaSoftmaxRowGroupForward_bf16_rowgroup_peel8" in {
        k.metadata.kernel_name for k in kernel_api.get_kernels(_args(CudaSoftmaxRowGroupForward, x), cc=90)}
    assert "CudaSoftmaxRowGroupBackward_bf16_rowgroup_peel8" in {
        k.metadata.kernel_name for k in kernel_api.get_kernels(_args(CudaSoftmaxRowGroupBackward, x), cc=90)}


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
    """On 132 SMs with 14-chunk rings (H100/H200), the slices the session-23 sweep ran fastest
    with: 128 KB in the forward (32x1M bf16: S=16, 8 rows at once, 4 waves; 8x4M: S=64),
    about 186 KB of dy and y in the backward (32x1M bf16: S=22); a lone row on every SM;
    only the f32 backward of 4M columns (254 KB of dy and y per CTA) overflows the ring."""
    p = plan_rows(32, 2**20, 2, False)
    assert (p.ctas_per_row, p.groups, p.waves, p.grid) == (16, 8, 4, 128)
    assert p.slice_vectors == 2**17 // 16 and p.overflow_vectors == 0
    p = plan_rows(8, 2**22, 2, False)
    assert (p.ctas_per_row, p.groups, p.waves) == (64, 2, 4) and p.overflow_vectors == 0
    p = plan_rows(32, 2**20, 2, True)
    assert (p.ctas_per_row, p.groups, p.waves) == (22, 6, 6) and p.overflow_vectors == 0
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
                    reserve = min(rg.PREFETCH_CHUNKS, ring - 1)
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


@pytest.mark.parametrize("cls", _CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiles_for_sm90a_without_spills(cls, dtype):
    """One artifact per dtype and direction (any shape); the cubin's report: no local memory,
    registers that let a CTA of 544 threads launch."""
    k = _kernel(cls, dtype)
    args = _args(cls, torch.empty(3, 1000, dtype=dtype))
    artifact = k.compile(args, cc=90)
    assert artifact.compiled_obj.compiled.arch == "sm_90a"
    op = "bwd" if cls.backward else "fwd"
    assert artifact.compiled_obj.name_expression == f"ka_softmax::{op}_rowgroup<{rg._TYPES[k.dtype]}, {k.vec}>"
    assert k.compile_key(_args(cls, torch.empty(8, 2**20, dtype=dtype)), 90) == k.compile_key(args, 90)
    res = _resources(artifact)
    assert res.get(0x11, 0) == 0 and res.get(0x12, 0) == 0, f"{k.metadata.kernel_name}: local memory {res}"
    assert 0 < res[0x2f] <= 65536 // (rg.THREADS + 32) // 8 * 8, res


def test_compiles_for_sm100a():
    k = _kernel(CudaSoftmaxRowGroupBackward, torch.bfloat16)
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
    assert first["cooperative"] and first["grid"] == p.grid <= 120 and first["block"] == rg.THREADS
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
    assert k.group_plan(args, fake, 0)[1] == 264  # capped at two per SM
    k.limit_ring = 7
    ws = torch.empty(k.get_workspace_size(args), dtype=torch.uint8)
    k._run(args, types.SimpleNamespace(compiled_obj=fake), 0x1, ws)
    assert fake.launches[-1]["grid"] == plan.grid and fake.launches[-1]["smem"] == 7 * rg.CHUNK_BYTES


def test_workspace_and_launch_config_without_a_gpu():
    k = _kernel(CudaSoftmaxRowGroupForward, torch.float32)
    args = _args(CudaSoftmaxRowGroupForward, torch.empty(8, 2**20))
    grid, block, smem = k.launch_config(args)
    p = k.plan(args)
    assert (grid, block, smem) == (p.grid, rg.THREADS, p.smem_bytes)
    assert k.get_workspace_size(args) >= p.workspace_bytes
    e1, e2 = rg.next_epoch(), rg.next_epoch()
    assert e1 != e2 and 0 <= e1 < 2**32 and 0 <= e2 < 2**32


# ---- the launcher's cooperative launches (cuda.core and the device stood in for) ----------
class _Config:
    def __init__(self, grid=None, block=None, shmem_size=0, **flags):
        self.grid, self.block, self.shmem_size, self.flags = grid, block, shmem_size, flags


class _OldConfig(_Config):  # cuda.core 0.3 spelled the flag cooperative_launch
    def __init__(self, grid=None, block=None, shmem_size=0, cooperative_launch=False):
        super().__init__(grid, block, shmem_size, cooperative_launch=cooperative_launch)


class _PlainConfig(_Config):  # a cuda.core without cooperative launches
    def __init__(self, grid=None, block=None, shmem_size=0):
        super().__init__(grid, block, shmem_size)


def _no_occupancy(threads, smem):
    raise RuntimeError("no occupancy query here")


def _fake_launcher(monkeypatch, config_type=_Config, per_sm=1, sms=132, cooperative=True, occupancy=None):
    launched = []
    core = types.SimpleNamespace(LaunchConfig=config_type, __version__="fake",
                                 launch=lambda stream, cfg, kernel, *params: launched.append((cfg, params)),
                                 Stream=types.SimpleNamespace(from_handle=lambda h: ("stream", h)))
    monkeypatch.setattr(launcher_mod, "_core", core)
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    compiled = types.SimpleNamespace(symbols={}, cubin=b"", arch="sm_90a")
    lch = launcher_mod.CudaLauncher(compiled, "k<1>", "FakeKernel", convert_args=False)
    lch._kernel = types.SimpleNamespace(
        attributes={0: types.SimpleNamespace(max_threads_per_block=1024, shared_size_bytes=520)},
        occupancy=types.SimpleNamespace(max_active_blocks_per_multiprocessor=occupancy or (lambda threads, smem: per_sm)))
    limits = object.__new__(launcher_mod._DeviceLimits)
    for name, value in dict(max_threads=1024, max_block=(1024, 1024, 64), max_grid=(2**31 - 1, 65535, 65535),
                            max_smem_optin=232448, max_smem_default=49152, sms=sms, cooperative=cooperative,
                            threads_per_sm=2048, smem_per_sm=233472, smem_reserved=1024).items():
        setattr(limits, name, value)
    lch._devices[0] = limits
    lch._allow_smem = lambda device, smem: lch._smem_set.__setitem__(device, smem)  # (no driver here)
    return lch, launched


def test_cooperative_launch_sets_the_attribute(monkeypatch):
    lch, launched = _fake_launcher(monkeypatch)
    lch.launch(7, 0, 132, 544, 40000, (1, 2), cooperative=True)
    lch.launch(7, 0, 132, 544, 40000, (1, 2))
    (cfg, params), (plain, _) = launched
    assert cfg.flags == {"is_cooperative": True} and cfg.grid == (132, 1, 1) and params == (1, 2)
    assert plain.flags == {}  # the same shape launched plainly is its own configuration
    assert lch.max_coresident(0, 544, 40000) == 132 and lch.max_dynamic_smem(0) == 232448 - 520


def test_coresident_ctas_from_the_device_limits_without_the_occupancy_query(monkeypatch):
    """(A cuda.core whose occupancy query fails for the kernel's handle: threads and shared
    memory per SM decide; the driver would refuse a grid too large anyway.)"""
    lch, _ = _fake_launcher(monkeypatch, occupancy=_no_occupancy)
    assert lch.max_coresident(0, 544, 14 * 16384) == 132  # one 224 KB ring per SM
    assert lch.max_coresident(0, 544, 2 * 16384) == 3 * 132  # threads: 2048 // 544
    assert lch.max_coresident(0, 256, 100 * 1024) == 2 * 132  # shared memory: 228 KB // (100 KB + 1.5 KB)


def test_cooperative_launch_with_cuda_core_0_3(monkeypatch):
    lch, launched = _fake_launcher(monkeypatch, _OldConfig)
    lch.launch(7, 0, 64, 544, 1024, (), cooperative=True)
    assert launched[0][0].flags == {"cooperative_launch": True}


def test_cooperative_launch_refusals_are_errors_not_hangs(monkeypatch):
    lch, launched = _fake_launcher(monkeypatch, per_sm=1, sms=132)
    with pytest.raises(KernelLaunchError, match=r"cooperative launch of 133 CTAs exceeds the 132 that can be resident"):
        lch.launch(7, 0, 133, 544, 1024, (), cooperative=True)
    lch, launched = _fake_launcher(monkeypatch, _PlainConfig)
    with pytest.raises(KernelLaunchError, match="cannot launch cooperative kernels"):
        lch.launch(7, 0, 8, 544, 1024, (), cooperative=True)
    lch, launched = _fake_launcher(monkeypatch, cooperative=False)
    with pytest.raises(KernelLaunchError, match="does not support cooperative launches"):
        lch.launch(7, 0, 8, 544, 1024, (), cooperative=True)
    assert not launched


# ---- PickAny ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_pick_any_takes_long_rows_only(dtype):
    """The long shapes (benchmarks/softmax.py's "long" case) go to the row-group family: the
    cluster-split and looped kernels read those rows twice. The ordinary shapes keep the
    kernels measured best there (register, shared-memory, looped and cluster-split)."""
    for backward in (False, True):
        for rows, cols in LONG + [(4, 2**21), (64, 2**20), (256, 2**18)]:
            assert "RowGroup" in _first(rows, cols, dtype, backward), (rows, cols, backward)
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
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_shapes(dtype):
    k = _kernel(CudaSoftmaxRowGroupForward, dtype)
    torch.manual_seed(len(str(dtype)))
    for rows, cols, offset in _SHAPES:
        _check_forward_at(rows, cols, dtype, offset, k)
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_shapes(dtype):
    """(f32 8x4M: slices past the ring, the overflow read twice; also misaligned, 2x(4M+3).)"""
    k = _kernel(CudaSoftmaxRowGroupBackward, dtype)
    torch.manual_seed(len(str(dtype)) + 1)
    shapes = _SHAPES + ([(2, 2**22 + 3, 1)] if dtype == torch.float32 else [])
    for rows, cols, offset in shapes:
        _check_backward_at(rows, cols, dtype, offset, k)
        torch.cuda.empty_cache()


# (limit_ctas, limit_ring, ctas_per_row, rows, cols, offset): slices overflowing rings of 1-3
# chunks (the overflow read twice), rings wrapping many times, both consumer schedules (with
# and without the look-ahead), odd groupings, one CTA per row.
_SMALL = [(7, 3, None, 9, 70001, 3), (12, 3, 3, 10, 150001, 1), (5, 2, 5, 4, 99999, 0), (16, 6, 1, 33, 40003, 5),
          (24, 1, None, 3, 400001, 0), (9, 14, 4, 11, 9001, 7)]


@pytest.mark.gpu
@pytest.mark.parametrize("cls", _CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_small_rings_and_grids(cls, dtype):
    k = _kernel(cls, dtype)
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


_SANITIZED = r"""
import torch
from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments
from kernel_api.providers.cuda_src.kernels.softmax_rowgroup import CudaSoftmaxRowGroupBackward, CudaSoftmaxRowGroupForward
torch.manual_seed(0)
def at(rows, cols, dtype, offset):  # its own allocation, offset elements in: rows at any alignment
    return torch.randn(rows * cols + offset, device="cuda").to(dtype)[offset:].view(rows, cols)
n = 0
for cls in (CudaSoftmaxRowGroupForward, CudaSoftmaxRowGroupBackward):
    for k in cls.generate_kernels(None, cc=90):
        dtype = k.dtype.to_torch()
        for ctas, ring, S, rows, cols, offset in [(None, None, None, 3, 200003, 3), (6, 2, 3, 5, 30011, 1)]:
            k.limit_ctas, k.limit_ring, k.ctas_per_row = ctas, ring, S
            x, out, gi = (at(rows, cols, dtype, offset) for _ in range(3))
            k.run(SoftmaxBackwardArguments(x, out, gi) if cls.backward else SoftmaxArguments(x, out)); n += 1
torch.cuda.synchronize()
print("launches", n)
"""


@pytest.mark.gpu
def test_memcheck():
    """Both directions, every dtype, a row split over many CTAs and a small ring whose slices
    overflow, misaligned, under compute-sanitizer memcheck (caching allocator off: each
    operand and workspace is its own allocation, so an overrun is caught)."""
    out = run_memcheck(_SANITIZED)
    assert int(out.split("launches")[-1].split()[0]) == 12, out[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows(dtype):
    """Rows of a wider buffer, three elements past a 16-byte boundary and of odd length (each
    row at another phase), into a poisoned contiguous output: taken when the row stride keeps
    every operand's rows at one phase (stride cols + 3 vectors), refused otherwise; the
    backward's dy and y strided alike."""
    rows, cols, offset = 6, 2**20 + 1, 3
    vec = 16 // _ELEM[dtype]
    k = _kernel(CudaSoftmaxRowGroupForward, dtype)
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
    kb = _kernel(CudaSoftmaxRowGroupBackward, dtype)
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
@pytest.mark.parametrize("cls", _CLASSES)
def test_back_to_back_and_repeated_launches(cls):
    """Launches queued on one stream without synchronising (each finds the workspace as the
    previous left it), a different shape between them, and the same buffers run again:
    every result right, the repeat bit-identical."""
    dtype = torch.bfloat16
    k = _kernel(cls, dtype)
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
def test_side_stream_and_fresh_data():
    """One artifact over new data each call on a side stream."""
    k = _kernel(CudaSoftmaxRowGroupForward, torch.float16)
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
def test_ops_pick_any_runs_long_rows_here():
    """ops.softmax and its backward on 32x1M (PickAny: this family) match the references."""
    x = make_rows(32, 2**20, torch.bfloat16)
    args = SoftmaxArguments(x, torch.empty_like(x))
    assert "RowGroup" in rank_candidates(kernel_api.get_kernels(args), args)[0].metadata.kernel_name
    y = kernel_api.ops.softmax(x)
    check_forward(y, x, "ops.softmax 32x1M")
    assert math.isclose(float(y[-1].double().sum()), 1.0, rel_tol=1e-2)
    y = kernel_api.ops.softmax((torch.randn(32, 2**20, device="cuda") * 2).to(torch.bfloat16))
    g = torch.randn_like(y)
    check_backward(kernel_api.ops.softmax_backward(g, y, -1), g, y, "ops.softmax_backward 32x1M")
