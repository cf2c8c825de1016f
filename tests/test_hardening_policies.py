"""PickAny and PickBest hardening (CPU): what tuning records are keyed on, the as-called timing
mode, PickAny's ranking of families launched from Python, and the GEMM families' launchers.

PickBest runs here on a pretend GPU (`FakePickBest`: a fixed device name, measurements from a
table); the timing functions run on a simulated GPU timeline (`SimulatedGpu`).
"""

import types

import pytest
import torch

import kernel_api
from kernel_api import GemmArguments, registry
from kernel_api.tuning import timing
from kernel_api.tuning.policies import Measurement, PickBest
from kernel_api.tuning.records import RecordContext, TuningRecords, operation_key, record_key

from toy_kernels import ToyGemm, ToyProvider


@pytest.fixture
def toy():
    ToyProvider.register(ToyGemm)
    yield ToyGemm
    ToyProvider.unregister(ToyGemm)
    registry.unregister_provider("toy")


@pytest.fixture
def tf32_flag():
    """Restores torch's TF32 matmul flag after the test."""
    before = torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def gemm(m, n=256, k=512, dtype=torch.float32):
    meta = dict(device="meta", dtype=dtype)
    return GemmArguments(torch.empty(m, k, **meta), torch.empty(k, n, **meta), torch.empty(m, n, **meta))


def toy_candidates(args):
    return kernel_api.get_kernels(args, metadata_filter=lambda m: m.kernel_class is ToyGemm, cc=90)


class FakePickBest(PickBest):
    """PickBest on a pretend GPU: kernel ``fastest`` wins; ``measured`` counts the measurements."""

    def __init__(self, fastest=None, **kw):
        super().__init__(num_workers=1, repeat=1, **kw)
        self.fastest = fastest
        self.measured = 0

    def _device(self, args):
        return "Fake GPU", 90

    def _precompile(self, args, kernels, cc):
        return {}

    def _measure(self, args, kernels):
        self.measured += 1
        fastest = self.fastest or kernels[-1].metadata.kernel_name
        return [Measurement(k.metadata.kernel_name, 1.0 if k.metadata.kernel_name == fastest else 2.0 + i, 0.0)
                for i, k in enumerate(kernels)]


# ---- the record key ---------------------------------------------------------------------------

def test_a_record_tuned_without_tf32_is_not_reused_once_torch_allows_it(toy, tmp_path, tf32_flag):
    """An f32 GEMM tuned while TF32 was off (its winner the best of the candidates without TF32)
    is measured again once torch allows TF32: the candidates and cuBLAS's math changed."""
    args = gemm(1000)
    pool = toy_candidates(args)
    picker = FakePickBest(records=TuningRecords(tmp_path / "t.sqlite"))
    torch.backends.cuda.matmul.allow_tf32 = False
    assert not picker.tune(args, pool).from_record and picker.measured == 1
    assert picker.tune(args, pool).from_record and picker.measured == 1
    torch.backends.cuda.matmul.allow_tf32 = True
    assert not picker.tune(args, pool).from_record and picker.measured == 2
    assert picker.tune(args, pool).from_record and picker.measured == 2
    assert sorted(r.operation.split(" math=")[1].split()[0] for r in picker.records.all()) == ["f32", "tf32"]


def test_bf16_records_do_not_depend_on_the_tf32_flag(toy, tmp_path, tf32_flag):
    args = gemm(64, dtype=torch.bfloat16)
    picker = FakePickBest(records=TuningRecords(tmp_path / "t.sqlite"))
    torch.backends.cuda.matmul.allow_tf32 = False
    picker.tune(args, toy_candidates(args))
    torch.backends.cuda.matmul.allow_tf32 = True
    assert picker.tune(args, toy_candidates(args)).from_record and picker.measured == 1


def test_records_are_keyed_on_the_settings_providers(toy, tmp_path):
    """A winner measured among one provider's kernels is not reused where every provider's
    kernels are candidates (a faster kernel of another provider was never measured)."""
    args = gemm(100, dtype=torch.float16)
    pool = toy_candidates(args)
    picker = FakePickBest(records=TuningRecords(tmp_path / "t.sqlite"))
    with kernel_api.settings(providers=["toy"]):
        assert not picker.tune(args, pool).from_record
        assert picker.tune(args, pool).from_record
    assert not picker.tune(args, pool).from_record and picker.measured == 2
    assert picker.tune(args, pool).from_record and picker.measured == 2


