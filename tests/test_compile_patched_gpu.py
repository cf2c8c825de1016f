"""A patched transformers GPT-2 (the small model's widths and vocabulary, two layers) under
torch.compile on the GPU, default mode and ``reduce-overhead`` (CUDA graphs): no graph breaks,
no recompiles in steady state while the decode position moves, and logits equal to the
unpatched model's in eager mode within bf16 noise; prefill and decode, the lowering rule's
choice and kernel_api's op forced everywhere (so that the op itself is captured in CUDA graphs)."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from kernel_api.nn import patch, set_compile_lowering

pytestmark = pytest.mark.gpu

REL_TOL = 2e-2  # norm-wise, bf16 against the unpatched eager model


def _rel(x, ref):
    x, ref = x.float(), ref.float()
    return ((x - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(device="cuda", dtype=torch.bfloat16).eval()
    model.loss_type = "ForCausalLM"  # (unset, transformers logs a warning in forward: a graph break of its own)
    return model


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.config.error_on_recompile = False
    torch._dynamo.reset()


def _decode(compiled, ref_model, steps=6, batch=4, prompt=16):
    """Decode ``steps`` tokens through ``compiled`` and the eager reference from one prompt, the
    compiled model on a fresh copy of the reference's cache each step (under reduce-overhead a
    cache holding a replay's outputs would be overwritten by the next replay); after two steps
    (the first compile and the retrace with a dynamic cache length) a recompile raises."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ref_model.config.vocab_size, (batch, prompt), generator=g).cuda()
    with torch.no_grad():
        ref_cache = ref_model(input_ids=ids, use_cache=True).past_key_values
        for step in range(steps):
            if step == 2:
                torch._dynamo.config.error_on_recompile = True
            new = torch.randint(0, ref_model.config.vocab_size, (batch, 1), generator=g).cuda()
            cache = copy.deepcopy(ref_cache)
            torch.compiler.cudagraph_mark_step_begin()
            logits = compiled(input_ids=new, past_key_values=cache, use_cache=True).logits.clone()
            ref = ref_model(input_ids=new, past_key_values=ref_cache, use_cache=True).logits
            assert _rel(logits, ref) <= REL_TOL, (step, _rel(logits, ref))
    torch._dynamo.config.error_on_recompile = False


def _prefill(compiled, ref_model, batch=2, seq=512):
    """Prefill at a static shape of 1024 rows (where a layer forced to kernel_api's op takes it, the
    vocabulary projection's misaligned 50257-column rows split and padded); three calls, one
    compile."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for step in range(3):
            if step == 1:
                torch._dynamo.config.error_on_recompile = True
            ids = torch.randint(0, ref_model.config.vocab_size, (batch, seq), generator=g).cuda()
            torch.compiler.cudagraph_mark_step_begin()
            logits = compiled(input_ids=ids, use_cache=False).logits.clone()
            ref = ref_model(input_ids=ids, use_cache=False).logits
            assert _rel(logits, ref) <= REL_TOL, (step, _rel(logits, ref))
    torch._dynamo.config.error_on_recompile = False


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_patched_gpt2_decode_and_prefill_compiled(gpt2, mode):
    """The lowering rule's choice without tuning records: aten in the default mode; under
    reduce-overhead aten in decode but for the lm_head (rows of 50257 columns, which cuBLAS
    cannot vectorise), and kernel_api's op in the 1024-row prefill."""
    _compiled_decode_and_prefill(gpt2, mode, "auto")


