"""The backward of an autograd-visible epilogue on the CPU (kernels replaced by torch stand-ins):
`kernel_api.epilogue.needs_accumulator` on a table of epilogues, and the op's gradients
(gradcheck in float64) with the accumulator recomputed only where they depend on it."""

import pytest
import torch

from kernel_api import ops
from kernel_api.epilogue import evaluate, needs_accumulator, parse, parse_cached
from kernel_api.ops import dispatch, epilogue_gemm


def _src(body, params="C, bias, alpha", returns="D"):
    lines = "\n".join(f"    {line}" for line in body.split("; "))
    return f"def epi(accum, {params}):\n{lines}\n    return {returns}\n"


# (body, differentiated parameters, whether the gradients read the accumulator)
CASES = [
    ("D = accum + C", {"C"}, False),
    ("D = alpha * accum + bias", {"bias"}, False),
    ("D = (accum + bias) * C", set(), False),              # C constant: a coefficient
    ("D = (accum + bias) * C", {"C"}, True),               # dC = g * (accum + bias)
    ("D = accum / C", set(), False),
    ("D = C / accum", set(), True),
    ("D = accum + relu(C)", {"C"}, False),                 # the nonlinearity reads C only
    ("D = relu(accum) + C", {"C"}, True),
    ("D = -accum - C * alpha", {"C"}, False),
    ("D = max(accum, C)", set(), True),
    ("D = accum.to(torch.bfloat16) + C", {"C"}, False),  # a cast differentiates as identity
    ("z = gelu(accum); D = accum + C; s = sum(z, dim=1)", {"C"}, False),  # reductions are not differentiated
    ("z = gelu(accum); D = accum + C", {"C"}, True),        # z is an output, differentiated
]


@pytest.mark.parametrize("body,differentiated,needed", CASES)
def test_needs_accumulator(body, differentiated, needed):
    returns = "D, s" if "s = " in body else "D, z" if "z = " in body else "D"
    graph = parse(_src(body, returns=returns))
    assert needs_accumulator(graph, differentiated) is needed


@pytest.fixture
def gemms(monkeypatch):
    """Torch stand-ins for the kernels; the GEMMs the backward runs, by their operands' shapes."""
    made = []

    def named(A, B, out, alpha, beta, C, bias, activation, accumulator_type, stream):
        made.append((tuple(A.shape), tuple(B.shape)))
        z = alpha * (A @ B) + (beta * C if C is not None and beta != 0 else 0) + (bias if bias is not None else 0)
        return z if out is None else out.copy_(z)

    def function(A, B, out, epilogue, accumulator_type, stream, record=None):
        D = evaluate(parse_cached(epilogue.function), A @ B, dict(epilogue.operands), dtype=A.dtype)["D"]
        return D if out is None else out.copy_(D)

    monkeypatch.setattr(dispatch, "LAUNCH_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(dispatch, "_gemm_eager", named)
    monkeypatch.setattr(epilogue_gemm, "_run", function)
    ops.clear_dispatch_cache()
    yield made
    ops.clear_dispatch_cache()


@pytest.mark.parametrize("body,needed", [("D = accum + C * alpha", False), ("D = tanh(accum) * C + bias", True)])
def test_backward_recomputes_the_accumulator_only_where_needed(gemms, body, needed):
    g = torch.Generator().manual_seed(0)
    A, B, C, bias = (torch.randn(*s, dtype=torch.float64, generator=g, requires_grad=True)
                     for s in ((6, 5), (5, 7), (6, 7), (7,)))
    src = _src(body)

    def f(A, B, C, bias):
        return ops.gemm(A, B, epilogue=src, C=C, bias=bias, alpha=0.75)

    assert torch.autograd.gradcheck(f, (A, B, C, bias))
    gemms.clear()
    f(A, B, C, bias).sum().backward()
    recomputed = gemms.count(((6, 5), (5, 7)))
    assert recomputed == (1 if needed else 0) and len(gemms) == recomputed + 2
