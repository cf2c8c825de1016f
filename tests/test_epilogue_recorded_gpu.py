"""Repeated epilogue-function GEMMs launched from their recorded launch (`kernel_api.ops.epilogue_gemm`):
the first call of a metadata takes the Python path, later ones launch its kernel with their own
operands, and every result matches a float64 reference with fresh data each call.

Through ``ops.gemm(A, B, epilogue=...)`` eagerly and through ``torch.ops.kernel_api.gemm_epilogue``
(what a compiled graph calls), with an extra output made by the op."""

import pytest
import torch
from test_op_replay import count_python_path

from kernel_api import ops
from kernel_api.epilogue import evaluate, parse

pytestmark = pytest.mark.gpu

RESIDUAL = "def epi(accum, bias, residual, alpha):\n    D = alpha * accum + bias + residual\n    return D\n"
WITH_AUX = "def epi(accum, bias, gate):\n    Z = accum + bias\n    D = gelu(Z) * gate\n    return D, Z\n"


def _operand_sets(M, K, N, dtype, sets=2):
    """``sets`` groups of tensors of one metadata each (alternated: the recorded launch must
    read each call's own)."""
    def weight(*shape):  # (as a model's: compiled graphs pass Parameters)
        return torch.nn.Parameter(torch.empty(*shape, device="cuda", dtype=dtype), requires_grad=False)

    return [dict(A=torch.empty(M, K, device="cuda", dtype=dtype), B=weight(K, N), bias=weight(N),
                 other=torch.empty(M, N, device="cuda", dtype=dtype)) for _ in range(sets)]


def _refill(t):
    with torch.no_grad():
        t.copy_(torch.randn(t.shape, device=t.device))


def _reference(source, A, B, values):
    return evaluate(parse(source), A.double() @ B.double(), {k: v.double() if isinstance(v, torch.Tensor) else v
                                                              for k, v in values.items()})


@pytest.mark.parametrize("M,K,N", [(1000, 256, 392), (37, 72, 136)])
def test_repeated_eager_calls_launch_the_recorded_kernel_with_their_own_operands(monkeypatch, M, K, N):
    launches = count_python_path(monkeypatch)
    dtype = torch.bfloat16
    sets = _operand_sets(M, K, N, dtype)
    calls = 12
    for i in range(calls):
        s = sets[i % 2]
        for t in s.values():
            _refill(t)
        alpha = 0.5 + i / 8
        got = ops.gemm(s["A"], s["B"], epilogue=RESIDUAL, bias=s["bias"], residual=s["other"], alpha=alpha)
        want = _reference(RESIDUAL, s["A"], s["B"], dict(bias=s["bias"], residual=s["other"], alpha=alpha))["D"]
        torch.testing.assert_close(got.double(), want, atol=0.25, rtol=2e-2, msg=f"call {i}")
    # one Python-path launch per operand set and output alignment (the allocator's 512-byte steps)
    assert 0 < len(launches) <= 4, launches


def test_the_op_a_compiled_graph_calls_replays_with_its_extra_output(monkeypatch):
    launches = count_python_path(monkeypatch)
    M, K, N, dtype = 512, 128, 256, torch.bfloat16
    sets = _operand_sets(M, K, N, dtype)
    text = ops.epilogue_gemm._op_text(WITH_AUX)
    for i in range(10):
        s = sets[i % 2]
        for t in s.values():
            _refill(t)
        initial = torch.empty(M, N, device="cuda", dtype=torch.float32)
        D, Z = torch.ops.kernel_api.gemm_epilogue(s["A"], s["B"], text, ["bias", "gate"], [s["bias"], s["other"]],
                                                  [], [], [initial])
        want = _reference(WITH_AUX, s["A"], s["B"], dict(bias=s["bias"], gate=s["other"]))
        torch.testing.assert_close(D.double(), want["D"], atol=0.25, rtol=2e-2, msg=f"D, call {i}")
        torch.testing.assert_close(Z.double(), want["Z"], atol=5e-2, rtol=1e-2, msg=f"Z, call {i}")
    assert 0 < len(launches) <= 4, launches


def test_other_metadata_or_a_new_policy_scope_takes_the_python_path_again(monkeypatch):
    launches = count_python_path(monkeypatch)
    s = _operand_sets(256, 64, 128, torch.bfloat16, sets=1)[0]
    for t in s.values():
        _refill(t)

    def call(residual):
        return ops.gemm(s["A"], s["B"], epilogue=RESIDUAL, bias=s["bias"], residual=residual, alpha=1.0)

    for _ in range(3):
        call(s["other"])
    before = len(launches)
    strided = torch.randn(256, 136, device="cuda", dtype=torch.bfloat16)[:, :128]  # another stride
    got = call(strided)
    want = _reference(RESIDUAL, s["A"], s["B"], dict(bias=s["bias"], residual=strided, alpha=1.0))["D"]
    torch.testing.assert_close(got.double(), want, atol=0.25, rtol=2e-2)
    assert len(launches) == before + 1
    ops.clear_dispatch_cache()
    call(s["other"])
    assert len(launches) == before + 2
