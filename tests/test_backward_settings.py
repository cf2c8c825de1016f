"""The settings in force at a differentiable call also choose its backward's kernels.

Autograd runs a CUDA backward on a device thread of its own, where the caller's context
variables (kernel_api's settings: the policy and the providers) are not set. The generated
operations' autograd functions keep the forward's settings for their backward; here the backward
runs on another thread, as autograd's device threads do.
"""

from __future__ import annotations

import threading

import torch

import kernel_api
from kernel_api import ops
from kernel_api.tuning.pick_any import PickAny


class RecordingPolicy(PickAny):
    """PickAny, recording the arguments type of every choice it makes."""

    def __init__(self) -> None:
        self.chosen: list[str] = []

    def choose(self, args, candidates):
        self.chosen.append(type(args).__name__)
        return super().choose(args, candidates)


def backward_on_another_thread(loss: torch.Tensor) -> None:
    failures = []

    def run() -> None:
        try:
            loss.backward()
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if failures:
        raise failures[0]


def test_a_generated_operation_s_backward_is_chosen_under_the_forward_s_settings(cpu_ops):
    policy = RecordingPolicy()
    x = torch.randn(6, 32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(32, dtype=torch.float64, requires_grad=True)
    with kernel_api.settings(policy=policy):
        y = ops.rms_norm(x, w, 1e-6)
    backward_on_another_thread(y.square().sum())
    assert policy.chosen == ["RMSNormArguments", "RMSNormBackwardArguments"]
    assert x.grad is not None and w.grad is not None


def test_the_settings_are_restored_after_the_backward(cpu_ops):
    policy = RecordingPolicy()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64)
    with kernel_api.settings(policy=policy):
        y = ops.rms_norm(x, w, 1e-6)
    before = kernel_api.tuning.scope.CURRENT.get()
    y.sum().backward()  # (the CPU backward runs on this thread)
    assert kernel_api.tuning.scope.CURRENT.get() is before
    assert policy.chosen == ["RMSNormArguments", "RMSNormBackwardArguments"]
