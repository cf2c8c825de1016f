"""`kernel_api.nn.patch` fusing what a model does after a projection into its GEMM's epilogue, on
the CPU: the residual adds of Llama-family decoder layers and GPT-2 blocks (into o_proj /
down_proj, attn.c_proj / mlp.c_proj), the gate multiply of the SwiGLU MLP (into up_proj), an
activation before the add; which form each call takes (the epilogue function, the named
epilogue, torch ops); outputs, losses and gradients against the unpatched model; unpatch.
tests/test_compile_patched_epilogue.py compiles the patched models.

The GEMM kernels are torch stand-ins (the named epilogue's `dispatch._gemm_eager` and the
epilogue function's `epilogue_gemm._run`, which evaluates the function's graph with torch) and
the front door launches on the CPU with the torch provider. tests/test_epilogue_patch_gpu.py
runs the kernels."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import kernel_api
from kernel_api import ops
from kernel_api.epilogue import evaluate, parse, parse_cached
from kernel_api.nn import Linear, lowering, patch, patched_modules, unpatch
from kernel_api.nn import blocks, fusion
from kernel_api.nn.fusion import FusedProjection, armed, epilogue_source, torch_epilogue
from kernel_api.nn.mlp import SwiGLUMLP
from kernel_api.ops import dispatch, epilogue_gemm

transformers = pytest.importorskip("transformers")

_ACT = {"relu": F.relu, "gelu": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}
KINDS = ("linear", "residual", "mlp")  # (norms, attention and RoPE have their own tests)


class _Calls(list):
    def count(self, kind):  # noqa: D102 - list.count by kind
        return sum(1 for c in self if c == kind)


@pytest.fixture
def calls(monkeypatch):
    """Torch stand-ins for the GEMM kernels, recording which form each call took."""
    made = _Calls()

    def named(A, B, out, alpha, beta, C, bias, activation, accumulator_type, stream):
        made.append("named" if C is not None else "plain")
        z = alpha * (A @ B)
        if C is not None and beta != 0:
            z = z + beta * C
        if bias is not None:
            z = z + bias
        if activation is not None:
            z = _ACT[activation](z)
        return z if out is None else out.copy_(z)

    def function(A, B, out, epilogue, accumulator_type, stream, record=None):
        made.append("function")
        graph = parse_cached(epilogue.function)
        D = evaluate(graph, A @ B, dict(epilogue.operands), dtype=A.dtype)["D"]
        return D if out is None else out.copy_(D)

    monkeypatch.setattr(dispatch, "LAUNCH_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(dispatch, "_gemm_eager", named)
    monkeypatch.setattr(epilogue_gemm, "_run", function)
    ops.clear_dispatch_cache()
    torch._dynamo.reset()
    counters.clear()
    with kernel_api.settings(providers="torch"):
        yield made
    torch._dynamo.reset()
    ops.clear_dispatch_cache()


@pytest.fixture
def fuse_small(monkeypatch):
    """The epilogue function from one row on (eager and under compile), so small models take it."""
    monkeypatch.setattr(fusion, "FUSE_MIN_ROWS", 1)
    monkeypatch.setattr(lowering, "COMPILE_MIN_ROWS", 1)


def tiny_llama(seed=0, device="cpu", **overrides):
    sizes = dict(vocab_size=97, hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0)
    sizes.update(overrides)
    config = transformers.LlamaConfig(**sizes)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    return model.eval()


def tiny_gpt2(seed=2, device="cpu", pdrop=0.0, **overrides):
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1001, n_positions=64,
                                     resid_pdrop=pdrop, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0, **overrides)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # (unset, transformers logs a warning in forward: a graph break of its own)
    return model.eval()


def _patch(model, **kwargs):
    kwargs.setdefault("kinds", KINDS)
    return patch(model, **kwargs)


# ---- what patch makes ------------------------------------------------------------------------

def test_llama_on_meta_fuses_residuals_and_the_gate_keeps_state_and_unpatch_restores():
    model = tiny_llama(device="meta")
    keys, params, modules = list(model.state_dict()), dict(model.named_parameters()), dict(model.named_modules())
    assert _patch(model) is model
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    for layer in model.model.layers:
        assert isinstance(layer, blocks.ResidualBlock) and isinstance(layer, type(modules["model.layers.0"]))
        assert layer.kernel_api_block is blocks.LLAMA_DECODER_LAYER
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            assert isinstance(proj, FusedProjection) and isinstance(proj, Linear) and proj.gate_activation is None
        assert isinstance(layer.mlp, SwiGLUMLP)
        assert isinstance(layer.mlp.up_proj, FusedProjection) and layer.mlp.up_proj.gate_activation == "silu"
        for proj in (layer.mlp.gate_proj, layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            assert type(proj) is Linear
    assert type(model.lm_head) is Linear
    names = {n for n, _ in patched_modules(model)}
    assert "model.layers.1" not in names and "model.layers.1.mlp.up_proj" in names  # (blocks run no op)
    assert unpatch(model) is model
    assert all(m is modules[n] for n, m in model.named_modules()) and set(dict(model.named_modules())) == set(modules)
    assert list(model.state_dict()) == keys and not patched_modules(model)


def test_gpt2_on_meta_fuses_both_c_proj_and_keeps_the_gelu_in_c_fc():
    model = tiny_gpt2(device="meta")
    keys = list(model.state_dict())
    original = model.transformer.h[0]
    patch(model)
    for block in model.transformer.h:
        assert isinstance(block, blocks.ResidualBlock) and block.kernel_api_block is blocks.GPT2_BLOCK
        assert isinstance(block.attn.c_proj, FusedProjection) and isinstance(block.mlp.c_proj, FusedProjection)
        assert type(block.attn.c_proj).__name__ == "FusedKernelApiConv1D"
        assert block.mlp.c_fc.activation == "gelu" and not isinstance(block.mlp.c_fc, FusedProjection)
    assert list(model.state_dict()) == keys
    unpatch(model)
    assert model.transformer.h[0] is original and type(original.attn.c_proj).__name__ == "Conv1D"


def test_nothing_fused_without_fuse_activations_or_the_projections():
    model = patch(tiny_llama(device="meta"), kinds=KINDS, fuse_activations=False)
    assert not any(isinstance(m, (FusedProjection, blocks.ResidualBlock)) for m in model.modules())
    unpatch(model)
    model = patch(tiny_llama(device="meta"), kinds=("residual", "mlp"))  # projections left as torch's
    assert not any(isinstance(m, (FusedProjection, blocks.ResidualBlock)) for m in model.modules())
    unpatch(model)
    model = patch(tiny_llama(device="meta"), kinds=("linear", "mlp"))  # no residual blocks: the gate only
    assert not any(isinstance(m, blocks.ResidualBlock) for m in model.modules())
    assert isinstance(model.model.layers[0].mlp.up_proj, FusedProjection)
    assert not isinstance(model.model.layers[0].mlp.down_proj, FusedProjection)
    unpatch(model)


def test_a_block_whose_projections_are_excluded_adds_its_residuals_itself(calls):
    ref = tiny_gpt2()
    model = patch(copy.deepcopy(ref), include=lambda name: not name.endswith("attn.c_proj"))
    block = model.transformer.h[0]
    assert isinstance(block, blocks.ResidualBlock) and not isinstance(block.attn.c_proj, FusedProjection)
    ids = torch.randint(0, 1001, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


# ---- the epilogue ------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu"])
@pytest.mark.parametrize("gate_activation,gate", [(None, False), (None, True), ("silu", True), ("gelu", True)])
@pytest.mark.parametrize("residual", [False, True])
def test_epilogue_source_is_the_torch_math(bias, activation, gate_activation, gate, residual):
    """The function `FusedProjection` fuses computes what the model's torch ops do after the layer."""
    if not (gate or residual):
        return
    g = torch.Generator().manual_seed(5)
    acc, b, gt, r = (torch.randn(*s, dtype=torch.float64, generator=g) for s in ((6, 7), (7,), (6, 7), (6, 7)))
    graph = parse(epilogue_source(bias, activation, gate_activation, gate, residual))
    operands = {k: v for k, v, on in (("bias", b, bias), ("gate", gt, gate), ("residual", r, residual)) if on}
    assert set(graph.params) == set(operands)
    y = acc + b if bias else acc
    y = _ACT[activation](y) if activation else y
    expected = torch_epilogue(y, gt if gate else None, gate_activation, r if residual else None)
    torch.testing.assert_close(evaluate(graph, acc, operands)["D"], expected)


