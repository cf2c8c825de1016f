"""Provider versions (CPU): tuning records are keyed on the versions of the providers whose
kernels may be candidates, each read once per process; ``kernel-api list|bench --provider``.

PickBest runs on a pretend GPU (`FakePickBest`); the providers live in a ``Registry()`` of the
test's own, or are the toy provider of the default registry.
"""

import importlib.metadata

import pytest
import torch

import kernel_api
from kernel_api import (BLASDesignMetadata, CompiledArtifact, GemmArguments, GemmOperandsMetadata, KernelMetadata,
                        RegistrationError, Status, TensorAttributes, registry)
from kernel_api.registry import Registry, versions
from kernel_api.tuning.policies import Measurement, PickBest, candidate_versions
from kernel_api.tuning.records import RecordContext, TuningRecords, record_key

import toy_kernels

ROW = (0, 0, 1)


@pytest.fixture(autouse=True)
def fresh_versions():
    """Each test starts as a new process would: no version read yet."""
    versions.forget_versions()
    yield
    versions.forget_versions()


@pytest.fixture
def toy():
    toy_kernels.ToyProvider.register(toy_kernels.ToyGemm)
    yield
    toy_kernels.ToyProvider.unregister(toy_kernels.ToyGemm)
    registry.unregister_provider("toy")


def gemm(m=128, n=256, k=512):
    meta = dict(device="meta", dtype=torch.float16)
    return GemmArguments(torch.empty(m, k, **meta), torch.empty(k, n, **meta), torch.empty(m, n, **meta))


def one_kernel_class(name):
    """A kernel class whose one instance, ``name``, takes f16 row-major GEMMs."""

    class OneGemm(kernel_api.Kernel):
        supported_args_type = GemmArguments

        def compile(self, args, cc=None):
            return CompiledArtifact(name, self)

        def _run(self, args, artifact, stream, workspace=None):
            torch.matmul(args.A, args.B, out=args.out)

        @classmethod
        def generate_kernels(cls, metadata_filter, epilogue_args=None, cc=None):
            attrs = TensorAttributes("f16", ROW, 8)
            md = KernelMetadata(name, cls, GemmOperandsMetadata(attrs, attrs, attrs, accumulator_type="f32"),
                                design=BLASDesignMetadata((128, 128, 64)), min_cc=80)
            return [cls(md)] if metadata_filter(md) else []

        def _supports(self, args):
            return Status.success()

        def get_workspace_size(self, args):
            return 0

    OneGemm.__name__ = OneGemm.__qualname__ = name
    return OneGemm


def two_providers():
    """A private registry with providers "alpha" (version 1.0, kernel AlphaGemm) and "beta"
    (version 1.0, kernel BetaGemm)."""

    class Alpha(kernel_api.Provider):
        name, version = "alpha", "1.0"

    class Beta(kernel_api.Provider):
        name, version = "beta", "1.0"

    reg = Registry()
    reg.register(one_kernel_class("AlphaGemm"), Alpha)
    reg.register(one_kernel_class("BetaGemm"), Beta)
    return reg, Alpha, Beta


class FakePickBest(PickBest):
    """PickBest on a pretend GPU: kernel ``fastest`` wins; ``measured`` counts the measurements."""

    def __init__(self, fastest, **kw):
        super().__init__(num_workers=1, repeat=1, **kw)
        self.fastest = fastest
        self.measured = 0

    def _device(self, args):
        return "Fake GPU", 90

    def _precompile(self, args, kernels, cc):
        return {}

    def _measure(self, args, kernels):
        self.measured += 1
        return [Measurement(k.metadata.kernel_name, 1.0 if k.metadata.kernel_name == self.fastest else 2.0, 0.0)
                for k in kernels]


# ---- records keyed by provider versions ---------------------------------------------------------

def test_a_record_is_not_reused_after_the_winners_provider_changes_version(tmp_path, monkeypatch):
    reg, alpha, _ = two_providers()
    args = gemm()
    pool = reg.get_kernels(args, cc=90)
    picker = FakePickBest("AlphaGemm", records=TuningRecords(tmp_path / "t.sqlite"))
    assert picker.tune(args, pool).winner.metadata.kernel_name == "AlphaGemm" and picker.measured == 1
    assert picker.tune(args, pool).from_record and picker.measured == 1  # same versions: reused
    monkeypatch.setattr(alpha, "version", "1.1")
    versions.forget_versions()  # a new process, after the upgrade
    assert picker.recorded(args, pool) is None
    result = picker.tune(args, pool)
    assert not result.from_record and picker.measured == 2
    assert "alpha:1.1" in result.record.operation and "beta:1.0" in result.record.operation


