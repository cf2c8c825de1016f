"""PickBest over the shipped kernels of operations other than GEMM and softmax, on CUDA: every
candidate that builds passes verification on the fresh inputs (none is excluded as wrong: the
references and tolerances fit the kernels), the winner is a verified one, and on the caller's
own tensors it matches the float64 reference. Odd sizes, 16-bit operands, in-place and strided
forms. The CPU half is tests/test_pick_best_generic.py.
"""

from __future__ import annotations

import pytest
import torch

from kernel_api import (AttentionArguments, CrossEntropyArguments, GatedActivationArguments, LayerNormBackwardArguments,
                        LinearCrossEntropyArguments, RMSNormArguments, RopeArguments)
from kernel_api.tuning.policies import PickBest
from kernel_api.tuning.records import TuningRecords
from kernel_api.tuning.reference import reference, tolerance
from kernel_api.tuning.timing import relative_error_tensor

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def rms_norm_residual():
    x = torch.randn(3, 333, 4096, device="cuda", dtype=torch.bfloat16)
    return RMSNormArguments(x, torch.randn(4096, device="cuda"), torch.empty_like(x), residual=torch.randn_like(x),
                            residual_out=torch.empty_like(x))


def layer_norm_backward():
    x = torch.randn(1000, 1027, device="cuda", dtype=torch.float16)
    w = torch.randn(1027, device="cuda", dtype=torch.float16)
    return LayerNormBackwardArguments(torch.randn_like(x), x, w, torch.empty_like(x), torch.empty_like(w),
                                      torch.empty_like(w))


def swiglu_halves():
    projected = torch.randn(513, 2 * 1000, device="cuda", dtype=torch.bfloat16)
    gate, up = projected.chunk(2, dim=-1)
    return GatedActivationArguments(gate, up, torch.empty_like(gate))


def cross_entropy_in_place():
    logits = torch.randn(1000, 32003, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, 32003, (1000,), device="cuda")
    target[::7] = -100
    loss = torch.empty(1000, device="cuda")
    return CrossEntropyArguments(logits, target, loss, torch.empty_like(loss), grad_logits=logits,
                                 grad_loss=torch.full((), 1e-3, device="cuda").expand(1000), label_smoothing=0.1)


def linear_cross_entropy_with_gradients():
    hidden = (torch.randn(1000, 1024, device="cuda") / 32).to(torch.bfloat16)  # logits of unit variance
    weight = torch.randn(32000, 1024, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, 32000, (1000,), device="cuda")
    target[::9] = -100
    return LinearCrossEntropyArguments(hidden, weight, target, torch.empty(1000, device="cuda"),
                                       grad_hidden=torch.empty_like(hidden), grad_weight=torch.empty_like(weight),
                                       grad_loss=torch.full((), 1e-3, device="cuda").expand(1000))


def rope():
    q = torch.randn(2, 77, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(2, 77, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    angles = torch.randn(1, 77, 64, device="cuda")
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    return RopeArguments(q, k, cos, sin, torch.empty_like(q), torch.empty_like(k))


def attention_causal():
    q = torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 300, 2, 128, device="cuda", dtype=torch.bfloat16)
    return AttentionArguments(q, k, torch.randn_like(k), torch.empty_like(q), causal=True)


@pytest.mark.parametrize("make", [rms_norm_residual, layer_norm_backward, swiglu_halves, cross_entropy_in_place, rope,
                                  attention_causal, linear_cross_entropy_with_gradients])
def test_every_candidate_that_builds_verifies_and_the_winner_is_right(make, tmp_path):
    args = make()
    picker = PickBest(num_workers=1, max_candidates=4, repeat=5, settle_ms=0,
                      records=TuningRecords(tmp_path / "t.sqlite"))
    result = picker.tune(args, force=True)
    wrong = [(m.kernel_name, m.failure) for m in result.measurements if m.error is not None and m.failure]
    assert not wrong, wrong
    found = {m.kernel_name: m for m in result.measurements}
    assert found[result.winner.metadata.kernel_name].failure is None
    expected = reference(args)  # (before the run: the cross-entropy writes its gradient over the logits)
    result.winner.run(args)
    for name, value in expected.items():
        error = float(relative_error_tensor(getattr(args, name), value))
        assert error <= tolerance(args, result.winner), (name, error)
