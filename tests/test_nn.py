"""kernel_api.nn: Linear, patch/unpatch (structure, on CPU and meta tensors) and the GEMM
custom op's autograd formula with activations (numerically, on CPU, with a float64 torch
stand-in for the kernels). The GPU checks are in tests/test_nn_gpu.py."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import kernel_api
from kernel_api import DeviceError, ops
from kernel_api.nn import FusedActivation, Linear, patch, patched_modules, unpatch
from kernel_api.ops import dispatch


# ---- stand-ins for transformers' classes (transformers is not installed on the CPU machine) ----
# Same names, module and attributes as transformers.pytorch_utils.Conv1D (weight (nx, nf), bias (nf,),
# forward x @ W + b), transformers.activations.NewGELUActivation (gelu_new: tanh GELU) and
# GPT2MLP (c_fc, act, c_proj, dropout; forward dropout(c_proj(act(c_fc(x))))).
class Conv1D(torch.nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = torch.nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = torch.nn.Parameter(torch.randn(nf) * 0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


Conv1D.__module__ = "transformers.pytorch_utils"


class NewGELUActivation(torch.nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


NewGELUActivation.__module__ = "transformers.activations"


class GPT2MLP(torch.nn.Module):
    def __init__(self, d=16, hidden=64):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(hidden, d), Conv1D(d, hidden)
        self.act, self.dropout = NewGELUActivation(), torch.nn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


GPT2MLP.__module__ = "transformers.models.gpt2.modeling_gpt2"


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Linear(16, 48)
        self.mlp = GPT2MLP()
        self.head = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                        torch.nn.GELU(), torch.nn.Linear(32, 8), torch.nn.GELU(approximate="tanh"))


def _params(module):
    return {name: p for name, p in module.named_parameters()}


# ---- Linear --------------------------------------------------------------------------------
def test_linear_is_a_torch_linear_with_the_same_state_and_init():
    torch.manual_seed(0)
    ref = torch.nn.Linear(12, 20)
    torch.manual_seed(0)
    layer = Linear(12, 20, activation="GELU")
    assert isinstance(layer, torch.nn.Linear) and layer.activation == "gelu"
    assert list(layer.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    assert all(torch.equal(a, b) for a, b in zip(layer.state_dict().values(), ref.state_dict().values()))
    layer.load_state_dict(ref.state_dict())
    half = layer.to(torch.float16)
    assert half is layer and layer.weight.dtype == torch.float16 and layer.bias.dtype == torch.float16
    assert "activation='gelu'" in repr(layer)
    assert Linear(3, 4, bias=False).bias is None
    with pytest.raises(ValueError, match="activation"):
        Linear(3, 4, activation="tanh")


def test_linear_traces_on_meta_tensors_forward_and_backward():
    """Leading dimensions are kept; the custom op's fake implementation gives shapes, and the
    backward (activation included) gives every gradient its parameter's shape."""
    for fuse in (False, True):
        layer = Linear(24, 40, activation="silu", device="meta", dtype=torch.bfloat16)
        layer.fuse_activation_when_training = fuse
        x = torch.empty(2, 3, 24, device="meta", dtype=torch.bfloat16, requires_grad=True)
        y = layer(x)
        assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
        y.sum().backward()
        assert x.grad.shape == x.shape and layer.weight.grad.shape == layer.weight.shape
        assert layer.bias.grad.shape == (40,)


def test_linear_rejects_cpu_inputs_and_dtype_mixes_naming_the_layer():
    model = patch(torch.nn.Sequential(torch.nn.Linear(8, 4)))
    with pytest.raises(DeviceError, match=r"layer '0'.*cpu"):
        model(torch.randn(2, 8))
    layer = Linear(8, 4, device="meta", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="input dtype torch.float32 differs from the weight's torch.bfloat16"):
        layer(torch.empty(2, 8, device="meta"))
    with pytest.raises(ValueError, match="6 features"):
        layer(torch.empty(2, 6, device="meta", dtype=torch.bfloat16))
    layer.bias.data = layer.bias.data.float()  # a dtype mix in the parameters: the bias is named
    with pytest.raises(TypeError, match="bias dtype torch.float32 differs from the weight's torch.bfloat16"):
        layer(torch.empty(2, 8, device="meta", dtype=torch.bfloat16))


