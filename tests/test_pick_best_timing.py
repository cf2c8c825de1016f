"""PickBest's default timing, ``as_called``, charges a call's host time even where its kernel is
the longer part: every sample starts on a GPU with nothing queued. On the CPU: a fake host and
GPU (the host's clock advances by a call's host work; its kernel runs when the GPU is free, after
the launch; events read the GPU's clock where they sit in the queue).

The case is the H200's RMSNorm over every provider: QuACK's call (60 us of host work, a 69.3 us
kernel) against ours (5 us, 69.8 us). Behind the settle's backlog, both timed as their kernels
and QuACK won; re-timed from an idle GPU, QuACK's calls took 79.0 us against ours 70.1."""

from __future__ import annotations

import types

import pytest

from kernel_api.tuning import policies, timing
from test_selection import fake_measure_inputs

QUACK = (0.060, 0.0693)  # (host ms, kernel ms) per call
OURS = (0.005, 0.0698)
FLOOR_MS = 0.056  # the problem's GPU floor (its bytes at the peak bandwidth)


class _HostAndGpu:
    """The fake: ``host`` and ``gpu_free`` (when the GPU has run what is queued) in ms."""

    def __init__(self, monkeypatch):
        self.host = 0.0
        self.gpu_free = 0.0
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self, stream=None):
                self.t = fake.gpu_free = max(fake.gpu_free, fake.host)

            def elapsed_time(self, other):
                return other.t - self.t

            def synchronize(self):
                fake.host = max(fake.host, self.t)

        monkeypatch.setattr(timing.torch.cuda, "Event", Event)
        monkeypatch.setattr(timing.torch.cuda, "current_stream", lambda: None)
        monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: fake.host / 1e3))
        monkeypatch.setattr(timing, "gpu_sleep", self.sleep)

    def sleep(self, ms, stream=None):
        self.gpu_free = max(self.gpu_free, self.host) + ms

    def call(self, host_ms: float, kernel_ms: float):
        def run(i: int) -> None:
            self.host += host_ms  # the host's work, then the launch
            self.gpu_free = max(self.gpu_free, self.host) + kernel_ms
        return run


@pytest.mark.parametrize("timer", [timing.time_own_state, timing.time_interleaved])
def test_as_called_charges_the_host_time_a_backlog_would_hide(monkeypatch, timer):
    gpu = _HostAndGpu(monkeypatch)
    runs = {"quack": gpu.call(*QUACK), "ours": gpu.call(*OURS)}
    found = timer(runs, sets=2, warmup=5, repeat=10, gpu_floor_ms=FLOOR_MS, settle_ms=50.0, timing="as_called")
    quack, ours = found["quack"]["median_ms"], found["ours"]["median_ms"]
    calls = timing.calls_per_sample(QUACK[0], FLOOR_MS)
    assert quack == pytest.approx(QUACK[1] + QUACK[0] / calls, rel=1e-6)  # the first call's host time in each sample
    assert ours == pytest.approx(OURS[1] + OURS[0] / timing.calls_per_sample(OURS[0], FLOOR_MS), rel=1e-6)
    assert ours < quack
    device = timer(runs, sets=2, warmup=5, repeat=10, gpu_floor_ms=FLOOR_MS, settle_ms=50.0, timing="device")
    assert device["quack"]["median_ms"] == pytest.approx(QUACK[1]) and device["ours"]["median_ms"] == pytest.approx(
        OURS[1])  # GPU time only: QuACK's kernel is the faster


def test_a_host_bound_call_is_charged_its_host_time(monkeypatch):
    gpu = _HostAndGpu(monkeypatch)
    found = timing.time_own_state({"k": gpu.call(0.020, 0.005)}, warmup=3, repeat=6, gpu_floor_ms=0.004,
                                  settle_ms=1.0, timing="as_called")
    assert found["k"]["median_ms"] == pytest.approx(0.020, rel=0.02)


class _Kernel:
    """A candidate PickBest loads and runs on the fake (its calls through ``run``)."""

    def __init__(self, name, gpu, cost):
        self.metadata = types.SimpleNamespace(kernel_name=name)
        self.launch = gpu.call(*cost)

    def compile_key(self, args, cc):
        return cc

    def compile(self, args):
        return self

    def run(self, args, compiled_artifact=None, assume_supported_args=False):
        self.launch(0)


def test_pick_best_by_default_picks_the_call_that_is_faster_as_called(monkeypatch):
    assert policies.DEFAULT_TIMING == "as_called" and policies.PickBest().timing == "as_called"
    gpu = _HostAndGpu(monkeypatch)
    shared = fake_measure_inputs(monkeypatch, lambda args: 0.0)
    monkeypatch.setattr(policies, "gpu_floor_ms", lambda args: FLOOR_MS)
    candidates = [_Kernel("quack", gpu, QUACK), _Kernel("ours", gpu, OURS)]
    found = policies.PickBest(repeat=10, settle_ms=50.0)._measure(shared, candidates)
    times = {m.kernel_name: m.median_ms for m in found}
    assert times["ours"] < times["quack"], times
    device = policies.PickBest(repeat=10, settle_ms=50.0, timing="device")._measure(shared, candidates)
    times = {m.kernel_name: m.median_ms for m in device}
    assert times["quack"] < times["ours"], times  # for code that replays graphs: the faster kernel
