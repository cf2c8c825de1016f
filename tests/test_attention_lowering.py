"""Attention under torch.compile: torch's cuDNN op itself where the policy runs torch's cuDNN kernel
for the problem (`kernel_api.nn.attention_lowering`), kernel_api's ops otherwise. On the CPU: the rule on
fake CUDA tensors, and the graphs a patched GPT-2's prefill and training step trace. The GPU
check (the kernels that run, the gradients) is in tests/test_compile_patched_gpu.py."""

import copy
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

import kernel_api.registry
from kernel_api.core import tracing
from kernel_api.nn import attention as nn_attention, patch
from kernel_api.nn.attention_lowering import cudnn_serves
from kernel_api.ops import dispatch

_BF16 = torch.bfloat16


@pytest.mark.parametrize("sizes, causal, expected", [
    ((8, 1024, 1024, 12, 12, 64), True, True),      # GPT-2's training attention
    ((4, 2048, 2048, 32, 8, 128), True, True),      # a Llama-3-8B layer's (GQA)
    ((2, 100, 300, 4, 4, 64), False, True),         # full attention over more keys
    ((2, 100, 300, 4, 4, 64), True, False),         # causal over unequal lengths: not cuDNN's mask
    ((2, 128, 128, 4, 4, 256), True, False),        # head dim past cuDNN's 128
    ((2, 128, 128, 4, 4, 60), True, False),         # head dim not a multiple of 8
])
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_cudnn_serves_dense_attention_that_cudnn_takes(sizes, causal, expected, training):
    assert cudnn_serves(_BF16, *sizes, causal, training, 90) is expected


def test_another_providers_kernel_keeps_the_ops(monkeypatch):
    """A kernel of another provider (a plugin's FlashAttention, say) for the forward or the
    backward whose rank cannot be told: the policy chooses per call, so the ops stay."""
    real = kernel_api.registry.get_kernels
    for kind in ("forward", "backward"):
        def get_kernels(args, *rest, kind=kind, **named):
            found = real(args, *rest, **named)
            if ("Backward" in type(args).__name__) == (kind == "backward"):
                plugin = SimpleNamespace(metadata=SimpleNamespace(provider="flash_attn", design=None))
                found = [*found, plugin]
            return found
        monkeypatch.setattr(kernel_api.registry, "get_kernels", get_kernels)
        assert not cudnn_serves(_BF16, 8, 1024, 1024, 12, 12, 64, True, True, 90), kind
        # inference asks the forward alone
        assert cudnn_serves(_BF16, 8, 1024, 1024, 12, 12, 64, True, False, 90) is (kind == "backward")
    monkeypatch.setattr(kernel_api.registry, "get_kernels", real)
    assert cudnn_serves(_BF16, 8, 1024, 1024, 12, 12, 64, True, True, 90)


def _ranked_kernel(cost):
    """A kernel of another provider that serves every attention at ``cost`` (PickAny's units)."""
    return SimpleNamespace(metadata=SimpleNamespace(provider="plugin", design=None, kernel_name="plugin"),
                           estimated_cost=lambda args, sm_count: cost)


@pytest.mark.parametrize("speedup, lowers", [(0.5, True), (1.05, True), (1.07, True), (1.09, False), (2.0, False)])
def test_pick_any_lowers_where_cudnn_ranks_first_or_close(monkeypatch, speedup, lowers):
    """Under PickAny another provider's kernel that ranks behind torch's cuDNN kernel, or ahead by
    less than COMPILE_MIN_SPEEDUP, leaves the lowering as it is (cuDNN runs); one ranked further
    ahead keeps the ops. Under another policy any other provider's kernel keeps them."""
    from kernel_api.tuning.pick_any import PickAny

    real = kernel_api.registry.get_kernels

    def get_kernels(args, *rest, **named):
        from kernel_api.cost.estimate import estimated_cost
        best = min(estimated_cost(k, args, 132) for k in real(args, *rest, **named)
                   if getattr(k.metadata.design, "backend", None) in ("cudnn", "sdpa"))
        return [*real(args, *rest, **named), _ranked_kernel(best / speedup)]

    monkeypatch.setattr(kernel_api.registry, "get_kernels", get_kernels)
    assert cudnn_serves(_BF16, 8, 1024, 1024, 12, 12, 64, True, True, 90) is lowers
    assert cudnn_serves(_BF16, 8, 1024, 1024, 12, 12, 64, True, False, 90) is lowers

    class Timed(PickAny):  # a policy other than PickAny itself
        pass

    with kernel_api.settings(policy=Timed()):
        assert not cudnn_serves(_BF16, 8, 1024, 1024, 12, 12, 64, True, True, 90)


