"""kernel_api.nn.patch on transformers' Llama family (Llama, Mistral, Qwen2, Qwen3) on the CPU:
which layers are replaced (on the meta device), the state_dict and Parameters kept, unpatch
restoring the same objects and settings, the warning naming layers left alone, and, with the
front door launching on the CPU through the torch provider (the tests add "cpu" to
`dispatch.LAUNCH_DEVICE_TYPES`), logits, losses and gradients of the patched model against
eager's in f32. tests/test_nn_llama_gpu.py runs the model in bf16 on a GPU."""

from __future__ import annotations

import copy

import sys
import warnings

import pytest
import torch

import kernel_api
from kernel_api import ops
from kernel_api.nn import Linear, patch, patched_modules, set_compile_lowering, unpatch
from kernel_api.nn.edits import GLOBAL_HOOKS
from kernel_api.nn.patching import KINDS
from kernel_api.nn.loss import causal_lm_loss
from kernel_api.nn.mlp import SwiGLUMLP
from kernel_api.nn.norm import RMSNorm
from kernel_api.ops import dispatch

transformers = pytest.importorskip("transformers")

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
TOL = dict(atol=2e-5, rtol=2e-5)
# On the CPU the projections stay torch's: the front door's replay of a recorded GEMM asks for the
# current CUDA device. (tests/test_nn.py covers the patched projections; the GPU tests, all of it.)
CPU_KINDS = [kind for kind in KINDS if kind != "linear"]


def small_model(family: str, device: str = "cpu", seed: int = 0, **overrides) -> torch.nn.Module:
    """A 2-layer model of ``family`` with GQA (4 query heads, 2 key/value heads), random weights."""
    config_name, model_name = FAMILIES[family]
    sizes = dict(vocab_size=97, hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0)
    if family == "qwen3":
        sizes["head_dim"] = 16
    sizes.update(overrides)
    config = getattr(transformers, config_name)(**sizes)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, model_name)(config)
    return model


def modeling_module(model: torch.nn.Module):
    return sys.modules[type(model.model.layers[0].self_attn).__module__]


@pytest.fixture(autouse=True)
def _rope_released():
    """Each test unpatches its models: patch's module-wide functions (RoPE, the causal-mask
    builder) stay installed while one holds them. (Models other test files patched and keep
    hold theirs.)"""
    before = set(GLOBAL_HOOKS.held)
    yield
    held = [key for key in GLOBAL_HOOKS.held if key not in before]
    for module_id, name in held:  # (a failed test's leftovers, put back for the next tests)
        original = GLOBAL_HOOKS.held.pop((module_id, name))[0]
        for module in list(sys.modules.values()):
            if id(module) == module_id:
                setattr(module, name, original)
    assert not held, "a test left a patched model's RoPE function installed"


