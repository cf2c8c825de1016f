"""What `kernel_api.nn.patch` fuses after a projection, on the GPU: `FusedProjection`'s fused
forms (the epilogue function, the named epilogue) against float64 references with fresh random
data and awkward sizes; patched transformers models (Llama, GPT-2; two layers, bf16) whose
prefill takes the epilogue function, eager and under torch.compile (Inductor, no graph break),
against the unpatched model; a training step through the patched blocks; and the
tanh-form GELU of the SM90 emitter (computed as x * sigmoid(2u)) at f32 over the whole range.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import kernel_api
from kernel_api import EpilogueArguments, GemmArguments
from kernel_api.epilogue import evaluate, parse
from kernel_api.nn import Linear, patch, set_compile_lowering
from kernel_api.nn import fusion
from kernel_api.nn.fusion import FusedProjection, armed, epilogue_source

pytestmark = pytest.mark.gpu

REL_TOL = 2e-2  # norm-wise, bf16 against float64 (or the unpatched bf16 model)
_ACT = {None: lambda t: t, "relu": F.relu, "gelu": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}


def _rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


@pytest.fixture
def forms(monkeypatch):
    """The fused forms `FusedProjection` calls ran ("function", "named"), in order."""
    taken = []
    for form in ("function", "named"):
        original = getattr(FusedProjection, f"_{form}")

        def counted(self, *args, _original=original, _form=form):
            taken.append(_form)
            return _original(self, *args)
        monkeypatch.setattr(FusedProjection, f"_{form}", counted)
    return taken


def _projection(conv1d, K, N, activation, bias=True):
    torch.manual_seed(0)
    if conv1d:
        from transformers.pytorch_utils import Conv1D
        from kernel_api.nn.linear import conv1d_from
        base = conv1d_from(Conv1D(N, K).to("cuda", torch.bfloat16), activation)
        if not bias:
            pytest.skip("Conv1D always has a bias")
    else:
        base = Linear(K, N, bias=bias, activation=activation, device="cuda", dtype=torch.bfloat16)
    return fusion.fused_from(base)


@pytest.mark.parametrize("conv1d", [False, True])
@pytest.mark.parametrize("activation,gate_activation,gate,residual,bias", [
    (None, None, False, True, True),        # a residual add (GPT-2's c_proj)
    (None, None, False, True, False),       # (Llama's o_proj, down_proj)
    (None, "silu", True, False, False),     # the SwiGLU gate (Llama's up_proj)
    ("gelu", None, False, True, True),      # an activation before the add
    ("relu", "silu", True, True, True),     # all of it
])
@pytest.mark.parametrize("shape", [(1031, 264, 200), (3, 520, 384, 136)])  # (lead..., M, K, N): odd M
def test_function_form_against_float64(forms, conv1d, activation, gate_activation, gate, residual, bias, shape):
    pytest.importorskip("transformers")
    *lead, K, N = shape
    layer = _projection(conv1d, K, N, activation, bias)
    layer.gate_activation = gate_activation
    x = torch.randn(*lead, K, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(*lead, N, device="cuda", dtype=torch.bfloat16) if residual else None
    g = torch.randn(*lead, N, device="cuda", dtype=torch.bfloat16) if gate else None
    with torch.no_grad(), armed(layer, residual=r, gate=g):
        y = layer(x)
    assert forms == ["function"]
    w = (layer.weight if conv1d else layer.weight.t()).double()
    graph = parse(epilogue_source(layer.bias is not None, activation, gate_activation, gate, residual))
    operands = {k: v for k, v in (("bias", layer.bias), ("gate", g), ("residual", r)) if v is not None}
    want = evaluate(graph, x.double() @ w, operands)["D"]
    assert y.shape == want.shape and y.dtype == torch.bfloat16
    assert _rel(y, want) < REL_TOL


@pytest.mark.parametrize("rows", [7, 640])
def test_named_form_against_float64_and_its_gradients(forms, rows):
    """Fewer rows than `FUSE_MIN_ROWS`, or autograd on: the named epilogue (C = residual)."""
    layer = _projection(False, 264, 200, None)
    x = torch.randn(rows, 264, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(rows, 200, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with armed(layer, residual=r):
        y = layer(x)
    assert forms == ["named"]
    want = x.double() @ layer.weight.double().t() + layer.bias.double() + r.double()
    assert _rel(y, want) < REL_TOL
    g = torch.randn_like(y)
    y.backward(g)
    assert _rel(r.grad, g) == 0
    assert _rel(x.grad, g.double() @ layer.weight.double()) < REL_TOL
    assert _rel(layer.weight.grad, g.double().t() @ x.double()) < REL_TOL


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=1000, n_positions=1024,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to("cuda", torch.bfloat16).eval()
    model.loss_type = "ForCausalLM"
    return model


MODELS = {"llama": (_llama, 3), "gpt2": (_gpt2, 2)}  # fused projections per layer


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_patched_prefill_takes_the_function_and_matches_the_unpatched_model(forms, family, compiled):
    make, per_layer = MODELS[family]
    ref = make()
    model = patch(copy.deepcopy(ref), kinds=("linear", "residual", "mlp"))
    if compiled:  # (the lowering rule's default under compile is aten: asked for here)
        set_compile_lowering(model, "kernel_api")
    ids = torch.randint(0, 1000, (2, 600), device="cuda")  # 1200 rows
    torch._dynamo.reset()
    counters.clear()
    # (static shapes: Dynamo's automatic dynamic shapes, from other compiles of these models' code in
    # the process, would make M dynamic, which the lowering rule gives to aten)
    run = torch.compile(model, fullgraph=True, dynamic=False) if compiled else model
    with torch.no_grad():
        logits = run(input_ids=ids).logits
        want = ref(input_ids=ids).logits
    assert _rel(logits, want) < REL_TOL
    assert forms == ["function"] * (per_layer * 2), forms
    if compiled:
        assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


@pytest.mark.parametrize("family", list(MODELS))
def test_patched_training_step_matches_the_unpatched_model(forms, family):
    """A training step through the patched blocks (which add the residuals themselves under
    autograd, `fusion.worth_arming`): the loss and every gradient as close to a float32 eager
    reference as the unpatched bf16 model's are (twice its error, at least 2e-2)."""
    make, _ = MODELS[family]
    ref = make()
    exact_model = copy.deepcopy(ref).float()
    model = patch(copy.deepcopy(ref), kinds=("linear", "residual", "mlp"))
    ids = torch.randint(0, 1000, (2, 128), device="cuda")
    losses = {}
    for name, m in (("exact", exact_model), ("ref", ref), ("patched", model)):
        m.train()
        losses[name] = m(input_ids=ids, labels=ids).loss
        losses[name].backward()
    assert forms == []
    noise = abs(losses["ref"].item() - losses["exact"].item())
    assert abs(losses["patched"].item() - losses["exact"].item()) <= max(2 * noise, 2e-2 * losses["exact"].item())
    exact, unpatched = dict(exact_model.named_parameters()), dict(ref.named_parameters())
    off = []
    for name, p in model.named_parameters():
        bound = max(2 * _rel(unpatched[name].grad, exact[name].grad), 2e-2)
        if not _rel(p.grad, exact[name].grad) <= bound:
            off.append((name, _rel(p.grad, exact[name].grad), bound))
    assert not off, off