def test_a_kernel_ranked_exactly_the_threshold_ahead_keeps_the_ops(monkeypatch):
    """A kernel ranked exactly `COMPILE_MIN_SPEEDUP` ahead of cuDNN keeps the ops, whatever the
    rounding of its cost: 7.29 / 1.08 * 1.08 rounds above 7.29."""
    import kernel_api.cost.estimate as estimate
    import kernel_api.tuning.pick_any as pick_any
    from kernel_api.nn.attention_lowering import COMPILE_MIN_SPEEDUP

    cudnn_cost = 7.29
    assert cudnn_cost < COMPILE_MIN_SPEEDUP * (cudnn_cost / COMPILE_MIN_SPEEDUP)  # the rounding this guards
    real = kernel_api.registry.get_kernels
    plugin = _ranked_kernel(cudnn_cost / COMPILE_MIN_SPEEDUP)

    def cost(kernel, args, sm_count=None):
        return kernel.estimated_cost(args, sm_count) if kernel is plugin else cudnn_cost

    monkeypatch.setattr(kernel_api.registry, "get_kernels", lambda *a, **k: [*real(*a, **k), plugin])
    monkeypatch.setattr(estimate, "estimated_cost", cost)
    monkeypatch.setattr(pick_any, "estimated_cost", cost)
    assert not cudnn_serves(_BF16, 8, 1024, 1024, 12, 12, 64, True, False, 90)


@pytest.mark.parametrize("head_dim, causal", [(64, True), (64, False), (128, True), (128, False)])
def test_the_shipped_hopper_forward_keeps_the_ops_only_where_it_ranks_clearly_ahead(head_dim, causal):
    """kernel_api's own forward (Sm90Attention) keeps the ops in inference where it ranks at least
    `COMPILE_MIN_SPEEDUP` ahead of SDPA (its `SPEED_VS_SDPA`), and lowers elsewhere; training,
    where cuDNN's backward serves either way, lowers at the full-attention d128 problem."""
    from kernel_api.nn.attention_lowering import COMPILE_MIN_SPEEDUP
    from kernel_api.providers.cutedsl.attention.sm90_attention import SPEED_VS_SDPA

    sizes = (4, 4096, 4096, 32, 32, 128) if head_dim == 128 else (16, 1024, 1024, 16, 16, 64)
    keeps = SPEED_VS_SDPA[head_dim, causal] >= COMPILE_MIN_SPEEDUP
    assert cudnn_serves(_BF16, *sizes, causal, False, 90) is not keeps
    if (head_dim, causal) == (128, False):
        assert cudnn_serves(_BF16, *sizes, causal, True, 90)


def test_the_answers_are_kept_per_policy(monkeypatch):
    """A problem answered under PickAny answers again under another policy (which keeps the ops
    wherever another provider offers a kernel), through the rule's cache."""
    from kernel_api.nn import attention_lowering
    from kernel_api.ops import clear_dispatch_cache
    from kernel_api.tuning.pick_any import PickAny

    class Timed(PickAny):
        pass

    import kernel_api.core.arch as arch
    monkeypatch.setattr(arch, "device_cc", lambda index=None: 90)
    clear_dispatch_cache()
    sizes = (_BF16, 16, 1024, 1024, 16, 16, 64, True, False, 0)
    assert attention_lowering.lowers_to_cudnn(*sizes)
    with kernel_api.settings(policy=Timed()):
        assert not attention_lowering.lowers_to_cudnn(*sizes)
    assert attention_lowering.lowers_to_cudnn(*sizes)
    assert sorted(p.pick_any for p in attention_lowering.decisions()) == [False, True]
    clear_dispatch_cache()


