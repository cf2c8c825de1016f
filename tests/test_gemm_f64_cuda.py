"""The CUDA f64 tensor-core GEMM (cuda_src `CudaGemmF64`): generation, refusals, compilation for
sm_90a without a GPU; on a GPU, every instance and layout against a float64 reference on the
CPU inside sentinel-filled buffers, at odd extents, odd-but-even-strided leading dimensions
(the ``_align1`` instances also odd ones, odd batch strides and 8-byte-offset bases), batches,
and compute-sanitizer memcheck."""

from __future__ import annotations

import os
import random

import pytest
import torch

from kernel_api import GemmArguments
from kernel_api.providers.cuda_src.kernels.gemm_f64 import CONFIGS, COPY8_COST, SPLIT_WAVE_COST, CudaGemmF64, F64Config
from memcheck import run_memcheck


def instances(layouts: str | None = None) -> list[CudaGemmF64]:
    found = CudaGemmF64.generate_kernels(None, cc=90)
    return [k for k in found if layouts is None or k.metadata.kernel_name.split("_")[2] == layouts]


def operand(rows: int, cols: int, layout: str, L: int, pad: int, device: str, odd: bool = False) -> torch.Tensor:
    """Fresh random (L,) rows x cols f64, row-major ('t') or column-major ('n'), with ``pad``
    extra elements per leading dimension, rounded up to an even leading dimension; ``odd``: an
    odd leading dimension and batch stride instead, and the base one element (8 bytes) past a
    16-byte boundary."""
    inner = cols if layout == "t" else rows
    ld = inner + pad + (inner + pad) % 2 + (1 if odd else 0)
    outer = rows if layout == "t" else cols
    flat = torch.randn(L * outer * ld + 2 * L + 1, device=device, dtype=torch.float64)
    if odd:
        t = flat[1:].as_strided((L, outer, ld), (outer * ld + 1, ld, 1))
    else:
        t = flat[:L * outer * ld].view(L, outer, ld)
    t = t[..., :inner]
    t = t if layout == "t" else t.transpose(-1, -2)
    return t if L > 1 else t[0]


def check(kernel: CudaGemmF64, M: int, N: int, K: int, L: int = 1, pad: int = 0, artifact=None,
          odd: bool = False) -> float:
    """Run on fresh random operands (``odd``: A's and B's leading dimensions and batch strides
    odd, their bases 8 bytes off 16-byte alignment); assert every output written, nothing
    outside it (NaN sentinels around out intact), and the error against a CPU float64 product."""
    layouts = kernel.metadata.kernel_name.split("_")[2]
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    what = f"{kernel.metadata.kernel_name} M={M} N={N} K={K} L={L} pad={pad} odd={odd} seed={seed}"
    A = operand(M, K, layouts[0], L, pad, "cuda", odd)
    B = operand(K, N, layouts[1], L, pad, "cuda", odd)
    if layouts[2] == "t":
        big = torch.full((L, M + 2, N + 16), float("nan"), device="cuda", dtype=torch.float64)
        out = big[:, 1:M + 1, 8:8 + N]
    else:
        big = torch.full((L, N + 2, M + 16), float("nan"), device="cuda", dtype=torch.float64)
        out = big[:, 1:N + 1, 8:8 + M].transpose(-1, -2)
    if L == 1:
        out = out[0]
    args = GemmArguments(A, B, out)
    status = kernel.supports(args)
    assert status, f"{what}: not supported: {status.error}"
    kernel.run(args, compiled_artifact=artifact)
    torch.cuda.synchronize()
    ref = A.cpu() @ B.cpu()
    got = out.cpu()
    assert torch.isfinite(got).all(), f"{what}: outputs left unwritten"
    inside = torch.zeros_like(big, dtype=torch.bool)
    if layouts[2] == "t":
        inside[:, 1:M + 1, 8:8 + N] = True
    else:
        inside[:, 1:N + 1, 8:8 + M] = True
    assert torch.isnan(big[~inside]).all(), f"{what}: stores outside out"
    scale = (A.abs().cpu() @ B.abs().cpu()).clamp_min(1e-300)
    err = float(((got - ref).abs() / scale).max())
    assert err < 1e-13, f"{what}: max error {err:.2e} of sum |a||b|"
    return err