@pytest.mark.parametrize("conv1d", [False, True])
@pytest.mark.parametrize("rows,form", [(3, "named"), (1100, "function")])
def test_an_armed_projection_adds_the_residual_in_its_epilogue(calls, conv1d, rows, form):
    layer, x, r = _layer(conv1d, None), torch.randn(rows, 16), torch.randn(rows, 24)
    expected = layer(x) + r
    with torch.no_grad(), armed(layer, residual=r) as hand:
        y = layer(x)
    assert hand.consumed and layer.kernel_api_residual is None
    torch.testing.assert_close(y, expected)
    assert calls[-1] == form


@pytest.mark.parametrize("conv1d", [False, True])
def test_an_activation_before_the_add_and_a_gate_take_the_function(calls, fuse_small, conv1d):
    layer = _layer(conv1d, "gelu")
    x, r, g = torch.randn(2, 5, 16), torch.randn(2, 5, 24), torch.randn(2, 5, 24)
    plain = layer(x)
    with torch.no_grad():
        with armed(layer, residual=r):
            y = layer(x)
        torch.testing.assert_close(y, plain + r)
        layer.gate_activation = "silu"
        with armed(layer, residual=r, gate=g):
            y = layer(x)
        torch.testing.assert_close(y, plain * F.silu(g) + r)
    assert calls.count("function") == 2