@pytest.mark.parametrize("options", [dict(timing="device"), dict(power_state="shared")])
def test_records_are_keyed_on_the_timing_options(toy, tmp_path, options):
    args = gemm(100, dtype=torch.float16)
    pool = toy_candidates(args)
    records = TuningRecords(tmp_path / "t.sqlite")
    default = FakePickBest(fastest=pool[0].metadata.kernel_name, records=records)
    other = FakePickBest(fastest=pool[1].metadata.kernel_name, records=records, **options)
    assert default.timing == "as_called" and default.power_state == "own"
    assert default.tune(args, pool).winner is pool[0]
    assert other.tune(args, pool).winner is pool[1] and other.measured == 1
    assert default.tune(args, pool).winner is pool[0] and default.measured == 1
    assert other.tune(args, pool).from_record and other.measured == 1


def test_records_of_the_older_key_format_are_not_reused(toy, tmp_path):
    """Records keyed by the bare signature (and the "own-power:" shape prefix) said nothing of
    the math, the providers or the timing, so they count as missing."""
    args = gemm(100, dtype=torch.float16)
    pool = toy_candidates(args)
    records = TuningRecords(tmp_path / "t.sqlite")
    signature, shape = operation_key(args)
    for old_shape in (shape, "own-power:" + shape):
        records.record("Fake GPU", 90, signature, old_shape, pool[0].metadata.kernel_name, 1.0, {}, {})
    picker = FakePickBest(fastest=pool[1].metadata.kernel_name, records=records)
    assert picker.recorded(args, pool) is None
    assert picker.tune(args, pool).winner is pool[1] and picker.measured == 1


def test_record_key_holds_every_field_of_the_context():
    args = gemm(100)
    base = RecordContext("f32", None, "as_called/own")
    keys = {record_key(args, base), record_key(args, base._replace(math="tf32")),
            record_key(args, base._replace(providers=("cutedsl", "torch"))),
            record_key(args, base._replace(timing="device/own")), record_key(args, base._replace(timing="as_called/shared"))}
    assert len(keys) == 5
    key = record_key(args, base)
    assert key.operation.startswith("k3 ") and "math=f32" in key.operation and "providers=all" in key.operation
    assert key.shape == operation_key(args)[1]
    assert record_key(args, base, "bucket:x").shape == "bucket:x"


def test_pickbest_refuses_an_unknown_timing():
    with pytest.raises(ValueError, match="timing must be 'as_called' or 'device', got 'graph'"):
        PickBest(timing="graph")


# ---- the as-called timing -----------------------------------------------------------------------

class SimulatedGpu:
    """One stream's timeline: a call spends host time, then queues GPU work that starts when both
    the host has launched it and the GPU is free; an event completes when the GPU reaches it."""

    def __init__(self):
        self.host = 0.0  # ms
        self.free = 0.0

    def call(self, host_ms, gpu_ms):
        self.host += host_ms
        self.free = max(self.free, self.host) + gpu_ms

    def sleep(self, ms, stream=None):
        self.free = max(self.free, self.host) + ms

    def event(self, enable_timing=True):
        gpu = self

        class Event:
            def record(self, stream=None):
                self.at = max(gpu.free, gpu.host)
                gpu.host += 0.003  # an event record's host time

            def elapsed_time(self, end):
                return end.at - self.at

            def synchronize(self):
                gpu.host = max(gpu.host, self.at)

            def query(self):
                return True

        return Event()


@pytest.fixture
def simulated(monkeypatch):
    gpu = SimulatedGpu()
    monkeypatch.setattr(timing.torch.cuda, "Event", gpu.event)
    monkeypatch.setattr(timing.torch.cuda, "current_stream", lambda *a, **k: None)
    monkeypatch.setattr(timing, "gpu_sleep", gpu.sleep)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: gpu.host / 1e3))
    return gpu


@pytest.mark.parametrize("timer", [timing.time_own_state, timing.time_interleaved])
def test_as_called_timing_charges_the_host_time_that_outlasts_the_kernel(simulated, timer):
    """A kernel of 10 us whose calls cost the host 50 us runs a loop of calls at 50 us a call;
    a 20 us kernel launched in 2 us at 20. The device timing ranks the first ahead (GPU time
    only, as a CUDA graph replays them), the as-called one the second, each near its truth."""
    runs = {"python_launch": lambda i: simulated.call(0.050, 0.010),
            "native_launch": lambda i: simulated.call(0.002, 0.020)}
    floor = 0.005
    device = timer(runs, repeat=20, gpu_floor_ms=floor, settle_ms=1.0, timing="device")
    as_called = timer(runs, repeat=20, gpu_floor_ms=floor, settle_ms=1.0, timing="as_called")
    assert device["python_launch"]["median_ms"] == pytest.approx(0.010, rel=0.05)
    assert device["native_launch"]["median_ms"] == pytest.approx(0.020, rel=0.05)
    assert as_called["python_launch"]["median_ms"] == pytest.approx(0.050, rel=0.1)
    assert as_called["native_launch"]["median_ms"] == pytest.approx(0.020, rel=0.1)