def test_generation_and_metadata():
    ks = instances()
    assert len(ks) == 2 * 8 * len(CONFIGS)  # 16- and 8-byte copies
    names = {k.metadata.kernel_name for k in ks}
    assert len(names) == len(ks)
    for k in ks:
        md = k.metadata
        assert md.min_cc == md.max_cc == 90
        assert md.operands.accumulator_type.name == "f64"
        assert md.design.tile_shape[2] == k.config.bk
        assert md.design.schedule == ("warpspecialized" if k.config.ws else "multistage")


def _meta(M, N, K, layouts="ttt", L=1, device="meta"):
    A = operand(M, K, layouts[0], L, 0, device)
    B = operand(K, N, layouts[1], L, 0, device)
    out = operand(M, N, layouts[2], L, 0, device)
    return A, B, out


def test_refusals_name_the_operand_and_the_problem():
    k = instances("ttt")[0]
    A = torch.empty(64, 33, dtype=torch.float64)  # lda 33: odd
    B = torch.empty(33, 64, dtype=torch.float64)
    status = k.supports(GemmArguments(A, B, torch.empty(64, 64, dtype=torch.float64)))
    assert not status and "operand A" in status.error and "leading dimension 33" in status.error
    A = torch.empty(64, 34, dtype=torch.float64)[:, 1:33]  # base off 16 bytes
    status = k.supports(GemmArguments(A, torch.empty(32, 64, dtype=torch.float64),
                                      torch.empty(64, 64, dtype=torch.float64)))
    assert not status and "operand A" in status.error and "16-byte" in status.error
    B = torch.empty(32, 66, dtype=torch.float64)[:, 1:65]
    status = k.supports(GemmArguments(torch.empty(64, 32, dtype=torch.float64), B,
                                      torch.empty(64, 64, dtype=torch.float64)))
    assert not status and "operand B" in status.error


def test_refusals_of_batches_and_sizes_past_the_grid_and_index_limits():
    k = instances("ttt")[0]
    f64 = dict(dtype=torch.float64, device="meta")
    A = torch.empty(65536, 2, 2, **f64)
    status = k.supports(GemmArguments(A, A, torch.empty_like(A)))
    assert not status and "operand A" in status.error and "65,536" in status.error
    A = torch.as_strided(torch.empty(3 * 4 * 6 + 1, **f64), (3, 4, 6), (25, 6, 1))  # batch stride 25
    status = k.supports(GemmArguments(A, torch.empty(3, 6, 4, **f64), torch.empty(3, 4, 4, **f64)))
    assert not status and "operand A" in status.error and "batch stride 25" in status.error
    status = k.supports(GemmArguments(torch.empty(1, 2, **f64), torch.empty(2, 2**31, **f64),
                                      torch.empty(1, 2**31, **f64)))
    assert not status and "operand B" in status.error and "N=2,147,483,648" in status.error


def test_align1_instances_take_odd_strides_and_8_byte_bases():
    """The ``_align1`` instances (8-byte copies) take what the ``_align2`` ones refuse: odd
    leading dimensions and batch strides, bases 8 bytes off 16; they compile with COPY8 and rank
    after the 16-byte instance of their configuration wherever both apply (`COPY8_COST`)."""
    odd = GemmArguments(*(operand(r, c, "t", 2, 0, "cpu", odd=True) for r, c in ((77, 45), (45, 99))),
                        torch.empty(2, 77, 99, dtype=torch.float64))
    even = GemmArguments(*_meta(256, 256, 256))
    for layouts in ("ttt", "nnn"):
        wide = [k for k in instances(layouts) if k.align == 2]
        narrow = [k for k in instances(layouts) if k.align == 1]
        assert [k.config for k in wide] == [k.config for k in narrow]
        for w, n in zip(wide, narrow):
            assert n.metadata.kernel_name.endswith("_align1") and n.name_expression(None).endswith(", true>")
            assert not w.name_expression(None).endswith(", true>")
            if layouts == "ttt":
                assert n.supports(odd) and not w.supports(odd)
            assert n.estimated_cost(even, 132) == pytest.approx(w.estimated_cost(even, 132) * COPY8_COST)
    assert instances("ttt")[-1].compile(odd, cc=90) is not None


def test_align1_instances_refuse_a_base_off_its_8_bytes():
    """An f64 operand whose base is 4 bytes off (a view into a byte buffer) is refused by name."""
    A = torch.frombuffer(bytearray(8 * 130), dtype=torch.float64, offset=4, count=128).view(8, 16)
    if A.data_ptr() % 8 == 0:
        pytest.skip("the byte buffer's base left the view 8-byte aligned")
    args = GemmArguments(A, torch.empty(16, 8, dtype=torch.float64), torch.empty(8, 8, dtype=torch.float64))
    for k in (k for k in instances("ttt") if k.align == 1):
        status = k.supports(args)
        assert not status and "operand A" in status.error and "not 8-byte aligned" in status.error


