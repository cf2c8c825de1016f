"""GPU checks of the GEMM families' launchers through `kernel_api.ops` (repeated calls take the
recorded launcher, on fresh data each time) and of PickBest's timing modes and record keys.

Timings here only rank candidates; how fast the choices run is measured by benchmarks.
"""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api.ops import dispatch
from kernel_api.tuning.policies import PickBest, Policy
from kernel_api.tuning.records import TuningRecords

pytestmark = pytest.mark.gpu


class Chosen(Policy):
    """Chooses the candidate named ``name`` (a fixed choice, to reach one family through ops)."""

    def __init__(self, match):
        self.match = match

    def choose(self, args, candidates):
        found = [k for k in candidates if self.match(k.metadata.kernel_name)]
        assert found, [k.metadata.kernel_name for k in candidates][:10]
        return found[0]


def _check_repeated(match, M, N, K, dtype, b_col=False, a_offset=0, calls=3, tf32=False, tolerance=None):
    """``ops.gemm(A, B, out=out)`` three times on fresh data with operands of equal metadata:
    the first call takes the Python path, the later ones the recorded launcher. Returns the
    chosen kernel's name."""
    gen = torch.Generator(device="cuda").manual_seed(M * 7 + N)
    policy = Chosen(match)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        with kernel_api.settings(policy=policy):
            A_store = torch.empty(M, K + a_offset, device="cuda", dtype=dtype)
            out = torch.empty(M, N, device="cuda", dtype=dtype)
            B_store = torch.empty((N, K) if b_col else (K, N), device="cuda", dtype=dtype)
            for _ in range(calls):
                A_store.copy_(torch.randn(A_store.shape, device="cuda", generator=gen))
                B_store.copy_(torch.randn(B_store.shape, device="cuda", generator=gen))
                A = A_store[:, a_offset:]
                B = B_store.t() if b_col else B_store
                out.fill_(float("nan"))
                kernel_api.ops.gemm(A, B, out=out)
                expected = A.double() @ B.double()
                error = float((out.double() - expected).norm() / expected.norm())
                limit = tolerance or {torch.bfloat16: 8e-3, torch.float16: 2e-3, torch.float32: 1e-4,
                                      torch.float64: 1e-12}[dtype]
                assert error < limit, error
            torch.cuda.synchronize()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    # the later calls took the launcher recorded for the operands' metadata
    assert any(isinstance(v, dispatch.PlainEntry) and v.token is policy for v in dispatch._fast.values())
    entries = [v for v in dispatch._dispatch.values() if v[2] is policy]
    assert entries
    return entries[0][0].metadata.kernel_name


@pytest.mark.parametrize("problem", [(3, 9216, 3072, False), (8, 4096, 4096, True), (100, 1024, 512, False)])
def test_small_m_repeated_calls_through_its_launcher(problem):
    M, N, K, b_col = problem
    name = _check_repeated(lambda n: n.startswith("CudaGemmSmallM"), M, N, K, torch.bfloat16, b_col)
    assert name.startswith("CudaGemmSmallM")


@pytest.mark.parametrize("shape", [(100, 300, 200), (2176, 2048, 512)])
def test_f64_repeated_calls_through_its_launcher(shape):
    """(2176 x 2048 splits its last wave on 132 SMs: partial sums in a per-call workspace)"""
    _check_repeated(lambda n: n.startswith("CudaGemmF64") and "_ws_" in n, *shape, torch.float64)


def test_sm90_stream_k_repeated_calls_through_its_launcher():
    _check_repeated(lambda n: n.startswith("Sm90Warp") and "streamk" in n, 2048, 2048, 2048, torch.bfloat16)


def test_sm90_3xtf32_repeated_calls_through_its_launcher():
    _check_repeated(lambda n: "tf32x3" in n, 1000, 3000, 2000, torch.float32, tf32=True, tolerance=1e-5)


@pytest.mark.parametrize("problem", [(777, 5001, 555, 0), (256, 384, 200, 1)])
def test_realigned_repeated_calls_through_its_launcher(problem):
    M, N, K, offset = problem
    _check_repeated(lambda n: n.startswith("Sm90Realigned"), M, N, K, torch.bfloat16, a_offset=offset)


def test_pickbest_timings_are_recorded_apart(tmp_path):
    """PickBest times as called by default, and device-only on request, each recording its own
    winner; both winners compute the product."""
    A = torch.randn(3, 3072, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(3072, 9216, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(3, 9216, device="cuda", dtype=torch.bfloat16)
    args = kernel_api.GemmArguments(A, B, out)
    records = TuningRecords(tmp_path / "t.sqlite")
    with kernel_api.settings(providers=["cuda_src", "torch"]):
        found = {timing: PickBest(num_workers=1, repeat=10, settle_ms=20.0, records=records, timing=timing).tune(args)
                 for timing in ("as_called", "device")}
    # (the key names a settle_ms other than the default too)
    assert sorted(r.operation.rpartition("timing=")[2] for r in records.all()) == ["as_called/own/settle=20",
                                                                                  "device/own/settle=20"]
    for result in found.values():
        assert not result.from_record
        result.winner.run(kernel_api.GemmArguments(A, B, out))
        torch.testing.assert_close(out.float(), (A.double() @ B.double()).float(), rtol=2e-2, atol=2e-1)
