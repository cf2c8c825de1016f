"""PickAny's GEMM choice against recorded GPU measurements (the goal: within 10 % of
the measured best), replayed on the CPU.

`kernel_api.tuning.replay` ranks today's candidates with today's cost model (meta tensors, cc 90,
132 SMs) for every case of ``tests/data/measured_gemm_times.json`` and looks the choice up in the
case's times. The runs there are named by device and content: the GPT-2 and issue-sweep
selection evidence, and benchmarks/gemm_shapes.py's groups (small_m, f32, f64, odd, aligned,
models, models_more, wave_fit, small, batched, odd_small, the odd grids and the held-out odd
problems). ``benchmarks/gemm_replay.py`` prints the same replay for result files. Kernel
discovery needs no GPU and imports no CuTe DSL.
"""

from __future__ import annotations

import functools
import json
import math
import os

import pytest
import torch

from kernel_api.tuning.replay import GemmProblem, Replayed, replay_gemm

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "measured_gemm_times.json")

H100 = "H100 GPT-2 and sweep"
H200 = "H200 GPT-2 and sweep"
#: M in 1..128 against N, K in 4096..14336 (``--group small_m``): our best and PickAny's choice
SMALL_M = "H200 small-m"
SMALL_M_PICKANY = "H200 small-m-pickany"
#: M = 64 with every split-K count timed, before the narrow 64x64 tiles
SPLIT_ALL = "H200 splitall"
#: M = 64 / 128 with the narrow tiles
NARROW = "H200 narrow"
FINAL = "H200 final"
SHUFFLED_FINAL = "H200 shuffled-final"
#: The odd group: staged copies at a 16-byte pitch (H200, H100, then a final H200 run) ...
ODD = "H200 odd"
ODD_H100_A = "H100 odd"
ODD_FINAL = "H200 odd-final"
#: ... at a 128-byte pitch, then with the cooperative stream-K instance, then PickBest's timing shuffled
ODD_B = "H200 odd (b)"
ODD_SK = "H200 odd-sk"
SHUFFLED_PICKBEST = "H200 shuffled-pickbest"
ODD_H100_B = "H100 odd (b)"
#: A Llama-3-8B layer's projections (``--group models``), with the 128x192 tile
MODELS = "H200 models-a-192"
MODELS_H100 = "H100 models-192"
MODELS_MORE = "H200 models-more"
WAVE_FIT = "H200 wave-fit"
WAVE_FIT_H100 = "H100 wave-fit"
WAVE_FIT_224 = "H200 wave-fit-224"
WAVE_FIT_224_H100 = "H100 wave-fit-224"
#: 5-30 us problems (``--group small``) on both cards, and ``models_more`` on an H100
SMALL = "H200 small"
SMALL_H100 = "H100 small"
MODELS_MORE_H100 = "H100 models-more"
#: batched and small odd problems (``--group batched,odd_small``), two grids of small odd
#: problems (``odd_sweep``, ``odd_sweep2``) and tiny ones (``odd_tiny``)
BATCHED_ODD_SMALL = "H200 batched-oddsmall"
ODD_SWEEP = "H200 odd-sweep"
ODD_SWEEP2 = "H200 odd-sweep2"
ODD_TINY = "H200 odd-tiny"
#: Small odd problems held out from the alignment-1 models' first fit (``odd_heldout``), then
#: fitted on with the runs above
ODD_HELDOUT = "H200 odd-heldout"
#: ... and more, measured after that second fit (``odd_heldout2``): 17 of 18 within 10 %, where
#: the model before the fit had 15 (GPT-2's lm_head in nn.Linear's layout at 8 tokens: cuBLAS, 0.24x)
ODD_HELDOUT2 = "H200 odd-heldout2"
#: ... and those two, odd_tiny and odd_sweep2 on an H100 (45 of 51 within 10 %; before the fit: 41)
ODD_H100 = "H100 odd (c)"
#: f32 (FP32 and TF32) and f64 odd shapes (``odd_wide``, H200), the first measured
ODD_WIDE_F32 = "H200 odd-wide-f32"
ODD_WIDE_F64 = "H200 odd-wide-f64"
#: ... f64 again with `CudaGemmF64`'s 8-byte-copy instances (``_align1``), measured by PickBest
#: (``-align1``), then with PickAny's final model (``-final``)
ODD_WIDE_F64_ALIGN1 = "H200 odd-wide-f64-align1"
ODD_WIDE_F64_FINAL = "H200 odd-wide-f64-final"
#: narrow odd outputs (``odd_narrow``, H200; 7 of 8 within 10 %, the model before 5)
ODD_NARROW = "H200 odd-narrow"