def test_as_called_samples_span_several_calls():
    assert timing.calls_per_sample(0.002, 0.01) == 50
    assert timing.calls_per_sample(0.6, 0.0) == 1
    assert timing.calls_per_sample(0.0, 0.0) == timing.AS_CALLED_MAX_CALLS


# ---- every GEMM family offers a launcher ------------------------------------------------------

class RecordingLauncher:
    """Stands in for a cubin's `CudaLauncher`: records each launch's (stream, grid, block,
    shared memory, parameters)."""

    def __init__(self):
        self.launches = []

    def launch(self, stream, device, grid, block, smem, params, cooperative=False):
        self.launches.append((stream, grid, block, smem, tuple(params)))


def _cuda_src_artifact(kernel):
    from kernel_api import CompiledArtifact
    from kernel_api.providers.cuda_src.kernels.gemm_f64 import CudaGemmF64
    from kernel_api.providers.cuda_src.kernels.gemm_small_m import CLUSTER, SPLIT2_CLUSTER

    main = RecordingLauncher()
    if isinstance(kernel, CudaGemmF64):
        extra = RecordingLauncher() if kernel.config.ws else None
    else:
        extra = {CLUSTER: main, SPLIT2_CLUSTER: RecordingLauncher()}
    return CompiledArtifact(main, kernel, 90, extra)


def _launches(artifact):
    found = list(artifact.compiled_obj.launches)
    extra = artifact.extra
    for other in (extra.values() if isinstance(extra, dict) else [extra]):
        if isinstance(other, RecordingLauncher) and other is not artifact.compiled_obj:
            found += other.launches
    return found


@pytest.mark.parametrize("problem", [
    ("CudaGemmSmallM", torch.bfloat16, 3, 9216, 3072, False),
    ("CudaGemmSmallM", torch.bfloat16, 8, 4096, 4096, True),
    ("CudaGemmSmallM", torch.float16, 100, 512, 1024, False),
    ("CudaGemmF64", torch.float64, 100, 300, 200, False),
    ("CudaGemmF64", torch.float64, 2176, 2048, 512, False),  # a split last wave on 132 SMs: a workspace
])
def test_cuda_src_gemm_launchers_launch_as_run_does(monkeypatch, problem):
    """The small-M and f64 families' launcher, for new operands with the recorded metadata,
    makes the very launches `_run` makes for them (the fixed parameters, the new pointers, the
    caller's stream), its workspace a block of the size `get_workspace_size` asks for."""
    from kernel_api.providers.cuda_src.kernels import gemm_f64

    family, dtype, M, N, K, b_col = problem
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    blocks = []

    def workspace(size, device, stream):
        blocks.append(size)
        return torch.empty(size, dtype=torch.uint8)

    monkeypatch.setattr(gemm_f64, "launch_workspace", workspace)

    def operands():
        B = torch.randn(N, K).to(dtype).t() if b_col else torch.randn(K, N).to(dtype)
        return torch.randn(M, K).to(dtype), B, torch.empty(M, N, dtype=dtype)

    first = GemmArguments(*operands())
    kernel = next(k for k in kernel_api.get_kernels(first, cc=90) if type(k).__name__ == family)
    artifact = _cuda_src_artifact(kernel)
    launcher = kernel._launcher(first, artifact)
    assert launcher is not None and not launcher.ffi and launcher.tail == ()
    A, B, out = operands()
    launcher.function(A, B, out, 1234)
    by_launcher = _launches(artifact)
    artifact = _cuda_src_artifact(kernel)
    args = GemmArguments(A, B, out)
    size = kernel.get_workspace_size(args)
    kernel._run(args, artifact, 1234, torch.empty(size, dtype=torch.uint8) if size else None)
    by_run = _launches(artifact)
    assert len(by_launcher) == len(by_run) >= 1
    for got, expected in zip(by_launcher, by_run):
        assert got[:4] == expected[:4]
        assert got[4][:3] == (A.data_ptr(), B.data_ptr(), out.data_ptr()) or got[4][1] == out.data_ptr()
        if size:  # the partial sums' address is the workspace's, one per launch
            assert len(got[4]) == len(expected[4])
        else:
            assert got[4] == expected[4]
    assert blocks == ([size] if size else [])


def _gemm_problems():
    """Arguments on which every shipped GEMM family has candidates (CPU tensors)."""
    def make(M, N, K, dtype, b_col=False, offset=0):
        B = torch.randn(N, K).to(dtype).t() if b_col else torch.randn(K, N).to(dtype)
        A = torch.randn(M, K + offset).to(dtype)[:, offset:]
        return GemmArguments(A, B, torch.empty(M, N, dtype=dtype))

    return [make(3, 9216, 3072, torch.bfloat16), make(8, 4096, 4096, torch.bfloat16, b_col=True),
            make(2048, 2048, 2048, torch.bfloat16), make(777, 5001, 555, torch.bfloat16),
            make(256, 384, 200, torch.bfloat16, offset=1), make(1000, 3000, 2000, torch.float32),
            make(4096, 4096, 4096, torch.float32), make(2176, 2048, 512, torch.float64),
            make(100, 300, 200, torch.float64)]


