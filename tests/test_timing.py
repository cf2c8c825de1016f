"""kernel_api.tuning.timing.time_interleaved on the CPU: CUDA events, the stream and the GPU spin
are faked by a clock that each call advances by its kernel's duration."""

from __future__ import annotations

import pytest

from kernel_api.tuning import timing
from test_selection import fake_measure_inputs


class _Clock:
    """The fake GPU: ``now`` advances with each call; events read it when recorded."""

    def __init__(self, monkeypatch):
        self.now = 0.0
        self.log: list = []
        clock = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self, stream=None):
                self.t = clock.now

            def elapsed_time(self, other):
                return other.t - self.t

            def synchronize(self):
                clock.log.append(("wait", self.t))

        monkeypatch.setattr(timing.torch.cuda, "Event", Event)
        monkeypatch.setattr(timing.torch.cuda, "current_stream", lambda: None)
        monkeypatch.setattr(timing, "gpu_sleep", lambda ms, stream=None: clock.log.append(("sleep", round(ms, 3))))

    def kernel(self, name: str, ms: float, fail_at: int | None = None):
        def run(i: int) -> None:
            self.log.append((name, i))
            if fail_at is not None and sum(1 for e in self.log if e[0] == name) == fail_at:
                raise RuntimeError(f"{name} broke")
            self.now += ms
        return run


def test_rounds_launch_every_call_in_turn_on_a_new_input_set(monkeypatch):
    clock = _Clock(monkeypatch)
    runs = {"a": clock.kernel("a", 2.0), "b": clock.kernel("b", 1.0), "c": clock.kernel("c", 3.0)}
    found = timing.time_interleaved(runs, sets=4, warmup=2, repeat=3, gpu_floor_ms=1e9)
    launches = [e for e in clock.log if e[0] in runs]
    assert launches[:6] == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0), ("c", 1)]  # warm-ups, each alone
    rounds = launches[6:]
    assert [i for _, i in rounds] == [0, 1, 2, 3, 0, 1, 2, 3, 0]  # the set advances with every launch
    for r in range(3):  # every call once per round
        assert sorted(name for name, _ in rounds[3 * r:3 * r + 3]) == ["a", "b", "c"]
    assert {k: (v["median_ms"], v["samples"]) for k, v in found.items()} == {"a": (2.0, 3), "b": (1.0, 3),
                                                                           "c": (3.0, 3)}
    assert not [e for e in clock.log if e[0] == "sleep"]  # the GPU is slower than the host: no head start


def test_the_order_is_shuffled_each_round_so_no_call_always_follows_the_same_one(monkeypatch):
    """A call whose time depends on the call before it: "b" takes 1 ms after "a" and 3 ms
    otherwise. In a fixed order a, b, c it always followed "a"; shuffled it follows both others,
    and its samples show both neighbours; the orders repeat for the same keys and repeat count
    (seeded)."""
    clock = _Clock(monkeypatch)
    last = {"name": None}

    def call(name: str):
        def run(i: int) -> None:
            clock.log.append((name, i))
            clock.now += (1.0 if last["name"] == "a" else 3.0) if name == "b" else 2.0
            last["name"] = name
        return run

    runs = {"a": call("a"), "b": call("b"), "c": call("c")}
    found = timing.time_interleaved(runs, warmup=1, repeat=40, gpu_floor_ms=1e9)
    launches = [e[0] for e in clock.log if e[0] in runs][3:]
    assert {launches[j - 1] for j in range(1, len(launches)) if launches[j] == "b"} >= {"a", "c"}
    assert found["b"]["samples"] == 40 and found["b"]["min_ms"] == 1.0 and found["b"]["mean_ms"] > 1.5
    clock.log.clear()
    timing.time_interleaved(runs, warmup=1, repeat=40, gpu_floor_ms=1e9)
    assert [e[0] for e in clock.log if e[0] in runs][3:] == launches


def test_rounds_are_queued_in_chunks_two_ahead_of_the_waits(monkeypatch):
    clock = _Clock(monkeypatch)
    runs = {"a": clock.kernel("a", 1.0), "b": clock.kernel("b", 1.0)}
    timing.time_interleaved(runs, warmup=1, repeat=5, gpu_floor_ms=1e9, max_queued=4)  # 2 rounds per chunk
    marks = [e[0] if e[0] in ("wait", "sleep") else "launch" for e in clock.log[2:]]
    # chunks of 4, 4 and 2 launches; the first is waited for once the second is queued, and so on
    assert marks == ["launch"] * 8 + ["wait"] + ["launch"] * 2 + ["wait", "wait"]


