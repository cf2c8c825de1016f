"""The kernel-api command line works without a GPU."""

import subprocess
import sys

import pytest

from kernel_api.cli.commands import main
from kernel_api.cli.problems import gemm_arguments

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
    assert "--m must be an integer >= 1" in capsys.readouterr().err
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
    assert main(["cache", "clear", "--yes"]) == 0
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


# --- kernel-api env -----------------------------------------------------------------------------

def _cache_with_a_record(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path))
    from kernel_api.core.cache import DiskCache
    from kernel_api.tuning.records import TuningRecords

    DiskCache("cubin").put("k1", b"x" * 3000)
    for key in (None, "kernel_api 0.0.1; nvidia-cutlass-dsl 4.0.0 cu12"):  # this toolchain's, an older one's
        store = TuningRecords(toolchain_key=key)
        store.record("dev", 90, "op", "1x1x1x1", "winner", 1.0, {}, {})
        store.close()


def test_env_reports_without_a_gpu(tmp_path, monkeypatch, capsys):
    import torch

    import kernel_api
    from kernel_api.core.toolchain import distribution_version

    _cache_with_a_record(tmp_path, monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"kernel_api {kernel_api.__version__} on cpython")
    for dist in ("torch", "nvidia-cutlass-dsl", "apache-tvm-ffi", "cuda-bindings", "cuda-core"):
        line = next(l for l in out.splitlines() if l.split()[:1] == [dist])
        assert line.split()[1] == (distribution_version(dist) or "-"), line
    assert "CuTe DSL CUDA variants:" in out and "CUDA driver:" in out and "NVRTC:" in out
    assert "GPUs: 0 (" in out
    assert f"cache: {tmp_path}, " in out and "cubin: 1 entries" in out
    assert "tuning records: 2 (1 for this toolchain)" in out
    assert "native module: " in out


