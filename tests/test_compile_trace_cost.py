"""What Dynamo traces of kernel_api while it compiles a patched model, on the CPU: the Python of
the patched layers, the lowering rule and the front doors that it inlines at every projection
and block is compile time (each traced instruction costs Dynamo tens of microseconds, an inlined
frame more). Counted, not timed: instructions Dynamo traces in kernel_api's files per GPT-2 block,
against those of an unpatched block, and the frames a traced GEMM goes through.

Kernels are torch stand-ins (tests/test_epilogue_patch.py's fixtures); Dynamo traces with a
backend that runs the graph as it is, reporting CUDA graphs or not as Inductor's configuration
says under ``mode="reduce-overhead"``."""

import pytest
import torch

import kernel_api
from kernel_api.nn import Linear, fusion, lowering, patch
from kernel_api.nn.fusion import armed, fused_from
from kernel_api.ops import dispatch
from test_epilogue_patch import calls  # noqa: F401,F811 - fixture

transformers = pytest.importorskip("transformers")


class _Backend:
    """Runs the graph as traced; ``cuda_graphs``: what its configuration says of CUDA graphs (the
    lowering rule keeps kernel_api's op from `COMPILE_MIN_ROWS` rows under CUDA graphs)."""

    def __init__(self, cuda_graphs: bool = False):
        self.cuda_graphs = cuda_graphs
        self.graphs = []

    def get_compiler_config(self):
        return {"triton.cudagraphs": self.cuda_graphs}

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self):
        return [str(n.target) for gm in self.graphs for n in gm.graph.nodes if n.op == "call_function"]


def _gpt2(layers: int) -> torch.nn.Module:
    config = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=1001, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(2)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.loss_type = "ForCausalLM"  # (unset, transformers logs a warning in forward: a graph break of its own)
    return model


#: The files of the patched projections and blocks, the lowering rule and the GEMM front doors they
#: call (the attention implementation and the positions' mask are other layers, counted apart).
_PROJECTIONS = tuple(f"/kernel_api/{name}.py" for name in (
    "nn/linear", "nn/fusion", "nn/blocks", "nn/lowering", "nn/mixin", "ops/dispatch", "ops/epilogue_gemm"))


def _traced(model, backend) -> dict[str, int]:
    """What Dynamo traces for a prefill of ``model``: bytecode instructions ("projections": in
    `_PROJECTIONS`, "kernel_api": in kernel_api's other files, "other": elsewhere) and frames (each
    function call, comprehension or generator it inlines: "frames" in all, "projection_frames" in
    `_PROJECTIONS`); empty where this torch's tracer has no ``step``."""
    from torch._dynamo import symbolic_convert

    tracer = getattr(symbolic_convert, "InstructionTranslatorBase", None)
    step = getattr(tracer, "step", None)
    if step is None:
        return {}
    counts = {"projections": 0, "kernel_api": 0, "other": 0, "frames": 0, "projection_frames": 0}
    seen = {}  # id -> tracer, kept alive so that no later tracer reuses a counted one's id

    def counting_step(self):
        name = self.f_code.co_filename
        ours = name.endswith(_PROJECTIONS)
        counts["projections" if ours else "kernel_api" if "/kernel_api/" in name else "other"] += 1
        if id(self) not in seen:
            seen[id(self)] = self
            counts["frames"] += 1
            counts["projection_frames"] += ours
        return step(self)

    torch._dynamo.reset()
    tracer.step = counting_step
    try:
        with torch.no_grad():
            torch.compile(model, backend=backend)(input_ids=torch.randint(0, 1001, (2, 8)))
    finally:
        tracer.step = step
        torch._dynamo.reset()
    return counts


def _per_block(patched: bool, backend_of) -> dict[str, float]:
    """`_traced`'s counts per GPT-2 block (those of 4 layers less those of 2, halved)."""
    counts = {}
    for layers in (2, 4):
        model = _gpt2(layers)
        counts[layers] = _traced(patch(model) if patched else model, backend_of())
    if not counts[2]:
        pytest.skip("this torch's Dynamo has no InstructionTranslatorBase.step to count")
    return {k: (counts[4][k] - counts[2][k]) / 2 for k in counts[2]}