def test_only_cuda_half_precision_lowers():
    from kernel_api.nn.attention_lowering import lowers_to_cudnn
    assert not lowers_to_cudnn(_BF16, 8, 1024, 1024, 12, 12, 64, True, True, -1)  # not on CUDA
    assert not lowers_to_cudnn(torch.float32, 8, 1024, 1024, 12, 12, 64, True, True, 0)


class _Captured(Exception):
    pass


@pytest.fixture
def stubbed_rule(monkeypatch):
    """The rule's answer stubbed (the models here run on the CPU), the front door launching on
    the CPU: ``stub(answer)`` installs it and returns the list of problems it is asked."""
    monkeypatch.setattr(dispatch, "LAUNCH_DEVICE_TYPES", frozenset({"cuda", "cpu"}))

    def stub(answer):
        asked = []

        @tracing.assume_constant_result
        def lowers_to_cudnn(*problem):
            asked.append(problem)
            return answer

        monkeypatch.setattr(nn_attention, "lowers_to_cudnn", lowers_to_cudnn)
        return asked

    return stub


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1001, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(2)
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


def _traced_graph(model, ids, grad: bool):
    """The graph Dynamo traces for ``model``'s forward (with labels when ``grad``), not run."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        raise _Captured

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.set_grad_enabled(grad), pytest.raises(Exception, match="_Captured"):
        compiled(input_ids=ids, labels=ids if grad else None, use_cache=False)
    return graphs[0].graph


@pytest.mark.parametrize("serves_alone", [True, False])
def test_a_patched_gpt2_s_attention_traces_cudnn_s_op_where_cudnn_serves(stubbed_rule, serves_alone):
    """The rule's answer (stubbed here: the model runs on the CPU) decides the graphs: cuDNN's
    causal op (with the log-sum-exp in training) and no kernel_api attention op, or kernel_api's
    ops."""
    asked = stubbed_rule(serves_alone)
    model = patch(_tiny_gpt2()).train()
    ids = torch.randint(0, 1001, (2, 16), generator=torch.Generator().manual_seed(4))
    counters.clear()
    targets = [str(n.target) for n in _traced_graph(model, ids, grad=True).nodes if n.op == "call_function"]
    cudnn = [t for t in targets if "_scaled_dot_product_cudnn_attention" in t]
    ours = [t for t in targets if t.startswith("kernel_api.attention")]
    if serves_alone:
        assert len(cudnn) == 2 and not ours, targets
    else:
        assert not cudnn and ours == ["kernel_api.attention_forward.default"] * 2, targets
    assert asked and asked[0] == (torch.float32, 2, 16, 16, 4, 4, 16, True, True, -1)
    eval_model = copy.deepcopy(model).eval()
    graph = _traced_graph(eval_model, ids, grad=False)
    eval_targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert asked[-1] == (torch.float32, 2, 16, 16, 4, 4, 16, True, False, -1)
    if serves_alone:
        calls = [n for n in graph.nodes if "_scaled_dot_product_cudnn_attention" in str(n.target)]
        assert len(calls) == 2 and not any(t.startswith("kernel_api.attention") for t in eval_targets)
        assert all(n.args[4] is False and n.args[6] is True for n in calls)  # no log-sum-exp; causal
    else:
        assert eval_targets.count("kernel_api.attention.default") == 2, eval_targets
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


def test_decisions_record_each_problem_once(monkeypatch):
    from kernel_api.nn import attention_lowering
    asked = []

    def decide(*problem):
        asked.append(problem)
        return True

    from kernel_api.ops import clear_dispatch_cache
    monkeypatch.setattr(attention_lowering, "_decide", decide)
    clear_dispatch_cache()
    problem = (_BF16, 2, 16, 16, 4, 4, 64, True, True, 0, 90, None, True)
    assert attention_lowering._lowers(*problem) and attention_lowering._lowers(*problem)
    assert asked == [problem] and attention_lowering.decisions() == {problem: True}
    clear_dispatch_cache()  # (with the ops' choices: a provider added since answers again)
    assert attention_lowering.decisions() == {}


@pytest.mark.parametrize("reads_gqa", [True, False])
def test_gqa_lowers_only_where_cudnn_reads_it_in_place(monkeypatch, reads_gqa):
    """Grouped-query attention is cuDNN's op only where torch's cuDNN attention takes k and v
    with fewer heads (the torch provider's check); otherwise the ops stay (they repeat k and v)."""
    from kernel_api.nn import attention_lowering
    from kernel_api.providers.torch_ops import attention as torch_attention
    monkeypatch.setattr(torch_attention, "cudnn_reads_gqa", lambda device: reads_gqa)
    assert attention_lowering._decide(_BF16, 4, 256, 256, 32, 8, 128, True, True, 0, 90, None, True) is reads_gqa
    assert attention_lowering._decide(_BF16, 4, 256, 256, 32, 32, 128, True, True, 0, 90, None, True)  # not GQA


def test_dynamic_sizes_keep_kernel_api_s_op(stubbed_rule):
    """A trace whose sizes Dynamo made dynamic asks nothing (the rule takes static sizes) and
    keeps kernel_api's op, which serves any size."""
    asked = stubbed_rule(True)
    model = patch(_tiny_gpt2()).eval()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for seq in (16, 24):
            ids = torch.randint(0, 1001, (2, seq), generator=torch.Generator().manual_seed(seq))
            torch.testing.assert_close(compiled(input_ids=ids, use_cache=False).logits,
                                       model(input_ids=ids, use_cache=False).logits, rtol=1e-4, atol=1e-4)
    targets = [str(n.target) for n in graphs[-1].graph.nodes if n.op == "call_function"]
    assert not asked and targets.count("kernel_api.attention.default") == 2, targets
    torch._dynamo.reset()


def test_lowered_lists_the_problems_answered_yes(monkeypatch):
    from kernel_api.nn import attention_lowering
    from kernel_api.ops import clear_dispatch_cache
    monkeypatch.setattr(attention_lowering, "_decide", lambda *problem: problem[1] == 8)
    clear_dispatch_cache()
    attention_lowering._lowers(_BF16, 8, 1024, 1024, 12, 12, 64, True, True, 0, 90, None, True)
    attention_lowering._lowers(_BF16, 2, 100, 300, 4, 4, 64, False, False, 0, 90, None, True)
    assert attention_lowering.lowered() == ["training b8 s1024/1024 h12/12 d64 causal"]
    clear_dispatch_cache()


def test_a_pick_best_reading_records_keeps_the_ops(monkeypatch):
    """Tuning records may rank another of torch's kernels first: with a PickBest that reads them
    in force, the ops stay and the policy chooses per call."""
    from kernel_api.nn import attention_lowering, lowering
    from kernel_api.ops import clear_dispatch_cache
    monkeypatch.setattr(attention_lowering, "_decide", lambda *problem: True)
    monkeypatch.setattr("kernel_api.core.arch.device_cc", lambda index=None: 90)
    clear_dispatch_cache()
    assert attention_lowering.lowers_to_cudnn(_BF16, 8, 1024, 1024, 12, 12, 64, True, True, 0)
    monkeypatch.setattr(lowering, "_records_policy", lambda: object())
    assert not attention_lowering.lowers_to_cudnn(_BF16, 8, 1024, 1024, 12, 12, 64, True, True, 0)
    clear_dispatch_cache()
