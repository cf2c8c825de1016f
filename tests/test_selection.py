"""Tuning records, policies, settings and the ops front door (CPU-side behaviour)."""

import os
import sqlite3
import subprocess
import sys
import warnings

import pytest
import torch

import kernel_api
from kernel_api import GemmArguments, registry
from kernel_api.errors import DeviceError, NoKernelFoundError
from kernel_api.tuning.records import TuningRecords, operation_key
from kernel_api.tuning.reference import random_like, reference, tolerance
from kernel_api.tuning.policies import PickAny, PickBest, gemm_cost, rank_candidates
from kernel_api.tuning.settings import current

from toy_kernels import ToyGemm, ToyProvider


@pytest.fixture
def toy():
    ToyProvider.register(ToyGemm)
    yield ToyGemm
    ToyProvider.unregister(ToyGemm)
    registry.unregister_provider("toy")


def test_records_roundtrip_and_wal(tmp_path):
    records = TuningRecords(tmp_path / "tuning.sqlite")
    records.record("NVIDIA H200", 90, "sig", "4096x4096x4096x1", "k_best", 1.25, {"k_other": 1.5}, {"torch": "2"})
    found = records.lookup("NVIDIA H200", 90, "sig", "4096x4096x4096x1")
    assert found.kernel_name == "k_best" and found.runners_up == {"k_other": 1.5} and found.median_ms == 1.25
    assert records.lookup("NVIDIA H200", 90, "sig", "1x1x1x1") is None
    mode = sqlite3.connect(tmp_path / "tuning.sqlite").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode.lower() == "wal"


def test_records_are_seen_by_another_process(tmp_path):
    path = tmp_path / "tuning.sqlite"
    TuningRecords(path).record("dev", 90, "op", "shape", "winner", 2.0, {}, {})
    code = ("import sys; sys.path.insert(0, %r); from kernel_api.tuning.records import TuningRecords; "
            "print(TuningRecords(%r).lookup('dev', 90, 'op', 'shape').kernel_name)") % (os.getcwd(), str(path))
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "winner"


