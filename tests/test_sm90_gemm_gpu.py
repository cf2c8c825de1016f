"""GPU checks of every configuration `Sm90WarpSpecializedGemm.generate_kernels` emits.

Each instance runs batched (L = 3) on a shape whose non-contiguous extents are odd and not
tile multiples, plus a second shape spanning several tiles of every cluster, against a
float64 reference with fresh random inputs and a NaN-poisoned output. Subsets run rank-2
operands, strided (padded) operands, K < one k-tile, every fused-epilogue variant, and the
rejection of misaligned operands. Needs an sm_90 GPU; run with ``pytest -n 12`` to spread
the compiles over CPU cores.
"""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api.arguments import EpilogueArguments, GemmArguments
from kernel_api.errors import UnsupportedArgumentsError
from kernel_api.providers.cutedsl.gemm.sm90_warpspecialized import Sm90WarpSpecializedGemm
from gemm_family_utils import epilogue_reference, relative_error

pytestmark = pytest.mark.gpu

# Norm-wise relative error allowed per output type (inputs are exact in the reference; the
# error is the f32 accumulation plus one rounding to the output type).
TOLERANCE = {torch.bfloat16: 8e-3, torch.float16: 2e-3, torch.float32: 1e-4}
# The f16-accumulating instances round every partial sum to f16: for these random inputs a
# norm-wise error near 2^-11 * sqrt(K / 2), about 1.1e-2 at K = 1000; a wrong result is O(1).
F16_ACCUMULATION_TOLERANCE = 3e-2


def operand(shape: tuple[int, ...], dtype: torch.dtype, column_major: bool, gen: torch.Generator,
            device: str = "cuda", pad: int = 0) -> torch.Tensor:
    """Random operand whose last two modes are row- or column-major; ``pad`` extra elements
    of leading dimension (a strided view of a larger buffer)."""
    rows, cols = shape[-2], shape[-1]
    stored = shape[:-2] + ((cols, rows + pad) if column_major else (rows, cols + pad))
    t = torch.randn(stored, device=device, generator=gen, dtype=torch.float32).to(dtype)
    if column_major:
        return t[..., :rows].transpose(-1, -2)
    return t[..., :cols]