def test_a_failing_call_is_reported_and_left_out_of_later_rounds(monkeypatch):
    clock = _Clock(monkeypatch)
    runs = {"a": clock.kernel("a", 1.0), "b": clock.kernel("b", 2.0, fail_at=3), "c": clock.kernel("c", 1.5, fail_at=1)}
    found = timing.time_interleaved(runs, warmup=1, repeat=4, gpu_floor_ms=1e9)
    assert isinstance(found["c"], RuntimeError)  # failed in its warm-up: never timed
    assert isinstance(found["b"], RuntimeError) and "b broke" in str(found["b"])  # failed in round 2
    assert found["a"]["samples"] == 4 and found["a"]["median_ms"] == 1.0
    assert [e[0] for e in clock.log if e[0] in runs][-2:] == ["a", "a"]  # b gone after its failure


def test_settle_rounds_run_untimed_before_the_timed_ones_in_the_same_orders(monkeypatch):
    """``settle_ms``: untimed shuffled rounds for that much GPU time by the floor (20 ms at 2 x
    0.5 ms a round: 20 rounds), between the warm-ups and the timed rounds, whose orders and
    input sets continue as without them; none when the floor is unknown."""
    clock = _Clock(monkeypatch)
    runs = {"a": clock.kernel("a", 1.0), "b": clock.kernel("b", 1.0)}
    timing.time_interleaved(runs, sets=3, warmup=1, repeat=6, gpu_floor_ms=0.5)
    plain = [e for e in clock.log if e[0] in runs][2:]
    clock.log.clear()
    found = timing.time_interleaved(runs, sets=3, warmup=1, repeat=6, gpu_floor_ms=0.5, settle_ms=20.0)
    launches = [e for e in clock.log if e[0] in runs][2:]
    settle, timed = launches[:40], launches[40:]
    assert sorted(name for name, _ in settle) == ["a"] * 20 + ["b"] * 20
    assert [name for name, _ in timed] == [name for name, _ in plain]  # the seeded timed orders
    assert [i for _, i in launches] == [i % 3 for i in range(52)]  # the set advances over both
    assert found["a"]["samples"] == found["b"]["samples"] == 6
    clock.log.clear()
    timing.time_interleaved(runs, warmup=1, repeat=6, gpu_floor_ms=0.0, settle_ms=20.0)
    assert len([e for e in clock.log if e[0] in runs]) == 2 + 12
    clock.log.clear()
    timing.time_interleaved(runs, warmup=1, repeat=6, gpu_floor_ms=1e-6, settle_ms=200.0)  # capped
    assert len([e for e in clock.log if e[0] in runs]) == 2 + timing.MAX_SETTLE_LAUNCHES + 12


def test_a_host_slower_than_the_calls_gets_a_head_start_per_chunk(monkeypatch):
    clock = _Clock(monkeypatch)
    runs = {"a": clock.kernel("a", 0.001), "b": clock.kernel("b", 0.001)}
    timing.time_interleaved(runs, warmup=2, repeat=4, gpu_floor_ms=0.0, max_queued=4)
    sleeps = [e for e in clock.log if e[0] == "sleep"]
    assert len(sleeps) == 2 and all(0 < ms <= timing.MAX_HEAD_START_MS for _, ms in sleeps)


@pytest.mark.parametrize("interleave", [False, True])
def test_pick_best_measures_the_same_either_way(monkeypatch, interleave):
    """PickBest._measure with the candidates timed one after another or in rounds: the same
    measurements and failures (fake kernels, clock-faked timing)."""
    from kernel_api.tuning import policies

    clock = _Clock(monkeypatch)

    class Fake:
        def __init__(self, name, ms, wrong=False):
            self.metadata = type("M", (), {"kernel_name": name})()
            self.ms, self.wrong = ms, wrong

        def compile_key(self, args, cc):
            return cc

        def compile(self, args):
            return self

        def run(self, args, compiled_artifact=None, assume_supported_args=False):
            if not assume_supported_args:
                shared.last = self
            clock.now += self.ms

    shared = fake_measure_inputs(monkeypatch, lambda args: 0.5 if args.last.wrong else 0.0)
    monkeypatch.setattr(policies, "_INTERLEAVE", interleave)
    found = policies.PickBest(repeat=5)._measure(shared, [Fake("a", 2.0), Fake("b", 1.0, wrong=True), Fake("c", 3.0)])
    assert [(m.kernel_name, m.median_ms, m.failure is None) for m in found] == [
        ("a", 2.0, True), ("b", None, False), ("c", 3.0, True)]
    assert "relative error 5.00e-01" in found[1].failure


