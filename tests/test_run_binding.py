"""Kernel.run's hot path: a kernel's Launcher bound to the arguments' tensors (CPU)."""

import functools

import pytest
import torch
from cuda.bindings import driver

from kernel_api import CompiledArtifact, GemmArguments
from kernel_api.launcher import Binding, Launcher
from toy_kernels import ToyGemm


class FastToyGemm(ToyGemm):
    """ToyGemm whose launcher records what it was called with."""

    def _run(self, args, artifact, stream, workspace=None):
        self.slow_runs = getattr(self, "slow_runs", 0) + 1
        super()._run(args, artifact, stream, workspace)

    def _launcher(self, args, artifact):
        if args.M == 0:
            return None

        def launch(A, B, out, alpha, cu_stream):
            self.fast_calls = getattr(self, "fast_calls", []) + [(A, B, out, alpha, cu_stream)]
            torch.mul(torch.matmul(A, B), alpha, out=out)

        return Launcher(launch, (1.0,))


def _kernel(cls=FastToyGemm):
    found = ToyGemm.generate_kernels(lambda m: m.operands.A.dtype.name == "f32" and m.operands.A.divisibility == 1)
    return cls(next(k for k in found if "ttt" in k.metadata.kernel_name).metadata)


def _args(M=8, N=6, K=4):
    return GemmArguments(torch.randn(M, K), torch.randn(K, N), torch.full((M, N), float("nan")))


def test_second_run_of_the_same_arguments_takes_the_bound_launcher():
    kernel, args, stream = _kernel(), _args(), driver.CUstream(0)
    art = kernel.compile(args)
    kernel.run(args, compiled_artifact=art, stream=stream, assume_supported_args=True)
    assert kernel.slow_runs == 1 and not hasattr(kernel, "fast_calls")
    args.out.fill_(float("nan"))
    args.A.copy_(torch.randn_like(args.A))  # new data, same tensors: the bound launch sees it
    kernel.run(args, compiled_artifact=art, stream=stream, assume_supported_args=True)
    assert kernel.slow_runs == 1 and len(kernel.fast_calls) == 1
    A, B, out, alpha, cu = kernel.fast_calls[0]
    assert A is args.A and B is args.B and out is args.out and alpha == 1.0 and cu is stream
    assert isinstance(args._binding, Binding) and args._binding.artifact is art
    torch.testing.assert_close(args.out, args.A @ args.B)


def test_other_artifacts_workspaces_and_unbindable_problems_take_the_full_path():
    kernel, args, stream = _kernel(), _args(), driver.CUstream(0)
    art = kernel.compile(args)
    kernel.run(args, compiled_artifact=art, stream=stream, assume_supported_args=True)
    other = kernel.compile(args)
    kernel.run(args, compiled_artifact=other, stream=stream, assume_supported_args=True)
    kernel.run(args, compiled_artifact=art, stream=stream, workspace=torch.empty(4), assume_supported_args=True)
    assert kernel.slow_runs == 3 and not hasattr(kernel, "fast_calls")
    empty = _args(M=0)
    kernel.run(empty, compiled_artifact=art, stream=stream, assume_supported_args=True)
    kernel.run(empty, compiled_artifact=art, stream=stream, assume_supported_args=True)
    assert kernel.slow_runs == 5 and _fields(empty._binding) == (art, None, None, None)


def test_kernels_without_a_launcher_always_run_their_own_path():
    kernel, args = _kernel(ToyGemm), _args()
    art = kernel.compile(args)
    for _ in range(3):
        args.out.fill_(float("nan"))
        kernel.run(args, compiled_artifact=art, stream=driver.CUstream(0), assume_supported_args=True)
        torch.testing.assert_close(args.out, args.A @ args.B)
    assert _fields(args._binding) == (art, None, None, None)


def test_unsupported_arguments_are_still_rejected_before_any_binding():
    kernel, args = _kernel(), _args()
    with pytest.raises(Exception, match="CUDA|cuda|GPU"):
        kernel.run(args, compiled_artifact=CompiledArtifact(None, kernel))
    assert args._binding is None