def test_an_activation_before_the_add_while_training_runs_torch_after_the_gemm(calls, fuse_small):
    layer = _layer(False, "relu")
    x, r = torch.randn(4, 16, requires_grad=True), torch.randn(4, 24, requires_grad=True)
    with armed(layer, residual=r):
        y = layer(x)
    assert "function" not in calls
    y.square().sum().backward()
    ref_x, ref_r = x.detach().requires_grad_(), r.detach().requires_grad_()
    (F.relu(F.linear(ref_x, layer.weight, layer.bias)) + ref_r).square().sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(r.grad, ref_r.grad)


def test_worth_arming_only_the_epilogue_functions_eager_calls(fuse_small, monkeypatch):
    monkeypatch.setattr(fusion, "FUSE_MIN_ROWS", 16)
    assert fusion.worth_arming(torch.zeros(2, 8, 5)) and not fusion.worth_arming(torch.zeros(15, 5))
    grad = torch.zeros(2, 8, 5, requires_grad=True)
    assert not fusion.worth_arming(grad)
    with torch.no_grad():
        assert fusion.worth_arming(grad)


def test_armed_clears_its_operands_when_the_call_raises(calls):
    layer, r = _layer(False, None), torch.randn(3, 24)
    with pytest.raises(ValueError), armed(layer, residual=r):
        layer(torch.randn(3, 15))  # wrong features
    assert layer.kernel_api_residual is None and layer.kernel_api_gate is None
    hand = armed(layer, residual=r)
    with hand:
        pass  # the projection never called: the caller adds the residual itself
    assert not hand.consumed and layer.kernel_api_residual is None


def _layer(conv1d, activation):
    torch.manual_seed(7)
    if conv1d:
        from transformers.pytorch_utils import Conv1D
        from kernel_api.nn.linear import conv1d_from
        base = conv1d_from(Conv1D(24, 16), activation)
    else:
        base = Linear(16, 24, activation=activation)
    return fusion.fused_from(base)


# ---- whole models, eager ------------------------------------------------------------------------

@pytest.mark.parametrize("small", [False, True], ids=["small-rows", "function"])
def test_llama_outputs_equal_the_unpatched_model(calls, request, small):
    if small:
        request.getfixturevalue("fuse_small")
    ref = tiny_llama()
    model = _patch(copy.deepcopy(ref))
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    layers = 2
    if small:  # o_proj, up_proj (gate) and down_proj of each layer
        assert calls.count("function") == 3 * layers and calls.count("named") == 0
    else:  # small eager calls: nothing handed over (`worth_arming`), the block adds
        assert calls.count("named") == 0 and calls.count("function") == 0