@pytest.fixture
def cpu_ops(monkeypatch):
    """The front door launching on CPU tensors, with the torch provider's kernels only."""
    monkeypatch.setattr(dispatch, "LAUNCH_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    ops.clear_dispatch_cache()
    with kernel_api.settings(providers="torch"):
        yield
    monkeypatch.undo()
    ops.clear_dispatch_cache()


@pytest.fixture
def op_calls(monkeypatch):
    """Counts the calls of the ops the patched layers use (names -> calls so far)."""
    counts: dict[str, int] = {}
    for name in ("rms_norm", "layer_norm", "swiglu", "attention", "rope", "cross_entropy", "linear_cross_entropy"):
        original = getattr(ops, name, None)
        if original is None:
            continue

        def counted(*args, _original=original, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(ops, name, counted)
    return counts


def _quiet_patch(model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the family has no layer kernel_api leaves alone
        return patch(model, **kwargs)


# ---- structure, on the meta device -------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_patch_on_meta_replaces_the_known_layers_and_unpatch_restores_them(family):
    model = small_model(family, device="meta")
    keys = list(model.state_dict())
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    original_rope = getattr(modeling_module(model), "apply_rotary_pos_emb")
    assert _quiet_patch(model) is model
    assert list(model.state_dict()) == keys
    assert all(p is params[name] for name, p in model.named_parameters())
    kinds = {name: type(m) for name, m in patched_modules(model)}
    for i in range(2):
        layer = model.model.layers[i]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert isinstance(getattr(layer, norm), RMSNorm)
            assert isinstance(getattr(layer, norm), type(modules[f"model.layers.{i}.{norm}"]))
        assert isinstance(layer.mlp, SwiGLUMLP) and type(layer.mlp).__name__.startswith("KernelApi")
        for proj in ("gate_proj", "up_proj", "down_proj"):  # (up and down: with an epilogue fused in)
            assert isinstance(getattr(layer.mlp, proj), Linear)
            assert getattr(modules[f"model.layers.{i}.mlp"], proj) is modules[f"model.layers.{i}.mlp.{proj}"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):  # (o_proj: with the residual add fused in)
            assert isinstance(getattr(layer.self_attn, proj), Linear)
        if family == "qwen3":
            assert isinstance(layer.self_attn.q_norm, RMSNorm) and isinstance(layer.self_attn.k_norm, RMSNorm)
    assert isinstance(model.model.norm, RMSNorm) and type(model.lm_head) is Linear
    assert "model.layers.1.mlp.down_proj" in kinds
    assert model.config._attn_implementation == "kernel_api"
    assert getattr(modeling_module(model), "apply_rotary_pos_emb") is not original_rope
    if hasattr(ops, "cross_entropy"):
        assert model.loss_function is causal_lm_loss
    if hasattr(ops, "linear_cross_entropy"):
        assert "forward" in vars(model)

    assert unpatch(model) is model
    assert all(m is modules[name] for name, m in model.named_modules())
    assert set(dict(model.named_modules())) == set(modules)
    assert not patched_modules(model)
    assert model.config._attn_implementation == "sdpa"
    assert getattr(modeling_module(model), "apply_rotary_pos_emb") is original_rope
    assert "forward" not in vars(model) and "_loss_function" not in vars(model)
    assert list(model.state_dict()) == keys


def test_kinds_pick_the_replacers_and_include_the_modules():
    model = small_model("llama", device="meta")
    with pytest.raises(ValueError, match=r"kinds: unknown \['norm'\]"):
        patch(model, kinds={"norm"})
    with pytest.raises(TypeError, match="kinds"):
        patch(model, kinds="rms_norm")
    _quiet_patch(model, kinds={"rms_norm"})
    assert {type(m).__name__ for _, m in patched_modules(model)} == {"KernelApiLlamaRMSNorm"}
    assert model.config._attn_implementation == "sdpa" and "forward" not in vars(model)
    unpatch(model)
    _quiet_patch(model, include=lambda name: name.startswith("model.layers.0."))
    names = {name for name, _ in patched_modules(model)}
    assert "model.layers.0.mlp" in names and "model.layers.0.mlp.up_proj" in names
    assert not any(name.startswith("model.layers.1") for name in names) and "lm_head" not in names
    assert "forward" not in vars(model)  # the root ("") was not included: no loss
    unpatch(model)
    assert not patched_modules(model)


def test_warning_names_the_layers_left_alone():
    model = small_model("llama", device="meta")
    model.model.extra_norm = torch.nn.GroupNorm(4, 64, device="meta")
    model.model.layers[1].gate = torch.nn.Module()
    model.model.layers[1].gate.scale = torch.nn.Parameter(torch.ones(3, device="meta"))
    with pytest.warns(UserWarning, match=r"left alone.*GroupNorm \(1: model\.extra_norm\).*Module \(1: "
                                         r"model\.layers\.1\.gate\)"):
        patch(model)
    unpatch(model)
    model.model.extra_norm = torch.nn.LayerNorm(64, device="meta")  # known (opt-in "layer_norm"): no warning
    with pytest.warns(UserWarning, match=r"layer for: Module \(1: model\.layers\.1\.gate\)$"):
        patch(model)
    unpatch(model)


def test_rope_function_is_held_while_a_patched_model_uses_it():
    a, b = small_model("llama", device="meta"), small_model("llama", device="meta")
    module = modeling_module(a)
    original = module.apply_rotary_pos_emb
    _quiet_patch(a)
    replaced = module.apply_rotary_pos_emb
    _quiet_patch(b)
    assert module.apply_rotary_pos_emb is replaced and replaced.kernel_api_original is original
    unpatch(a)
    assert module.apply_rotary_pos_emb is replaced
    unpatch(b)
    assert module.apply_rotary_pos_emb is original


def test_patching_twice_unpatches_in_one_step():
    model = small_model("qwen2", device="meta")
    modules = dict(model.named_modules())
    _quiet_patch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patch(model)
    unpatch(model)
    assert all(m is modules[name] for name, m in model.named_modules())
    assert model.config._attn_implementation == "sdpa"


# ---- numbers, on the CPU in f32 ------------------------------------------------------------------

def _ids(batch=2, seq=11, vocab=97, seed=1):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_losses_match_eager(cpu_ops, op_calls, family):
    model = small_model(family).eval()
    ids = _ids()
    with torch.no_grad():
        ref = model(input_ids=ids, labels=ids)
    _quiet_patch(model, kinds=CPU_KINDS)
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, ref.logits, **TOL)
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    layers, norms_per_layer = 2, 4 if family == "qwen3" else 2
    assert op_calls["rms_norm"] == layers * norms_per_layer + 1
    assert op_calls["swiglu"] == layers and op_calls["attention"] == layers and op_calls["rope"] == layers
    assert op_calls.get("cross_entropy", 0) == (1 if "cross_entropy" in dir(ops) else 0)
    unpatch(model)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_training_loss_and_gradients_match_eager(cpu_ops, op_calls, family):
    eager = small_model(family).train()
    model = small_model(family).train()
    ids = _ids(seed=2)
    ref = eager(input_ids=ids, labels=ids)
    ref.loss.backward()
    _quiet_patch(model, kinds=CPU_KINDS)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    if hasattr(ops, "linear_cross_entropy"):
        assert out.logits is None and op_calls["linear_cross_entropy"] == 1
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    unpatch(model)


def test_ignore_index_and_num_items_in_batch_reach_the_loss(cpu_ops):
    model = small_model("llama").train()
    ids = _ids(seed=3)
    labels = ids.clone()
    labels[0, :5] = -100
    ref = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(9)).loss
    _quiet_patch(model, kinds=CPU_KINDS)
    out = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(9)).loss
    torch.testing.assert_close(out, ref, **TOL)
    if hasattr(ops, "cross_entropy"):
        model.eval()
        torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, causal_lm_loss(
            model(input_ids=ids).logits, labels, 97), **TOL)
    unpatch(model)