def test_odd_extents_with_even_strides_are_taken():
    k = instances("ttt")[0]
    A = torch.empty(77, 46, dtype=torch.float64)[:, :45]
    B = torch.empty(45, 100, dtype=torch.float64)[:, :99]
    assert k.supports(GemmArguments(A, B, torch.empty(77, 99, dtype=torch.float64)))


def test_compiles_for_sm90a_without_a_gpu():
    A = torch.empty(64, 64, dtype=torch.float64)
    for k in instances("ttt") + instances("nnn"):
        art = k.compile(GemmArguments(A, A, torch.empty_like(A)), cc=90)
        assert art is not None


#: Design knobs outside CONFIGS, measured against the shipped ones (docs/performance.md, "f64 and
#: f32 GEMM"): m16n8k16, 32-deep k tiles, where the next stage's copies issue, the warp-specialized
#: kernel (with and without prefetching, 3 and 4 stages, m16n8k16).
KNOB_TAGS = ("tile128x64x16_warps2x2_stages3_mma16", "tile128x64x32_warps2x2_stages2_mma16",
             "tile64x64x32_warps2x2_stages2_mma16_ctas3", "tile128x64x16_warps2x2_stages4_copy2",
             "tile64x64x16_warps2x2_stages4_copy1_ctas3", "tile128x64x32_warps2x2_stages2")
WS_TAGS = ("tile128x64x16_warps2x2_stages3_ws", "tile128x64x16_warps2x2_stages4_ws",
           "tile64x64x16_warps2x2_stages4_prefetch_ws", "tile128x64x32_warps2x2_stages2_mma16_ws",
           "tile128x64x16_warps2x2_stages3_mma16_ws", "tile128x128x16_warps2x4_stages4_mma16_ws",
           # 12 consumer warps of 32x32; rows of 48 / 96 chunks copied by 96 of the 128 producers
           "tile128x96x32_warps4x3_stages3_mma16_ws_p64", "tile192x64x32_warps6x2_stages3_mma16_ws_p64")
KNOB_TAGS += WS_TAGS


def knob_instance(tag: str, layouts: str, align: int = 2) -> CudaGemmF64:
    params = dict(a=layouts[0], b=layouts[1], out=layouts[2], config=F64Config.from_tag(tag), align=align)
    return CudaGemmF64(CudaGemmF64.make_metadata(params), params)


def test_config_tags_round_trip_and_bad_tags_are_refused():
    for c in CONFIGS:
        assert F64Config.from_tag(c.tag) == c
    c = F64Config.from_tag("tile128x64x32_warps2x2_stages2_mma16_copy2_ctas2")
    assert (c.bk, c.mma_k, c.copy_at, c.min_ctas, c.smem_bytes) == (32, 16, 2, 2, 2 * 192 * 32 * 8)
    assert c.tag == "tile128x64x32_warps2x2_stages2_mma16_copy2"
    # min_ctas defaults to what shared memory allows, at most 2
    assert F64Config.from_tag("tile128x128x32_warps2x4_stages4").min_ctas == 1
    with pytest.raises(ValueError, match="expected tileBMxBNxBK"):
        F64Config.from_tag("tile128x64_warps2x2")


def test_warp_specialized_tags():
    """`_ws`: a producer warpgroup beside the 4 consumer warps, a full and an empty mbarrier per
    slot; only one consumer warpgroup and no copy placement knob."""
    c = F64Config.from_tag("tile128x64x16_warps2x2_stages3_ws")
    assert (c.ws, c.threads, c.smem_bytes, c.min_ctas) == (True, 256, 3 * 192 * 16 * 8 + 48, 2)
    assert F64Config.from_tag(c.tag) == c and c.tag.endswith("_ws")
    k = knob_instance(c.tag, "tnn")
    assert "gemm_f64_ws<true, true, false, 128, 64, 2, 2, 3, 2," in k.name_expression(None)
    assert F64Config.from_tag("tile128x128x16_warps2x4_stages4_mma16_ws").threads == 384
    c = F64Config.from_tag("tile128x96x32_warps4x3_stages3_mma16_ws_p64")
    assert (c.threads, c.producer_regs, c.min_ctas) == (512, 64, 1) and F64Config.from_tag(c.tag) == c
    assert knob_instance(c.tag, "ttt").name_expression(None).endswith(", 32, 16, 64>")
    for bad in ("tile128x64x16_warps2x1_stages3_ws", "tile128x64x16_warps2x2_stages3_copy1_ws",
                "tile128x64x16_warps2x2_stages3_p64"):
        with pytest.raises(ValueError, match="warp-specialized"):
            F64Config.from_tag(bad)


