"""`kernel_api.nn.patch`'s fused residual adds and gates under torch.compile, on the CPU: no
graph break, no recompile in steady state (decoding, a second call, training), the epilogue
function's op in the graph where the lowering rule keeps kernel_api's GEMM and aten otherwise,
outputs equal to the unpatched model's. Kernels are torch stand-ins (tests/test_epilogue_patch.py's
fixtures); Dynamo traces with ``aot_eager``. The GPU checks are in tests/test_epilogue_patch_gpu.py."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import kernel_api
from kernel_api.nn import patch, set_compile_lowering
from test_epilogue_patch import _patch, calls, fuse_small, tiny_gpt2, tiny_llama  # noqa: F401 - fixtures

transformers = pytest.importorskip("transformers")


class _Recorder:
    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager
        self.graphs.append(gm)
        return aot_eager(gm, example_inputs)

    def targets(self):
        return [str(n.target) for gm in self.graphs for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("small", [False, True], ids=["aten", "function"])
def test_compiled_patched_model_has_no_graph_break_and_equals_the_unpatched(calls, request, family, small):
    """Prefill rows under the rule: the epilogue function's op in the graph where the layers keep
    kernel_api's GEMM (forced, and here from one row on), aten otherwise (the rule's default); then
    decoding steps with no recompile after the cache length turns dynamic."""
    if small:
        request.getfixturevalue("fuse_small")
    ref = tiny_llama() if family == "llama" else tiny_gpt2()
    model = _patch(copy.deepcopy(ref)) if family == "llama" else patch(copy.deepcopy(ref))
    if small:
        set_compile_lowering(model, "kernel_api")
    vocab = 97 if family == "llama" else 1001
    backend = _Recorder()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, vocab, (2, 8), generator=g)
    with torch.no_grad():
        out = compiled(input_ids=ids, use_cache=True)
        ref_out = ref(input_ids=ids, use_cache=True)
        torch.testing.assert_close(out.logits, ref_out.logits, rtol=1e-5, atol=1e-5)
        epilogue_ops = sum("gemm_epilogue" in t for t in backend.targets())
        assert epilogue_ops == (3 * 2 if family == "llama" else 2 * 2) if small else epilogue_ops == 0
        if not small:
            cache, ref_cache = out.past_key_values, ref_out.past_key_values
            frames = []
            for _ in range(5):
                step = torch.randint(0, vocab, (2, 1), generator=g)
                logits = compiled(input_ids=step, past_key_values=cache, use_cache=True).logits
                ref_logits = ref(input_ids=step, past_key_values=ref_cache, use_cache=True).logits
                torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
                frames.append(len(backend.graphs))
            assert frames[2:] == [frames[1]] * 3, frames
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_forced_kernel_api_small_rows_take_the_named_epilogue(calls):
    ref = tiny_gpt2()
    model = patch(copy.deepcopy(ref))
    set_compile_lowering(model, "kernel_api")
    backend = _Recorder()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids = torch.randint(0, 1001, (2, 8), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    targets = backend.targets()
    assert not any("gemm_epilogue" in t for t in targets)
    assert sum("kernel_api.gemm" in t for t in targets) == 4 * 2 + 1
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("train", [False, True])
def test_compiled_patched_model_does_not_recompile_at_its_second_call(calls, train):
    """The operands `armed` hands over live in each projection's own attributes from the start,
    so the state Dynamo guards on is the same before and after a call."""
    ref = tiny_gpt2()
    model = patch(copy.deepcopy(ref)).train(train)
    compiled = torch.compile(model, backend="aot_eager")
    ids = torch.randint(0, 1001, (2, 8), generator=torch.Generator().manual_seed(12))
    try:
        for step in range(3):
            torch._dynamo.config.error_on_recompile = step > 0
            with torch.set_grad_enabled(train):
                out = compiled(input_ids=ids, labels=ids)
            if train:
                out.loss.backward()
    finally:
        torch._dynamo.config.error_on_recompile = False
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_inductor_compiles_an_epilogue_function_written_over_several_lines(calls):
    """Inductor writes the op's str arguments into the Python of its generated wrapper: the
    function's text goes as hexadecimal (a line break in it broke that module's syntax)."""
    def epi(accum, C):
        z = accum + C
        D = relu(z)  # noqa: F821 - an epilogue primitive, parsed, never called
        return D

    def f(A, B, C):
        return kernel_api.ops.gemm(A, B, epilogue=epi, C=C) * 2.0

    g = torch.Generator().manual_seed(3)
    A, B, C = (torch.randn(s, generator=g) for s in ((16, 8), (8, 24), (16, 24)))
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(f, backend="inductor", fullgraph=True)(A, B, C)
    torch.testing.assert_close(got, 2.0 * torch.relu(A @ B + C), rtol=1e-5, atol=1e-5)
    assert calls.count("function") == 1