def test_a_record_is_not_reused_after_a_losing_provider_changes_version(tmp_path, monkeypatch):
    """A new release of the provider whose kernel lost may now win: the record is measured anew."""
    reg, _, beta = two_providers()
    args = gemm()
    pool = reg.get_kernels(args, cc=90)
    picker = FakePickBest("AlphaGemm", records=TuningRecords(tmp_path / "t.sqlite"))
    picker.tune(args, pool)
    monkeypatch.setattr(beta, "version", "2.0")
    versions.forget_versions()
    picker.fastest = "BetaGemm"
    assert picker.tune(args, pool).winner.metadata.kernel_name == "BetaGemm" and picker.measured == 2


def test_records_of_the_default_registry_are_keyed_on_every_scope_provider(toy, tmp_path, monkeypatch):
    args = gemm()
    pool = kernel_api.get_kernels(args, metadata_filter=lambda m: m.kernel_class is toy_kernels.ToyGemm, cc=90)
    picker = FakePickBest(pool[0].metadata.kernel_name, records=TuningRecords(tmp_path / "t.sqlite"))
    picker.tune(args, pool)
    assert picker.tune(args, pool).from_record
    monkeypatch.setattr(toy_kernels.ToyProvider, "version", "9.9")
    versions.forget_versions()
    assert picker.recorded(args, pool) is None
    with kernel_api.settings(providers=["torch", "toy"]):
        key = record_key(args, picker.record_context(args, pool))
    assert "providers=torch,toy" in key.operation
    assert f"versions=torch:{kernel_api.__version__},toy:9.9 " in key.operation


def test_the_record_key_holds_the_versions():
    args = gemm()
    base = RecordContext("native", None, "as_called/own", (("alpha", "1.0"), ("beta", "1.0")))
    key = record_key(args, base)
    assert key.operation.startswith("k3 ") and "versions=alpha:1.0,beta:1.0 timing=as_called/own" in key.operation
    assert record_key(args, base._replace(versions=(("alpha", "1.1"), ("beta", "1.0")))) != key
    assert "versions=- " in record_key(args, base._replace(versions=())).operation


def test_records_of_the_k2_format_count_as_missing(tmp_path):
    reg, _, _ = two_providers()
    args = gemm()
    pool = reg.get_kernels(args, cc=90)
    records = TuningRecords(tmp_path / "t.sqlite")
    picker = FakePickBest("BetaGemm", records=records)
    k3 = record_key(args, picker.record_context(args, pool))
    k2 = k3.operation.replace("k3 ", "k2 ", 1).split(" versions=")[0] + " timing=as_called/own"
    records.record("Fake GPU", 90, k2, k3.shape, "AlphaGemm", 1.0, {}, {})
    assert picker.recorded(args, pool) is None
    assert picker.tune(args, pool).winner.metadata.kernel_name == "BetaGemm" and picker.measured == 1


# ---- each version read once per process -----------------------------------------------------------

def test_a_plugins_version_is_its_distributions_read_once_per_process(monkeypatch):
    calls = {"packages_distributions": 0, "version": 0}

    def packages_distributions():
        calls["packages_distributions"] += 1
        return {"fake_liger": ["fake-liger-kernel"]}

    def version(name):
        if name != "fake-liger-kernel":
            raise importlib.metadata.PackageNotFoundError(name)
        calls["version"] += 1
        return "0.5.2"

    monkeypatch.setattr(importlib.metadata, "packages_distributions", packages_distributions)
    monkeypatch.setattr(importlib.metadata, "version", version)

    class Liger(kernel_api.Provider):
        name = "fake_liger"

    Liger.__module__ = "fake_liger.kernel_api_plugin"

    class Loose(kernel_api.Provider):
        name = "loose"

    Loose.__module__ = "some_notebook"
    for _ in range(3):
        assert Liger.version == "0.5.2" and Liger().version == "0.5.2"
        assert Loose.version == versions.UNVERSIONED
        assert versions.provider_versions([Liger, Loose]) == (("fake_liger", "0.5.2"), ("loose", versions.UNVERSIONED))
    assert calls == {"packages_distributions": 1, "version": 1}


def test_kernel_api_providers_use_kernel_api_version_and_lookups_read_no_distribution(monkeypatch):
    def refuse(*args):
        raise AssertionError("importlib.metadata read during a lookup")

    kernel_api.registry.default_registry.load_plugins()
    first = candidate_versions(None)  # reads what it needs, once
    assert dict(first)["torch"] == kernel_api.__version__
    monkeypatch.setattr(importlib.metadata, "packages_distributions", refuse)
    monkeypatch.setattr(importlib.metadata, "version", refuse)
    for _ in range(3):
        assert candidate_versions(None) == first
    assert registry.get_provider("cutedsl").version == kernel_api.__version__


def test_a_provider_version_must_be_a_non_empty_string():
    class Bad(kernel_api.Provider):
        name, version = "bad_version", 3

    with pytest.raises(RegistrationError, match=r"Bad.version must be a non-empty string \(or unset\), got 3"):
        Registry().register_provider(Bad)