@pytest.mark.parametrize("small", [False, True], ids=["small-rows", "function"])
def test_gpt2_outputs_and_decoding_equal_the_unpatched_model(calls, request, small):
    if small:
        request.getfixturevalue("fuse_small")
    ref = tiny_gpt2()
    model = patch(copy.deepcopy(ref))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 1001, (2, 8), generator=g)
    with torch.no_grad():
        out, ref_out = model(input_ids=ids, use_cache=True), ref(input_ids=ids, use_cache=True)
        torch.testing.assert_close(out.logits, ref_out.logits, rtol=1e-5, atol=1e-5)
        cache, ref_cache = out.past_key_values, ref_out.past_key_values
        for _ in range(3):
            step = torch.randint(0, 1001, (2, 1), generator=g)
            logits = model(input_ids=step, past_key_values=cache, use_cache=True).logits
            torch.testing.assert_close(logits, ref(input_ids=step, past_key_values=ref_cache, use_cache=True).logits,
                                       rtol=1e-5, atol=1e-5)
    assert calls.count("function") == (2 * 2 * 4 if small else 0) and "named" not in calls


def test_gpt2_block_called_directly_positionally_and_with_cross_attention(calls):
    ref = tiny_gpt2(add_cross_attention=True)
    model = patch(copy.deepcopy(ref))
    block, ref_block = model.transformer.h[0], ref.transformer.h[0]
    g = torch.Generator().manual_seed(4)
    x, enc = torch.randn(2, 5, 64, generator=g), torch.randn(2, 3, 64, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(block(x, None, None), ref_block(x, None, None))
        calls.clear()
        torch.testing.assert_close(block(x, None, None, enc), ref_block(x, None, None, enc))
        assert "named" not in calls  # the block's own forward
        torch.testing.assert_close(block(x, encoder_hidden_states=enc), ref_block(x, encoder_hidden_states=enc))


@pytest.mark.parametrize("grad", [False, True])
def test_gpt2_with_an_active_dropout_keeps_the_adds_and_matches_the_unpatched_model(calls, fuse_small, grad):
    """An active dropout after c_proj (train mode, p > 0): the block adds the residual after it,
    as the model does (same random draws in the same order), with and without autograd."""
    ref = tiny_gpt2(pdrop=0.3).train()
    model = patch(copy.deepcopy(ref))
    ids = torch.randint(0, 1001, (2, 8), generator=torch.Generator().manual_seed(6))
    with torch.set_grad_enabled(grad):
        torch.manual_seed(11)
        loss = model(input_ids=ids, labels=ids).loss
        torch.manual_seed(11)
        ref_loss = ref(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, ref_loss)
    assert "named" not in calls and "function" not in calls


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_training_step_gradients_equal_the_unpatched_model(calls, family):
    ref = tiny_llama() if family == "llama" else tiny_gpt2()
    model = _patch(copy.deepcopy(ref)) if family == "llama" else patch(copy.deepcopy(ref))
    vocab = 97 if family == "llama" else 1001
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(8))
    for m in (ref, model):
        m.train()
        m.zero_grad(set_to_none=True)
        m(input_ids=ids, labels=ids).loss.backward()
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    assert "named" not in calls and "function" not in calls  # training: the blocks add (`worth_arming`)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_the_other_llama_family_decoder_layers_fuse_and_match(calls, fuse_small, family):
    config_name, model_name = {"mistral": ("MistralConfig", "MistralForCausalLM"),
                               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[family]
    sizes = dict(vocab_size=97, hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    if family == "qwen3":
        sizes["head_dim"] = 16
    config = getattr(transformers, config_name)(**sizes)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ref = getattr(transformers, model_name)(config).eval()
    model = _patch(copy.deepcopy(ref))
    assert all(isinstance(layer, blocks.ResidualBlock) for layer in model.model.layers)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert calls.count("function") == 3 * 2
    unpatch(model)