def test_corrupt_records_are_recreated_with_a_warning(tmp_path):
    path = tmp_path / "tuning.sqlite"
    path.write_bytes(b"this is not sqlite" * 64)
    records = TuningRecords(path)
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert records.lookup("d", 90, "o", "s") is None
    records.record("d", 90, "o", "s", "k", 1.0, {}, {})
    assert records.lookup("d", 90, "o", "s").kernel_name == "k"
    assert len(list(tmp_path.glob("tuning.sqlite.corrupt-*"))) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_records_fall_back_to_memory(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    records = TuningRecords(locked / "sub" / "tuning.sqlite")
    with pytest.warns(RuntimeWarning, match="in memory"):
        records.record("d", 90, "o", "s", "k", 1.0, {}, {})
    assert records.lookup("d", 90, "o", "s").kernel_name == "k"


def test_unwritable_records_fall_back_to_memory_as_root(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    records = TuningRecords(blocker / "tuning.sqlite")  # parent is a file: cannot be created
    with pytest.warns(RuntimeWarning, match="in memory"):
        records.record("d", 90, "o", "s", "k", 1.0, {}, {})
    assert records.lookup("d", 90, "o", "s").kernel_name == "k"


def test_operation_key_distinguishes_shapes_and_signatures():
    a = GemmArguments(torch.randn(8, 4), torch.randn(4, 2), torch.empty(8, 2))
    b = GemmArguments(torch.randn(16, 4), torch.randn(4, 2), torch.empty(16, 2))
    c = GemmArguments(torch.randn(8, 4).double(), torch.randn(4, 2).double(), torch.empty(8, 2).double())
    assert operation_key(a)[0] == operation_key(b)[0] and operation_key(a)[1] != operation_key(b)[1]
    assert operation_key(a)[0] != operation_key(c)[0]


def big_args(m, n, k=4096):
    meta = dict(device="meta", dtype=torch.float16)
    return GemmArguments(torch.empty(m, k, **meta), torch.empty(k, n, **meta), torch.empty(m, n, **meta))


def test_heuristic_prefers_big_tiles_for_big_problems_and_small_for_skinny(toy):
    big = big_args(8192, 8192)
    kernels = kernel_api.get_kernels(big, metadata_filter=lambda m: m.kernel_class is ToyGemm, cc=90)
    assert rank_candidates(kernels, big)[0].metadata.design.tile_shape[0] == 128
    # 256 tiles of 64x64 fill 132 SMs better than 64 tiles of 128x128.
    small = big_args(1024, 1024)
    k64 = next(k for k in kernels if k.metadata.design.tile_shape[0] == 64)
    k128 = next(k for k in kernels if k.metadata.design.tile_shape[0] == 128)
    assert gemm_cost(k64, small, 132) < gemm_cost(k128, small, 132)
    assert PickAny().choose(big, kernels).metadata.design.tile_shape[0] == 128


def test_performance_hint_is_a_kernel_attribute_the_ranking_reads(toy):
    from kernel_api.kernel import Kernel

    assert Kernel.performance_hint == 0.5 and "performance_hint" not in vars(ToyGemm)
    big = big_args(8192, 8192)
    k = kernel_api.get_kernels(big, metadata_filter=lambda m: m.kernel_class is ToyGemm, cc=90)[0]
    inherited = gemm_cost(k, big, 132)
    ToyGemm.performance_hint = 1.0
    try:
        assert gemm_cost(k, big, 132) == pytest.approx(inherited / 2)
    finally:
        del ToyGemm.performance_hint


def test_pick_any_without_candidates_says_so(toy):
    args = GemmArguments(torch.randn(4, 4).double(), torch.randn(4, 4).double(), torch.empty(4, 4).double())
    with pytest.raises(NoKernelFoundError, match="PickAny.choose: no candidates given"):
        PickAny().choose(args, [])


def test_pick_best_needs_a_gpu():
    args = GemmArguments(torch.randn(4, 4), torch.randn(4, 4), torch.empty(4, 4))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            PickBest().tune(args, [])


def test_settings_scope_policy():
    assert isinstance(current().policy, PickAny)
    with kernel_api.settings(policy=kernel_api.PickBest, num_workers=4) as s:
        assert isinstance(current().policy, PickBest) and current().policy.num_workers == 4 and s.num_workers == 4
        with kernel_api.settings(policy="any"):
            assert isinstance(current().policy, PickAny)
        assert isinstance(current().policy, PickBest)
    assert isinstance(current().policy, PickAny)
    with pytest.raises(TypeError, match="policy"):
        with kernel_api.settings(policy=42):
            pass
    with pytest.raises(ValueError, match="num_workers"):
        with kernel_api.settings(num_workers=0):
            pass


def test_random_like_keeps_signature_and_poisons_output():
    base = torch.randn(65 * 33 + 1).half()
    A = base[1:].view(65, 33)  # misaligned on purpose
    args = GemmArguments(A, torch.randn(17, 33).half().t(), torch.empty(65, 17).half())
    fresh = random_like(args)
    assert fresh.signature == args.signature
    assert torch.isnan(fresh.out).all() and not torch.equal(fresh.A, args.A)
    ref = reference(fresh)
    assert ref.dtype == torch.float64 and ref.shape == (65, 17)
    assert tolerance(fresh) == 1e-2


def test_ops_reject_cpu_tensors():
    with pytest.raises(DeviceError, match="operand A is on cpu"):
        kernel_api.ops.gemm(torch.randn(8, 8), torch.randn(8, 8))
    with pytest.raises(DeviceError, match="operand x is on cpu"):
        kernel_api.ops.softmax(torch.randn(4, 8))


def test_ops_validate_arguments():
    with pytest.raises(ValueError, match="K mismatch"):
        kernel_api.ops.gemm(torch.randn(8, 8), torch.randn(7, 8))
    with pytest.raises(ValueError, match="beta"):
        kernel_api.ops.gemm(torch.randn(8, 8), torch.randn(8, 8), beta=1.0)


def _pipelined_measure(monkeypatch, errors=None, broken=(), medians=None):
    """Fakes for PickBest._measure: (the fake kernel class, the events list they append to, the
    arguments to pass).
    ``errors``: a kernel's relative error (default 0); ``broken``: kernels whose timed launches
    fail when waited for (an asynchronous launch error); ``medians``: a kernel's median ms
    (default 1, 2, 3... for a, b, c...)."""
    from kernel_api.tuning import policies

    events = []
    errors, medians = errors or {}, medians or {}

    class Fake:
        def __init__(self, name, fails=False):
            self.metadata = type("M", (), {"kernel_name": name})()
            self.fails = fails

        def compile_key(self, args, cc):
            return ("signature", cc)

        def compile(self, args):
            events.append(("compile", self.metadata.kernel_name))
            if self.fails:
                raise RuntimeError("boom")
            return f"artifact-{self.metadata.kernel_name}"

        def run(self, args, compiled_artifact=None, assume_supported_args=False):
            assert compiled_artifact == f"artifact-{self.metadata.kernel_name}"
            assert args is not shared, "each kernel runs on its own copy of the arguments"
            events.append(("run", self.metadata.kernel_name)) if not assume_supported_args else None
            shared.current = self.metadata.kernel_name

    class FakeTiming:
        def __init__(self, run, sets=1, repeat=50, gpu_floor_ms=0.0, **kw):
            run(0)
            self.name = shared.current
            events.append(("queued", self.name))

        def result(self):
            events.append(("waited", self.name))
            if self.name in broken:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return {"median_ms": medians.get(self.name, 1.0 + ord(self.name) - ord("a"))}

    shared = fake_measure_inputs(monkeypatch, lambda args: errors.get(args.current, 0.0))
    monkeypatch.setattr(policies, "QueuedTiming", FakeTiming)
    monkeypatch.setattr(policies, "_INTERLEAVE", False)  # the one-after-the-other timing pass
    monkeypatch.setattr(policies, "_FIRST_LAUNCH_EARLY", False)  # each check is the first launch
    return Fake, events, shared


def fake_measure_inputs(monkeypatch, error_of):
    """Fakes PickBest._measure's inputs, reference, error and output (no GPU): returns the one
    arguments object every input set stands for; ``error_of(it)`` is the relative error a check
    finds (``it`` as the last verified run left it)."""
    from kernel_api.tuning import policies

    class Args:
        device_index = 0

        def tensors(self):
            return {}

    shared = Args()
    monkeypatch.setattr(policies, "device_cc", lambda index: 90)
    monkeypatch.setattr(policies, "random_like", lambda a: shared)
    monkeypatch.setattr(policies, "reference", lambda a: torch.zeros(1))
    monkeypatch.setattr(policies, "relative_error_tensor",
                        lambda o, r, n=None: torch.tensor(error_of(shared), dtype=torch.float64))
    monkeypatch.setattr(policies, "tolerance", lambda a, k=None: 1e-2)
    monkeypatch.setattr(policies, "output_of", lambda a: type("O", (), {"fill_": lambda self, v: None})())
    return shared


def test_pick_best_launches_new_artifacts_before_queueing_the_reference(monkeypatch):
    """With _FIRST_LAUNCH_EARLY, each artifact's first launch on a device comes before the float64
    reference is queued (a CuTe DSL first launch waits for the whole GPU queue holding the GIL),
    once per policy: the next problem sharing the kernels queues its reference at once. A kernel
    whose first launch fails is that candidate's failure, not the others'."""
    from kernel_api.tuning import policies

    Fake, events, args = _pipelined_measure(monkeypatch)
    monkeypatch.setattr(policies, "_FIRST_LAUNCH_EARLY", True)
    monkeypatch.setattr(policies, "reference", lambda a: events.append(("reference",)) or torch.zeros(1))
    picker = policies.PickBest()
    a, b = Fake("a"), Fake("b")
    picker._measure(args, [a, b])
    assert events[:5] == [("compile", "a"), ("run", "a"), ("compile", "b"), ("run", "b"), ("reference",)]
    assert events[5:7] == [("run", "a"), ("run", "b")]  # the checks
    events.clear()
    picker._measure(args, [a, b, Fake("c")])  # the registry gives the same kernel instances
    assert events[:3] == [("compile", "c"), ("run", "c"), ("reference",)]  # only c is new

    class FirstLaunchFails(Fake):
        def run(self, args, compiled_artifact=None, assume_supported_args=False):
            raise RuntimeError("cannot load module")

    events.clear()
    found = policies.PickBest()._measure(args, [FirstLaunchFails("a"), Fake("b")])
    assert [(m.kernel_name, m.failure is None) for m in found] == [("a", False), ("b", True)]
    assert "cannot load module" in found[0].failure


def test_pick_best_verifies_every_candidate_before_queueing_timed_launches(monkeypatch):
    """PickBest._measure: pass 1 loads each candidate (the next one while the GPU checks this
    one) and queues its check; pass 2 queues the timed launches, waiting for candidate n only
    after n+2 is queued. A failed early load is its own candidate's failure."""
    from kernel_api.tuning import policies

    Fake, events, args = _pipelined_measure(monkeypatch)
    found = policies.PickBest()._measure(args, [Fake("a"), Fake("b"), Fake("c"), Fake("d")])
    assert events == [("compile", "a"), ("run", "a"), ("compile", "b"), ("run", "b"), ("compile", "c"),
                      ("run", "c"), ("compile", "d"), ("run", "d"),
                      ("queued", "a"), ("queued", "b"), ("queued", "c"), ("waited", "a"), ("queued", "d"),
                      ("waited", "b"), ("waited", "c"), ("waited", "d")]
    assert [(m.kernel_name, m.median_ms, m.failure) for m in found] == [
        ("a", 1.0, None), ("b", 2.0, None), ("c", 3.0, None), ("d", 4.0, None)]
    events.clear()
    found = policies.PickBest()._measure(args, [Fake("a"), Fake("b", fails=True), Fake("c")])
    assert events == [("compile", "a"), ("run", "a"), ("compile", "b"), ("compile", "c"), ("run", "c"),
                      ("queued", "a"), ("queued", "c"), ("waited", "a"), ("waited", "c")]
    assert [(m.kernel_name, m.failure) for m in found] == [("a", None), ("b", "RuntimeError: boom"), ("c", None)]
    monkeypatch.setattr(policies, "_PREFETCH_NEXT", False)
    events.clear()
    policies.PickBest()._measure(args, [Fake("a"), Fake("c")])
    assert events == [("compile", "a"), ("run", "a"), ("compile", "c"), ("run", "c"),
                      ("queued", "a"), ("queued", "c"), ("waited", "a"), ("waited", "c")]


def test_pick_best_loads_each_kernel_once_per_device_and_compile_key(monkeypatch):
    """Tuning several shapes with one PickBest loads a kernel shared by them once (per device
    and compile key), not once per shape."""
    from kernel_api.tuning import policies

    Fake, events, args = _pipelined_measure(monkeypatch)
    picker = policies.PickBest()
    a, b = Fake("a"), Fake("b")
    picker._measure(args, [a, b])
    picker._measure(args, [b, a])
    assert [e for e in events if e[0] == "compile"] == [("compile", "a"), ("compile", "b")]
    args.device_index = 1  # another GPU: loaded again
    picker._measure(args, [a])
    assert [e for e in events if e[0] == "compile"] == [("compile", "a"), ("compile", "b"), ("compile", "a")]
    assert policies.PickBest()._artifact(a, args) == "artifact-a" and events[-1] == ("compile", "a")


def test_pick_best_pipelined_measure_reports_wrong_results_and_launch_failures(monkeypatch):
    """A wrong result read back from the GPU fails its own candidate (with its error), and so
    does a launch error that surfaces only when waited for; the others are measured."""
    from kernel_api.tuning import policies

    Fake, _, args = _pipelined_measure(monkeypatch, errors={"b": 0.5}, broken={"c"})
    found = policies.PickBest()._measure(args, [Fake("a"), Fake("b"), Fake("c"), Fake("d")])
    assert [m.kernel_name for m in found] == ["a", "b", "c", "d"]
    assert found[0].failure is None and found[0].error == 0.0
    assert found[1].median_ms is None and found[1].error == 0.5 and "relative error 5.00e-01 > 1e-02" in found[1].failure
    assert "illegal memory access" in found[2].failure and found[2].median_ms is None
    assert found[3].failure is None and found[3].median_ms == 4.0