def test_patched_model_traces_under_make_fx_with_the_custom_op():
    from torch.fx.experimental.proxy_tensor import make_fx
    model = patch(Block()).to(device="meta", dtype=torch.bfloat16)
    names = [name for name, _ in model.named_parameters() if not name.startswith("attn.")]

    def forward(x, params):
        state = dict(zip(names, params))
        return torch.func.functional_call(model.head, {k[5:]: v for k, v in state.items() if k.startswith("head.")},
                                          (torch.func.functional_call(model.mlp, {
                                              k[4:]: v for k, v in state.items() if k.startswith("mlp.")}, (x,)),))

    def step(x, *params):
        return torch.autograd.grad(forward(x, params).float().sum(), [x, *params])

    def gemms(gm):
        return [n for n in gm.graph.nodes if str(n.target) == "kernel_api.gemm.default"]

    x = torch.empty(4, 16, device="meta", dtype=torch.bfloat16)
    params = [p.detach() for name, p in model.named_parameters() if not name.startswith("attn.")]
    with torch.no_grad():
        gm = make_fx(lambda x, *ps: forward(x, ps), tracing_mode="fake")(x, *params)
    # inference: the activations ride in the GEMMs' epilogues (the op's last argument)
    assert [n.args[6] if len(n.args) > 6 else n.kwargs.get("activation") for n in gemms(gm)] == [
        "gelu", None, "relu", None, "gelu"]
    gm = make_fx(step, tracing_mode="fake")(x.requires_grad_(), *[p.requires_grad_() for p in params])
    assert len(gemms(gm)) == 5 * 3  # a forward GEMM and two gradient GEMMs per projection