def test_design_knobs_compile_for_sm90a_in_every_layout():
    A = torch.empty(64, 64, dtype=torch.float64)
    for tag in KNOB_TAGS:
        for layouts in ("ttt", "ntn", "tnt", "nnn"):
            k = knob_instance(tag, layouts)
            assert f"_{layouts}_{F64Config.from_tag(tag).tag}_" in k.metadata.kernel_name
            assert k.compile(GemmArguments(A, A, torch.empty_like(A)), cc=90) is not None


def test_stream_k_splits_only_a_short_last_wave():
    """`split_plan`: the tiles past whole waves go stream-K when they fill at most a quarter of
    a wave (at least 4 k tiles per split), one batch only; the workspace holds their partials."""
    big, small = (knob_instance(tag, "ttt") for tag in ("tile128x128x32_warps2x4_stages3_mma16_ws",
                                                         "tile128x64x32_warps2x2_stages2_mma16_ws"))
    args = GemmArguments(*_meta(8192, 8192, 8192))
    # 4096 tiles on 132 SMs: 31 whole waves and 4 tiles, each split 33 ways
    assert big.split_plan(args, 132) == (4092, 33)
    assert big.get_workspace_size(args) == 4 * 33 * 128 * 128 * 8  # (meta tensors plan for 132 SMs)
    assert small.split_plan(args, 132) == (8184, 33)  # 2 CTAs per SM: 8192 tiles, 264 slots
    assert big.split_plan(GemmArguments(*_meta(2048, 2048, 2048)), 132) is None  # 124 of 132: too full
    assert big.split_plan(GemmArguments(*_meta(8192, 8192, 8192, L=2)), 132) is None  # batched
    assert big.split_plan(GemmArguments(*_meta(8192, 8192, 64)), 132) is None  # 2 k tiles: nothing to split
    assert big.split_plan(GemmArguments(*_meta(8192, 8192, 256)), 132) == (4092, 2)  # 8 k tiles: 4 each
    assert big.split_plan(GemmArguments(*_meta(1024, 1024, 8192)), 132) is None  # one wave
    assert knob_instance("tile64x64x16_warps2x2_stages4_prefetch", "ttt").split_plan(args, 132) is None  # not ws
    # only the warp-specialized instances ask for a workspace; too small a one is refused by name
    assert not big.workspace_free and knob_instance("tile64x64x16_warps2x2_stages4_prefetch", "ttt").workspace_free
    plan = big.split_plan(args, 132)
    with pytest.raises(ValueError, match="operand workspace: needs 17301504 bytes .* got 1024 bytes"):
        big._partials_address(args, plan, torch.empty(1024, dtype=torch.uint8))
    with pytest.raises(ValueError, match="operand workspace: needs .* got none"):
        big._partials_address(args, plan, None)
    # the tile model's 32nd wave becomes 1 / 33 of one (plus the partial sums' share)
    with_split = big.estimated_cost(args, 132)
    big.split_plan = lambda *a, **k: None
    assert with_split == pytest.approx(big.estimated_cost(args, 132) * (31 + SPLIT_WAVE_COST / 33) / 32)


GPU_SHAPES = [(1, 1, 1), (131, 77, 45), (128, 64, 16), (257, 129, 33), (64, 200, 300), (300, 64, 17)]


@pytest.mark.gpu
@pytest.mark.parametrize("layouts", ["ttt", "ttn", "tnt", "tnn", "ntt", "ntn", "nnt", "nnn"])
def test_every_instance_matches_float64(layouts):
    for k in instances(layouts):
        art = k.compile(GemmArguments(*_meta(64, 64, 64, layouts, device="cpu")))
        for M, N, K in GPU_SHAPES:
            check(k, M, N, K, artifact=art)
        check(k, 190, 94, 70, pad=6, artifact=art)  # leading dimensions past the extents