@functools.lru_cache(maxsize=1)
def _runs() -> dict:
    with open(DATA) as f:
        return json.load(f)["runs"]


#: Every recorded run, replayed in full.
RUNS = sorted(_runs())


@functools.lru_cache(maxsize=None)
def _replayed(run: str) -> tuple[tuple[str, Replayed], ...]:
    doc = _runs()[run]
    return tuple((c["case"], replay_gemm(GemmProblem(**c["problem"]),
                                         {k: ms for k, ms in zip(doc["kernels"], c["ms"]) if ms is not None}))
                 for c in doc["cases"])


def _case(run: str, case: str) -> Replayed:
    found = [r for name, r in _replayed(run) if name == case]
    assert len(found) == 1, (run, case, len(found))
    return found[0]


#: The cases that cost terms brought within 10 %: (run, case, the ratio best / choice before
#: them, the family PickAny takes now). The cluster-orientation term
#: (`policies.CLUSTER_ALONG_LONG_SIDE`) turns GPT-2's tall prefill outputs to the 1x2 cluster;
#: without a GELU term cuBLASLt's fused bias + GELU keeps its discount at a decode step.
FIXED = [
    (H100, "c_attn", 0.897, "Sm90WarpSpecializedGemm"),       # 1x2: 0.0548 ms against 2x1's 0.0572
    (H100, "attn.c_proj", 0.854, "Sm90WarpSpecializedGemm"),  # 1x2: 0.0218 against 0.0247
    (H100, "c_fc+gelu M=64", 0.770, "TorchGemm"),             # 0.0084 against our 64x128 tile's 0.0110
    # `policies.COOPERATIVE_EPILOGUE_K`: GPT-2's lm_head (K = 768) on the ping-pong 128x128 tile
    (H200, "lm_head aligned part", 0.796, "Sm90WarpSpecializedGemm"),  # 0.8889 against 1.1167
    # (`COOPERATIVE_EPILOGUE_K` 75, not 80) 2048^3 on the 128x256 cooperative tile: one wave
    # against the ping-pong 128x128's two, 0.0273 ms against 0.0321 on the H100
    (SMALL_H100, "bf16 2048x2048x2048 ttt", 0.851, "Sm90WarpSpecializedGemm_bf16bf16_bf16_f32acc_ttt_tile128x256"),
    # the alignment-1 models in seconds, launches included (cuBLAS's path:
    # `TorchGemm._unaligned_cost`; `SimtGemm.estimated_cost`; the staged kernels' inner launch):
    # the staged kernels where cuBLAS's estimate had no fixed time ...
    (ODD_SWEEP, "bf16 777x1333x555 ttt", 0.845, "Sm90RealignedGemm"),          # 0.0224 ms against 0.0266
    (BATCHED_ODD_SMALL, "bf16 777x1333x555 ttt", 0.847, "Sm90RealignedGemm"),
    (BATCHED_ODD_SMALL, "bf16 100x5000x3001 tnt", 0.757, "Sm90RealignedGemm"),  # 0.0386 against 0.0510
    (ODD_SWEEP2, "bf16 250x2999x999 ttt", 0.852, "Sm90RealignedGemm"),
    (ODD_SWEEP2, "bf16 450x777x4001 ttt", 0.844, "Sm90RealignedGemm"),
    # ... and the SIMT 32x32 tile on the tiniest bf16 problem, where bf16's alignment-1 cuBLAS
    # starts 3 us later than f16's (0.0066 against 0.0078)
    (ODD_TINY, "bf16 37x53x29 ttt", 0.848, "SimtGemm"),
    # measured after the fit: GPT-2's lm_head in nn.Linear's layout at 8 tokens, where cuBLAS's
    # alignment-1 path (only the output unaligned) took 0.1094 ms and the Sm80 tile 0.0261
    (ODD_HELDOUT2, "bf16 8x50257x768 tnt", 0.238, "Sm80TensorOpGemm"),
    (ODD_HELDOUT2, "bf16 33x65x17 ttt", 0.722, "SimtGemm"),
    # `sm90_warpspecialized.STREAM_K_FIXUP_K_TILES`: the split 128x256 tile at 9 k-tiles, which
    # PickAny took at 0.0391 ms, against the 64x128 tile's 0.0337
    (ODD_SWEEP, "bf16 777x5001x555 ttt", 0.858, "Sm90RealignedGemm_bf16bf16_bf16_f32acc_ttt_tile64x128"),
    # `torch_ops.kernels.TORCH_UNALIGNED_FACTOR` by element size (f32 0.35, f64 0.8; 0.17 for all
    # before): cuBLAS TF32 and DGEMM on odd shapes, where 3xTF32 and the Sm80 DMMA tiles were taken
    (ODD_WIDE_F32, "f32 1000x1000x999 ttt tf32", 0.66, "TorchGemm"),
    (ODD_WIDE_F32, "f32 4095x4096x4095 ttt tf32", 0.78, "TorchGemm"),
    (ODD_WIDE_F64, "f64 777x1333x555 ttt", 0.65, "TorchGemm"),
    (ODD_WIDE_F64, "f64 1000x1000x999 ttt", 0.70, "TorchGemm"),
    # `CudaGemmF64`'s 8-byte-copy instances from 2000x3000x1001 up (1.22-1.27x DGEMM), with
    # `TORCH_DGEMM_COST` (PickAny's choice measured in ODD_WIDE_F64_FINAL)
    (ODD_WIDE_F64_FINAL, "f64 2000x3000x1001 ttt", 0.82, "CudaGemmF64_f64_ttt_tile128x128x32_warps2x4_stages3_mma16_ws_align1"),
    (ODD_WIDE_F64_FINAL, "f64 4095x4096x4095 ttt", 0.79, "CudaGemmF64_f64_ttt_tile128x128x32_warps2x4_stages3_mma16_ws_align1"),
]

