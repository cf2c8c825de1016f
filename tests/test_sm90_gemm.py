"""CPU checks of the SM90 warp-specialized GEMM: discovery, metadata, alignment, errors, and
compiles for sm_90a of a representative subset (one per schedule, layouts and output types
mixed), with the generated PTX/SASS inspected for the Hopper instructions."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import kernel_api
from kernel_api.dtypes import DataType
from kernel_api.providers.cutedsl.gemm.sm90_warpspecialized import (
    CONFIGS, F16_ACC_CONFIGS, F32_OUT_CONFIGS, K_TILE, SM90_SMEM_BYTES, Sm90WarpSpecializedGemm, plan_stages)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sm90(meta) -> bool:
    return meta.kernel_class is Sm90WarpSpecializedGemm


def _args(M=256, N=512, K=128, dtype=torch.bfloat16, out_dtype=None, a_col=False, b_col=False, out_col=False,
          L=None, epilogue=None):
    def mk(r, c, col, dt):
        shape = (L, c, r) if (col and L) else (c, r) if col else (L, r, c) if L else (r, c)
        t = torch.randn(shape).to(dt)
        return t.transpose(-1, -2) if col else t
    A = mk(M, K, a_col, dtype)
    B = mk(K, N, b_col, dtype)
    out = mk(M, N, out_col, out_dtype or dtype)
    return kernel_api.GemmArguments(A, B, out, accumulator_type=torch.float32, epilogue=epilogue)


def test_instances_names_and_metadata():
    # (f32 operands, tf32 and 3xTF32 math: test_sm90_gemm_f32.py)
    kernels = [k for k in Sm90WarpSpecializedGemm.generate_kernels(None, cc=90) if k.metadata.operands.A.dtype.bits == 16]
    names = [k.name for k in kernels]
    # (f32 accumulation in every layout; f16 accumulation of f16 operands into f16, bf16 and f32)
    assert len(names) == len(set(names)) == 2 * 8 * (len(CONFIGS) + len(F32_OUT_CONFIGS)) + 3 * 8 * len(F16_ACC_CONFIGS)
    for k in kernels:
        md = k.metadata
        assert md.min_cc == 90 and md.max_cc == 90 and md.provider == "cutedsl"
        assert md.epilogue is not None and md.epilogue.alpha_beta and md.epilogue.bias == {"row", "column"}
        ops = md.operands
        assert ops.A.dtype in (DataType.bf16, DataType.f16) and ops.B.dtype is ops.A.dtype
        assert ops.out.dtype in (ops.A.dtype, DataType.f32) or ops.accumulator_type is DataType.f16
        # TMA: 16-byte aligned pointers and strides
        for t in (ops.A, ops.B, ops.out):
            assert t.divisibility * t.dtype.bytes == 16
        d = md.design
        assert d.tile_shape[2] == K_TILE and d.schedule in ("cooperative", "pingpong")
        assert f"tile{d.tile_shape[0]}x{d.tile_shape[1]}x64" in k.name
        assert f"cluster{d.cluster_shape[0]}x{d.cluster_shape[1]}" in k.name and d.schedule in k.name
        assert f"stages{d.stages}x" in k.name


def test_all_four_majorness_combinations_and_both_out_layouts():
    combos = {(k.metadata.operands.A.layout, k.metadata.operands.B.layout, k.metadata.operands.out.layout)
              for k in Sm90WarpSpecializedGemm.generate_kernels(None, cc=90)}
    assert len(combos) == 8


def test_only_sm90():
    assert Sm90WarpSpecializedGemm.generate_kernels(None, cc=80) == []
    assert Sm90WarpSpecializedGemm.generate_kernels(None, cc=100) == []
    assert kernel_api.get_kernels(_args(), cc=80, metadata_filter=_sm90) == []


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.tag)
def test_stage_counts_fill_shared_memory(cfg):
    for ab, out in ((DataType.bf16, DataType.bf16), (DataType.f16, DataType.f32)):
        ab_stages, epi_stages, epi_tile = plan_stages(cfg, ab, out)
        rings = 2 if cfg.schedule == "pingpong" else 1
        stage = (cfg.tile_mn[0] + cfg.tile_mn[1]) * K_TILE * ab.bytes
        used = ab_stages * stage + epi_stages * rings * epi_tile[0] * epi_tile[1] * out.bytes + 1024
        assert 3 <= ab_stages and 2 <= epi_stages <= 4
        assert used <= SM90_SMEM_BYTES
        assert used + stage > SM90_SMEM_BYTES  # no room left for another A/B stage


def test_discovery_matches_layouts_and_types():
    args = _args(a_col=True, out_col=True, out_dtype=torch.float32)
    found = kernel_api.get_kernels(args, cc=90, metadata_filter=_sm90)
    assert len(found) == len(F32_OUT_CONFIGS)
    for k in found:
        assert "_bf16bf16_f32_" in k.name and "_ntn_" in k.name
    args = _args(dtype=torch.float16, b_col=True, L=3)
    found = kernel_api.get_kernels(args, cc=90, metadata_filter=_sm90)
    assert len(found) == len(CONFIGS) and all("_f16f16_f16_" in k.name and "_tnt_" in k.name for k in found)


def test_epilogue_discovery():
    ep = kernel_api.EpilogueArguments(alpha=2.0, beta=0.5, C=torch.randn(256, 512).to(torch.bfloat16),
                                      bias=torch.randn(512).to(torch.bfloat16), activation="silu")
    found = kernel_api.get_kernels(_args(epilogue=ep), cc=90, metadata_filter=_sm90)
    assert len(found) == len(CONFIGS)
    assert len(Sm90WarpSpecializedGemm.generate_kernels(lambda m: m.operands.A.dtype.bits == 16, epilogue_args=ep,
                                                        cc=90)) == (2 * 8 * (len(CONFIGS) + len(F32_OUT_CONFIGS))
                                                                    + 3 * 8 * len(F16_ACC_CONFIGS))


@pytest.mark.parametrize("case", ["K odd", "N odd", "pointer offset", "batch stride"])
def test_misaligned_operands_rejected(case):
    if case == "K odd":       # row-major A: K is its contiguous extent
        args = _args(K=129)
        bad = "operand A"
    elif case == "N odd":     # row-major B and out
        args = _args(N=513)
        bad = "operand B"
    elif case == "pointer offset":
        flat = torch.randn(256 * 128 + 1).to(torch.bfloat16)
        A = flat[1:].view(256, 128)
        B = torch.randn(128, 512).to(torch.bfloat16)
        args = kernel_api.GemmArguments(A, B, torch.empty(256, 512, dtype=torch.bfloat16),
                                        accumulator_type=torch.float32)
        bad = "operand A"
    else:                     # a single batch whose batch stride is not 16-byte aligned
        flat = torch.randn(256 * 128 + 4).to(torch.bfloat16)
        A = flat.as_strided((1, 256, 128), (256 * 128 + 4, 128, 1))
        assert A.stride(0) % 8 == 4
        B = torch.randn(1, 128, 512).to(torch.bfloat16)
        args = kernel_api.GemmArguments(A, B, torch.empty(1, 256, 512, dtype=torch.bfloat16),
                                        accumulator_type=torch.float32)
        bad = "batch stride"
    assert kernel_api.get_kernels(args, cc=90, metadata_filter=_sm90) == []
    kernel = Sm90WarpSpecializedGemm.generate_kernels(
        lambda m: "_bf16bf16_bf16_" in m.kernel_name and "_ttt_" in m.kernel_name, cc=90)[0]
    status = kernel.supports(args, cc=90)
    assert not status and bad in status.error


def test_k_zero_rejected():
    kernel = Sm90WarpSpecializedGemm.generate_kernels(
        lambda m: "_bf16bf16_bf16_" in m.kernel_name and "_ttt_" in m.kernel_name, cc=90)[0]
    status = kernel._supports(_args(K=0))
    assert not status and "K=0" in status.error


def test_interface_does_not_import_cutlass():
    code = ("import sys, kernel_api.providers.cutedsl.gemm.sm90_warpspecialized as m; "
            "m.Sm90WarpSpecializedGemm.generate_kernels(None, cc=90); "
            "assert not any(n == 'cutlass' or n.startswith('cutlass.') for n in sys.modules), 'cutlass imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


# Compiles in a subprocess that keeps the PTX and cubin, then greps them: one instance per
# schedule, covering column-major operands, f32 output, rank 3 and a full fused epilogue, and the
# 128x192 tile (wgmma n192).
_COMPILE_SCRIPT = textwrap.dedent("""
    import sys, torch, kernel_api
    from kernel_api.providers.cutedsl.gemm.sm90_warpspecialized import Sm90WarpSpecializedGemm
    def mk(shape, dt, col):
        t = torch.randn(*shape).to(dt)
        return t.transpose(-1, -2).contiguous().transpose(-1, -2) if col else t
    cases = [("128x256x64_cluster2x1_cooperative_swz", "tnt", torch.bfloat16, 2, False),
             ("128x128x64_cluster2x1_pingpong_streamk", "nnn", torch.float32, 3, True),
             ("128x192x64_cluster2x1_cooperative_swz", "ntt", torch.bfloat16, 2, False)]
    for cfg, lay, odt, rank, fused in cases:
        sh = (lambda r, c: (2, r, c)) if rank == 3 else (lambda r, c: (r, c))
        A = mk(sh(256, 128), torch.bfloat16, lay[0] == "n"); B = mk(sh(128, 256), torch.bfloat16, lay[1] == "n")
        out = mk(sh(256, 256), odt, lay[2] == "n")
        ep = None
        if fused:
            ep = kernel_api.EpilogueArguments(alpha=0.5, beta=2.0, C=mk(sh(256, 256), odt, False),
                                              bias=torch.randn(256).to(odt), activation="gelu")
        args = kernel_api.GemmArguments(A, B, out, accumulator_type=torch.float32, epilogue=ep)
        ks = kernel_api.get_kernels(args, cc=90, metadata_filter=lambda m: m.kernel_class is Sm90WarpSpecializedGemm
                                    and cfg in m.kernel_name)
        assert len(ks) == 1, [k.name for k in ks]
        art = ks[0].compile(args, cc=90)
        assert art.cc == 90
        print("compiled", ks[0].name)