def test_padding_mask_runs_sdpa_and_matches_eager(cpu_ops, op_calls):
    model = small_model("mistral").eval()
    ids = _ids(seq=9, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        _quiet_patch(model, kinds=CPU_KINDS)
        out = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(out[0], ref[0], **TOL)
    torch.testing.assert_close(out[1, 3:], ref[1, 3:], **TOL)
    assert op_calls.get("attention", 0) == 0  # a padding mask goes to SDPA
    unpatch(model)


def test_generate_with_a_kv_cache_matches_eager(cpu_ops, op_calls):
    model = small_model("qwen2").eval()
    ids = _ids(batch=2, seq=6, seed=5)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, **kwargs)
    _quiet_patch(model, kinds=CPU_KINDS)
    out = model.generate(ids, **kwargs)
    assert torch.equal(out, ref)
    assert op_calls["attention"] >= 2 * 5  # the prompt and each decoding step, through ops.attention
    unpatch(model)


def _packed(lengths, seed=6):
    """One row of packed sequences: token ids, position ids restarting at each sequence, offsets."""
    ids = torch.randint(0, 97, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, positions, cu


@pytest.fixture
def varlen_calls(monkeypatch):
    """Whether each `ops.attention` call had sequence offsets, and the mask checks made."""
    from kernel_api.nn import packed
    calls = {"varlen": [], "checks": 0}
    attention, check = ops.attention, packed._is_block_causal

    def counted_attention(*args, **kwargs):
        calls["varlen"].append(kwargs.get("cu_seqlens_q") is not None)
        return attention(*args, **kwargs)

    def counted_check(*args):
        calls["checks"] += 1
        return check(*args)
    monkeypatch.setattr(ops, "attention", counted_attention)
    monkeypatch.setattr(packed, "_is_block_causal", counted_check)
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_sequences_run_variable_length_attention_as_each_sequence_alone(cpu_ops, varlen_calls, family):
    """One row of packed sequences, described by restarting position ids or by FlashAttention's
    offsets too: variable-length attention, the logits those of each sequence run alone. By
    position ids alone the patched mask builder gives the offsets and builds no mask (transformers'
    would be (tokens x tokens)); with FlashAttention's offsets the mask is built and compared with
    them once a forward."""
    from kernel_api.nn import attention as nn_attention
    model = small_model(family).eval()
    lengths = [5, 3, 7, 1]
    ids, positions, cu = _packed(lengths)
    with torch.no_grad():
        alone = torch.cat([model(input_ids=part).logits for part in ids.split(lengths, 1)], 1)
    _quiet_patch(model, kinds=CPU_KINDS)
    masks_built = []
    sdpa_mask = nn_attention._transformers["sdpa_mask"]
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setitem(nn_attention._transformers, "sdpa_mask", lambda **kw: masks_built.append(1) or sdpa_mask(**kw))
        by_positions = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        assert masks_built == [] and varlen_calls["checks"] == 0
        by_offsets = model(input_ids=ids, position_ids=positions, use_cache=False, cu_seq_lens_q=cu,
                           cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths)).logits
        assert masks_built == [1]
    torch.testing.assert_close(by_positions, alone, **TOL)
    torch.testing.assert_close(by_offsets, alone, **TOL)
    assert varlen_calls["varlen"] == [True] * 4 and varlen_calls["checks"] == 1
    unpatch(model)