class _InstantKernel:
    """A kernel PickBest can load and run that does nothing (the timing is faked)."""

    metadata = type("M", (), {"kernel_name": "k"})()

    def compile_key(self, args, cc):
        return cc

    def compile(self, args):
        return self

    def run(self, args, compiled_artifact=None, assume_supported_args=False):
        pass


@pytest.mark.parametrize("settle", [None, 0.0, 50.0])
def test_pick_best_settles_the_gpu_before_timing(monkeypatch, settle):
    """PickBest hands its ``settle_ms`` (default `policies._SETTLE_MS`), the problem's GPU
    floor and its ``timing`` (default "as_called") to its timing, in either power state."""
    from kernel_api.tuning import policies

    seen = {}

    def fake_interleaved(runs, sets, repeat, gpu_floor_ms, settle_ms, timing):
        seen.update(settle_ms=settle_ms, gpu_floor_ms=gpu_floor_ms, timing=timing)
        return {key: {"median_ms": 1.0} for key in runs}

    shared = fake_measure_inputs(monkeypatch, lambda args: 0.0)
    monkeypatch.setattr(policies, "time_interleaved", fake_interleaved)
    monkeypatch.setattr(policies, "time_own_state", fake_interleaved)
    monkeypatch.setattr(policies, "gpu_floor_ms", lambda args: 0.25)
    for state in policies.POWER_STATES:
        seen.clear()
        picker = policies.PickBest(repeat=5, power_state=state) if settle is None else \
            policies.PickBest(repeat=5, settle_ms=settle, power_state=state)
        found = picker._measure(shared, [_InstantKernel()])
        assert found[0].median_ms == 1.0
        assert seen == {"settle_ms": policies._SETTLE_MS if settle is None else settle, "gpu_floor_ms": 0.25,
                        "timing": "as_called"}
    seen.clear()
    policies.PickBest(repeat=5, timing="device")._measure(shared, [_InstantKernel()])
    assert seen["timing"] == "device"


class _PowerCappedGpu(_Clock):
    """A fake power-capped GPU: each kernel needs a number of cycles and draws a power per cycle;
    the clock is the cap over the mean draw of the last few launches (at most 1), so a launch takes
    its cycles over that clock."""

    def __init__(self, monkeypatch, window: int = 8):
        super().__init__(monkeypatch)
        self.recent: list[float] = []
        self.window = window

    def kernel(self, name: str, cycles: float, draw: float):
        def run(i: int) -> None:
            self.log.append((name, i))
            self.recent = (self.recent + [draw])[-self.window:]
            clock = min(1.0, 1.0 / (sum(self.recent) / len(self.recent)))  # the cap is 1.0
            self.now += cycles / clock
        return run


def test_own_state_ranks_by_energy_where_interleaving_ranks_by_cycles(monkeypatch):
    """A kernel that needs 5 % fewer cycles but draws 20 % more per cycle: launched in turn with
    another, both run at the clock of their mix and it wins; each on its own at the cap, its
    energy per call is the higher and it loses (as measured for bf16 ping-pong tiles against
    cuBLAS: docs/performance.md, "Power state")."""
    gpu = _PowerCappedGpu(monkeypatch)
    runs = {"hungry": gpu.kernel("hungry", 0.95, 1.44), "frugal": gpu.kernel("frugal", 1.0, 1.2)}
    shared = timing.time_interleaved(runs, sets=2, warmup=2, repeat=20, gpu_floor_ms=0.5, settle_ms=10.0)
    assert shared["hungry"]["median_ms"] < shared["frugal"]["median_ms"]
    own = timing.time_own_state(runs, sets=2, warmup=2, repeat=20, gpu_floor_ms=0.5, settle_ms=10.0)
    assert own["hungry"]["median_ms"] == pytest.approx(0.95 * 1.44)  # its own clock: 1 / 1.44
    assert own["frugal"]["median_ms"] == pytest.approx(1.0 * 1.2)
    assert own["frugal"]["median_ms"] < own["hungry"]["median_ms"]