#: Recorded cases still outside 10 %, with what each measured.
OPEN_MISSES = {
    # GPT-2's mlp.c_proj dX (8192 x 3072 x 768): the 1x2 ping-pong tile that PickAny takes
    # (short K) ran 0.0662 ms on the H100 against the cooperative 256x128's 0.0594 (0.898), and
    # was the H200's best (0.0573 against 0.0583-0.0593): the devices disagree on the order.
    (H100, "mlp.c_proj dX"): "devices disagree",
    # Small odd problems where cuBLAS's alignment-1 path runs slower kernels than the model's
    # 64x64 tiles (`TorchGemm._unaligned_cost`): M <= 100 against N >= 4000, where the staged
    # kernels are 1.15-1.5x faster: 100x5001x555 0.0313 ms against 0.0209 (the model says
    # 0.0195: at K = 3001 the same output took cuBLAS 0.0467), 64x50257x768 0.1161 against 0.0775.
    (ODD_SWEEP, "bf16 100x5001x555 ttt"): "cuBLAS's alignment-1 path at M <= 100, N >= 4000",
    (ODD_SWEEP2, "bf16 63x9001x2047 tnt"): "cuBLAS's alignment-1 path at M <= 100, N >= 4000",
    (ODD_HELDOUT, "bf16 50x20001x1500 ttt"): "cuBLAS's alignment-1 path at M <= 100, N >= 4000",
    (ODD_HELDOUT, "bf16 40x4097x4097 ttt"): "cuBLAS's alignment-1 path at M <= 100, N >= 4000",
    (ODD_HELDOUT, "bf16 64x50257x768 ttt"): "cuBLAS's alignment-1 path at M <= 100, N >= 4000",
    # (a factor of 1.9 on cuBLAS's estimate at 17-64 rows against 4000+ columns fitted the five
    # above and failed on the held-out narrow group: 6 of 8 there against 7 without)
    (ODD_NARROW, "bf16 64x9999x4095 ttt"): "cuBLAS's alignment-1 path at M <= 100, N >= 4000",
    # 95x1000x300 (one staged copy, of A): cuBLAS 0.0082 ms, estimated 0.0119; the staged 64x128
    # tile 0.0095, estimated 0.0096
    (ODD_HELDOUT, "bf16 95x1000x300 ttt"): "cuBLAS's alignment-1 path, estimate 45 % long",
    # GPT-2's lm_head in nn.Linear's layout at 64 tokens (only the output's rows odd): the Sm80
    # 64x128 tile 0.0402 ms against the staged 64x128 wgmma tile's 0.0353 (0.879). The Sm80
    # family's tile-model estimate carries no launch time, the staged kernels' does.
    (ODD_HELDOUT2, "bf16 64x50257x768 tnt"): "Sm80 against the staged kernels, launch time",
    # The same problems on an H100: the three above (0.84-0.85 there) ...
    (ODD_H100, "bf16 95x1000x300 ttt"): "cuBLAS's alignment-1 path, estimate 45 % long",
    (ODD_H100, "bf16 64x50257x768 ttt"): "cuBLAS's alignment-1 path at M <= 100, N >= 4000",
    (ODD_H100, "bf16 64x50257x768 tnt"): "Sm80 against the staged kernels, launch time",
    # ... the staged kernels' own tiles: 3333x777x2222 tnt, the 64x128 tile 0.0630 ms against the
    # 128x256 cooperative one's 0.0548 (0.870; 0.915 on the H200); f16 3500x3500x900, 128x128
    # ping-pong 0.0850 against 128x256 cooperative 0.0751 (0.883; 0.949 on the H200) ...
    (ODD_H100, "bf16 3333x777x2222 tnt"): "tile choice among the staged kernels",
    (ODD_H100, "f16 3500x3500x900 ttt"): "tile choice among the staged kernels",
    # ... and 700x900x1100, the staged 64x128 tile 0.0246 against cuBLAS's 0.0221 (0.898; 0.924
    # on the H200)
    (ODD_H100, "bf16 700x900x1100 ttt"): "the staged kernels against cuBLAS, 10 %",
    # nn.Linear's layout at GPT-2's vocabulary in f32 and f64 (only the output's rows odd):
    # cuBLAS TF32 0.0741 ms against the Sm80 tf32 64x128 tile's 0.0608 (0.821; PickAny took the
    # 128x256 tile before, 0.0776); DGEMM 0.1208 against CudaGemmF64's 64x64 tile, 0.1074 (0.889)
    (ODD_WIDE_F32, "f32 64x50257x768 tnt tf32"): "cuBLAS against the Sm80 tf32 tiles, output unaligned",
    (ODD_WIDE_F64, "f64 64x50257x768 tnt"): "cuBLAS against CudaGemmF64, output unaligned",
    (ODD_WIDE_F64_ALIGN1, "f64 64x50257x768 tnt"): "cuBLAS against CudaGemmF64, output unaligned",
    (ODD_WIDE_F64_FINAL, "f64 64x50257x768 tnt"): "cuBLAS against CudaGemmF64, output unaligned",
    # The small-M kernel against cuBLAS at N = K = 8192 (0.88-0.91): the same kernel measured
    # 0.0360-0.0402 ms across the two runs and two contestant slots, cuBLAS 0.0357-0.0364.
    (SMALL_M, "bf16 1x8192x8192 tnt"): "within the kernel's run-to-run spread",
    (SMALL_M_PICKANY, "bf16 8x8192x8192 tnt"): "within the kernel's run-to-run spread",
    # Runs the benchmark flagged host-bound (their first case, 20-35 us problems on a slow host):
    # cuBLAS timed 33 us there against 18 us in the models-more run, PickAny's TorchGemm 40 us.
    # Re-run alone ("H200 host-bound-case"): TorchGemm 1.02x cuBLAS (23.0 us), our best tile 0.77x.
    ("H200 models-more-default", "bf16 256x4608x3584 tnt"): "host-bound run",
    ("H200 models-more-first-rerun", "bf16 256x4608x3584 tnt"): "host-bound run",
}