@pytest.mark.gpu
@pytest.mark.parametrize("layouts", ["ttt", "ttn", "tnt", "tnn", "ntt", "ntn", "nnt", "nnn"])
def test_align1_instances_match_float64_on_odd_strides(layouts):
    """8-byte copies: odd leading dimensions and batch strides, bases 8 bytes off 16, at odd
    and edge-only extents, batched."""
    for k in (k for k in instances(layouts) if k.align == 1):
        art = k.compile(GemmArguments(*_meta(64, 64, 64, layouts, device="cpu")))
        for M, N, K in GPU_SHAPES:
            check(k, M, N, K, artifact=art, odd=True)
        check(k, 190, 94, 70, pad=6, artifact=art, odd=True)
        check(k, 100, 72, 51, L=3, artifact=art, odd=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tag", KNOB_TAGS)
def test_design_knobs_match_float64(tag):
    for layouts in ("ttt", "ttn", "ntn", "nnt"):
        k = knob_instance(tag, layouts)
        for M, N, K in GPU_SHAPES + [(190, 94, 70)]:
            check(k, M, N, K)
        check(k, 100, 72, 50, L=2, pad=4)


@pytest.mark.gpu
@pytest.mark.parametrize("layouts", ["ttt", "tnt", "nnn"])
def test_batched(layouts):
    for k in instances(layouts):
        check(k, 100, 72, 50, L=3)


@pytest.mark.gpu
def test_large_matches_cublas_closely():
    """2048^3 against cuBLAS DGEMM on the GPU (the float64 CPU product would take long)."""
    for k in instances("ttt"):
        A = torch.randn(2048, 2048, device="cuda", dtype=torch.float64)
        B = torch.randn(2048, 2048, device="cuda", dtype=torch.float64)
        out = torch.full_like(A, float("nan"))
        k.run(GemmArguments(A, B, out))
        ref = A @ B
        err = float((out - ref).abs().max() / (A.abs() @ B.abs()).max())
        assert err < 1e-14, f"{k.metadata.kernel_name}: {err:.2e}"


def split_case(k: CudaGemmF64) -> tuple[int, int, int]:
    """Odd M, N, K whose output tiles are one whole wave on this GPU and a few more (at most 7),
    which `split_plan` runs stream-K (8 splits of K's 32 k tiles)."""
    slots = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count * k.config.ctas_per_sm
    return 7 * k.config.bm - 5, (slots // 7 + 1) * k.config.bn - 3, 1001


SPLIT_TAGS = ("tile128x128x32_warps2x4_stages3_mma16_ws", "tile128x64x32_warps2x2_stages2_mma16_ws")


@pytest.mark.gpu
@pytest.mark.parametrize("tag", SPLIT_TAGS)
@pytest.mark.parametrize("layouts", ["ttt", "ntn", "tnn"])
def test_stream_k_last_wave_matches_float64(tag, layouts):
    """The split last wave (both out layouts: the partial sums are stored and added up in each),
    edge tiles included, against float64; and bit for bit the same on a second run."""
    k = knob_instance(tag, layouts)
    M, N, K = split_case(k)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    plan = k.split_plan(GemmArguments(*_meta(M, N, K, layouts)), sms)
    assert plan is not None and plan[1] == 8, plan
    check(k, M, N, K)
    check(knob_instance(tag, layouts, align=1), M, N, K, odd=True)  # the same with 8-byte copies
    args = GemmArguments(*_meta(M, N, K, layouts, device="cuda"))  # fresh random operands
    out = args.out
    k.run(args)
    first = out.clone()
    out.fill_(float("nan"))
    k.run(args)
    assert torch.equal(out, first), f"{k.metadata.kernel_name}: the split sums differ between runs"


_SANITIZED = r"""
import sys
sys.path.insert(0, %r)
from test_gemm_f64_cuda import SPLIT_TAGS, WS_TAGS, check, instances, knob_instance, split_case
n = 0
for layouts in ("ttt", "tnt", "ntn", "nnn"):
    for k in instances(layouts) + [knob_instance(tag, layouts) for tag in WS_TAGS]:
        check(k, 37, 21, 19, odd=k.align == 1); n += 1
        check(k, 130, 66, 18, pad=2, odd=k.align == 1); n += 1
    for tag in SPLIT_TAGS:  # the stream-K last wave and its reduction
        k = knob_instance(tag, layouts)
        check(k, *split_case(k)); n += 1
print("launches", n)
"""


@pytest.mark.gpu
def test_memcheck_clean():
    out = run_memcheck(_SANITIZED % os.path.dirname(os.path.abspath(__file__)))
    assert f"launches {4 * ((2 * len(CONFIGS) + len(WS_TAGS)) * 2 + len(SPLIT_TAGS))}" in out, out[-3000:]