def test_every_gemm_instance_offers_a_launcher(monkeypatch):
    """Every candidate of every shipped GEMM family (stream-K and 3xTF32 instances, which take a
    workspace per launch, and the realigned family, which stages operands, included) offers a
    `Launcher` for a plain call, so repeated `kernel_api.ops.gemm` calls skip `_run`."""
    from kernel_api import CompiledArtifact
    from kernel_api.providers.cuda_src.kernels.gemm_f64 import CudaGemmF64
    from kernel_api.providers.cuda_src.kernels.gemm_small_m import CudaGemmSmallM

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    seen = set()
    for args in _gemm_problems():
        for kernel in kernel_api.get_kernels(args, cc=90):
            for holder in (kernel, getattr(kernel, "inner", None)):
                if holder is not None and hasattr(holder, "_clusters"):
                    holder._clusters[args.device_index] = 1  # (a device the kernel has run on)
            artifact = (_cuda_src_artifact(kernel) if isinstance(kernel, (CudaGemmSmallM, CudaGemmF64))
                        else CompiledArtifact(lambda *call: None, kernel, 90))
            assert kernel._launcher(args, artifact) is not None, kernel.metadata.kernel_name
            seen.add(type(kernel).__name__)
    assert seen >= {"CudaGemmSmallM", "CudaGemmF64", "SimtGemm", "Sm80TensorOpGemm", "Sm90WarpSpecializedGemm",
                    "Sm90RealignedGemm", "TorchGemm"}


@pytest.mark.parametrize("which", ["streamk", "tf32x3"])
def test_sm90_workspace_launchers_take_a_workspace_and_an_epoch_per_call(monkeypatch, which):
    from kernel_api import CompiledArtifact
    from kernel_api.providers.cutedsl.gemm import sm90_warpspecialized

    monkeypatch.setattr(sm90_warpspecialized, "launch_workspace",
                        lambda size, device, stream: (torch.empty(size, dtype=torch.uint8), int(stream)))
    dtype = torch.float32 if which == "tf32x3" else torch.bfloat16
    args = GemmArguments(torch.randn(4096, 4096).to(dtype), torch.randn(4096, 4096).to(dtype),
                         torch.empty(4096, 4096, dtype=dtype))
    kernel = next(k for k in kernel_api.get_kernels(args, cc=90) if which in k.metadata.kernel_name)
    kernel._clusters[args.device_index] = 66
    monkeypatch.setattr(sm90_warpspecialized, "max_active_clusters", lambda device, size: 66)
    calls = []
    launcher = kernel._launcher(args, CompiledArtifact(lambda *call: calls.append(call), kernel, 90))
    for _ in range(2):
        launcher.function(args.A, args.B, args.out, *launcher.tail, 77)
    assert [c[:3] for c in calls] == [(args.A, args.B, args.out)] * 2 and all(c[-1] == 77 for c in calls)
    assert all(c[7] == 66 and c[8].numel() == kernel.get_workspace_size(args) for c in calls)
    epochs = [c[9] for c in calls]
    assert (epochs[0] != epochs[1]) if which == "streamk" else epochs == [0, 0]


# ---- PickAny's choice where the GPU time model alone decides ------------------------------------

@pytest.mark.parametrize("b_col", [False, True])
def test_pickany_choice_at_decode_m8_is_launched_without_the_python_path(monkeypatch, b_col):
    """At bf16 M=8, N=K=4096 PickAny ranks the small-M family first (its GPU model: 14.6 us,
    cuBLAS 14.7): measured on an H200 its kernel ran 12.8-13.0 us a call back to back, but each
    call took `Kernel._run`'s Python path (no launcher: 46 us a call, 0.40x torch.matmul). The
    choice stands; it now offers a `Launcher`, which ops records for repeated calls."""
    from kernel_api.tuning.policies import PickAny

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    B = torch.randn(4096, 4096).bfloat16()
    args = GemmArguments(torch.randn(8, 4096).bfloat16(), B.t() if b_col else B, torch.empty(8, 4096).bfloat16())
    chosen = PickAny().choose(args, kernel_api.get_kernels(args, cc=90))
    assert type(chosen).__name__ == "CudaGemmSmallM"
    launcher = chosen._launcher(args, _cuda_src_artifact(chosen))
    assert launcher is not None and launcher.tail == ()