#: Cases whose choice today the run did not time (no ratio): the M = 64 decode shapes of the
#: runs before the narrow 64x64 tiles existed (PickAny takes them at M = 64 where they stream B
#: faster than cuBLAS's floor); NARROW times them (18 of 18 within 10 %).
UNTIMED: set = {
    # The 128x160 tile, which these runs did not have, for GPT-2's c_fc weight gradient and
    # Llama-3-70B's qkv at 256 tokens: WAVE_FIT and WAVE_FIT_H100 time it, 1.00x / 0.97x and
    # 1.04x / 1.00x cuBLAS (`test_wave_fit_shapes_take_the_128x160_tile`).
    (H100, "c_fc dW"), (H200, "c_fc dW"), (MODELS_MORE, "bf16 256x10240x8192 tnt"),
    # and the 128x224 tile for Qwen2-7B's o and down projections at 1024 tokens, where every
    # earlier tile ran 0.90-0.94x cuBLAS: WAVE_FIT_224 times it, 0.99x and 1.02x
    (MODELS_MORE, "bf16 1024x3584x3584 tnt"), (MODELS_MORE, "bf16 1024x3584x18944 tnt")} | {
    # f16 4097^3 (odd group): PickAny takes the 128x256 cooperative tile with stream-K over fuller
    # last waves (`sm90_realigned.REALIGNED_CONFIGS`), which these runs did not have. They had
    # the 128x128 ping-pong tile chosen, at 0.82-0.90 of the best with the staged copies at a
    # 16-byte pitch, 0.943 at the 128-byte pitch (ODD_B); ODD_SK times today's choice, the best
    # of the five instances (`test_f16_4097_cubed_takes_the_split_tile`).
    (name, "f16 4097x4097x4097 ttt") for name in (FINAL, SHUFFLED_FINAL, ODD, ODD_H100_A, ODD_FINAL, ODD_B)} | {
    (SMALL_M, f"bf16 64x{n}x{k} tnt") for n, k in ((4096, 4096), (8192, 8192), (14336, 4096), (14336, 14336))} | {
    (SPLIT_ALL, f"bf16 64x{n}x{k} tnt") for n in (4096, 8192, 14336) for k in (4096, 8192, 14336)
    if (n, k) != (4096, 14336)} | {
    # 2048^3 on the 128x256 cooperative tile (`COOPERATIVE_EPILOGUE_K` 75): these runs timed the
    # ping-pong tiles only; SMALL, SMALL_H100 and the odd runs time both (H200: a tie,
    # 0.997-1.004x; H100: 0.894x the ping-pong tile's time)
    (name, "bf16 2048x2048x2048 ttt") for name in (FINAL, SHUFFLED_FINAL)} | {
    # f64 from 2000x3000x1001 up: CudaGemmF64's 8-byte-copy instances, which this run did not
    # have; ODD_WIDE_F64_ALIGN1 and ODD_WIDE_F64_FINAL time them (1.21-1.27x DGEMM)
    (ODD_WIDE_F64, "f64 2000x3000x1001 ttt"), (ODD_WIDE_F64, "f64 4095x4096x4095 ttt")}


