"""The kernel-api command line works without a GPU."""

import subprocess
import sys

import pytest

from kernel_api.cli.commands import gemm_arguments, main

import toy_kernels
from kernel_api import registry


@pytest.fixture
def toy():
    toy_kernels.ToyProvider.register(toy_kernels.ToyGemm)
    yield
    toy_kernels.ToyProvider.unregister(toy_kernels.ToyGemm)
    registry.unregister_provider("toy")


def test_list_gemm_prints_a_table(toy, capsys):
    assert main(["list", "gemm", "--m", "256", "--n", "512", "--k", "128", "--dtype", "f16", "--layout", "tnt",
                 "--cc", "90", "--provider", "toy"]) == 0
    out = capsys.readouterr().out
    assert "ToyGemm_f16_tnt_tile128x128x64_align8" in out and "128x128x64 / 1x1x1" in out
    assert "min cc" in out


def test_list_reports_nothing_found(toy, capsys):
    assert main(["list", "gemm", "--m", "8", "--n", "8", "--k", "8", "--dtype", "f64", "--provider", "toy"]) == 1
    assert "no kernel found" in capsys.readouterr().out


def test_explain_lists_reasons(toy, capsys):
    assert main(["explain", "gemm", "--m", "8", "--n", "8", "--k", "8", "--dtype", "f64", "--provider", "toy"]) == 0
    out = capsys.readouterr().out
    assert "toy/ToyGemm: 96 of 96: needs A f16/bf16/f32 (96)" in out  # grouped in the summary
    assert main(["explain", "gemm", "--m", "8", "--n", "8", "--k", "8", "--dtype", "f64", "--provider", "toy",
                 "--all"]) == 0
    out = capsys.readouterr().out
    assert "operand A: dtype f64 but the kernel takes f16" in out


def test_list_softmax_runs(capsys):
    assert main(["list", "softmax", "--rows", "64", "--cols", "1000", "--dtype", "bf16"]) in (0, 1)
    assert "SoftmaxArguments" in capsys.readouterr().out


def test_bad_cli_values_are_errors(capsys):
    assert main(["list", "gemm", "--m", "0", "--n", "8", "--k", "8"]) == 2
    assert "--m must be >= 1" in capsys.readouterr().err
    assert main(["list", "gemm", "--m", "8", "--n", "8", "--k", "8", "--dtype", "f7"]) == 2
    assert main(["list", "gemm", "--m", "8", "--n", "8", "--k", "8", "--layout", "tx"]) == 2
    assert main(["list", "gemm", "--m", "8", "--n", "8", "--k", "8", "--cc", "banana"]) == 2


def test_gemm_arguments_layouts():
    args = gemm_arguments(64, 32, 16, batch=2, dtype="bf16", layout="ntn")
    assert args.A.shape == (2, 64, 16) and args.tensor_attributes["A"].stride == (0, 1, 0)
    assert args.tensor_attributes["out"].stride == (0, 1, 0)


def test_python_dash_m_entry_point():
    done = subprocess.run([sys.executable, "-m", "kernel_api", "list", "gemm", "--m", "64", "--n", "64", "--k", "64",
                           "--dtype", "f64", "--cc", "90"], capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1), done.stderr
    assert "GemmArguments(M=64" in done.stdout


def test_bench_and_tune_without_gpu_list_and_fail(toy, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for command in ("bench", "tune"):
        code = main([command, "gemm", "--m", "64", "--n", "64", "--k", "64", "--dtype", "f16", "--provider", "toy"])
        err = capsys.readouterr().err
        assert code == 3 and "no CUDA GPU here" in err and "ToyGemm_f16_ttt" in err


def test_cache_info_and_clear(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path))
    from kernel_api.core.cache import DiskCache
    from kernel_api.tuning.records import TuningRecords

    DiskCache("cutedsl").put("k1", b"x" * 1000)
    TuningRecords().record("dev", 90, "op", "1x1x1x1", "winner", 1.0, {}, {})
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "cutedsl: 1 entries" in out and "tuning records: 1" in out and "winner" in out
    assert main(["cache", "clear"]) == 0
    capsys.readouterr()
    main(["cache", "info"])
    out = capsys.readouterr().out
    assert "cutedsl" not in out and "tuning records: 0" in out


def test_bench_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from kernel_api.cli.bench import _plot

    rows = [{"kernel": "torch", "provider": "torch", "throughput": 780.0},
            {"kernel": "SomeKernel_bf16_ttt_128x256x64", "provider": "cutedsl", "throughput": 772.0},
            {"kernel": "Failed", "provider": "cutedsl", "throughput": None}]
    path = tmp_path / "bench.png"
    _plot(rows, "TFLOP/s", str(path), "4096^3 bf16")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