def test_own_state_settles_each_call_alone_then_times_it(monkeypatch):
    """Per pass (the calls in a shuffled order), each call's settle launches (``settle_ms`` by the
    floor, at most MAX_SETTLE_LAUNCHES) run back to back right before its timed share; the input
    set advances with every launch; a failing call is reported and dropped."""
    clock = _Clock(monkeypatch)
    runs = {"a": clock.kernel("a", 1.0), "b": clock.kernel("b", 2.0), "c": clock.kernel("c", 1.0, fail_at=4)}
    found = timing.time_own_state(runs, sets=3, warmup=1, repeat=4, gpu_floor_ms=0.5, settle_ms=2.0)
    launches = [e for e in clock.log if e[0] in runs][3:]  # after one warm-up each
    assert [i for _, i in launches] == [i % 3 for i in range(len(launches))]
    blocks = []  # runs of the same call
    for name, _ in launches:
        if blocks and blocks[-1][0] == name:
            blocks[-1][1] += 1
        else:
            blocks.append([name, 1])
    ok = [b for b in blocks if b[0] != "c"]
    assert len(ok) == 2 * timing.OWN_STATE_PASSES and all(n == 4 + 2 for _, n in ok)  # 4 settle + 2 timed
    assert {k: (v["median_ms"], v["samples"]) for k, v in found.items() if k != "c"} == {"a": (1.0, 4), "b": (2.0, 4)}
    assert isinstance(found["c"], RuntimeError) and "c broke" in str(found["c"])
    assert [b for b in blocks if b[0] == "c"] == [["c", 3]]  # its 3rd launch (4th with the warm-up) failed
    clock.log.clear()
    timing.time_own_state({"a": runs["a"]}, warmup=0, repeat=3, gpu_floor_ms=1e-6, settle_ms=200.0)  # capped
    assert len([e for e in clock.log if e[0] == "a"]) == timing.OWN_STATE_PASSES * timing.MAX_SETTLE_LAUNCHES + 3
    clock.log.clear()
    timing.time_own_state({"a": runs["a"]}, warmup=0, repeat=3, gpu_floor_ms=0.0, settle_ms=200.0)  # floor unknown
    assert len([e for e in clock.log if e[0] == "a"]) == 3


def test_own_state_gives_a_host_slower_than_the_calls_a_head_start_after_the_settle(monkeypatch):
    """Where the host needs longer per launch than the call's GPU floor, the settle launches do not
    leave the GPU's queue ahead of the host (it drains them as fast as they come), so each call's
    timed share is queued behind a GPU spin, as in `time_interleaved`; else every sample would
    hold the host's gap before its launch (a launch-bound softmax or small GEMM ranked by host
    time). Not where the floor says the GPU is the slower."""
    clock = _Clock(monkeypatch)
    runs = {"a": clock.kernel("a", 0.001), "b": clock.kernel("b", 0.001)}
    timing.time_own_state(runs, warmup=2, repeat=4, gpu_floor_ms=1e-6, settle_ms=0.01)
    launches_and_sleeps = [e[0] for e in clock.log if e[0] in ("a", "b", "sleep")][4:]  # after the warm-ups
    blocks = []
    for name in launches_and_sleeps:
        if blocks and blocks[-1][0] == name:
            blocks[-1][1] += 1
        else:
            blocks.append([name, 1])
    # per pass and call: its settle launches, a head start, its 2 timed launches
    assert [b[1] for b in blocks if b[0] == "sleep"] == [1] * (2 * timing.OWN_STATE_PASSES)
    for i, (name, count) in enumerate(blocks):
        if name == "sleep":
            assert blocks[i - 1][0] == blocks[i + 1][0] != "sleep" and blocks[i + 1][1] >= 2
    sleeps = [ms for e, ms in (e for e in clock.log if e[0] == "sleep")]
    assert all(0 < ms <= timing.MAX_HEAD_START_MS for ms in sleeps)
    clock.log.clear()
    timing.time_own_state(runs, warmup=2, repeat=4, gpu_floor_ms=50.0, settle_ms=100.0)
    assert not [e for e in clock.log if e[0] == "sleep"]


@pytest.mark.parametrize("state", ["shared", "own", None])
def test_pick_best_times_in_the_power_state_it_is_asked_for(monkeypatch, state):
    """``power_state`` picks the timer; without one, each candidate in its own power state (the
    shared timing's choices ran down to 0.85x cuBLAS: docs/performance.md, "SM90 GEMM tiles")."""
    from kernel_api.tuning import policies

    seen = []
    for name in ("time_interleaved", "time_own_state"):
        monkeypatch.setattr(policies, name, lambda runs, sets, repeat, gpu_floor_ms, settle_ms, timing, name=name:
                            seen.append(name) or {key: {"median_ms": 1.0} for key in runs})

    shared = fake_measure_inputs(monkeypatch, lambda args: 0.0)
    picker = policies.PickBest(repeat=5) if state is None else policies.PickBest(repeat=5, power_state=state)
    found = picker._measure(shared, [_InstantKernel()])
    assert found[0].median_ms == 1.0
    assert seen == ["time_interleaved" if state == "shared" else "time_own_state"]
    with pytest.raises(ValueError, match="power_state must be 'shared' or 'own', got 'hot'"):
        policies.PickBest(power_state="hot")