""")


def _nvdisasm():
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia  # the nvidia-cuda-nvdisasm wheel
        for base in nvidia.__path__:
            for sub in ("cu13/bin/nvdisasm", "cuda_nvdisasm/bin/nvdisasm"):
                path = os.path.join(base, sub)
                if os.path.exists(path):
                    return path
    except ImportError:
        pass
    return None


def test_compile_for_sm90a_emits_wgmma_and_tma(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "CUTE_DSL_KEEP": "ptx,cubin", "CUTE_DSL_DUMP_DIR": str(tmp_path),
           "KERNEL_API_CACHE": "0"}  # compile for real (no artifact from the disk cache)
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("compiled") == 3
    ptxs = sorted(p for p in os.listdir(tmp_path) if p.endswith(".ptx"))
    cubins = sorted(p for p in os.listdir(tmp_path) if p.endswith(".cubin"))
    assert len(ptxs) == 3 and len(cubins) == 3
    for name in ptxs:
        ptx = (tmp_path / name).read_text()
        assert ".target sm_90a" in ptx
        assert "wgmma.mma_async.sync.aligned.m64n" in ptx
        assert "cp.async.bulk.tensor" in ptx and "mbarrier" in ptx
        assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx
        assert ".multicast::cluster" in ptx  # every case uses a 2-CTA cluster
    streamk = [n for n in ptxs if "ld.acquire.gpu" in (tmp_path / n).read_text()]
    assert len(streamk) == 1  # the stream-K case waits for its partner's partial tile
    tool = _nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed: PTX checked, SASS not")
    for name in cubins:
        sass = subprocess.run([tool, "-c", str(tmp_path / name)], capture_output=True, text=True, check=True).stdout
        assert "HGMMA.64x" in sass and "UTMALDG" in sass and "UTMASTG" in sass
        assert "LDL" not in sass and "STL" not in sass  # no local-memory spills


def test_launch_arguments_of_every_run_path():
    """What _run and the bound launch hand the compiled function (a recording stub, CPU
    tensors): plain, bound repeat, fused epilogue and stream-K with its workspace and epoch."""
    from cuda.bindings import driver
    from kernel_api import CompiledArtifact, EpilogueArguments, GemmArguments

    A, B, out = (torch.randn(*s).half() for s in ((64, 32), (32, 48), (64, 48)))
    kernels = [k for k in kernel_api.get_kernels(GemmArguments(A, B, out), cc=90) if _sm90(k.metadata)]
    plain = next(k for k in kernels if not k.config.stream_k)
    streamk = next(k for k in kernels if k.config.stream_k)
    calls, stream = [], driver.CUstream(0)
    for k in (plain, streamk):
        k._clusters[-1] = 66  # CPU tensors: device index -1; no occupancy query without a GPU
    try:
        art = CompiledArtifact(lambda *a: calls.append(a), plain, 90)
        args = GemmArguments(A, B, out)
        for _ in range(2):  # the second run takes the launch bound to these arguments
            plain.run(args, compiled_artifact=art, stream=stream, assume_supported_args=True)
        assert calls[0] == calls[1] == (args.A, args.B, args.out, None, None, 1.0, 0.0, 66, None, 0, stream)
        C, bias = torch.randn(64, 48).half(), torch.randn(48).half()
        eargs = GemmArguments(A, B, out, epilogue=EpilogueArguments(alpha=2.0, beta=0.5, C=C, bias=bias))
        plain.run(eargs, compiled_artifact=art, stream=stream, assume_supported_args=True)
        ep = eargs.epilogue
        assert calls[2] == (A, B, out, ep.C, ep.bias, 2.0, 0.5, 66, None, 0, stream)
        workspace = torch.empty(streamk.get_workspace_size(args) or 1 << 20, dtype=torch.uint8)
        sk_args = GemmArguments(A, B, out)
        streamk.run(sk_args, compiled_artifact=CompiledArtifact(lambda *a: calls.append(a), streamk, 90), stream=stream,
                    workspace=workspace, assume_supported_args=True)
        assert calls[3][:9] == (A, B, out, None, None, 1.0, 0.0, 66, workspace) and calls[3][9] != 0
        assert sk_args._binding is None  # a run with a workspace binds nothing
    finally:
        for k in (plain, streamk):
            k._clusters.pop(-1, None)  # registry instances are shared with other tests


def test_split_all_instances_share_every_tile_over_the_grid():
    """The split_all design points (decode and prefill tails): 16-bit instances in every layout,
    named ``_splitall_``, with a stream-K workspace; the implementation refuses split_all
    without stream-K's fix-up; PickAny ranks them after the narrow 64x64 tiles and cuBLAS at
    M = 64 (measured 0.88-0.98x of cuBLAS on an H200; the narrow tiles 0.97-1.07x) and ahead of
    the data-parallel 64x128 tile."""
    import kernel_api
    from kernel_api.providers.cutedsl.gemm.implementations.sm90_warpspecialized_impl import Sm90WarpSpecializedGemmImpl
    from kernel_api.tuning.policies import rank_candidates

    split = [c for c in CONFIGS if c.split_all]
    assert split and all(c.stream_k for c in split)
    names = [k.metadata.kernel_name for k in Sm90WarpSpecializedGemm.generate_kernels(None, cc=90)
             if "_splitall_" in k.metadata.kernel_name]
    assert len(names) == len(split) * 2 * 8  # bf16 / f16, 8 layouts (16-bit outputs only)
    epilogue = type("E", (), dict(scaled=False, has_c=False, bias=None, activation=None))()
    with pytest.raises(ValueError, match="needs stream_k"):
        Sm90WarpSpecializedGemmImpl((64, 128), (1, 1), "pingpong", 1, True, 4, 2, epilogue, split_all=True)
    A = torch.empty(64, 8192, dtype=torch.bfloat16, device="meta")
    W = torch.empty(8192, 8192, dtype=torch.bfloat16, device="meta")
    args = kernel_api.GemmArguments(A, W.t(), torch.empty(64, 8192, dtype=torch.bfloat16, device="meta"))
    ranked = [k.metadata.kernel_name for k in rank_candidates(kernel_api.get_kernels(args, cc=90), args)]
    assert all("_tile64x64x64_" in name for name in ranked[:2]) and ranked[2].startswith("TorchGemm")
    assert "_splitall_" in ranked[3]
    assert ranked.index(next(n for n in ranked if "tile64x128x64_cluster2x1" in n)) > 3


def test_narrow_tiles_stream_b_at_decode_sizes():
    """The narrow (64x64, A multicast along N) design points: emitted in every 16-bit layout with
    their deeper rings named (``_maxst``); `narrow_tile_cost` reproduces the H200 measurements
    it was fitted to within 10 % (M = 64 and 128 against N, K of 4096-14336), charges a
    second wave of clusters and a one-tile M below the tile's 64 rows, and ranks the narrow
    tiles last at large M."""
    import kernel_api
    from kernel_api.providers.cutedsl.gemm.sm90_warpspecialized import NARROW_PARTIAL_M, narrow_tile_cost
    from kernel_api.tuning.policies import GEMM_COST_UNITS_PER_SECOND, rank_candidates

    narrow = [c for c in CONFIGS if c.narrow]
    assert [(c.tile_mn, c.cluster_mn) for c in narrow] == [((64, 64), (1, 2)), ((64, 64), (1, 4))]
    kernels = [k for k in Sm90WarpSpecializedGemm.generate_kernels(None, cc=90) if k.config.narrow]
    assert len(kernels) == len(narrow) * 2 * 8
    assert all("_maxst" in k.metadata.kernel_name and k.ab_stages > 8 for k in kernels)

    def args_of(M, N, K):
        A = torch.empty(M, K, dtype=torch.bfloat16, device="meta")
        B = torch.empty(K, N, dtype=torch.bfloat16, device="meta")
        return kernel_api.GemmArguments(A, B, torch.empty(M, N, dtype=torch.bfloat16, device="meta"))

    def micros(kernel, M, N, K):
        return narrow_tile_cost(kernel, args_of(M, N, K), 132) / GEMM_COST_UNITS_PER_SECOND * 1e6

    ttt = {k.config.cluster_mn: k for k in kernels if "_bf16bf16_bf16_f32acc_ttt_" in k.metadata.kernel_name}
    measured = {((1, 2), (64, 8192, 8192)): 36.9, ((1, 4), (64, 4096, 4096)): 13.2, ((1, 2), (64, 14336, 4096)): 34.9,
                ((1, 4), (64, 4096, 14336)): 35.3, ((1, 2), (128, 14336, 14336)): 204.3}
    for (cluster, shape), us in measured.items():
        assert micros(ttt[cluster], *shape) == pytest.approx(us, rel=0.1), (cluster, shape)
    # 66 clusters of two fit on 132 SMs: a 67th adds 1.5 % of the bytes but a second wave, in which
    # the busiest SM takes in twice the slabs
    one, two = micros(ttt[(1, 2)], 64, 66 * 128, 4096), micros(ttt[(1, 2)], 64, 67 * 128, 4096)
    assert two > 1.2 * one
    partial = micros(ttt[(1, 2)], 8, 8192, 8192)
    assert partial == pytest.approx(NARROW_PARTIAL_M * micros(ttt[(1, 2)], 64, 8192, 8192), rel=0.02)
    big = args_of(4096, 4096, 4096)
    ours = [k for k in rank_candidates(kernel_api.get_kernels(big, cc=90), big)
            if isinstance(k, Sm90WarpSpecializedGemm) and k.metadata.operands.math_type is None]
    assert all(k.config.narrow for k in ours[-2:]) and not any(k.config.narrow for k in ours[:-2])