def test_flash_attention_offsets_alone_are_honoured_as_flash_attention_does(cpu_ops, varlen_calls):
    """FlashAttention's offsets without position ids (no mask is built): each sequence attends
    to itself only, at the positions the model counts across the row, as transformers'
    FlashAttention integration reads them (SDPA would attend across sequences)."""
    model = small_model("llama").eval()
    lengths = [4, 6, 2]
    ids, _, cu = _packed(lengths, seed=7)
    with torch.no_grad():
        starts = [0, 4, 10]
        alone = torch.cat([model(input_ids=part, position_ids=torch.arange(s, s + n)[None]).logits
                           for part, s, n in zip(ids.split(lengths, 1), starts, lengths)], 1)
    _quiet_patch(model, kinds=CPU_KINDS)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6,
                    max_length_k=6).logits
    torch.testing.assert_close(out, alone, **TOL)
    assert varlen_calls["varlen"] == [True] * 2
    unpatch(model)


def test_packed_training_matches_eager(cpu_ops, varlen_calls):
    eager, model = small_model("llama").train(), small_model("llama").train()
    ids, positions, _ = _packed([6, 2, 9], seed=8)
    ref = eager(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
    ref.loss.backward()
    _quiet_patch(model, kinds=CPU_KINDS)
    out = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    assert varlen_calls["varlen"] == [True] * 2
    unpatch(model)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_compiled_packed_rows_run_variable_length_attention(cpu_ops, family):
    """Under torch.compile the mask builder hands kernel_api's attention the packed row's offsets,
    traced from the position ids (no value read while tracing): the ops run variable length, the
    empty sequences past the last dropped, and the logits and gradients are eager's; a row with
    one sequence, a second packing of the same length (no new trace) and a sliding window agree."""
    from kernel_api.arguments import attention as attention_arguments
    seen = []
    problem = attention_arguments.AttentionProblem.__init__

    def recorded(self, *args):
        problem(self, *args)
        if self.varlen:
            seen.append((self.batch, self.seqlen_q, self.cu_seqlens_q.tolist()))
    lengths = [5, 3, 7, 1]
    for window in ((None, 3) if family == "mistral" else (None,)):
        eager = small_model(family, **({"sliding_window": window} if family == "mistral" else {})).train()
        model = copy.deepcopy(eager)
        ids, positions, _ = _packed(lengths, seed=12)
        ref = eager(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
        ref.loss.backward()
        _quiet_patch(model, kinds=CPU_KINDS)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        seen.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(attention_arguments.AttentionProblem, "__init__", recorded)
            out = compiled(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
            out.loss.backward()
            torch.testing.assert_close(out.loss, ref.loss, **TOL)
            grads = dict(eager.named_parameters())
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-4, rtol=1e-4,
                                           msg=lambda m: f"{name}: {m}")
            packed_calls = list(seen)
            with torch.no_grad():
                other = [4, 4, 8]
                ids2, positions2, _ = _packed(other, seed=13)
                want = torch.cat([eager(input_ids=part).logits for part in ids2.split(other, 1)], 1)
                torch.testing.assert_close(compiled(input_ids=ids2, position_ids=positions2, use_cache=False).logits,
                                           want, **TOL)
                whole = torch.arange(16)[None] + 3
                torch.testing.assert_close(compiled(input_ids=ids2, position_ids=whole, use_cache=False).logits,
                                           eager(input_ids=ids2, position_ids=whole, use_cache=False).logits, **TOL)
        unpatch(model)
        torch._dynamo.reset()
        if window is None:  # forward and backward of both layers: the four sequences, the padding dropped
            assert packed_calls == [(4, 7, [0, 5, 8, 15, 16])] * 4, packed_calls
            assert seen[-4:] == [(3, 8, [0, 4, 8, 16])] * 2 + [(1, 16, [0, 16])] * 2, seen
        else:  # (Mistral's sliding window builds its mask elsewhere: SDPA, no offsets)
            assert packed_calls == [] and seen == [], seen


def test_compiled_packed_rows_with_flash_attention_offsets_attend_within_both(cpu_ops):
    """Position ids and FlashAttention's offsets together under torch.compile: each token attends
    within the sequences both put together, as the eager patched model does (SDPA under the mask
    confined to the offsets), through variable-length attention."""
    from kernel_api.arguments import attention as attention_arguments
    model = small_model("llama").eval()
    lengths = [6, 4, 5]
    ids, positions, cu = _packed(lengths, seed=14)
    finer = torch.tensor([0, 3, 6, 10, 15], dtype=torch.int32)  # (the first sequence split in two)
    _quiet_patch(model, kinds=CPU_KINDS)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    seen = []
    problem = attention_arguments.AttentionProblem.__init__

    def recorded(self, *args):
        problem(self, *args)
        seen.append(self.cu_seqlens_q.tolist() if self.varlen else None)
    with torch.no_grad():
        for offsets in (cu, finer):
            keywords = dict(position_ids=positions, use_cache=False, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets,
                            max_length_q=6, max_length_k=6)
            want = model(input_ids=ids, **keywords).logits
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(attention_arguments.AttentionProblem, "__init__", recorded)
                torch.testing.assert_close(compiled(input_ids=ids, **keywords).logits, want, **TOL)
    assert seen == [[0, 6, 10, 15]] * 2 + [[0, 3, 6, 10, 15]] * 2, seen
    unpatch(model)
    torch._dynamo.reset()


def test_a_packed_row_with_other_masking_keeps_sdpa_and_the_mask(cpu_ops, varlen_calls):
    """A sliding window shorter than a sequence: the mask is not the packed block-causal one, so
    the layers run SDPA with it; a batch of two rows is no packed row either."""
    model = small_model("mistral", sliding_window=2).eval()
    ids, positions, _ = _packed([5, 4])
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        two_rows = model(input_ids=ids[:, :8].reshape(2, 4), use_cache=False).logits
    _quiet_patch(model, kinds=CPU_KINDS)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        torch.testing.assert_close(model(input_ids=ids[:, :8].reshape(2, 4), use_cache=False).logits, two_rows, **TOL)
    torch.testing.assert_close(out, ref, **TOL)
    assert True not in varlen_calls["varlen"] and varlen_calls["checks"] == 1  # (checked once, refused)
    unpatch(model)


def test_packed_and_padded_rows_under_inference_mode(cpu_ops, varlen_calls):
    """Inference tensors (no version counter) are not kept, only recomputed: a packed row runs
    variable-length attention under inference_mode too, and a left-padded row of one is SDPA's."""
    model = small_model("llama").eval()
    lengths = [3, 6]
    ids, positions, _ = _packed(lengths, seed=9)
    with torch.inference_mode():
        alone = torch.cat([model(input_ids=part).logits for part in ids.split(lengths, 1)], 1)
        padding = torch.ones_like(ids)
        padding[0, :2] = 0
        padded_ref = model(input_ids=ids, attention_mask=padding).logits
    _quiet_patch(model, kinds=CPU_KINDS)
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids, position_ids=positions, use_cache=False).logits, alone, **TOL)
        torch.testing.assert_close(model(input_ids=ids, attention_mask=padding).logits[0, 2:], padded_ref[0, 2:],
                                   **TOL)
    assert varlen_calls["varlen"] == [True] * 2
    unpatch(model)


