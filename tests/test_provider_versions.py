"""Provider versions (CPU): tuning records are keyed on the versions of the providers whose
kernels may be candidates, each read once per process; ``kernel-api list|bench --provider``.

PickBest runs on a pretend GPU (`FakePickBest`); the providers live in a ``Registry()`` of the
test's own, or are the toy provider of the default registry.
"""

import importlib.metadata
import types
from pathlib import Path

import pytest
import torch

import kernel_api
from kernel_api import (BLASDesignMetadata, CompiledArtifact, GemmArguments, GemmOperandsMetadata, KernelMetadata,
                        RegistrationError, Status, TensorAttributes, registry)
from kernel_api.cli import bench as cli_bench
from kernel_api.cli.commands import main
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
    assert f"versions=torch:{kernel_api.__version__}+torch-{torch.__version__},toy:9.9 " in key.operation


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
    assert dict(first)["torch"] == f"{kernel_api.__version__}+torch-{torch.__version__}"  # cuBLAS comes with torch
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


# ---- kernel-api list|bench|tune --provider -------------------------------------------------------

def test_list_provider_alone_lists_that_providers_classes_and_instances(toy, capsys):
    assert main(["list", "--provider", "toy", "--cc", "90"]) == 0
    out = capsys.readouterr().out
    assert "ToyGemm" in out and "GemmArguments" in out and versions.UNVERSIONED in out
    assert "TorchGemm" not in out and "1 kernel class(es), 96 instance(s) for cc 90" in out
    assert main(["list", "--provider", "toy,torch"]) == 0
    out = capsys.readouterr().out
    assert "ToyGemm" in out and "TorchGemm" in out and f"torch     {kernel_api.__version__}" in out


def test_list_provider_filters_a_problems_kernels(toy, capsys):
    problem = ["gemm", "--m", "64", "--n", "64", "--k", "64", "--dtype", "f16", "--cc", "90"]
    assert main(["list", *problem, "--provider", "toy"]) == 0
    out = capsys.readouterr().out
    assert "ToyGemm_f16" in out and "TorchGemm" not in out
    assert main(["list", "--provider", "torch", *problem]) == 0  # before the problem too
    out = capsys.readouterr().out
    assert "TorchGemm" in out and "ToyGemm" not in out


def test_an_unknown_provider_is_one_line_naming_the_available_ones(toy, capsys):
    for argv in (["list", "--provider", "nope"], ["list", "--provider", "toy,nope"],
                 ["list", "gemm", "--m", "8", "--n", "8", "--k", "8", "--provider", "nope"],
                 ["bench", "gemm", "--m", "8", "--n", "8", "--k", "8", "--provider", "nope"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("kernel-api: error: --provider: unknown provider 'nope'; "
                                                       "available: ") and "toy" in err and "torch" in err
    assert main(["list"]) == 2
    assert "give a problem" in capsys.readouterr().err


def test_bench_and_tune_without_gpu_list_only_the_providers_kernels(toy, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for command in ("bench", "tune"):
        assert main([command, "gemm", "--m", "64", "--n", "64", "--k", "64", "--dtype", "f16",
                     "--provider", "toy"]) == 3
        err = capsys.readouterr().err
        assert "ToyGemm_f16_ttt" in err and "TorchGemm" not in err


def test_each_providers_best_against_torch():
    rows = [{"kernel": "torch", "provider": "torch", "median_ms": 1.0, "vs_torch": 1.0},
            {"kernel": "A1", "provider": "alpha", "median_ms": 0.8, "vs_torch": 1.25},
            {"kernel": "A2", "provider": "alpha", "median_ms": 0.5, "vs_torch": 2.0},
            {"kernel": "T1", "provider": "torch", "median_ms": 1.1, "vs_torch": 1 / 1.1},
            {"kernel": "B1", "provider": "beta", "median_ms": None, "vs_torch": None}]
    assert [(b["provider"], b["kernel"]) for b in cli_bench.provider_bests(rows)] == \
        [("alpha", "A2"), ("torch", "T1"), ("beta", None)]


def test_tune_with_providers_chooses_and_records_in_their_scope(monkeypatch):
    seen = []
    monkeypatch.setattr(PickBest, "tune", lambda self, args, force=False: seen.append(
        kernel_api.tuning.scope.current().providers) or _Result())
    cli_bench.tune(gemm(), providers=["torch"], show=lambda line: None)
    cli_bench.tune(gemm(), show=lambda line: None)
    assert seen == [("torch",), None]


class _Result:
    from_record = True
    measurements = [Measurement("K", 0.001)]
    winner = types.SimpleNamespace(metadata=types.SimpleNamespace(kernel_name="K"))


def test_the_usage_guide_shows_the_provider_options():
    text = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    cli = text[text.index("## Command line"):text.index("### Kernels ahead of time")]
    assert "kernel-api list --provider" in cli and "--provider cutedsl,cuda_src" in cli
    assert "`Provider.version`" in cli


def test_release_numbers_and_require_library(monkeypatch):
    """`release` reads the leading numbers of a version; `require_library` refuses a missing
    library and one outside the supported range, in one line naming both versions."""
    import importlib.metadata

    import pytest

    from kernel_api.registry import release, require_library

    assert release("0.8.5.dev1") == (0, 8, 5) and release("4.0.0b36") == (4, 0, 0) and release("x") == ()
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.9.1" if name == "some-library" else real(name))
    assert require_library("kernel-api-some", "0.1.0", "some-library", ("0.9", "0.10")) == "0.9.1"
    with pytest.raises(ImportError, match=r"kernel-api-some 0.1.0 wraps some-library>=0.7,<0.9; 0.9.1 is installed"):
        require_library("kernel-api-some", "0.1.0", "some-library", ("0.7", "0.9"))
    with pytest.raises(ImportError, match="needs no-such-library-here>=1,<2, which is not installed"):
        require_library("kernel-api-some", "0.1.0", "no-such-library-here", ("1", "2"))
