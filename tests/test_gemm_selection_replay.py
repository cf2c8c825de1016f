"""PickAny's GEMM choice against the recorded GPU measurements (issue #16, goal 7: within 10 %
of the measured best), replayed on the CPU.

`benchmarks/gemm_replay.py` ranks today's candidates with today's cost model (meta tensors,
132 SMs) for every timed case of the H100 / H200 torch evidence
(``selection_torch-*.json``: GPT-2's GEMMs and the issue #16 sweep) and of the H200 session 25
``gemm_shapes`` runs (small_m, f32, f64), and looks the choice up in the case's timings. A
results file that is missing skips its tests. Kernel discovery needs no GPU and imports no
CuTe DSL.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
H100 = "selection_torch-NVIDIA_H100_80GB_HBM3.json"
H200 = "selection_torch-NVIDIA_H200.json"
SMALL_M = "gemm_shapes-NVIDIA_H200-s25-small-m.json"
SMALL_M_PICKANY = "gemm_shapes-NVIDIA_H200-s25-small-m-pickany.json"

#: The recorded files replayed in full.
FILES = [H100, H200, SMALL_M, SMALL_M_PICKANY, "gemm_shapes-NVIDIA_H200-s25-f32.json",
         "gemm_shapes-NVIDIA_H200-s25-f64.json"]

#: The cases the cuBLAS model's split-K reduction and GELU-fallback terms
#: (kernel_api/providers/torch_ops/kernels.py) brought within 10 %: (file, case, the ratio best /
#: choice before them, when PickAny took cuBLAS for both, and the family it takes now).
FIXED = [
    # cuBLASLt's bias + GELU at a decode step: 0.0763 ms against our fused 64x128 tile's 0.0231
    (H100, "c_fc+gelu M=64", 0.282, "Sm90WarpSpecializedGemm"),
    # 768 x 2304 x 8192 (X^T dY): cuBLAS's split-K over 54 tiles, 0.0512 ms against 0.0454
    (H100, "c_attn dW", 0.887, "Sm90WarpSpecializedGemm"),
]

#: Recorded cases still outside 10 %, with what each measured.
OPEN_MISSES = {
    # Host-bound samples: the session 22 H100 run timed each launch between events without a
    # GPU head start (timing.py before commit 245d64f), so every candidate's sample at these
    # sizes is 22-32 us (76 us for the GELU call) while the GPU work is 2-13 us. The order they give contradicts every
    # GPU-only measurement: cuBLAS ran GPT-2's decode GEMMs in 4.4-7.5 us against ~8 us for
    # ours in the H200 nsys profile (profile_gpt2-NVIDIA_H200-s21c-before.txt), cuBLAS is
    # 1.2-1.4x our best at M = 64 in the H200 small_m house timing, and our 64x128 tile, faster
    # or equal there, is 0.0313 against 0.0248 for the 128x128 tile here (and best at
    # mlp.c_proj M = 64). PickBest now times GPU work only; an H100 rerun of
    # `selection.py --torch-evidence` is the check.
    (H100, "c_attn M=64"): "host-bound",
    (H100, "mlp.c_proj M=64"): "host-bound",
    # 128x256 cooperative 0.9565 ms against 128x128 pingpong 0.868 on the H200; on the H100
    # the same two ran 0.9529 (best) and 1.0126: the devices disagree on the order.
    (H200, "lm_head aligned part"): "devices disagree",
    # The small-M kernel against cuBLAS at N = K = 8192 (0.88-0.91): the same kernel measured
    # 0.0360-0.0402 ms across the two runs and two contestant slots, cuBLAS 0.0357-0.0364.
    (SMALL_M, "bf16 1x8192x8192 tnt"): "within the kernel's run-to-run spread",
    (SMALL_M_PICKANY, "bf16 8x8192x8192 tnt"): "within the kernel's run-to-run spread",
}

#: Cases whose choice today the run did not time (no ratio): the H200 torch evidence timed only
#: the Sm80 family for GPT-2's whole lm_head (PickAny's choice then), not Sm90RealignedGemm.
UNTIMED = {(H200, "lm_head whole")}


@functools.lru_cache(maxsize=1)
def _replayer():
    path = os.path.join(ROOT, "benchmarks", "gemm_replay.py")
    spec = importlib.util.spec_from_file_location("_gemm_replay", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def _replayed(name: str) -> tuple[dict, ...]:
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        pytest.skip(f"{name} is not in benchmarks/results")
    return tuple(_replayer().replay_file(path))


def _case(name: str, case: str) -> dict:
    found = [r for r in _replayed(name) if r["case"] == case]
    assert len(found) == 1, (name, case, len(found))
    return found[0]


@pytest.mark.parametrize("name,case,before,family", FIXED)
def test_fixed_cases_choose_within_10_percent(name, case, before, family):
    r = _case(name, case)
    assert r["choice"].startswith(family), r
    assert r["within"], r
    assert r["ratio"] > before


@pytest.mark.parametrize("name", FILES)
def test_every_recorded_case_within_10_percent(name):
    """Every timed case of the file chooses within 10 % of its measured best, but the open
    misses (`OPEN_MISSES`); every case was so before the split-K and GELU-fallback terms, but
    those and the two they fixed, so none regressed. A choice the run did not time fails unless
    listed in `UNTIMED`."""
    outside, untimed = [], []
    for r in _replayed(name):
        key = (name, r["case"])
        if r["within"] is None:
            if key not in UNTIMED:
                untimed.append(f"{r['case']}: {r['choice']}")
        elif not r["within"] and key not in OPEN_MISSES:
            outside.append(f"{r['case']}: {r['choice']} at {r['ratio']:.3f} of {r['best']}")
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


def test_cublas_gelu_epilogue_fused_discount_only_where_its_tiles_fill_a_wave():
    """cuBLASLt's bias + GELU: 0.85x the bias-only cost at 8192 tokens (fused, measured
    fastest), two more output passes at a decode step (measured 2.4-2.6x the bias-only call)."""
    from kernel_api.providers.torch_ops import kernels as tk
    from kernel_api.tuning.policies import GEMM_COST_UNITS_PER_SECOND

    def cost(M, gelu):
        args = _args(M, 3072, 768, gelu=gelu)
        return _torch_gemm(args).estimated_cost(args, 132)

    assert cost(8192, True) == pytest.approx(cost(8192, False) * tk.TORCH_GELU_EPILOGUE_FACTOR)
    passes = 2 * tk.TORCH_EPILOGUE_PASS_SECONDS * GEMM_COST_UNITS_PER_SECOND
    assert cost(64, True) == pytest.approx(cost(64, False) + passes)