def test_flash_attention_offsets_confine_a_sliding_window_mask_and_compile_alike(cpu_ops, varlen_calls):
    """FlashAttention's offsets with a sliding window that bites: SDPA under the window's mask
    confined to each sequence, as FlashAttention attends; the compiled model (Dynamo, nothing read
    on the host) answers the same, without a mask and with one."""
    lengths = [5, 4, 3]
    ids, _, cu = _packed(lengths, seed=10)
    keywords = dict(use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
    starts = [0, 5, 9]
    for window in (2, None):
        model = small_model("mistral", sliding_window=window).eval()
        with torch.no_grad():
            alone = torch.cat([model(input_ids=part, position_ids=torch.arange(s, s + n)[None]).logits
                               for part, s, n in zip(ids.split(lengths, 1), starts, lengths)], 1)
        _quiet_patch(model, kinds=CPU_KINDS)
        compiled = torch.compile(model, backend="eager", fullgraph=False)
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids, **keywords).logits, alone, **TOL)
            torch.testing.assert_close(compiled(input_ids=ids, **keywords).logits, alone, **TOL)
        unpatch(model)
        torch._dynamo.reset()
    # (the window that bites: SDPA, no op call; no window: the eager model's two layers are varlen)
    assert varlen_calls["varlen"][:2] == [True] * 2