def test_runs_with_checks_take_the_bound_launch_once_a_check_passed_for_that_kernel():
    kernel, args, stream = _kernel(), _args(), driver.CUstream(0)
    checks = []
    kernel._check_runnable = lambda a, art: checks.append(kernel)  # CPU operands would fail the device check
    art = kernel.compile(args)
    kernel.run(args, compiled_artifact=art, stream=stream, assume_supported_args=True)
    assert args._binding.checked_by is None  # bound, but nobody checked
    kernel.run(args, compiled_artifact=art, stream=stream)
    assert checks == [kernel] and kernel.slow_runs == 2 and args._binding.checked_by is kernel
    for _ in range(2):
        kernel.run(args, compiled_artifact=art, stream=stream)
    assert checks == [kernel] and kernel.slow_runs == 2 and len(kernel.fast_calls) == 2
    # Another instance never launches through a binding it did not check.
    other = _kernel()
    other._check_runnable = lambda a, art: checks.append(other)
    other.run(args, compiled_artifact=art, stream=stream)
    assert checks == [kernel, other] and other.slow_runs == 1
    torch.testing.assert_close(args.out, args.A @ args.B)



def _fields(binding):
    return binding.artifact, binding.launch, binding.checked_by, binding.snapshot


def test_vouched_runs_take_the_snapshot_launch_and_checked_runs_the_live_one():
    kernel, args, stream = _kernel(), _args(), driver.CUstream(0)
    kernel._check_runnable = lambda a, art: None  # CPU operands would fail the device check
    art = kernel.compile(args)
    kernel.run(args, compiled_artifact=art, stream=stream)
    binding = args._binding
    assert binding.checked_by is kernel and binding.snapshot is binding.launch  # a Python function: no packing
    calls = []
    live = lambda cu: calls.append(("live", cu))  # noqa: E731
    snapshot = lambda cu: calls.append(("snapshot", cu))  # noqa: E731
    args._binding = Binding(art, live, kernel, snapshot)
    kernel.run(args, compiled_artifact=art, stream=stream, assume_supported_args=True)
    kernel.run(args, compiled_artifact=art, stream=stream)
    assert calls == [("snapshot", stream), ("live", stream)] and kernel.slow_runs == 1
    other = _kernel()
    other._check_runnable = lambda a, art: None
    other.run(args, compiled_artifact=art, stream=stream)  # not the kernel that checked: its own path
    assert len(calls) == 2 and other.slow_runs == 1 and args._binding.checked_by is other


def test_kernels_without_a_launcher_for_the_arguments_bind_no_snapshot():
    kernel, args = _kernel(), _args(M=0)
    art = kernel.compile(args)
    kernel.run(args, compiled_artifact=art, stream=driver.CUstream(0), assume_supported_args=True)
    assert _fields(args._binding) == (art, None, None, None)


def test_a_checked_run_without_a_launcher_binds_once():
    kernel, args = _kernel(ToyGemm), _args()
    kernel._check_runnable = lambda a, art: None
    art = kernel.compile(args)
    kernel.run(args, compiled_artifact=art, stream=driver.CUstream(0))
    binding = args._binding
    assert _fields(binding) == (art, None, kernel, None)
    kernel.run(args, compiled_artifact=art, stream=driver.CUstream(0))
    assert args._binding is binding  # nothing to rebind: the same kernel checked, no launch to bind


# ---- Launcher and Binding with Python functions and TVM-FFI functions (no GPU) ----------------

def test_a_launcher_of_a_python_function_binds_a_partial_and_launches_with_its_tail():
    seen = []

    def function(*call):
        seen.append(call)

    launcher = Launcher(function, [2.5, None])
    assert launcher.function is function and launcher.tail == (2.5, None) and launcher.ffi is False
    A, B = torch.randn(2), torch.randn(3)
    launcher.launch((A, B), "s")
    live = launcher.bind((A, B))
    assert isinstance(live, functools.partial) and launcher.bind_snapshot((A, B), live) is live
    live("t")
    assert seen == [(A, B, 2.5, None, "s"), (A, B, 2.5, None, "t")]
    artifact = CompiledArtifact(function, None)
    assert Launcher(artifact).function is function and Launcher(artifact).tail == ()
    with pytest.raises(AttributeError, match="immutable"):
        launcher.tail = ()
    with pytest.raises(TypeError, match="callable"):
        Launcher(CompiledArtifact(None, None))
    for tail in (None, 3, "ab"):
        with pytest.raises(TypeError, match="tail must be a sequence"):
            Launcher(function, tail)
    binding = Binding(artifact, live, None, live)
    with pytest.raises(AttributeError, match="immutable"):
        binding.launch = None
    assert Binding.of(None, artifact, (A, B), "k").launch is None
    assert _fields(Binding.of(launcher, artifact, (A, B), "k"))[2] == "k"