def test_every_named_run_and_case_is_recorded():
    named = {run for run, *_ in FIXED} | {run for run, _ in OPEN_MISSES} | {run for run, _ in UNTIMED}
    assert named <= set(RUNS), named - set(RUNS)
    for run, case in [(r, c) for r, c, *_ in FIXED] + list(OPEN_MISSES) + sorted(UNTIMED):
        assert any(name == case for name, _ in _replayed(run)), (run, case)


@pytest.mark.parametrize("name,case,before,family", FIXED)
def test_fixed_cases_choose_within_10_percent(name, case, before, family):
    r = _case(name, case)
    assert r.choice.startswith(family), r
    assert r.within, r
    assert r.ratio > before


@pytest.mark.parametrize("name", [MODELS, MODELS_H100])
def test_qkv_projection_at_512_tokens_takes_the_128x192_tile(name):
    """bf16 512x6144x4096 (a Llama-3-8B qkv projection at 512 tokens): 128 tiles of 128x192, one
    wave, where every other tile ran 0.76x cuBLAS before the tile existed and this one 1.01x on
    both cards."""
    r = _case(name, "bf16 512x6144x4096 tnt")
    assert "_tile128x192x64_" in r.choice and r.within and r.ratio > 0.99, r


@pytest.mark.parametrize("name", [WAVE_FIT, WAVE_FIT_H100])
def test_wave_fit_shapes_take_the_128x160_tile(name):
    """GPT-2's c_fc weight gradient (120 tiles of 128x160) and Llama-3-70B's qkv at 256 tokens (128
    tiles; every other tile of ours 0.90-0.92x cuBLAS in MODELS_MORE) take the 128x160 tile;
    mlp.c_proj's weight gradient, where the tile ran 0.84x cuBLAS on the H100, takes cuBLAS
    (the tile's ``cost_factor``)."""
    for case in ("bf16 768x3072x8192 ntt", "bf16 256x10240x8192 tnt"):
        r = _case(name, case)
        assert "_tile128x160x64_" in r.choice and r.within, r
    r = _case(name, "bf16 3072x768x8192 ntt")
    assert r.choice.startswith("TorchGemm") and r.within, r


