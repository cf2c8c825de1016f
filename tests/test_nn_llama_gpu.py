"""kernel_api.nn.patch on transformers' Llama family on a GPU, in bf16: logits within bf16 noise
of eager's (measured against an f32 model of the same weights), the kernel_api ops serving the
forward, 20 AdamW steps whose loss curve follows eager's, and torch.compile of the patched
model. tests/test_nn_llama.py holds the CPU checks."""

from __future__ import annotations

import copy

import pytest
import torch

from kernel_api import ops
from kernel_api.nn import patch, unpatch

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM")}


def f32_model(family: str, seed: int = 0) -> torch.nn.Module:
    """2 layers, hidden 512, 8 query heads of 64, 2 key/value heads, vocab 1000, on the GPU in f32."""
    config_name, model_name = FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=1000, hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, attention_dropout=0.0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).cuda()


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def _assert_step_matches(out, ref, model: torch.nn.Module, eager: torch.nn.Module) -> None:
    """``model``'s training step (its output ``out`` after backward) against ``eager``'s (``ref``):
    the loss within 2 %, the gradients within 5e-2 (relative, all parameters together)."""
    assert abs(out.loss.item() - ref.loss.item()) <= 2e-2 * abs(ref.loss.item())
    grads = dict(eager.named_parameters())
    got = torch.cat([p.grad.float().flatten() for _, p in model.named_parameters()])
    ref_grads = torch.cat([grads[name].grad.float().flatten() for name, _ in model.named_parameters()])
    assert rel(got, ref_grads) < 5e-2