@pytest.mark.parametrize("op", ["gelu_tanh", "silu", "sigmoid", "tanh"])
def test_sm90_unary_math_at_f32_over_the_whole_range(op):
    """A D of f32 (no bf16 rounding to hide behind) for arguments from -60 to 60, both ends and
    zero included: within 1e-4 relative (or 1e-30 absolute) of float64, each element. (The tanh
    GELU's exponent, up to about 128 before the result leaves f32's range, carries its f32
    rounding into the result: about 2e-5 relative at the far negative end. The erf GELU is left
    out: 1 + erf(x) cancels in f32 for x far below 0, as torch's f32 GELU does.)"""
    M, N, K = 128, 256, 64
    A = torch.zeros(M, K, device="cuda", dtype=torch.bfloat16)
    A[:, 0] = 1
    B = torch.zeros(K, N, device="cuda", dtype=torch.bfloat16)
    values = torch.linspace(-60, 60, M * N, device="cuda").reshape(M, N)
    C = values.float()  # the value reaches the function through a full f32 input
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    z = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float32)  # the f32 result
    source = f"def epi(accum, C):\n    x = accum + C\n    z = {op}(x)\n    D = x\n    return D, z\n"
    args = GemmArguments(A, B, out, epilogue=EpilogueArguments(source, C=C, z=z))
    found = [k for k in kernel_api.get_kernels(args) if k.name.startswith("Sm90WarpSpecializedGemm_")]
    if not found:
        pytest.skip("no SM90 instance on this GPU")
    found[0].run(args)
    torch.cuda.synchronize()
    want = evaluate(parse(source), A.double() @ B.double(), {"C": C})["z"]
    err = (z.double() - want).abs()
    bad = err > torch.maximum(1e-4 * want.abs(), torch.full_like(want, 1e-30))
    assert not bad.any(), f"{op}: {int(bad.sum())} elements off, worst at x={C[bad][:4].tolist()}"


def test_gradcheck_of_an_epilogue_affine_in_the_accumulator_without_its_recompute(monkeypatch):
    """A residual-and-bias epilogue's backward skips recomputing the accumulator
    (`needs_accumulator`): gradcheck in float64 through the fused kernel, and no GEMM of A by B
    in the backward."""
    from kernel_api.ops import dispatch
    g = torch.Generator(device="cuda").manual_seed(4)

    def leaf(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.float64, generator=g).requires_grad_()

    A, B, C, bias = leaf(9, 7), leaf(7, 5), leaf(9, 5), leaf(5)
    src = "def epi(accum, C, bias):\n    D = 0.5 * accum + bias + C\n    return D"

    def f(A, B, C, bias):
        return kernel_api.ops.gemm(A, B, epilogue=src, C=C, bias=bias)

    assert torch.autograd.gradcheck(f, (A, B, C, bias))
    shapes, gemm = [], dispatch.gemm

    def counted(X, Y, *args, **kwargs):
        shapes.append((tuple(X.shape), tuple(Y.shape)))
        return gemm(X, Y, *args, **kwargs)
    monkeypatch.setattr(dispatch, "gemm", counted)
    f(A, B, C, bias).sum().backward()
    assert ((9, 7), (7, 5)) not in shapes and len(shapes) == 2, shapes