@pytest.mark.parametrize("name", [WAVE_FIT_224, WAVE_FIT_224_H100])
@pytest.mark.parametrize("case", ["bf16 1024x3584x3584 tnt", "bf16 1024x3584x18944 tnt"])
def test_qwen_projections_take_the_128x224_tile(name, case):
    """Qwen2-7B's o and down projections at 1024 tokens: 128 tiles of 128x224, one wave (every
    earlier tile of ours 0.90-0.94x cuBLAS in MODELS_MORE); with it 0.99x and 1.02x on the H200
    (cuBLAS the measured best at 3584x3584, 1 % ahead), 1.04x and 1.10x on the H100."""
    r = _case(name, case)
    assert "_tile128x224x64_" in r.choice and r.within and r.ratio > 0.98, r


def test_f16_4097_cubed_takes_the_split_tile():
    r = _case(ODD_SK, "f16 4097x4097x4097 ttt")
    assert "cooperative_streamk_skk80" in r.choice and r.within and r.ratio > 0.99, r


@pytest.mark.parametrize("name", RUNS)
def test_every_recorded_case_within_10_percent(name):
    """Every timed case of the run chooses within 10 % of its measured best, but the open
    misses (`OPEN_MISSES`). A choice the run did not time fails unless listed in `UNTIMED`."""
    outside, untimed = [], []
    for case, r in _replayed(name):
        key = (name, case)
        if r.within is None:
            if key not in UNTIMED:
                untimed.append(f"{case}: {r.choice}")
        elif not r.within and key not in OPEN_MISSES:
            outside.append(f"{case}: {r.choice} at {r.ratio:.3f} of {r.best}")
    assert not outside, "\n".join(outside)
    assert not untimed, "choices the run did not time:\n" + "\n".join(untimed)


def _args(M, N, K, *, a_col=False, b_col=False, dtype=torch.bfloat16, gelu=False):
    import kernel_api

    def operand(rows, cols, col):
        return (torch.empty(cols, rows, dtype=dtype, device="meta").t() if col
                else torch.empty(rows, cols, dtype=dtype, device="meta"))

    epilogue = (kernel_api.EpilogueArguments(bias=torch.empty(N, dtype=dtype, device="meta"), activation="gelu")
                if gelu else None)
    return kernel_api.GemmArguments(operand(M, K, a_col), operand(K, N, b_col),
                                    torch.empty(M, N, dtype=dtype, device="meta"), epilogue=epilogue)