def test_compile_fullgraph_forward_and_backward_trace_on_meta():
    """torch.compile(fullgraph=True) traces Linear through the custom op, forward and backward
    (aot_eager runs the graphs on meta tensors, so nothing launches)."""
    layer = Linear(32, 16, activation="relu", device="meta", dtype=torch.bfloat16)
    layer.compile_lowering = "kernel_api"  # the op itself in the graph (the rule would pick aten here)
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        from torch._dynamo.backends.debugging import aot_eager
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    x = torch.empty(5, 7, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
    y = compiled(x)
    assert y.shape == (5, 7, 16)
    y.sum().backward()
    assert x.grad.shape == x.shape and layer.weight.grad.shape == (16, 32)
    assert seen and any("kernel_api.gemm" in str(n.target) for n in seen[0].graph.nodes)


# ---- the custom op's backward with activations, numerically ---------------------------------
def _reference_gemm(A, B, out, alpha, beta, C, bias, activation, accumulator_type, stream):
    z = alpha * (A @ B)
    if C is not None and beta != 0:
        z = z + beta * C
    if bias is not None:
        M, N = z.shape[-2:]
        z = z + (bias.reshape(N) if tuple(bias.shape) in ((N,), (1, N)) else bias.reshape(M, 1))
    if activation is not None:
        z = {"relu": F.relu, "gelu": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}[activation](z)
    return z if out is None else out.copy_(z)


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu"])
@pytest.mark.parametrize("bias_shape", [(7,), (1, 7), (5, 1), None])
def test_gemm_autograd_formula_with_activation_passes_gradcheck(monkeypatch, activation, bias_shape):
    """The op's formula (recompute z, times the activation's derivative, then the transposed
    GEMMs, C and bias sums) in float64 on CPU, the kernels replaced by a torch stand-in."""
    monkeypatch.setattr(dispatch, "_gemm_eager", _reference_gemm)
    g = torch.Generator().manual_seed(1)
    A = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    B = torch.randn(3, 7, dtype=torch.float64, generator=g, requires_grad=True)
    C = torch.randn(5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    bias = None if bias_shape is None else torch.randn(*bias_shape, dtype=torch.float64, generator=g,
                                                        requires_grad=True)
    inputs = (A, B, C) + (() if bias is None else (bias,))

    def f(A, B, C, bias=None):
        return ops.gemm(A, B, alpha=0.75, beta=0.5, C=C, bias=bias, activation=activation)

    assert torch.autograd.gradcheck(f, inputs)
    # and against torch's own autograd of the same expression
    y = f(*inputs)
    ref = _reference_gemm(*[t.detach().requires_grad_() for t in (A, B)], None, 0.75, 0.5, C, bias, activation,
                          None, None)
    assert torch.allclose(y, ref)


# ---- patch / unpatch -----------------------------------------------------------------------
def test_patch_keeps_parameters_and_state_dict_and_fuses_known_activations():
    torch.manual_seed(0)
    model = Block()
    before = model.state_dict()
    params = _params(model)
    originals = dict(model.named_modules())
    assert patch(model) is model
    assert list(model.state_dict()) == list(before)
    assert all(model.state_dict()[k] is not None and torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert all(p is params[name] for name, p in _params(model).items())  # the same Parameter objects
    kinds = {name: (type(m).__name__, getattr(m, "activation", None)) for name, m in patched_modules(model)}
    assert kinds == {
        "attn": ("Linear", None), "mlp.c_fc": ("KernelApiConv1D", "gelu"), "mlp.c_proj": ("KernelApiConv1D", None),
        "head.0": ("Linear", "relu"), "head.2": ("Linear", None),  # exact GELU: not fused
        "head.4": ("Linear", "gelu")}
    assert isinstance(model.mlp.c_fc, Conv1D) and isinstance(model.attn, torch.nn.Linear)
    assert isinstance(model.mlp.act, FusedActivation) and model.mlp.act.fused_into == "mlp.c_fc"
    assert isinstance(model.head[1], FusedActivation) and isinstance(model.head[5], FusedActivation)
    assert type(model.head[3]) is torch.nn.GELU
    assert model.attn.kernel_api_name == "attn"
    # unpatch: the very same module objects everywhere
    assert unpatch(model) is model
    assert all(m is originals[name] for name, m in model.named_modules())
    assert set(dict(model.named_modules())) == set(originals)
    assert not patched_modules(model)


def test_patch_without_fusion_and_with_include():
    model = patch(Block(), fuse_activations=False)
    assert all(getattr(m, "activation", None) is None for _, m in patched_modules(model))
    assert type(model.mlp.act) is NewGELUActivation and type(model.head[1]) is torch.nn.ReLU
    unpatch(model)
    model = patch(Block(), include=lambda name: name.startswith("mlp."))
    assert [name for name, _ in patched_modules(model)] == ["mlp.c_fc", "mlp.c_proj"]
    assert type(model.head[0]) is torch.nn.Linear and type(model.head[1]) is torch.nn.ReLU


def test_patch_and_unpatch_of_a_bare_layer_shared_layers_and_nothing_to_patch():
    layer = torch.nn.Linear(4, 4)
    new = patch(layer)
    assert isinstance(new, Linear) and new.weight is layer.weight
    assert unpatch(new) is layer
    shared = torch.nn.Linear(8, 8)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    patch(model)
    assert model[0] is model[2] and isinstance(model[0], Linear)
    assert model[0].activation is None  # a shared projection is not fused (its other use has no ReLU)
    unpatch(model)
    assert model[0] is shared and model[2] is shared
    with pytest.warns(UserWarning, match="no torch.nn.Linear"):
        plain = torch.nn.Sequential(torch.nn.ReLU())
        assert patch(plain) is plain
    with pytest.warns(UserWarning, match="not patched"):
        unpatch(plain)
    with pytest.raises(TypeError, match="module"):
        patch("model")


def test_patched_conv1d_matches_its_forward_on_meta_and_keeps_isinstance():
    c = Conv1D(6, 4)
    new = patch(torch.nn.Sequential(c))[0]
    assert isinstance(new, Conv1D) and new.weight is c.weight and new.bias is c.bias
    y = new.to("meta")(torch.empty(2, 3, 4, device="meta", requires_grad=True))
    assert y.shape == (2, 3, 6)


def test_transformers_gpt2_every_projection_goes_through_kernel_api():
    """GPT-2 (2 layers) on meta, every attention and MLP projection patched,
    the state_dict keys unchanged."""
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2)).to("meta")
    keys = list(model.state_dict())
    patch(model)
    assert list(model.state_dict()) == keys
    names = {name for name, _ in patched_modules(model)}
    for i in range(2):
        assert {f"transformer.h.{i}.attn.c_attn", f"transformer.h.{i}.attn.c_proj", f"transformer.h.{i}.mlp.c_fc",
                f"transformer.h.{i}.mlp.c_proj"} <= names
        assert model.transformer.h[i].mlp.c_fc.activation == "gelu"
        assert isinstance(model.transformer.h[i].mlp.act, FusedActivation)
    assert "lm_head" in names
    unpatch(model)
    assert not patched_modules(model)


# ---- misaligned N: split columns into a padded output; padded gradients in the backward -------
def _stand_in_launch(calls):
    """A `dispatch._launch` stand-in: computes the GemmArguments' GEMM with torch into args.out."""
    def launch(args, stream=None, fast_key=None, tensors=(), tag=0, new_output=False):
        ep = args.epilogue
        z = args.A @ args.B
        if ep is not None:
            z = ep.alpha * z
            if ep.C is not None:
                z = z + ep.beta * ep.C
            if ep.bias is not None:
                z = z + (ep.bias if ep.bias_kind == "row" else ep.bias.reshape(-1, 1))
            if ep.activation is not None:
                z = {"relu": F.relu, "gelu": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}[ep.activation](z)
        args.out.copy_(z)
        calls.append((args.M, args.N, args.K, args.out.stride()))
    return launch


def test_gemm_with_misaligned_columns_splits_into_a_padded_output(monkeypatch):
    """N = 37 float32 (rows of 148 bytes) at M = 256: the first 36 columns and the last one are
    two GEMMs (the first aligned to 16 bytes) writing one output whose rows are padded to 40;
    the fake implementation gives the same strides; small M or aligned N are left whole."""
    calls = []
    monkeypatch.setattr(dispatch, "_launch", _stand_in_launch(calls))
    g = torch.Generator().manual_seed(3)
    A, B, bias = (torch.randn(*s, generator=g) for s in ((256, 24), (24, 37), (37,)))
    out = ops.gemm(A, B, bias=bias, activation="relu")
    assert out.shape == (256, 37) and out.stride() == (40, 1)
    assert [c[:3] for c in calls] == [(256, 36, 24), (256, 1, 24)]
    assert torch.allclose(out, F.relu(A.double() @ B.double() + bias.double()).float(), atol=1e-5)
    fake = torch.ops.kernel_api.gemm(A.to("meta"), B.to("meta"), None, bias.to("meta"), 1.0, 0.0, "relu")
    assert fake.shape == out.shape and fake.stride() == out.stride()
    calls.clear()
    assert ops.gemm(A[:255], B).stride() == (37, 1) and ops.gemm(A, B[:, :36]).is_contiguous()
    assert [c[:3] for c in calls] == [(255, 37, 24), (256, 36, 24)]


def test_long_padded_rows_start_128_bytes_apart():
    """Rows of 4 KB and more are padded to 128 bytes (TMA's lines), shorter ones to 16: the
    lm_head's 50257 bf16 logits get a row stride of 50304, not 50264; eager and fake alike."""
    for dtype, n, stride in ((torch.bfloat16, 50257, 50304), (torch.float32, 1037, 1056), (torch.bfloat16, 2047, 2048),
                             (torch.bfloat16, 2041, 2048), (torch.float32, 1021, 1024), (torch.bfloat16, 2039, 2040)):
        A = torch.empty(256, 64, dtype=dtype, device="meta")
        assert dispatch.padded_output(A, n).stride() == (stride, 1), (dtype, n)
        fake = torch.ops.kernel_api.gemm(A, torch.empty(64, n, dtype=dtype, device="meta"), None, None, 1.0, 0.0, None)
        assert fake.shape == (256, n) and fake.stride() == (stride, 1), (dtype, n)


def test_gemm_backward_with_misaligned_columns_matches_torch(monkeypatch):
    """The lm_head's case in float64 (rows of 37 elements, not a multiple of 16 bytes): the
    gradient is copied into padded rows and dA, dB split at the aligned column; the gradients
    equal torch's."""
    calls = []
    monkeypatch.setattr(dispatch, "_launch", _stand_in_launch(calls))
    g = torch.Generator().manual_seed(4)
    A = torch.randn(256, 24, dtype=torch.float64, generator=g, requires_grad=True)
    W = torch.randn(37, 24, dtype=torch.float64, generator=g, requires_grad=True)
    grad = torch.randn(256, 37, dtype=torch.float64, generator=g)
    y = ops.gemm(A, W.t())
    y.backward(grad)
    assert torch.allclose(A.grad, grad @ W.detach()) and torch.allclose(W.grad, grad.t() @ A.detach())
    # dA: the aligned 36 columns of the contraction, then the last one accumulated (C);
    # dB^T: its first 36 rows, then the last one
    assert (256, 24, 36) in [c[:3] for c in calls] and (36, 24, 256) in [c[:3] for c in calls]
