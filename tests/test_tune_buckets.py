"""PickBest(bucket=...): records keyed by a bucket of shapes (CPU, with faked device and timings).

`FakePickBest` stands in for the GPU: its device is fixed and its measurements come from a
table of kernel times (one per kernel name, scaled by M), and it counts what it measures.
"""

import pytest
import torch

import kernel_api
from kernel_api import GemmArguments, Status, registry
from kernel_api.tuning.buckets import bucket_reference, pow2_m, pow2_range, resolve_bucket
from kernel_api.tuning.policies import Measurement, PickBest
from kernel_api.tuning.records import TuningRecords, operation_key, record_key

from toy_kernels import ToyGemm, ToyProvider


@pytest.fixture
def toy():
    ToyProvider.register(ToyGemm)
    yield ToyGemm
    ToyProvider.unregister(ToyGemm)
    registry.unregister_provider("toy")


def gemm(m, n=256, k=512):
    meta = dict(device="meta", dtype=torch.float16)
    return GemmArguments(torch.empty(m, k, **meta), torch.empty(k, n, **meta), torch.empty(m, n, **meta))


def candidates(args):
    return kernel_api.get_kernels(args, metadata_filter=lambda m: m.kernel_class is ToyGemm, cc=90)


class FakePickBest(PickBest):
    """PickBest on a pretend GPU: kernel ``fastest`` wins, the others are slower; every
    measurement of a problem is logged in ``measured`` as its M."""

    def __init__(self, fastest=None, **kw):
        super().__init__(num_workers=1, repeat=1, **kw)
        self.fastest = fastest
        self.measured = []

    def _device(self, args):
        return "Fake GPU", 90

    def _precompile(self, args, kernels, cc):
        return {}

    def _measure(self, args, kernels):
        self.measured.append(args.M)
        fastest = self.fastest or kernels[-1].metadata.kernel_name
        return [Measurement(k.metadata.kernel_name, (1.0 if k.metadata.kernel_name == fastest else 2.0 + i) * args.M,
                            0.0) for i, k in enumerate(kernels)]


def test_pow2_buckets():
    assert [pow2_range(m) for m in (1, 2, 3, 4, 5, 8, 65, 100, 128, 129)] == \
        [(1, 1), (2, 2), (3, 4), (3, 4), (5, 8), (5, 8), (65, 128), (65, 128), (65, 128), (129, 256)]
    assert pow2_m(gemm(100)) == pow2_m(gemm(65)) == "pow2_m M=65..128 N=256 K=512 L=1"
    assert pow2_m(gemm(129)) != pow2_m(gemm(128))
    assert pow2_m(gemm(100, n=512)) != pow2_m(gemm(100))  # N and K stay exact
    x = torch.empty(100, 4096, device="meta", dtype=torch.bfloat16)
    assert pow2_m(kernel_api.SoftmaxArguments(x, torch.empty_like(x))) == "pow2_m rows=65..128 cols=4096"


def test_bucket_names_and_references():
    assert resolve_bucket("pow2_m") is pow2_m
    assert resolve_bucket("kernel_api.tuning.buckets:pow2_m") is pow2_m
    assert bucket_reference(pow2_m) == "pow2_m"
    with pytest.raises(ValueError, match="unknown bucket 'pow3'"):
        PickBest(bucket="pow3")
    with pytest.raises(ValueError, match="cannot be sent to a worker"):
        bucket_reference(lambda args: "x")
    with pytest.raises(TypeError, match="bucket: expected"):
        PickBest(bucket=3)


def test_one_tuning_per_bucket_reused_for_unseen_m(toy, tmp_path):
    records = TuningRecords(tmp_path / "t.sqlite")
    picker = FakePickBest(records=records, bucket="pow2_m")
    first = picker.tune(gemm(70), candidates(gemm(70)))
    assert not first.from_record and picker.measured == [70]
    assert first.record.shape == "bucket:pow2_m M=65..128 N=256 K=512 L=1"
    for m in (65, 100, 128):  # unseen M of the same bucket: the winner, without measuring
        again = picker.tune(gemm(m), candidates(gemm(m)))
        assert again.from_record and again.winner.metadata.kernel_name == first.winner.metadata.kernel_name
    assert picker.measured == [70]
    # Another process (a fresh policy on the same records) reuses it too.
    other = FakePickBest(records=TuningRecords(tmp_path / "t.sqlite"), bucket="pow2_m")
    assert other.tune(gemm(99), candidates(gemm(99))).from_record and other.measured == []


def test_different_buckets_tune_separately(toy, tmp_path):
    picker = FakePickBest(records=TuningRecords(tmp_path / "t.sqlite"), bucket="pow2_m")
    for m in (70, 129, 256, 3, 4):
        picker.tune(gemm(m), candidates(gemm(m)))
    assert picker.measured == [70, 129, 3]
    shapes = sorted(r.shape for r in picker.records.all())
    assert shapes == ["bucket:pow2_m M=129..256 N=256 K=512 L=1", "bucket:pow2_m M=3..4 N=256 K=512 L=1",
                      "bucket:pow2_m M=65..128 N=256 K=512 L=1"]