def _torch_gemm(args):
    import kernel_api

    return next(k for k in kernel_api.get_kernels(args, cc=90) if k.metadata.provider == "torch")


def test_cublas_streaming_floor_past_16_rows_only_for_large_operands():
    """cuBLAS's streaming floor holds at M = 64 and 128 where the operands take 32 MB or more
    (measured 0.88-1.03x of it, `NARROW`'s cuBLAS times), not on GPT-2's 3.6 MB decode product;
    with it PickAny takes the narrow 64x64 tile where that streams B faster (64x8192x8192:
    38.9 us against cuBLAS's 40.2) and keeps cuBLAS at M = 128."""
    from kernel_api.providers.torch_ops import kernels as tk
    from kernel_api.tuning.policies import GEMM_COST_UNITS_PER_SECOND, rank_candidates

    import kernel_api

    decode = _args(64, 8192, 8192, b_col=True)
    floor = tk.TorchGemm._streaming_cost(decode) / GEMM_COST_UNITS_PER_SECOND * 1e6
    assert floor == pytest.approx(40.2, rel=0.05)
    assert tk.TorchGemm._streaming_cost(_args(64, 2304, 768, b_col=True)) == 0.0
    assert tk.TorchGemm._streaming_cost(_args(256, 8192, 8192, b_col=True)) == 0.0
    assert "_tile64x64x64_" in rank_candidates(kernel_api.get_kernels(decode, cc=90), decode)[0].metadata.kernel_name
    wider = _args(128, 8192, 8192, b_col=True)
    assert rank_candidates(kernel_api.get_kernels(wider, cc=90), wider)[0].metadata.provider == "torch"


def test_cublas_split_k_reduction_only_on_non_skinny_outputs_below_a_wave():
    """The split-K term: the partials of ceil(SMs / tiles) splits on GPT-2's dW outputs; nothing
    where the output fills a wave of cuBLAS's tiles, or on skinny (decode) outputs, which its
    streaming floor describes; DGEMM counts its 128x64 tiles (2048^3: 512 of them)."""
    from kernel_api.providers.torch_ops import kernels as tk
    from kernel_api.tuning.policies import GEMM_COST_UNITS_PER_SECOND, TILE_STREAM_BYTES_PER_SECOND

    dw = _args(768, 2304, 8192, a_col=True)
    kernel = _torch_gemm(dw)
    assert kernel._tiles(dw) == 6 * 9
    splits = math.ceil(132 / 54)
    seconds = tk.TORCH_SPLIT_K_REDUCE_SECONDS + 2 * splits * 768 * 2304 * 4 / TILE_STREAM_BYTES_PER_SECOND
    assert kernel._split_k_cost(dw, 132) == pytest.approx(seconds * GEMM_COST_UNITS_PER_SECOND)
    for args in (_args(8192, 768, 3072), _args(64, 2304, 768), _args(128, 4096, 14336, b_col=True),
                 _args(2048, 2048, 2048, dtype=torch.float64)):
        assert _torch_gemm(args)._split_k_cost(args, 132) == 0.0, (args.M, args.N, args.K)


def test_cublas_gelu_epilogue_fused_discount_at_every_m():
    """cuBLASLt's bias + GELU: 0.85x the bias-only cost at 8192 tokens and at a decode step alike
    (the GPU-only H100 run: 0.0084 ms at 64 x 3072 x 768, the fastest of the case)."""
    from kernel_api.providers.torch_ops import kernels as tk

    def cost(M, gelu):
        args = _args(M, 3072, 768, gelu=gelu)
        return _torch_gemm(args).estimated_cost(args, 132)

    for M in (8192, 64):
        assert cost(M, True) == pytest.approx(cost(M, False) * tk.TORCH_GELU_EPILOGUE_FACTOR)


