"""Kernel.run's hot path: a kernel's fast launcher bound to the arguments' tensors (CPU)."""

import pytest
import torch
from cuda.bindings import driver

from kernel_api import CompiledArtifact, GemmArguments
from toy_kernels import ToyGemm


class FastToyGemm(ToyGemm):
    """ToyGemm whose fast launcher records what it was called with."""

    def _run(self, args, artifact, stream, workspace=None):
        self.slow_runs = getattr(self, "slow_runs", 0) + 1
        super()._run(args, artifact, stream, workspace)

    def _fast_launcher(self, args, artifact):
        if args.M == 0:
            return None

        def launch(A, B, out, cu_stream):
            self.fast_calls = getattr(self, "fast_calls", []) + [(A, B, out, cu_stream)]
            torch.matmul(A, B, out=out)

        return launch


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
    A, B, out, cu = kernel.fast_calls[0]
    assert A is args.A and B is args.B and out is args.out and cu is stream
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
    assert kernel.slow_runs == 5 and empty._bound == (art, None, None, None)


def test_kernels_without_a_fast_launcher_always_run_their_own_path():
    kernel, args = _kernel(ToyGemm), _args()
    art = kernel.compile(args)
    for _ in range(3):
        args.out.fill_(float("nan"))
        kernel.run(args, compiled_artifact=art, stream=driver.CUstream(0), assume_supported_args=True)
        torch.testing.assert_close(args.out, args.A @ args.B)
    assert args._bound == (art, None, None, None)


def test_unsupported_arguments_are_still_rejected_before_any_binding():
    kernel, args = _kernel(), _args()
    with pytest.raises(Exception, match="CUDA|cuda|GPU"):
        kernel.run(args, compiled_artifact=CompiledArtifact(None, kernel))
    assert args._bound is None


def test_runs_with_checks_take_the_bound_launch_once_a_check_passed_for_that_kernel():
    kernel, args, stream = _kernel(), _args(), driver.CUstream(0)
    checks = []
    kernel._check_runnable = lambda a, art: checks.append(kernel)  # CPU operands would fail the device check
    art = kernel.compile(args)
    kernel.run(args, compiled_artifact=art, stream=stream, assume_supported_args=True)
    assert args._bound[2] is None  # bound, but nobody checked
    kernel.run(args, compiled_artifact=art, stream=stream)
    assert checks == [kernel] and kernel.slow_runs == 2 and args._bound[2] is kernel
    for _ in range(2):
        kernel.run(args, compiled_artifact=art, stream=stream)
    assert checks == [kernel] and kernel.slow_runs == 2 and len(kernel.fast_calls) == 2
    # Another instance never launches through a binding it did not check.
    other = _kernel()
    other._check_runnable = lambda a, art: checks.append(other)
    other.run(args, compiled_artifact=art, stream=stream)
    assert checks == [kernel, other] and other.slow_runs == 1
    torch.testing.assert_close(args.out, args.A @ args.B)



class SnapshotToyGemm(FastToyGemm):
    """FastToyGemm whose vouched-for launch is a separate callable, as kernels that pre-pack have."""

    def _bind_snapshot_launch(self, args, artifact, launch):
        def snapshot(cu_stream):
            self.snapshot_calls = getattr(self, "snapshot_calls", 0) + 1
            launch(cu_stream)

        return snapshot


def test_vouched_runs_take_the_snapshot_launch_and_checked_runs_the_live_one():
    kernel, args, stream = _kernel(SnapshotToyGemm), _args(), driver.CUstream(0)
    kernel._check_runnable = lambda a, art: None  # CPU operands would fail the device check
    art = kernel.compile(args)
    kernel.run(args, compiled_artifact=art, stream=stream)
    assert args._bound[1] is not args._bound[3] and args._bound[2] is kernel
    kernel.run(args, compiled_artifact=art, stream=stream, assume_supported_args=True)
    assert kernel.snapshot_calls == 1 and len(kernel.fast_calls) == 1
    kernel.run(args, compiled_artifact=art, stream=stream)
    assert kernel.snapshot_calls == 1 and len(kernel.fast_calls) == 2 and kernel.slow_runs == 1
    torch.testing.assert_close(args.out, args.A @ args.B)


def test_kernels_without_a_bound_launch_bind_no_snapshot():
    kernel, args = _kernel(SnapshotToyGemm), _args(M=0)
    art = kernel.compile(args)
    kernel.run(args, compiled_artifact=art, stream=driver.CUstream(0), assume_supported_args=True)
    assert args._bound == (art, None, None, None) and not hasattr(kernel, "snapshot_calls")