def test_env_json(tmp_path, monkeypatch, capsys):
    import json

    import torch

    from kernel_api.core.toolchain import distribution_version

    _cache_with_a_record(tmp_path, monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["packages"]["torch"] == distribution_version("torch")
    assert info["gpus"]["devices"] == []
    assert info["cache"]["directory"] == str(tmp_path) and info["cache"]["namespaces"] == {"cubin": 1}
    assert info["cache"]["bytes"] >= 3000 and info["tuning_records"]["total"] == 2
    assert set(info["native"]) >= {"table", "entry_points", "why_not"}
    assert set(info["cuda_majors"]) >= {"cutlass_dsl", "cuda_bindings", "nvrtc", "driver", "mixed"}


def test_env_in_a_new_process_exits_0_with_no_visible_gpu(tmp_path):
    import os

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "KERNEL_API_CACHE_DIR": str(tmp_path / "none")}
    done = subprocess.run([sys.executable, "-m", "kernel_api", "env"], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr
    assert "GPUs: 0 (" in done.stdout and "CUDA_VISIBLE_DEVICES=" in done.stdout
    assert "(not created yet)" in done.stdout and not (tmp_path / "none").exists()  # the report creates nothing
    assert "Traceback" not in done.stderr


def test_env_names_a_mixed_cuda_stack():
    from kernel_api.cli.env import format_report
    from kernel_api.cli.env import collect
    from kernel_api.core.environment import cuda_majors

    info = collect()
    packages = {**info["packages"], "cuda-bindings": "13.0.1"}
    info["cuda_majors"] = cuda_majors(packages, "cu12", "13.0", None)
    assert "warning: mixed CUDA majors (CuTe DSL 12, cuda-bindings 13, NVRTC 13)" in format_report(info)
    info["cuda_majors"] = cuda_majors(packages, "cu13", "13.0", "12.8")
    text = format_report(info)
    assert "mixed" not in text and "warning: a CUDA 12 driver cannot load the CUDA 13 pieces" in text


def test_dsl_variant_follows_the_driver(monkeypatch):
    from kernel_api.core import environment

    monkeypatch.setattr(environment, "distribution_version", lambda name: "4.8.1" if "libs-cu" in name else None)
    assert environment.dsl_variants(None) == {"installed": ["cu12", "cu13"], "loaded": "cu13"}
    assert environment.dsl_variants("12.9") == {"installed": ["cu12", "cu13"], "loaded": "cu12"}
    assert environment.dsl_variants("13.1")["loaded"] == "cu13"
    assert environment.dsl_variants("11.8")["loaded"] is None


@pytest.mark.gpu
def test_env_lists_the_gpus_with_their_compute_capability(capsys):
    import torch

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"GPUs: {torch.cuda.device_count()} (torch CUDA {torch.version.cuda}" in out
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        assert f"  {i}: {torch.cuda.get_device_name(i)}, cc {major * 10 + minor}, " in out
    assert "CUDA driver: none" not in out


# --- errors: one line and a status, not a traceback ----------------------------------------------

def _raising(monkeypatch, exc):
    from kernel_api.cli import commands

    def command(ns):
        raise exc

    monkeypatch.setitem(commands.COMMANDS, "list", command)


LIST = ["list", "gemm", "--m", "8", "--n", "8", "--k", "8"]


@pytest.mark.parametrize("exc, status", [
    (lambda: __import__("kernel_api").NoKernelFoundError("no kernel supports X; nearest misses:\n  a: b\n  c: d"), 1),
    (lambda: __import__("kernel_api").CompilationError("k.cu: error: expected ';'\nline 2"), 1),
    (lambda: __import__("kernel_api").KernelLaunchError("launch failed"), 1),
    (lambda: __import__("kernel_api").DeviceError("needs a CUDA GPU"), 3),
    (lambda: __import__("kernel_api").UnsupportedArgumentsError("A: dtype f64"), 2),
    (lambda: ModuleNotFoundError("No module named 'cutlass'", name="cutlass"), 1),
])
def test_errors_are_one_line_on_stderr_with_a_status(monkeypatch, capsys, exc, status):
    error = exc()
    _raising(monkeypatch, error)
    monkeypatch.delenv("KERNEL_API_DEBUG", raising=False)
    assert main(LIST) == status
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kernel-api: error: " + str(error).splitlines()[0])
    if "\n" in str(error):
        assert "rerun with --debug" in lines[0]
    if isinstance(error, ModuleNotFoundError):
        assert "kernel-api env" in lines[0]


def test_debug_shows_the_whole_error_and_its_traceback(monkeypatch):
    from kernel_api import NoKernelFoundError

    _raising(monkeypatch, NoKernelFoundError("no kernel\n  nearest"))
    with pytest.raises(NoKernelFoundError):
        main(["--debug"] + LIST)
    monkeypatch.setenv("KERNEL_API_DEBUG", "1")
    with pytest.raises(NoKernelFoundError):
        main(LIST)


def test_a_bug_keeps_its_traceback(monkeypatch):
    _raising(monkeypatch, ZeroDivisionError("a bug"))
    with pytest.raises(ZeroDivisionError):
        main(LIST)


def test_an_interrupt_is_one_line(monkeypatch, capsys):
    _raising(monkeypatch, KeyboardInterrupt())
    assert main(LIST) == 130
    assert capsys.readouterr().err == "kernel-api: interrupted\n"


def _block_matplotlib(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError


def test_bench_plot_without_matplotlib_names_the_extra(toy, monkeypatch, capsys):
    """Before anything is measured (here: before even the GPU check), one line and status 1."""
    _block_matplotlib(monkeypatch)
    code = main(["bench", "gemm", "--m", "64", "--n", "64", "--k", "64", "--dtype", "f16", "--provider", "toy",
                 "--plot", "out.png"])
    err = capsys.readouterr().err
    assert code == 1
    assert err == "kernel-api: error: --plot needs matplotlib, which is not installed: pip install 'kernel_api[plot]'\n"


def test_the_plot_helper_without_matplotlib_raises_a_missing_dependency(monkeypatch, tmp_path):
    from kernel_api import KernelApiError
    from kernel_api.cli.bench import _plot

    _block_matplotlib(monkeypatch)
    with pytest.raises(KernelApiError, match=r"pip install 'kernel_api\[plot\]'") as info:
        _plot([], "TFLOP/s", str(tmp_path / "x.png"), "t")
    assert isinstance(info.value, ImportError) and info.value.name == "matplotlib"


def test_errors_in_a_new_process_have_no_traceback(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from kernel_api.cli import main\n"
            "sys.exit(main(['bench', 'gemm', '--m', '8', '--n', '8', '--k', '8', '--plot', 'x.png']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("pip install 'kernel_api[plot]'")
    done = subprocess.run([sys.executable, "-m", "kernel_api", "list", "gemm", "--m", "0", "--n", "8", "--k", "8"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "--m must be an integer >= 1" in done.stderr


# --- progress bars ----------------------------------------------------------------------------------

def test_progress_is_a_tqdm_bar_per_phase():
    import io

    pytest.importorskip("tqdm")
    from kernel_api.cli.progress import TqdmProgress

    stream = io.StringIO()
    progress = TqdmProgress("bench", file=stream, disable=False)
    for done, name in enumerate(("compiled a", "compiled b", "compiled c"), 1):  # the compile workers
        progress(done, 3, name)
    for done, name in enumerate(("a", "b"), 1):  # the measurements start counting again
        progress(done, 2, name)
    text = stream.getvalue()
    assert "bench: 100%" in text and "3/3" in text and "2/2" in text and "compiled c" in text
    assert progress._bar is None  # both bars closed at their totals


def test_bench_and_tune_pass_tqdm_progress(monkeypatch):
    pytest.importorskip("tqdm")
    from kernel_api.cli import bench
    from kernel_api.cli.progress import TqdmProgress

    assert not hasattr(bench, "progress_bar")  # the hand-written bar is gone
    seen = []

    class Picker:
        def __init__(self, **kwargs):
            seen.append(kwargs["progress"])

        def tune(self, args, force=False):
            raise RuntimeError("stop")

    monkeypatch.setattr(bench, "PickBest", Picker)
    with pytest.raises(RuntimeError, match="stop"):
        bench.tune(object())
    assert isinstance(seen[0], TqdmProgress) and seen[0].desc == "tune"


def test_without_tqdm_there_is_no_progress_and_no_error(monkeypatch):
    from kernel_api.cli.progress import progress

    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert progress("bench") is None


def test_tune_takes_the_power_state_before_or_after_the_problem(monkeypatch, toy):
    """``tune --power-state own gemm ...`` and ``tune gemm ... --power-state own`` reach
    PickBest's ``power_state``; the default is ``own``; anything else is refused by argparse."""
    from kernel_api.cli import bench, commands

    seen = []
    monkeypatch.setattr(commands, "_gpu_arguments", lambda ns: object())
    monkeypatch.setattr(bench, "tune", lambda args, num_workers=None, force=False, power_state="shared",
                        providers=None: seen.append(power_state))
    problem = ["gemm", "--m", "64", "--n", "64", "--k", "64", "--dtype", "f16", "--provider", "toy"]
    assert main(["tune", "--power-state", "own", *problem]) == 0
    assert main(["tune", *problem, "--power-state", "own"]) == 0
    assert main(["tune", *problem, "--power-state", "shared"]) == 0
    assert main(["tune", *problem]) == 0
    assert seen == ["own", "own", "shared", "own"]
    with pytest.raises(SystemExit):
        main(["tune", *problem, "--power-state", "hot"])