def test_a_launcher_of_a_tvm_ffi_function_packs_its_snapshot_and_records_for_the_table():
    tvm_ffi = pytest.importorskip("tvm_ffi")
    seen = []
    function = tvm_ffi.convert(lambda *call: seen.append(call))
    assert function.release_gil  # TVM-FFI's default: bound as a partial, which converts per call
    launcher = Launcher(CompiledArtifact(function, None), (1.0, 7))
    assert launcher.ffi and launcher.function is function and launcher.tail == (1.0, 7)
    A, out = torch.arange(4.0), torch.zeros(4)
    live = launcher.bind((A, out))
    assert isinstance(live, functools.partial) and live.func is function
    snapshot = launcher.bind_snapshot((A, out), live)
    assert snapshot is not live and all(isinstance(a, tvm_ffi.Tensor) for a in snapshot.args[:2])
    assert snapshot.args[2:] == (1.0, 7)
    A.add_(1)  # data written in place: the snapshot reads the same memory
    snapshot(None)
    assert torch.equal(torch.from_dlpack(seen[-1][0]), A) and seen[-1][2:] == (1.0, 7, None)


def test_cutedsl_kernels_offer_a_launcher_for_launches_without_c():
    """The shipped CuTe DSL families' _launcher (no compile: a stub artifact stands in): plain
    launches, and epilogues without a C operand with the arguments' alpha and (resolved) bias
    in the tail; none with a C operand (not a launcher tensor, so it would go stale)."""
    import kernel_api
    from kernel_api import EpilogueArguments, SoftmaxArguments

    A, B, out = torch.randn(64, 32).half(), torch.randn(32, 48).half(), torch.empty(64, 48).half()
    args = GemmArguments(A, B, out)
    kernels = kernel_api.get_kernels(args, cc=90, providers=["cutedsl"])
    families = {type(k).__name__: k for k in kernels if type(k).__name__.startswith(("Simt", "Sm80"))}
    assert len(families) == 2, sorted(families)
    stub = lambda *call: None  # noqa: E731
    for kernel in families.values():
        artifact = CompiledArtifact(stub, kernel, 90)
        launcher = kernel._launcher(args, artifact)
        assert launcher.function is stub and not launcher.ffi and launcher.tail == (None, None, 1.0, 0.0)
        scaled = GemmArguments(A, B, out, epilogue=EpilogueArguments(alpha=2.0))
        assert kernel._launcher(scaled, artifact).tail == (None, None, 2.0, 0.0)
        biased = GemmArguments(A, B, out, epilogue=EpilogueArguments(bias=torch.randn(48).half(), activation="relu"))
        tail = kernel._launcher(biased, artifact).tail
        assert tail[0] is None and tail[1] is biased.epilogue.bias and tail[2:] == (1.0, 0.0)
        with_c = GemmArguments(A, B, out, epilogue=EpilogueArguments(beta=1.0, C=torch.randn(64, 48).half()))
        empty = GemmArguments(A[:0], B, out[:0])
        assert kernel._launcher(with_c, artifact) is None and kernel._launcher(empty, artifact) is None
    x = torch.randn(4, 96).half()
    softmax = kernel_api.get_kernels(SoftmaxArguments(x, torch.empty_like(x)), cc=90, providers=["cutedsl"])
    assert softmax
    kernel = softmax[0]
    artifact = CompiledArtifact(stub, kernel, 90)
    assert kernel._launcher(SoftmaxArguments(x, torch.empty_like(x)), artifact).tail == ()
    x3 = x.view(2, 2, 96)  # launched through a rows view: no launcher
    assert kernel._launcher(SoftmaxArguments(x3, torch.empty_like(x3)), artifact) is None