def shape_for(kernel, base: tuple[int, int, int]) -> tuple[int, int, int]:
    """(M, N, K) near ``base``: extents that are some operand's contiguous mode are rounded to
    the kernel's alignment, the others are left odd (TMA handles ragged edges)."""
    ops = kernel.metadata.operands
    M, N, K = base
    def up(x, a):
        return -(-x // a) * a
    if ops.A.layout == "n" or ops.out.layout == "n":
        M = up(M, max(ops.A.divisibility, ops.out.divisibility))
    if ops.B.layout == "t" or ops.out.layout == "t":
        N = up(N, max(ops.B.divisibility, ops.out.divisibility))
    if ops.A.layout == "t" or ops.B.layout == "n":
        K = up(K, max(ops.A.divisibility, ops.B.divisibility))
    return M, N, K


def make_problem(kernel, M: int, N: int, K: int, L: int, rank: int, gen: torch.Generator,
                 epilogue: dict | None = None, pad: int = 0) -> tuple[GemmArguments, torch.Tensor]:
    """Arguments with a NaN-poisoned output for ``kernel``'s types/layouts, and the float64 reference."""
    ops = kernel.metadata.operands
    ab, od = ops.A.dtype.to_torch(), ops.out.dtype.to_torch()
    batch = (L,) if rank == 3 else ()
    A = operand(batch + (M, K), ab, ops.A.layout == "n", gen, pad=pad)
    B = operand(batch + (K, N), ab, ops.B.layout == "n", gen, pad=pad)
    out = operand(batch + (M, N), od, ops.out.layout == "n", gen, pad=pad).fill_(float("nan"))
    ref = A.double() @ B.double()
    ep = None
    if epilogue:
        kw = dict(epilogue)
        bias_kind = kw.pop("bias", None)
        if kw.pop("C", False):
            kw["C"] = operand(batch + (M, N), od, kw.pop("C_column_major", False), gen)
        if bias_kind == "row":
            kw["bias"] = torch.randn(N, device="cuda", generator=gen).to(od)
        elif bias_kind == "column":
            kw["bias"] = torch.randn(M, 1, device="cuda", generator=gen).to(od)
        ep = EpilogueArguments(**kw)
        ref = epilogue_reference(ref, ep, bias_kind, M, N)
    return GemmArguments(A, B, out, accumulator_type=ops.accumulator_type.to_torch(), epilogue=ep), ref


def in_nan_margin(args: GemmArguments, N: int) -> tuple[GemmArguments, torch.Tensor]:
    """``args`` with its output moved inside a NaN-filled buffer 8 columns wider (returned too):
    a store past N overwrites the margin."""
    big = torch.full(args.out.shape[:-1] + (N + 8,), float("nan"), device="cuda", dtype=args.out.dtype)
    return GemmArguments(args.A, args.B, big[..., :N], accumulator_type=args.accumulator_type.to_torch(),
                         epilogue=args.epilogue), big


# (f32 operands, tf32 and 3xTF32 math: test_sm90_gemm_f32_gpu.py)
_ALL = {k.name: k for k in Sm90WarpSpecializedGemm.generate_kernels(None, cc=90) if k.metadata.operands.A.dtype.bits == 16}
# One instance per schedule/tile/cluster for the deeper checks (bf16, row-major).
_REPS = [n for n, k in _ALL.items() if "_bf16bf16_bf16_" in n and "_ttt_" in n]


def _needs_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")


def _run_and_check(kernel, args, ref, what: str) -> None:
    status = kernel.supports(args)
    assert status, f"{kernel.name} rejected {args}: {status.error}"
    kernel.run(args)
    torch.cuda.synchronize()
    err = relative_error(args.out, ref)
    tol = TOLERANCE[args.out.dtype]
    if kernel.metadata.operands.accumulator_type.bits == 16:
        tol = max(tol, F16_ACCUMULATION_TOLERANCE)
    assert err < tol, f"{kernel.name} {what}: relative error {err:.3e} >= {tol:.0e} ({args})"


def _run_twice_on_one_workspace(kernel, args, ref, what: str) -> list[torch.Tensor]:
    """Run ``kernel`` twice on one workspace (stale flags must not pass for fresh ones), the
    output NaN-filled before each run; assert each result against ``ref``; the two outputs."""
    workspace = torch.empty(kernel.get_workspace_size(args), dtype=torch.uint8, device="cuda")
    outs = []
    for attempt in range(2):
        args.out.fill_(float("nan"))
        kernel.run(args, workspace=workspace)
        torch.cuda.synchronize()
        err = relative_error(args.out, ref)
        assert err < TOLERANCE[args.out.dtype], f"{what} run {attempt}: relative error {err:.3e}"
        outs.append(args.out.clone())
    return outs


def _gen(name: str, salt: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed((hash(name) + salt) & 0x7FFFFFFF)


@pytest.mark.parametrize("name", sorted(_ALL))
def test_every_config(name):
    _needs_sm90()
    kernel = _ALL[name]
    gen = _gen(name, 1)
    tm, tn = kernel.config.tile_mn
    cm, cn = kernel.config.cluster_mn
    for base, L in (((203, 301, 139), 3), ((tm * cm * 2 + 37, tn * cn * 2 + 11, 1000), 1)):
        M, N, K = shape_for(kernel, base)
        args, ref = make_problem(kernel, M, N, K, L, 3, gen)
        _run_and_check(kernel, args, ref, f"(L,M,N,K)=({L},{M},{N},{K})")


@pytest.mark.parametrize("name", _REPS)
def test_rank2_strided_and_short_k(name):
    _needs_sm90()
    kernel = _ALL[name]
    gen = _gen(name, 2)
    for (M, N, K), pad in (((1, 8, 8), 0), ((517, 264, 40), 8), ((128, 1024, 4096), 16), ((1000, 72, 520), 0)):
        args, ref = make_problem(kernel, M, N, K, 1, 2, gen, pad=pad)
        _run_and_check(kernel, args, ref, f"rank-2 (M,N,K)=({M},{N},{K}) pad={pad}")


@pytest.mark.parametrize("name", [n for n in _ALL if "_streamk_" in n and ("_ttt_" in n or "_nnn_" in n)])
def test_stream_k_splits_tiles(name):
    """12 x 12 cluster tiles per batch (more than one wave on any sm_90 part, not a multiple of
    it): the last waves' tiles are split along K between clusters and summed through the
    workspace. Run twice on one workspace (stale flags must not be taken for fresh ones)."""
    _needs_sm90()
    kernel = _ALL[name]
    gen = _gen(name, 3)
    (tm, tn), (cm, cn) = kernel.config.tile_mn, kernel.config.cluster_mn
    M, N, K = shape_for(kernel, (12 * tm * cm - 37, 12 * tn * cn - 11, 1000))
    args, ref = make_problem(kernel, M, N, K, 2, 3, gen, epilogue=dict(alpha=0.5, bias="row"))
    assert kernel.get_workspace_size(args) > 0
    _run_twice_on_one_workspace(kernel, args, ref, name)


@pytest.mark.parametrize("name", [n for n in _ALL if "_splitall_" in n and ("_ttt_" in n or "_tnt_" in n)
                                  and "_bf16bf16_bf16_" in n])
def test_split_all_shares_every_tile_over_the_grid(name):
    """split_all: every tile's k-iterations spread over the whole persistent grid, so one tile's
    pieces come from several clusters (decode shapes: 1, 2 or 4 tiles per column of SMs), a
    share may lie inside one tile, K may give fewer k-iterations than clusters (the grid
    shrinks), batches and odd M; a fused epilogue applied once by the head cluster; twice on
    one workspace (stale flags must not pass for fresh ones) with bit-identical results."""
    _needs_sm90()
    kernel = _ALL[name]
    gen = _gen(name, 4)
    for (M, N, K), L, epilogue in (((64, 4096, 4096), 1, None), ((1, 4096, 14336), 1, None),
                                   ((77, 1024, 1000), 3, dict(alpha=0.5, bias="row")),
                                   ((128, 8192, 64), 1, None), ((200, 512, 4096), 2, dict(bias="row", activation="gelu")),
                                   ((1024, 1024, 1024), 1, None)):
        M, N, K = shape_for(kernel, (M, N, K))
        args, ref = make_problem(kernel, M, N, K, L, 3 if L > 1 else 2, gen, epilogue=epilogue)
        args, big = in_nan_margin(args, N)
        assert kernel.supports(args), kernel.supports(args).error
        first, second = _run_twice_on_one_workspace(kernel, args, ref, f"{name} {(L, M, N, K)}")
        assert torch.isnan(big[..., N:]).all(), f"{name} {(L, M, N, K)}: stores past the output's N"
        assert torch.equal(first, second), f"{name} {(L, M, N, K)}: the two runs differ"


def _sanitized_decode_script(name_part: str, shapes: tuple, label: str) -> str:
    """A compute-sanitizer script: the bf16 ``_tnt_`` instances whose name holds ``name_part``
    (or one of its ``|``-separated parts) on decode-like ``shapes`` (M, N, K) against float64,
    printing ``<label> runs <count>``."""
    return f"""
import torch, kernel_api
from kernel_api.providers.cutedsl.gemm.sm90_warpspecialized import Sm90WarpSpecializedGemm
runs = 0
for k in Sm90WarpSpecializedGemm.generate_kernels(None, cc=90):
    name = k.metadata.kernel_name
    if not any(p in name for p in "{name_part}".split("|")) or "_bf16bf16_bf16_" not in name or "_tnt_" not in name:
        continue
    for M, N, K in {shapes!r}:
        A = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        W = torch.randn(N, K, device="cuda").to(torch.bfloat16)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        k.run(kernel_api.GemmArguments(A, W.t(), out))
        torch.cuda.synchronize()
        ref = A.double() @ W.double().t()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 8e-3, (name, M, N, K, err)
        runs += 1
print("{label} runs", runs)
"""


_SPLIT_ALL_SANITIZED = _sanitized_decode_script("_splitall_", ((64, 1024, 1000), (77, 512, 4096), (1, 256, 64)),
                                                "split_all")


def test_split_all_memcheck_clean():
    """The split_all instances (pieces of a tile from several clusters, partials through the
    workspace) under compute-sanitizer memcheck, on odd skinny shapes."""
    _needs_sm90()
    from memcheck import run_memcheck

    out = run_memcheck(_SPLIT_ALL_SANITIZED)
    assert "split_all runs 6" in out, out[-3000:]


@pytest.mark.parametrize("name", [n for n in _ALL if "_tile64x64x64_" in n and ("_ttt_" in n or "_tnt_" in n)
                                  and "_bf16bf16_bf16_" in n])
def test_narrow_tiles_at_decode_sizes(name):
    """The narrow 64x64 tiles (A multicast over 1x2 / 1x4 clusters, rings of 12-16 stages):
    one-tile M below and above 64, two M tiles, N leaving a cluster's last CTAs without columns
    (N = 72: two tiles in a cluster of four), more clusters than fit at once (a second wave),
    batches and a fused epilogue, each output inside a NaN-filled buffer 8 columns wider."""
    _needs_sm90()
    kernel = _ALL[name]
    gen = _gen(name, 5)
    for (M, N, K), L, epilogue in (((1, 4096, 4096), 1, None), ((8, 72, 1000), 1, None), ((64, 8192, 8192), 1, None),
                                   ((100, 4104, 520), 2, dict(alpha=0.5, bias="row")),
                                   ((64, 67 * 256 + 8, 256), 1, None), ((130, 1000, 64), 3, dict(activation="gelu"))):
        M, N, K = shape_for(kernel, (M, N, K))
        args, ref = make_problem(kernel, M, N, K, L, 3 if L > 1 else 2, gen, epilogue=epilogue)
        args, big = in_nan_margin(args, N)
        _run_and_check(kernel, args, ref, f"(L,M,N,K)=({L},{M},{N},{K})")
        assert torch.isnan(big[..., N:]).all(), f"{name} {(L, M, N, K)}: stores past the output's N"


_NARROW_SANITIZED = _sanitized_decode_script("_tile64x64x64_", ((64, 1000, 1000), (7, 72, 4096), (130, 264, 64)),
                                             "narrow")


def test_narrow_tiles_memcheck_clean():
    """The narrow tiles (1x2 and 1x4 clusters multicasting A) under compute-sanitizer memcheck."""
    _needs_sm90()
    from memcheck import run_memcheck

    out = run_memcheck(_NARROW_SANITIZED)
    assert "narrow runs 6" in out, out[-3000:]


_WAVE_FIT_TILES = {"_tile128x192x64_": (512, 6144, 4096), "_tile128x160x64_": (256, 10240, 8192),
                   "_tile128x224x64_": (1024, 3584, 3584)}


@pytest.mark.parametrize("name", [n for n in _ALL if any(t in n for t in _WAVE_FIT_TILES)
                                  and ("_ttt_" in n or "_tnt_" in n or "_ntt_" in n)])
def test_wave_fitting_tiles_at_their_edges(name):
    """The 128x192, 128x160 and 128x224 cooperative tiles (wgmma n192 / n160 / n224; one wave of
    128 tiles at 512x6144 / 256x10240 / 1024x3584): N that is no multiple of the tile, odd M, K of
    one k tile, batches, and the model shapes that called for them, each output inside a
    NaN-filled buffer 8 columns wider."""
    _needs_sm90()
    kernel = _ALL[name]
    gen = _gen(name, 7)
    model = next(shape for t, shape in _WAVE_FIT_TILES.items() if t in name)
    for (M, N, K), L in ((model, 1), ((301, 200, 136), 1), ((129, 376, 64), 2), ((1000, 1544, 520), 1)):
        M, N, K = shape_for(kernel, (M, N, K))
        args, ref = make_problem(kernel, M, N, K, L, 3 if L > 1 else 2, gen)
        args, big = in_nan_margin(args, N)
        _run_and_check(kernel, args, ref, f"(L,M,N,K)=({L},{M},{N},{K})")
        assert torch.isnan(big[..., N:]).all(), f"{name} {(L, M, N, K)}: stores past the output's N"


_WAVE_FIT_SANITIZED = _sanitized_decode_script("|".join(_WAVE_FIT_TILES),
                                               ((512, 6144, 256), (301, 200, 136), (7, 392, 72)), "wave-fit")


def test_wave_fitting_tiles_memcheck_clean():
    """The 128x160, 128x192 and 128x224 tiles under compute-sanitizer memcheck (3 shapes each)."""
    _needs_sm90()
    from memcheck import run_memcheck

    out = run_memcheck(_WAVE_FIT_SANITIZED)
    assert f"wave-fit runs {3 * len(_WAVE_FIT_TILES)}" in out, out[-3000:]


_EPILOGUES = [
    dict(alpha=0.5),
    dict(alpha=1.5, beta=-0.75, C=True),
    dict(alpha=1.0, beta=1.0, C=True, C_column_major=True, bias="row", activation="relu"),
    dict(bias="column", activation="gelu"),
    dict(alpha=0.25, bias="row", activation="silu"),
]


@pytest.mark.parametrize("name", [n for n in _ALL if ("_ttt_" in n or "_ntn_" in n)
                                  and ("_bf16bf16_bf16_" in n or "_f16f16_f32_" in n)
                                  and ("cluster2x1_cooperative" in n or "128x128x64_cluster2x1_pingpong" in n
                                       or "64x64x64_cluster1x4" in n)])
@pytest.mark.parametrize("epi", range(len(_EPILOGUES)))
def test_fused_epilogue(name, epi):
    _needs_sm90()
    kernel = _ALL[name]
    M, N, K = shape_for(kernel, (301, 203, 136))
    args, ref = make_problem(kernel, M, N, K, 2, 3, _gen(name, 10 + epi), epilogue=_EPILOGUES[epi])
    _run_and_check(kernel, args, ref, f"epilogue {_EPILOGUES[epi]}")


def test_misaligned_operands_are_never_offered():
    _needs_sm90()
    base = torch.randn(1024 * 1024 + 1, device="cuda").to(torch.bfloat16)
    A = base[1:1 + 512 * 512].view(512, 512)          # pointer off by one element
    B = torch.randn(512, 512, device="cuda").to(torch.bfloat16)
    out = torch.empty(512, 512, device="cuda", dtype=torch.bfloat16)
    args = kernel_api.GemmArguments(A, B, out, accumulator_type=torch.float32)
    found = kernel_api.get_kernels(args, metadata_filter=lambda m: m.kernel_class is Sm90WarpSpecializedGemm)
    assert found == []
    kernel = _ALL[_REPS[0]]
    with pytest.raises(UnsupportedArgumentsError, match="operand A"):
        kernel.run(args)


def test_discovery_on_device_offers_aligned_problems():
    _needs_sm90()
    A = torch.randn(256, 128, device="cuda").to(torch.bfloat16)
    B = torch.randn(128, 512, device="cuda").to(torch.bfloat16)
    out = torch.empty(256, 512, device="cuda", dtype=torch.bfloat16)
    args = kernel_api.GemmArguments(A, B, out, accumulator_type=torch.float32)
    found = kernel_api.get_kernels(args, metadata_filter=lambda m: m.kernel_class is Sm90WarpSpecializedGemm)
    assert {k.config for k in found} == {k.config for k in (_ALL[n] for n in _REPS)}
    found[0].run(args)
    torch.cuda.synchronize()
    ref = A.double() @ B.double()
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]