@pytest.mark.parametrize("cu, message", [
    (torch.tensor([0, 5, 11], dtype=torch.int32), "cu_seq_lens_q: offsets must go from 0 to the row's 12 tokens"),
    (torch.tensor([0, 7, 5, 12], dtype=torch.int32), "without decreasing"),
    (torch.tensor([[0, 12]], dtype=torch.int32), "cu_seq_lens_q: expected a 1-D tensor of at least 2 offsets"),
])
def test_bad_flash_attention_offsets_are_one_line(cpu_ops, cu, message):
    model = small_model("llama").eval()
    ids, _, _ = _packed([5, 7], seed=11)
    _quiet_patch(model, kinds=CPU_KINDS)
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        model(input_ids=ids, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    unpatch(model)


def test_a_model_on_a_device_ops_do_not_take_runs_its_own_forward(op_calls):
    model = small_model("llama").eval()
    ids = _ids(seed=6)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    packed_ids, positions, _ = _packed([5, 9, 2], seed=15)
    with torch.no_grad():
        packed_ref = model(input_ids=packed_ids, position_ids=positions, use_cache=False).logits
    _quiet_patch(model, kinds={"rms_norm", "mlp", "attention", "rope", "loss"})
    with torch.no_grad():
        out = model(input_ids=ids).logits
        # (packed rows: the mask builder's offsets unused, its mask built for SDPA)
        packed_out = model(input_ids=packed_ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(packed_out, packed_ref, **TOL)
    assert not any(op_calls.get(name) for name in ("rms_norm", "swiglu", "rope"))
    unpatch(model)


def test_a_deep_copy_of_a_patched_model_is_patched_on_its_own():
    import copy
    model = small_model("llama", device="meta").train()
    module = modeling_module(model)
    original = module.apply_rotary_pos_emb
    _quiet_patch(model)
    twin = copy.deepcopy(model)
    assert twin.forward.__self__ is twin and twin.config is not model.config
    assert twin.config._attn_implementation == "kernel_api"
    unpatch(model)
    assert module.apply_rotary_pos_emb is not original  # the copy still holds it
    assert twin.config._attn_implementation == "kernel_api" and model.config._attn_implementation == "sdpa"
    unpatch(twin)
    assert module.apply_rotary_pos_emb is original
    assert "forward" not in vars(twin) and not patched_modules(twin)


def test_layer_norm_is_opt_in_and_matches_torch(cpu_ops, op_calls):
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = _ids(seed=7)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    patch(model, kinds={"layer_norm"})
    assert sum(isinstance(m, torch.nn.LayerNorm) and type(m).__name__ == "KernelApiLayerNorm"
               for m in model.modules()) == 2 * 2 + 1
    with torch.no_grad():
        out = model(input_ids=ids).logits
    torch.testing.assert_close(out, ref, **TOL)
    assert op_calls["layer_norm"] == 5
    unpatch(model)
    assert not patched_modules(model)


def test_torch_compile_of_the_patched_model_traces_the_ops(cpu_ops):
    """aot_eager: Dynamo's graph holds kernel_api's attention op (the mask function gives it
    plain causal attention) and, by default, torch's norm, SwiGLU and RoPE math for Inductor to
    fuse; with ``compile_lowering="kernel_api"`` the norm and SwiGLU ops too. The numbers stay
    eager's, forward and backward."""
    import torch._dynamo
    eager = small_model("llama").eval()
    model = small_model("llama").eval()
    ids = _ids(seed=8)
    with torch.no_grad():
        want = eager(input_ids=ids).logits
    want_loss = eager.train()(input_ids=ids, labels=ids).loss
    _quiet_patch(model, kinds=CPU_KINDS)
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.debugging import aot_eager
        return aot_eager(gm, example_inputs)

    def targets():
        found = {str(n.target) for gm in graphs for n in gm.graph.nodes}
        graphs.clear()
        return {t for t in found if t.startswith("kernel_api.")}

    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).logits, want, **TOL)
    assert targets() == {"kernel_api.attention.default"}
    set_compile_lowering(model, "kernel_api")
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).logits, want, **TOL)
    assert targets() == {"kernel_api.attention.default", "kernel_api.rms_norm.default",
                         "kernel_api.gated_activation.default"}
    model.train()
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert all(p.grad is not None for p in model.parameters())
    torch._dynamo.reset()
    unpatch(model)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_compiled_prefill_without_a_cache_runs_kernel_api_attention(cpu_ops, family):
    """With no cache, no mask and no position ids, the base model's own positions reach no
    packed-sequence check: the compiled graph runs kernel_api's causal attention where the
    unpatched model's runs SDPA with a dense mask. Position ids the caller passes (two
    sequences packed in each row) keep their mask, and the logits stay eager's."""
    import torch._dynamo
    eager = small_model(family).eval()
    model = small_model(family).eval()
    ids = _ids(seq=12, seed=9)
    packed = torch.tensor([list(range(5)) + list(range(7))] * 2)
    with torch.no_grad():
        want = eager(input_ids=ids, use_cache=False).logits
        want_packed = eager(input_ids=ids, position_ids=packed, use_cache=False).logits
    _quiet_patch(model, kinds=CPU_KINDS)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.debugging import aot_eager
        return aot_eager(gm, example_inputs)

    def targets():
        found = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
        graphs.clear()
        return found

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids, use_cache=False).logits, want, **TOL)
        found = targets()
        assert found.count("kernel_api.attention.default") == 2 and not any("scaled_dot" in t for t in found)
        torch.testing.assert_close(compiled(input_ids=ids, position_ids=packed, use_cache=False).logits,
                                   want_packed, **TOL)
        assert any("scaled_dot" in t for t in targets())  # the packed rows' mask, through SDPA
    torch._dynamo.reset()
    assert "forward" in vars(model.model)
    unpatch(model)
    assert "forward" not in vars(model.model)
    assert getattr(modeling_module(model), "create_causal_mask").__module__ == "transformers.masking_utils"


def test_the_forward_behind_a_patched_layer_follows_a_replaced_class_forward(monkeypatch):
    """A patched layer reaches its original class's forward as ``super()`` would: one replaced on
    that class after patching (as other kernel libraries patch transformers' classes) is the one
    that runs."""
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    layer = patch(torch.nn.Sequential(LlamaRMSNorm(8)))[0]
    assert type(layer) is not LlamaRMSNorm and isinstance(layer, LlamaRMSNorm)
    x = torch.randn(3, 8, dtype=torch.float64)  # (another dtype than the weight's: the forward behind runs)
    monkeypatch.setattr(LlamaRMSNorm, "forward", lambda self, h: h * 2)
    torch.testing.assert_close(layer(x), x * 2)