@pytest.fixture
def op_calls(monkeypatch):
    """Counts the calls of the ops the patched layers use (names -> calls so far)."""
    counts: dict[str, int] = {}
    for name in ("rms_norm", "swiglu", "attention", "rope"):
        original = getattr(ops, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(ops, name, counted)
    return counts


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_logits_within_bf16_noise_of_eager(family, op_calls):
    reference = f32_model(family).eval()
    eager = copy.deepcopy(reference).to(torch.bfloat16)
    ids = torch.randint(0, 1000, (3, 333), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        eager_err = rel(eager(input_ids=ids).logits, want)
        patched = patch(eager)  # (after eager's run: patch's RoPE function is module-wide)
        patched_logits = patched(input_ids=ids).logits
    unpatch(patched)
    assert patched_logits.dtype == torch.bfloat16
    norms = 2 * (4 if family == "qwen3" else 2) + 1
    assert op_calls == {"rms_norm": norms, "swiglu": 2, "attention": 2, "rope": 2}
    # bf16 noise: the patched model is no further from the f32 model than eager bf16 is, give or take
    assert rel(patched_logits, want) <= max(1.5 * eager_err, 1e-2), (rel(patched_logits, want), eager_err)


def test_eval_loss_and_the_fused_training_loss_match_eager():
    reference = f32_model("llama")
    eager = copy.deepcopy(reference).to(torch.bfloat16)
    ids = torch.randint(0, 1000, (2, 257), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    want, eager_loss = {}, {}
    for mode in ("eval", "train"):
        want[mode] = getattr(reference, mode)()(input_ids=ids, labels=ids).loss.item()
        eager_loss[mode] = getattr(eager, mode)()(input_ids=ids, labels=ids).loss.item()
    patched = patch(eager)
    for mode in ("eval", "train"):
        got = getattr(patched, mode)()(input_ids=ids, labels=ids)
        assert abs(got.loss.item() - want[mode]) <= max(2 * abs(eager_loss[mode] - want[mode]),
                                                        2e-2 * want[mode]), mode
        if mode == "train" and hasattr(ops, "linear_cross_entropy"):
            assert got.logits is None
    unpatch(patched)


def _train(model: torch.nn.Module, batches: list, lr: float = 1e-3) -> list[float]:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_twenty_adamw_steps_follow_eager_loss_curve(family):
    eager = f32_model(family).to(torch.bfloat16)
    start = copy.deepcopy(eager)
    gen = torch.Generator("cuda").manual_seed(3)
    # counting sequences from random starts: a curve that falls (random tokens would stay at ln(vocab))
    batches = [(torch.randint(0, 1000, (4, 1), device="cuda", generator=gen)
                + torch.arange(256, device="cuda")) % 1000 for _ in range(20)]
    want = _train(eager, batches)
    patched = patch(start)  # (after eager's run: patch's RoPE function is module-wide)
    got = _train(patched, batches)
    assert want[-1] < want[0] - 1.0  # the model learns: the curve has a shape to follow
    scale = sum(want) / len(want)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 5e-2 * scale, (got, want)
    unpatch(patched)
    assert "forward" not in vars(patched)


def test_compiled_patched_model_matches_eager():
    eager = f32_model("llama").to(torch.bfloat16).eval()
    ids = torch.randint(0, 1000, (2, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    with torch.no_grad():
        want = eager(input_ids=ids).logits
    want_loss = eager.train()(input_ids=ids, labels=ids).loss.item()
    patched = patch(copy.deepcopy(eager).eval())
    compiled = torch.compile(patched)
    with torch.no_grad():
        assert rel(compiled(input_ids=ids).logits, want) <= 2e-2
    patched.train()
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - want_loss) <= 5e-2
    assert all(p.grad is not None for p in patched.parameters() if p.requires_grad)
    unpatch(patched)


def test_packed_bf16_training_step_runs_variable_length_attention(monkeypatch):
    """One row of packed sequences (position ids restarting) in bf16: the patched layers run
    variable-length attention (kernel_api's Hopper forward or FA4's, and a varlen backward), the
    logits within bf16 noise of the f32 model's, the loss and gradients those of eager bf16."""
    lengths = [700, 1, 333, 64, 500]
    ids = torch.randint(0, 1000, (1, sum(lengths)), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    reference = f32_model("llama").eval()
    eager = copy.deepcopy(reference).to(torch.bfloat16)
    model = copy.deepcopy(eager)
    with torch.no_grad():
        want = reference(input_ids=ids, position_ids=positions, use_cache=False).logits
        eager_err = rel(eager(input_ids=ids, position_ids=positions, use_cache=False).logits, want)
    ref = eager(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
    ref.loss.backward()
    varlen = []
    attention = ops.attention
    monkeypatch.setattr(ops, "attention", lambda *a, **k: varlen.append(k.get("cu_seqlens_q") is not None)
                        or attention(*a, **k))
    patch(model)
    with torch.no_grad():
        assert rel(model(input_ids=ids, position_ids=positions, use_cache=False).logits, want) <= 1.5 * eager_err
    out = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
    out.loss.backward()
    _assert_step_matches(out, ref, model, eager)
    assert varlen and all(varlen), varlen
    unpatch(model)


def test_compiled_packed_training_step_runs_variable_length_attention(monkeypatch):
    """torch.compile of the patched model on one row of packed sequences: the mask builder hands
    the offsets to the attention layers, which run variable length (read once a call, the empty
    sequences dropped); the loss and gradients are eager bf16's."""
    from kernel_api.arguments import attention as attention_arguments
    lengths = [700, 1, 333, 64, 500]
    ids = torch.randint(0, 1000, (1, sum(lengths)), device="cuda", generator=torch.Generator("cuda").manual_seed(6))
    positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    eager = f32_model("llama").to(torch.bfloat16).train()
    model = copy.deepcopy(eager)
    ref = eager(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
    ref.loss.backward()
    seen = []
    problem = attention_arguments.AttentionProblem.__init__

    def recorded(self, *args):
        problem(self, *args)
        if self.varlen:
            seen.append((self.batch, self.seqlen_q))
    monkeypatch.setattr(attention_arguments.AttentionProblem, "__init__", recorded)
    compiled = torch.compile(patch(model))
    out = compiled(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
    out.loss.backward()
    _assert_step_matches(out, ref, model, eager)
    assert seen and set(seen) == {(5, 700)}, seen
    unpatch(model)