@pytest.fixture
def kept_from_one_row(monkeypatch):
    """The rule keeps kernel_api's op (and blocks hand residuals over) from one row on under CUDA
    graphs, as for a prefill of `COMPILE_MIN_ROWS` rows."""
    monkeypatch.setattr(lowering, "COMPILE_MIN_ROWS", 1)
    monkeypatch.setattr(fusion, "FUSE_MIN_ROWS", 1)


@pytest.mark.parametrize("kept", [False, True], ids=["aten", "kept-op"])
def test_a_patched_block_costs_dynamo_few_traced_instructions_and_frames(calls, request, kept):
    """Per GPT-2 block, what Dynamo traces in the projections' and blocks' Python (`_PROJECTIONS`)
    against an unpatched block's whole trace. Lowered to aten (decode, a graph without CUDA
    graphs): at most 42 % of its instructions and 45 % of its frames (each projection asks the rule
    through constant functions and one ``numel``, not a loop over its dimensions). Keeping
    kernel_api's ops with the residuals handed to the projections (a prefill under CUDA graphs):
    at most as many instructions and 80 % of the frames (the hand-over writes no attribute
    through ``nn.Module.__setattr__``, the epilogue's source is a constant, the ops are called
    without the front doors' argument handling, the rule's checks are loops rather than
    generators). Measured with them: 39 % and 38 %, 86 % and 56 % (frames are counted once each,
    every tracer kept alive until the count ends, so that the count is the same on every run)."""
    if kept:
        request.getfixturevalue("kept_from_one_row")
    unpatched = _per_block(False, _Backend)
    patched = _per_block(True, lambda: _Backend(cuda_graphs=kept))
    assert unpatched["projections"] == unpatched["kernel_api"] == 0
    instructions = patched["projections"] / unpatched["other"]
    frames = patched["projection_frames"] / unpatched["frames"]
    assert instructions <= (1.0 if kept else 0.42), (patched, unpatched, instructions)
    assert frames <= (0.8 if kept else 0.45), (patched, unpatched, frames)


def test_a_traced_gemm_goes_from_the_front_door_to_the_op(calls, monkeypatch):
    """Under Dynamo, ``kernel_api.ops.gemm`` (what a projection keeping kernel_api's op calls)
    calls ``torch.ops.kernel_api.gemm`` itself, not through `dispatch._traced_call`'s frames."""
    def not_here(*args, **kwargs):
        raise AssertionError("traced through _traced_call")

    monkeypatch.setattr(dispatch, "_traced_call", not_here)
    layer = Linear(24, 40)
    layer.compile_lowering = "kernel_api"
    backend = _Backend()
    x = torch.randn(8, 24)
    with torch.no_grad():
        y = torch.compile(layer, backend=backend, fullgraph=True)(x)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert sum("kernel_api.gemm" in t for t in backend.targets()) == 1, backend.targets()
    # (out=, a stream or an accumulator type still take the checked path)
    with pytest.raises(Exception, match="traced through _traced_call"):
        torch.compile(lambda a, b: kernel_api.ops.gemm(a, b, out=torch.empty(8, 40)), backend=_Backend(),
                      fullgraph=True)(x, layer.weight.t())


def test_a_hand_over_writes_no_attribute_through_the_modules_setattr(calls, monkeypatch):
    """`armed` and the projection consuming what it hands over write the projection's instance
    attributes directly: ``nn.Module.__setattr__``'s Python, which Dynamo would trace at every
    hand-over, is not called; the values are where they were."""
    projection = fused_from(Linear(8, 8))
    seen = []
    cls = type(projection)
    monkeypatch.setattr(cls, "__setattr__", lambda self, name, value: (seen.append(name),
                                                                       torch.nn.Module.__setattr__(self, name, value)))
    residual = torch.randn(2, 8)
    with armed(projection, residual=residual) as hand:
        assert projection.kernel_api_residual is residual and projection.kernel_api_gate is None
    assert not hand.consumed and projection.kernel_api_residual is None
    x = torch.randn(2, 8)
    with armed(projection, residual=residual) as hand:
        y = projection(x)
    assert hand.consumed and projection.kernel_api_residual is None
    torch.testing.assert_close(y, torch.nn.functional.linear(x, projection.weight, projection.bias) + residual)
    assert seen == [], seen