def test_without_a_bucket_every_shape_is_tuned(toy, tmp_path):
    picker = FakePickBest(records=TuningRecords(tmp_path / "t.sqlite"))
    for m in (70, 100, 70):
        picker.tune(gemm(m), candidates(gemm(m)))
    assert picker.measured == [70, 100]
    assert sorted(r.shape for r in picker.records.all()) == [operation_key(gemm(100))[1], operation_key(gemm(70))[1]]


def test_an_exact_record_wins_over_the_bucket(toy, tmp_path):
    records = TuningRecords(tmp_path / "t.sqlite")
    pool = candidates(gemm(100))
    exact = FakePickBest(fastest=pool[0].metadata.kernel_name, records=records)
    assert exact.tune(gemm(100), pool).winner is pool[0]
    bucketed = FakePickBest(fastest=pool[1].metadata.kernel_name, records=records, bucket="pow2_m")
    assert bucketed.tune(gemm(70), candidates(gemm(70))).winner.metadata.kernel_name == pool[1].metadata.kernel_name
    assert bucketed.tune(gemm(100), pool).winner is pool[0]  # its own measured record
    assert bucketed.tune(gemm(90), candidates(gemm(90))).winner.metadata.kernel_name == pool[1].metadata.kernel_name
    assert bucketed.measured == [70]


def test_a_bucket_winner_that_does_not_support_the_new_args_is_not_used(toy, tmp_path, monkeypatch):
    pool = candidates(gemm(70))
    winner = pool[2].metadata.kernel_name
    picker = FakePickBest(fastest=winner, records=TuningRecords(tmp_path / "t.sqlite"), bucket="pow2_m")
    assert picker.tune(gemm(70), pool).winner.metadata.kernel_name == winner
    # The winner turns out to handle M <= 80 only (a limit its metadata cannot express).
    original = ToyGemm._supports
    monkeypatch.setattr(ToyGemm, "_supports", lambda self, args: Status.fail("M > 80") if (
        self.metadata.kernel_name == winner and args.M > 80) else original(self, args))
    assert picker.recorded(gemm(100), pool) is None  # in the candidate list, but it does not support M=100
    result = picker.tune(gemm(100), [k for k in pool if k.supports(gemm(100))])
    assert not result.from_record and picker.measured == [70, 100]
    assert result.winner.metadata.kernel_name != winner
    assert result.record.shape == operation_key(gemm(100))[1]  # under its exact shape...
    bucket = picker.records.lookup("Fake GPU", 90, *record_key(gemm(70), picker.record_context(gemm(70)),
                                                               "bucket:" + pow2_m(gemm(70))))
    assert bucket.kernel_name == winner  # ...and the bucket keeps its winner for the M it suits
    assert picker.tune(gemm(75), pool).winner.metadata.kernel_name == winner
    assert picker.tune(gemm(100), pool).from_record  # its exact record
    assert picker.measured == [70, 100]


def test_force_retunes_the_bucket(toy, tmp_path):
    picker = FakePickBest(records=TuningRecords(tmp_path / "t.sqlite"), bucket="pow2_m")
    picker.tune(gemm(70), candidates(gemm(70)))
    again = picker.tune(gemm(120), candidates(gemm(120)), force=True)
    assert picker.measured == [70, 120] and again.record.shape.startswith("bucket:pow2_m M=65..128")
    assert len(picker.records.all()) == 1


def test_winners_timed_in_their_own_power_state_are_recorded_apart(toy, tmp_path):
    """PickBest(power_state="own"), the default, keys its records apart from the shared timing's
    (the timings can rank kernels differently): neither policy answers from the other's record,
    each reuses its own."""
    records = TuningRecords(tmp_path / "t.sqlite")
    pool = candidates(gemm(100))
    shared = FakePickBest(fastest=pool[0].metadata.kernel_name, records=records, power_state="shared")
    own = FakePickBest(fastest=pool[1].metadata.kernel_name, records=records)
    assert own.power_state == "own"
    assert shared.tune(gemm(100), pool).winner is pool[0]
    assert own.tune(gemm(100), pool).winner is pool[1] and own.measured == [100]
    assert own.tune(gemm(100), pool).from_record and own.measured == [100]
    assert shared.tune(gemm(100), pool).winner is pool[0] and shared.measured == [100]
    shape = operation_key(gemm(100))[1]
    assert [r.shape for r in records.all()] == [shape, shape]
    assert sorted(r.operation.rpartition("timing=")[2] for r in records.all()) == ["as_called/own", "as_called/shared"]
    bucketed = FakePickBest(records=records, power_state="own", bucket="pow2_m")
    assert bucketed.tune(gemm(70), candidates(gemm(70))).record.shape == \
        "bucket:pow2_m M=65..128 N=256 K=512 L=1"
