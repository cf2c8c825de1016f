"""kernel_api.tuning.timing on a GPU: samples hold GPU time, not the host's launch gaps, and a
queued timing does not wait until asked."""

from __future__ import annotations

import os
import time

import pytest
import torch

from kernel_api.tuning.timing import (QueuedTiming, relative_error, relative_error_tensor, time_cuda, time_cuda_pair,
                                      time_own_state)

pytestmark = pytest.mark.gpu


def _slow_host_launch(x: torch.Tensor):
    """A launch that costs the host 1 ms before a tiny kernel (a few microseconds of GPU work)."""
    def run(_: int) -> None:
        time.sleep(0.001)
        x.add_(1.0)
    return run


def test_timed_samples_leave_out_the_hosts_gaps():
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        # Other workers' kernels run between this test's events on a shared GPU
        pytest.skip("times samples of 0.3 ms or less: needs the GPU to itself (run without -n)")
    # Without a head start the GPU would wait about 1 ms for each launch between its events.
    x = torch.zeros(256, device="cuda")
    found = time_cuda(_slow_host_launch(x), repeat=5)
    assert found["median_ms"] < 0.3, found
    first, second = time_cuda_pair(_slow_host_launch(x), _slow_host_launch(x), repeat=4)
    assert first < 0.3 and second < 0.3, (first, second)
    assert x[0].item() == 5 + 5 + 2 * (5 + 4)  # every call ran once: warm-ups and timed


def test_no_head_start_when_the_gpu_is_slower_than_the_host():
    x = torch.zeros(256, device="cuda")
    timing = QueuedTiming(lambda i: x.add_(1.0), repeat=3, gpu_floor_ms=1e9)
    assert timing.head_start_ms == 0.0
    timing.result()
    timing = QueuedTiming(_slow_host_launch(x), repeat=3)
    assert timing.head_start_ms > 3.0


def test_queued_timing_returns_before_the_gpu_ran_the_calls():
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        # Under 8 workers it failed even with a 1 s spin (H200);
        # alone it passes.
        pytest.skip("races a GPU spin against the host: needs the GPU and the host to itself (run without -n)")
    x = torch.zeros(256, device="cuda")
    # About 1 s of GPU spin ahead of the calls: the host must queue them and ask before it ends
    # (0.1 s was too short with 8 test workers compiling beside it)
    torch.cuda._sleep(2_000_000_000)
    timing = QueuedTiming(lambda i: x.add_(1.0), repeat=10, gpu_floor_ms=1e9)
    assert not timing.ready()
    found = timing.result()
    assert timing.ready() and found["samples"] == 10 and found["median_ms"] < 1.0


def test_relative_error_tensor_stays_on_the_gpu_and_flags_non_finite_values():
    ref = torch.randn(64, 64, device="cuda", dtype=torch.float64)
    out = (ref * 1.001).float()
    err = relative_error_tensor(out, ref)
    assert err.device.type == "cuda" and err.dim() == 0
    assert err.item() == pytest.approx(1e-3, rel=1e-2) and relative_error(out, ref) == pytest.approx(err.item())
    out[3, 5] = float("nan")
    assert relative_error(out, ref) == float("inf")


def test_interleaved_rounds_time_each_call_without_the_hosts_gaps():
    from kernel_api.tuning.timing import time_interleaved

    x = torch.zeros(256, device="cuda")
    y = torch.zeros(1 << 22, device="cuda")  # 16 MB: scaling it in place takes about 10 us
    found = time_interleaved({"slow host": _slow_host_launch(x), "copy": lambda i: y.mul_(1.0)}, repeat=4)
    assert found["slow host"]["median_ms"] < 0.3 and found["slow host"]["samples"] == 4, found
    assert found["copy"]["median_ms"] > found["slow host"]["median_ms"], found
    assert x[0].item() == 5 + 4


def test_own_state_times_each_call_after_its_own_settle_launches():
    """Two GEMMs of different size, each timed in its own power state: every launch ran (warm-up,
    settle and timed: counted on the GPU), the samples are the calls' GPU times (the larger
    one's 8x the flops takes the longer) and a failing call is reported, not raised."""
    a = torch.randn(1024, 1024, device="cuda")
    big = torch.randn(2048, 2048, device="cuda")
    count = torch.zeros(2, device="cuda")

    def gemm(x, slot):
        def run(_: int) -> None:
            torch.mm(x, x)
            count[slot] += 1
        return run

    def broken(_: int) -> None:
        raise RuntimeError("no launch")

    found = time_own_state({"small": gemm(a, 0), "big": gemm(big, 1), "broken": broken}, warmup=2, repeat=6,
                           gpu_floor_ms=0.05, settle_ms=5.0)
    assert isinstance(found["broken"], RuntimeError)
    assert found["small"]["samples"] == found["big"]["samples"] == 6
    assert found["big"]["median_ms"] > 3 * found["small"]["median_ms"], found
    assert count.tolist() == [2 + 2 * 100 + 6] * 2  # warm-ups, settle launches (5 ms / 0.05 ms) per pass, timed