def test_cluster_padding_and_orientation_in_the_tile_model():
    """gemm_cost counts whole clusters (a 2x1 cluster on a one-tile M runs an empty CTA) and
    charges a cluster along the output's longer side of tiles `CLUSTER_ALONG_LONG_SIDE`."""
    import kernel_api
    from kernel_api.tuning.policies import CLUSTER_ALONG_LONG_SIDE, gemm_cost

    def sm90(args, cluster):
        return next(k for k in kernel_api.get_kernels(args, cc=90)
                    if "tile128x128x64_cluster%dx%d_pingpong_swz" % cluster in k.metadata.kernel_name)

    tall, wide, square, decode = _args(8192, 768, 768), _args(768, 8192, 768), _args(4096, 4096, 4096), \
        _args(64, 4096, 4096, b_col=True)
    for args, ratio in ((tall, CLUSTER_ALONG_LONG_SIDE), (wide, 1 / CLUSTER_ALONG_LONG_SIDE), (square, 1.0)):
        along_m, along_n = gemm_cost(sm90(args, (2, 1)), args, 132), gemm_cost(sm90(args, (1, 2)), args, 132)
        assert along_m / along_n == pytest.approx(ratio), (args.M, args.N)
    # one M tile: every 2x1 cluster's second CTA is empty and still paces its partner
    from kernel_api.tuning.policies import CLUSTER_PAST_THE_TILES

    for args in (decode, _args(128, 8192, 8192)):
        two_by_one, one_by_two = sm90(args, (2, 1)), sm90(args, (1, 2))
        assert gemm_cost(two_by_one, args, 132) > gemm_cost(one_by_two, args, 132)
    assert CLUSTER_PAST_THE_TILES > CLUSTER_ALONG_LONG_SIDE  # (1x2 runs along the long side there)


def test_cooperative_tiles_pay_their_epilogue_at_short_k():
    """`COOPERATIVE_EPILOGUE_K`: at GPT-2's lm_head (K = 768) the ping-pong 128x128 tile outranks
    the cooperative 128x256 one (measured 1.08-1.26x faster); at 8192^3 the cooperative tile
    keeps its place (the aligned-shape sweep)."""
    import kernel_api
    from kernel_api.tuning.policies import COOPERATIVE_EPILOGUE_K, gemm_cost

    def cost(args, part):
        k = next(k for k in kernel_api.get_kernels(args, cc=90) if part in k.metadata.kernel_name)
        return gemm_cost(k, args, 132)

    lm_head = _args(8192, 50256, 768, b_col=True)
    big = _args(8192, 8192, 8192)
    pingpong, cooperative = "tile128x128x64_cluster2x1_pingpong_swz", "tile128x256x64_cluster2x1_cooperative"
    assert cost(lm_head, pingpong) < cost(lm_head, cooperative)
    assert cost(big, cooperative) < cost(big, pingpong)
    assert 60 < COOPERATIVE_EPILOGUE_K < 100  # (the bounds its comment gives)


def test_f32_and_f64_problems_have_our_kernels_and_the_front_doors_math():
    """Every recorded f32 / f64 problem has kernels of ours among the candidates (f64 accumulates
    in f64: with an f32 accumulator none would be found), and tf32 / 3xTF32 math only where torch
    allowed TF32 (the f32 precision rule of ``ops.gemm``), on aligned problems always."""
    from kernel_api.core.dtypes import DataType
    from kernel_api.tuning.replay import candidates

    problems = {GemmProblem(**c["problem"]) for doc in _runs().values() for c in doc["cases"]
                if c["problem"].get("dtype") in ("f32", "f64")}
    assert any(p.dtype == "f64" for p in problems) and any(p.tf32 for p in problems)
    for problem in sorted(problems, key=repr):
        found = candidates(problem.arguments(), tf32=problem.tf32)
        assert [k for k in found if k.metadata.provider != "torch"], problem
        maths = {k.metadata.operands.math_type for k in found}
        tf32_math = bool(maths & {DataType.tf32, DataType.tf32x3})
        aligned = all(n % 16 == 0 for n in (problem.M, problem.N, problem.K))
        assert tf32_math == problem.tf32 if aligned else not tf32_math or problem.tf32, (problem, maths)