def _compiled_decode_and_prefill(gpt2, mode, lowering):
    model = patch(copy.deepcopy(gpt2))
    set_compile_lowering(model, lowering)
    compiled = torch.compile(model, mode=mode)
    _decode(compiled, gpt2)
    torch._dynamo.reset()
    compiled = torch.compile(model, mode=mode)
    _prefill(compiled, gpt2)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_patched_gpt2_training_step_compiled(gpt2):
    """Forward, loss and backward through the compiled patched model: no graph breaks, no
    recompile at the second step, and the loss and gradients as close to a float32 eager
    reference as the unpatched bf16 eager model's are (bf16 noise: twice its error, at least 2e-2)."""
    ref_model = copy.deepcopy(gpt2).train()
    f32_model = copy.deepcopy(gpt2).float().train()
    model = patch(copy.deepcopy(gpt2)).train()
    compiled = torch.compile(model)
    ids = torch.randint(0, gpt2.config.vocab_size, (2, 512), generator=torch.Generator().manual_seed(3)).cuda()
    f32_loss = f32_model(input_ids=ids, labels=ids).loss
    f32_loss.backward()
    exact = dict(f32_model.named_parameters())
    for step in range(2):
        if step == 1:
            torch._dynamo.config.error_on_recompile = True
        model.zero_grad(set_to_none=True)
        ref_model.zero_grad(set_to_none=True)
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_loss = ref_model(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        noise = abs(ref_loss.item() - f32_loss.item())
        assert abs(loss.item() - f32_loss.item()) <= max(2 * noise, 2e-2 * abs(f32_loss.item())), (
            loss.item(), ref_loss.item(), f32_loss.item())
        ref_grads = dict(ref_model.named_parameters())
        off = []
        for name, p in model.named_parameters():
            bound = max(2 * _rel(ref_grads[name].grad, exact[name].grad), 2e-2)
            if not _rel(p.grad, exact[name].grad) <= bound:
                off.append((name, round(_rel(p.grad, exact[name].grad), 4), round(bound, 4)))
        assert not off, (step, off)
    torch._dynamo.config.error_on_recompile = False
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_prefill_and_training_run_cudnn_s_causal_attention_with_no_kernel_api_attention_op(gpt2, mode):
    """Attention that only torch's kernels serve is torch's cuDNN op in the compiled graphs
    (kernel_api.nn.attention_lowering): cuDNN's forward runs in a prefill, its forward and
    backward in a training step, and kernel_api's attention ops do not."""
    from kernel_api.nn.attention_lowering import lowers_to_cudnn
    device = torch.cuda.current_device()
    if not (lowers_to_cudnn(torch.bfloat16, 2, 512, 512, 12, 12, 64, True, True, device)
            and lowers_to_cudnn(torch.bfloat16, 2, 512, 512, 12, 12, 64, True, False, device)):
        pytest.skip("another provider's kernel serves this attention (a plugin installed): the ops stay")
    model = patch(copy.deepcopy(gpt2))
    compiled = torch.compile(model, mode=mode)
    ids = torch.randint(0, gpt2.config.vocab_size, (2, 512), generator=torch.Generator().manual_seed(5)).cuda()

    def ran(step):
        step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
            torch.cuda.synchronize()
        return [e.key for e in prof.key_averages()]

    def prefill():
        with torch.no_grad():
            torch.compiler.cudagraph_mark_step_begin()
            compiled(input_ids=ids, use_cache=False)

    model.eval()
    names = ran(prefill)
    assert not [n for n in names if n.startswith("kernel_api::attention")], names
    if mode is None:  # (under CUDA graphs the replay runs no aten op on the host)
        assert "aten::_scaled_dot_product_cudnn_attention" in names, names
    _prefill(compiled, gpt2)  # the logits against the eager model's
    if mode is None:
        model.train()
        names = ran(lambda: compiled(input_ids=ids, labels=ids).loss.backward())
        assert not [n for n in names if n.startswith("kernel_api::attention")], names
        assert "aten::_scaled_dot_product_cudnn_attention" in names and "aten::_cudnn_attention_backward" in names
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_kernel_api_op_everywhere_is_captured_in_cuda_graphs(gpt2):
    """Every projection forced to kernel_api's op under reduce-overhead: the op runs inside the
    CUDA graphs (decode and prefill) and the logits stay right."""
    _compiled_decode_and_prefill(gpt2, "reduce-overhead", "kernel_api")


class _Graphs:
    """An aot_eager backend that keeps the call targets of each graph Dynamo hands it."""

    def __init__(self):
        self.targets = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager
        self.targets.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return aot_eager(gm, example_inputs)


@pytest.mark.parametrize("rows, training, fused", [(1024, False, True), (1023, False, False), (1024, True, False)])
def test_a_gelu_projection_lowers_to_cublaslt_s_fused_epilogue_at_prefill_rows(rows, training, fused):
    """Lowered to aten (the default mode's rule), a bias-and-tanh-GELU projection of at least
    COMPILE_MIN_ROWS rows outside autograd is one ``aten._addmm_activation`` (cuBLASLt's fused
    epilogue) in the graph, equal to the float64 reference within bf16 noise; fewer rows or
    autograd keep ``addmm`` and a separate GELU for Inductor to fuse."""
    torch.manual_seed(4)
    dense = torch.nn.Sequential(torch.nn.Linear(768, 3072), torch.nn.GELU(approximate="tanh"))
    dense = dense.to(device="cuda", dtype=torch.bfloat16)
    model = patch(copy.deepcopy(dense))
    x = torch.randn(rows, 768, device="cuda", dtype=torch.bfloat16, requires_grad=training)
    graphs = _Graphs()
    with torch.set_grad_enabled(training):
        y = torch.compile(model, backend=graphs, fullgraph=True)(x)
    targets = graphs.targets[-1]
    assert any("_addmm_activation" in t for t in targets) == fused, targets
    w, b = dense[0].weight.double(), dense[0].bias.double()
    ref = torch.nn.functional.gelu(x.double() @ w.t() + b, approximate="tanh")
    assert _rel(y.detach(), ref) <= 1e-2, _rel(y.detach(), ref)
    if training:
        y.float().sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
