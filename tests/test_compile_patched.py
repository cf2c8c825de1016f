"""Patched models under torch.compile, on the CPU: no graph breaks and no recompiles in steady
state while the decode position moves, the lowering rule (`kernel_api.nn.lowering.choose`) and
its forcing attribute, what the traced graphs hold, and outputs against the unpatched model.

The GEMM kernels are replaced by a torch stand-in (`_stand_in_gemm`) and the front door
launches on the CPU (`dispatch.LAUNCH_DEVICE_TYPES`); Dynamo traces with ``aot_eager``, so
AOTAutograd and the fake implementations run as under Inductor. The GPU checks are in
tests/test_compile_patched_gpu.py."""

import copy
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from kernel_api.nn import Linear, lowering, patch, set_compile_lowering, unpatch
from kernel_api.nn.patching import DEFAULT_KINDS
from kernel_api.ops import dispatch

_ACTIVATIONS = {"relu": F.relu, "gelu": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}
_GEMM_EAGER = dispatch._gemm_eager  # the front door's own, for the layout test


def _stand_in_gemm(A, B, out, alpha, beta, C, bias, activation, accumulator_type, stream):
    z = alpha * (A @ B)
    if C is not None and beta != 0:
        z = z + beta * C
    if bias is not None:
        z = z + bias
    if activation is not None:
        z = _ACTIVATIONS[activation](z)
    return z if out is None else out.copy_(z)


@pytest.fixture(autouse=True)
def _cpu_front_door(monkeypatch):
    monkeypatch.setattr(dispatch, "LAUNCH_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(dispatch, "_gemm_eager", _stand_in_gemm)
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class _Recorder:
    """An aot_eager backend that keeps each graph Dynamo hands it (one per compile)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager
        self.graphs.append(gm)
        return aot_eager(gm, example_inputs)

    def targets(self, index=-1):
        return [str(n.target) for n in self.graphs[index].graph.nodes if n.op == "call_function"]


def _gemm_nodes(targets):
    return sum("kernel_api.gemm" in t for t in targets)


def _aten_projections(targets):
    return sum(("linear" in t or "addmm" in t or "matmul" in t) for t in targets)


# ---- the rule ------------------------------------------------------------------------------
def test_aten_lowering_fuses_relu_and_tanh_gelu_with_a_bias_at_prefill_rows_of_half_precision_outside_training():
    M, bf16 = lowering.COMPILE_MIN_ROWS, torch.bfloat16

    def fuses(activation, has_bias, rows, dtype, on_cuda, training, bias_dtype=None, autocast=False):
        x = torch.empty(2, 8, dtype=dtype, device="meta")
        weight = torch.empty(8, 4, dtype=dtype, device="meta")
        bias = torch.empty(4, dtype=bias_dtype or dtype, device="meta") if has_bias else None
        with mock.patch.object(torch, "is_autocast_enabled", lambda device=None: autocast):
            return lowering.aten_fuses_activation(activation, rows, on_cuda, training, x, weight, bias)

    assert fuses("gelu", True, M, bf16, True, False)
    assert fuses("relu", True, 8192, torch.float16, True, False)
    assert not fuses("silu", True, M, bf16, True, False)        # (cuBLASLt has no SiLU epilogue)
    assert not fuses(None, True, M, bf16, True, False)
    assert not fuses("gelu", False, M, bf16, True, False)       # no bias
    assert not fuses("gelu", True, M - 1, bf16, True, False)    # decode-sized: Inductor's to fuse
    assert not fuses("gelu", True, None, bf16, True, False)     # dynamic rows
    assert not fuses("gelu", True, M, torch.float32, True, False)
    assert not fuses("gelu", True, M, bf16, True, False, bias_dtype=torch.float32)  # mixed dtypes
    assert not fuses("gelu", True, M, bf16, True, False, autocast=True)  # autocast's to choose
    assert not fuses("gelu", True, M, bf16, False, False)       # not CUDA
    assert not fuses("gelu", True, M, bf16, True, True)         # autograd: no pre-activation kept


def test_under_cuda_graphs_a_decode_sized_gelu_projection_lowers_to_cublaslt_s_epilogue(monkeypatch):
    """In a graph replayed as CUDA graphs the separate GELU kernel is GPU time a layer, and
    cuBLASLt's host time is not paid per call: decode-sized rows fuse too (static rows only)."""
    x = torch.empty(64, 8, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(8, 4, dtype=torch.bfloat16, device="meta")
    bias = torch.empty(4, dtype=torch.bfloat16, device="meta")
    assert not lowering.aten_fuses_activation("gelu", 64, True, False, x, weight, bias)
    monkeypatch.setattr(lowering, "_trace_context", lambda: (True, True))
    assert lowering.aten_fuses_activation("gelu", 64, True, False, x, weight, bias)
    assert lowering.aten_fuses_activation("relu", 1, True, False, x, weight, bias)
    assert not lowering.aten_fuses_activation("gelu", None, True, False, x, weight, bias)  # dynamic rows
    assert not lowering.aten_fuses_activation("gelu", 64, True, True, x, weight, bias)     # autograd


def test_rule_forced_dynamic_small_large_and_training():
    bf16 = torch.bfloat16
    choose = lowering.choose
    # forced either way, whatever the shapes
    assert choose("aten", 8192, 768, 50257, bf16, None, False, False, 0) == "aten"
    assert choose("kernel_api", None, 768, 768, bf16, "gelu", True, True, 0) == "kernel_api"
    # M dynamic: aten; decode-sized M: aten, the vocabulary projection included
    assert choose("auto", None, 768, 50257, bf16, None, False, False, 0) == "aten"
    assert choose("auto", 64, 768, 50257, bf16, None, False, False, 0) == "aten"
    # prefill-sized M without records: aten too (kept as the op, GPT-2's compiled prefill ran 0.43x)
    M = lowering.COMPILE_MIN_ROWS
    assert choose("auto", M, 768, 50257, bf16, None, False, False, 0) == "aten"
    assert choose("auto", 8192, 768, 3072, bf16, "gelu", True, False, 0) == "aten"
    assert choose("auto", 8192, 768, 37, torch.float32, None, False, False, -1) == "aten"
    # training graphs: aten (the backward stays Inductor's)
    assert choose("auto", 8192, 768, 50257, bf16, None, False, True, 0) == "aten"
    with pytest.raises(ValueError, match="compile_lowering"):
        choose("fast", 8, 8, 8, bf16, None, False, False, 0)


def test_rule_follows_pick_best_records(monkeypatch, tmp_path):
    """A PickBest in force whose records hold the problem decides: a winner of another provider
    than torch's keeps kernel_api's op (a decode shape here), torch's winner gives aten (the
    vocabulary projection here); a problem without records takes aten."""
    import kernel_api
    from kernel_api.ops import gemm_arguments
    from kernel_api.registry import get_kernels
    from kernel_api.tuning.policies import PickBest
    from kernel_api.tuning.records import TuningRecords, record_key

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Test GPU")
    import kernel_api.core.arch as arch
    monkeypatch.setattr(arch, "device_cc", lambda index=None: 90)
    records = TuningRecords(tmp_path / "records.db")
    policy = PickBest(records=records)
    bf16 = torch.bfloat16

    def record(rows, K, N, bias, activation, provider):
        A = torch.empty(rows, K, dtype=bf16, device="meta")
        B = torch.empty(N, K, dtype=bf16, device="meta").t()
        b = torch.empty(N, dtype=bf16, device="meta") if bias else None
        for args in gemm_arguments(A, B, bias=b, activation=activation):
            candidates = get_kernels(args, cc=90)
            winner = next((k for k in candidates if (k.metadata.provider == "torch") == (provider == "torch")), None)
            if winner is None:
                pytest.skip(f"no {provider} kernel takes {args.problem_shape} on this machine")
            problem = lowering._Problem(args.signature[:-1] + (0,), args.problem_shape)
            key = record_key(problem, policy.record_context(args, candidates))
            records.record("Test GPU", 90, key.operation, key.shape, winner.metadata.kernel_name, 0.01, {}, {})

    with kernel_api.settings(policy=policy):
        assert lowering.choose("auto", 64, 256, 512, bf16, None, True, False, 0) == "aten"
        record(64, 256, 512, True, None, "kernel_api")
        assert lowering.choose("auto", 64, 256, 512, bf16, None, True, False, 0) == "kernel_api"
        assert lowering.choose("auto", 64, 256, 512, bf16, None, True, False, -1) == "aten"  # not a GPU
        assert lowering.choose("auto", 2048, 256, 1001, bf16, None, False, False, 0) == "aten"
        record(2048, 256, 1001, False, None, "kernel_api")
        assert lowering.choose("auto", 2048, 256, 1001, bf16, None, False, False, 0) == "kernel_api"
        record(2048, 256, 1001, False, None, "torch")  # a newer record: torch's kernel won
        assert lowering.choose("auto", 2048, 256, 1001, bf16, None, False, False, 0) == "aten"
    # another policy: the records are not read
    assert lowering.choose("auto", 64, 256, 512, bf16, None, True, False, 0) == "aten"


# ---- what the graphs hold -----------------------------------------------------------------
def test_auto_lowers_to_aten_forced_keeps_the_op_and_dynamic_m_takes_aten():
    torch.manual_seed(0)
    layer = Linear(24, 37, device="cpu")
    ref = torch.nn.Linear(24, 37)
    ref.load_state_dict(layer.state_dict())
    backend = _Recorder()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    with torch.no_grad():
        for rows, forced, ops in ((8, "auto", "aten"), (lowering.COMPILE_MIN_ROWS, "auto", "aten"),
                                  (lowering.COMPILE_MIN_ROWS, "kernel_api", "kernel_api")):
            layer.compile_lowering = forced
            torch._dynamo.reset()
            x = torch.randn(rows, 24)
            torch._dynamo.mark_static(x, 0)
            y = compiled(x)
            targets = backend.targets()
            if ops == "aten":
                assert _gemm_nodes(targets) == 0 and _aten_projections(targets) == 1, targets
            else:
                assert _gemm_nodes(targets) == 1 and _aten_projections(targets) == 0, targets
            torch.testing.assert_close(y, ref(x), rtol=1e-5, atol=1e-5)
        layer.compile_lowering = "auto"
        torch._dynamo.reset()
        backend.graphs.clear()
        x = torch.randn(2048, 24)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), ref(x), rtol=1e-5, atol=1e-5)
        assert _gemm_nodes(backend.targets()) == 0


class _GraphsRecorder(_Recorder):
    """A `_Recorder` whose configuration says its graphs are replayed as CUDA graphs, as
    Inductor's says under ``mode="reduce-overhead"``."""

    def get_compiler_config(self):
        return {"triton.cudagraphs": True}


def test_under_cuda_graphs_auto_keeps_the_op_from_prefill_rows_outside_training():
    """A graph replayed as CUDA graphs pays no host time per op: from `COMPILE_MIN_ROWS` rows,
    outside autograd, the rule keeps kernel_api's op; fewer rows (output rows cuBLAS vectorises),
    autograd, or a compiler without CUDA graphs lower to aten."""
    torch.manual_seed(0)
    layer = Linear(24, 40, device="cpu")
    ref = torch.nn.Linear(24, 40)
    ref.load_state_dict(layer.state_dict())
    M = lowering.COMPILE_MIN_ROWS
    for backend, rows, grad, kept in ((_GraphsRecorder(), M, False, True), (_GraphsRecorder(), M - 1, False, False),
                                      (_GraphsRecorder(), M, True, False), (_Recorder(), M, False, False)):
        torch._dynamo.reset()
        x = torch.randn(rows, 24)
        torch._dynamo.mark_static(x, 0)
        with torch.set_grad_enabled(grad):
            y = torch.compile(layer, backend=backend, fullgraph=True)(x)
        targets = backend.targets()
        assert (_gemm_nodes(targets), _aten_projections(targets)) == ((1, 0) if kept else (0, 1)), (rows, grad, targets)
        torch.testing.assert_close(y, ref(x), rtol=1e-5, atol=1e-5)
    assert not lowering.tracing.graph_uses_cuda_graphs()  # (outside a trace)


@pytest.mark.parametrize("dtype,N,kept", [(torch.bfloat16, 50257, True), (torch.bfloat16, 37, True),
                                          (torch.bfloat16, 48, False), (torch.float32, 36, False),
                                          (torch.float32, 37, True)])
def test_under_cuda_graphs_a_projection_with_misaligned_output_rows_keeps_the_op_at_any_rows(dtype, N, kept):
    """Output rows of N elements that do not start on 16 bytes make cuBLAS run element-wise
    kernels (GPT-2's lm_head, N = 50257: 154 against kernel_api's 37 us at 64 rows on an H200):
    in a graph replayed as CUDA graphs, outside autograd, such a projection keeps kernel_api's op
    at decode rows too; without CUDA graphs, or in training, it lowers to aten."""
    assert lowering.columns_aligned(N, dtype) is not kept
    assert lowering.choose("auto", 64, 768, N, dtype, None, False, False, 0) == "aten"  # (no trace: no CUDA graphs)
    torch.manual_seed(0)
    layer = Linear(16, N, device="cpu", dtype=dtype)
    for backend, grad, expect in ((_GraphsRecorder(), False, kept), (_GraphsRecorder(), True, False),
                                  (_Recorder(), False, False)):
        torch._dynamo.reset()
        x = torch.randn(64, 16, dtype=dtype)
        torch._dynamo.mark_static(x, 0)
        with torch.set_grad_enabled(grad):
            y = torch.compile(layer, backend=backend, fullgraph=True)(x)
        targets = backend.targets()
        assert (_gemm_nodes(targets), _aten_projections(targets)) == ((1, 0) if expect else (0, 1)), (grad, targets)
        torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=2e-2, atol=2e-2)


def test_forcing_per_layer_and_per_class_retraces_and_keeps_values():
    """compile_lowering is read while tracing and guarded: changing it on the instance or on the
    class retraces, and each graph holds the forced form."""
    torch.manual_seed(1)
    layer = Linear(16, 32, activation="gelu")
    backend = _Recorder()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    x = torch.randn(4, 3, 16)
    with torch.no_grad():
        ref = F.gelu(F.linear(x, layer.weight, layer.bias), approximate="tanh")
        torch.testing.assert_close(compiled(x), ref)
        assert _gemm_nodes(backend.targets()) == 0
        layer.compile_lowering = "kernel_api"
        torch.testing.assert_close(compiled(x), ref)
        assert len(backend.graphs) == 2 and _gemm_nodes(backend.targets()) == 1
        del layer.compile_lowering  # back to the class's "auto": the first graph, or a new one like it
        compiled(x)
        assert len(backend.graphs) == 2 or _gemm_nodes(backend.targets()) == 0
        try:
            Linear.compile_lowering = "kernel_api"
            torch.testing.assert_close(compiled(x), ref)
            assert _gemm_nodes(backend.targets()) == 1
        finally:
            Linear.compile_lowering = "auto"
    with pytest.raises(ValueError, match="compile_lowering"):
        set_compile_lowering(layer, "cublas")


def test_set_compile_lowering_reaches_every_layer_that_declares_it():
    """Modules whose class declares compile_lowering (kernel_api layers) get it; `keeps_op` is
    True only when forced to kernel_api's op."""
    class Norm(torch.nn.LayerNorm):
        compile_lowering = "auto"

    model = torch.nn.Sequential(Linear(4, 4), Norm(4), torch.nn.Linear(4, 4))
    assert not lowering.keeps_op(model[1])
    set_compile_lowering(model, "kernel_api")
    assert model[0].compile_lowering == "kernel_api" and lowering.keeps_op(model[1])
    assert "compile_lowering" not in vars(model[2]) and not lowering.keeps_op(model[2])
    assert Norm.compile_lowering == "auto"  # set on the instances


# ---- the op's fake implementation -----------------------------------------------------------
def _launch_with_torch(args, stream=None, fast_key=None, tensors=(), tag=0, new_output=False, maker=None):
    """A `dispatch._launch` stand-in: the GemmArguments' GEMM with torch, into ``args.out``."""
    ep = args.epilogue
    z = args.A @ args.B
    if ep is not None:
        z = ep.alpha * z
        if ep.bias is not None:
            z = z + (ep.bias if ep.bias_kind == "row" else ep.bias.reshape(-1, 1))
        if ep.activation is not None:
            z = _ACTIVATIONS[ep.activation](z)
    args.out.copy_(z)


@pytest.mark.parametrize("M,K,N,dtype", [(8, 24, 37, torch.float32), (256, 24, 37, torch.float32),
                                         (300, 64, 1037, torch.float32), (5, 16, 40, torch.float64),
                                         (257, 32, 2047, torch.bfloat16)])
def test_the_ops_fake_gives_the_implementations_shape_and_strides(monkeypatch, M, K, N, dtype):
    """What Inductor allocates around the op and asserts after it: the fake implementation's
    shape and strides equal the implementation's (padded rows where the misaligned columns are
    split off), with and without bias and activation; compiled, the layer returns that layout."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    monkeypatch.setattr(dispatch, "_gemm_eager", _GEMM_EAGER)
    monkeypatch.setattr(dispatch, "_launch", _launch_with_torch)
    g = torch.Generator().manual_seed(5)
    A = torch.randn(M, K, generator=g).to(dtype)
    W = torch.randn(N, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    for b, act in ((None, None), (bias, "relu")):
        real = torch.ops.kernel_api.gemm(A, W.t(), None, b, 1.0, 0.0, act)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = torch.ops.kernel_api.gemm(mode.from_tensor(A), mode.from_tensor(W).t(), None,
                                             None if b is None else mode.from_tensor(b), 1.0, 0.0, act)
        assert fake.shape == real.shape and fake.stride() == real.stride(), (real.stride(), fake.stride())
        ref = A.double() @ W.double().t() + (0 if b is None else b.double())
        ref = ref if act is None else F.relu(ref)
        torch.testing.assert_close(real.double(), ref, rtol=2e-2, atol=2e-2)
    layer = Linear(K, N, dtype=dtype)
    layer.compile_lowering = "kernel_api"
    with torch.no_grad():
        y = torch.compile(layer, backend="aot_eager", fullgraph=True)(A)
        assert y.stride() == real.stride()


# ---- a transformers GPT-2, decoding ---------------------------------------------------------
def _tiny_gpt2(layers=2):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=1001, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0)
    torch.manual_seed(2)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.loss_type = "ForCausalLM"  # (unset, transformers logs a warning in forward: a graph break of its own)
    return model


@pytest.mark.parametrize("forced", ["auto", "kernel_api"])
def test_gpt2_decode_has_no_graph_breaks_nor_recompiles_in_steady_state(forced):
    """Decoding with a growing KV cache: Dynamo compiles the first step, once more when the
    cache length turns dynamic, then nothing; no graph breaks; every projection is patched and
    the logits equal the unpatched model's."""
    ref_model = _tiny_gpt2()
    model = patch(copy.deepcopy(ref_model))
    set_compile_lowering(model, forced)
    backend = _Recorder()
    compiled = torch.compile(model, backend=backend)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 1001, (2, 8), generator=g)
    with torch.no_grad():
        cache = ref_model(input_ids=prompt, use_cache=True).past_key_values
        ref_cache = copy.deepcopy(cache)
        frames = []
        for step in range(6):
            ids = torch.randint(0, 1001, (2, 1), generator=g)
            logits = compiled(input_ids=ids, past_key_values=cache, use_cache=True).logits
            ref = ref_model(input_ids=ids, past_key_values=ref_cache, use_cache=True).logits
            torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
            frames.append(len(backend.graphs))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert frames[2:] == [frames[1]] * 4 and frames[1] <= 2, frames  # steady after the dynamic retrace
    assert not any("kernel_api.attention" in t for t in backend.targets())  # one query: SDPA, for Inductor
    gemms = _gemm_nodes(backend.targets())
    if forced == "kernel_api":
        assert gemms == 2 * 4 + 1  # every projection, the lm_head too
    else:
        assert gemms == 0 and _aten_projections(backend.targets()) == 2 * 4 + 1


def _sdpa_masks(graph) -> list:
    """The attn_mask argument of each SDPA call in an FX graph (None where none is passed)."""
    masks = []
    for node in graph.graph.nodes:
        if node.op == "call_function" and "scaled_dot_product" in str(node.target):
            masks.append(node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None))
    return masks


def test_a_compiled_decode_step_builds_no_mask_for_a_query_that_sees_every_cached_key(monkeypatch):
    """A decode step with nothing padded: the patched model's mask function answers None, so the
    compiled graph's SDPA calls take no mask, and the logits are the unpatched model's. (Under
    Dynamo transformers' SDPA mask materialises one of all ones where torch's `is_exporting` reads
    True while compiling, as in torch 2.11: one more kernel a layer; the stand-in below always
    materialises.) With a padding mask, the mask is built as before."""
    from kernel_api.nn import attention as nn_attention

    ref_model = _tiny_gpt2()
    model = patch(copy.deepcopy(ref_model))
    sdpa_mask = nn_attention._transformers["sdpa_mask"]
    monkeypatch.setitem(nn_attention._transformers, "sdpa_mask",
                        lambda **kwargs: sdpa_mask(**{**kwargs, "allow_is_causal_skip": False}))
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 1001, (2, 8), generator=g)
    with torch.no_grad():
        cache = ref_model(input_ids=prompt, use_cache=True).past_key_values
    ids = torch.randint(0, 1001, (2, 1), generator=torch.Generator().manual_seed(8))
    recorder, logits = _Recorder(), {}
    for name, m in (("unpatched", ref_model), ("patched", model)):
        torch._dynamo.reset()
        with torch.no_grad():
            logits[name] = torch.compile(m, backend=recorder)(input_ids=ids, past_key_values=copy.deepcopy(cache),
                                                             use_cache=True).logits
    masks = _sdpa_masks(recorder.graphs[-1])  # (the patched model's graph)
    assert len(masks) == 2 and all(m is None for m in masks), masks
    torch.testing.assert_close(logits["patched"], logits["unpatched"], rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
    padded = torch.ones(2, 9, dtype=torch.long)
    padded[0, 0] = 0
    recorder = _Recorder()
    with torch.no_grad():
        torch.compile(model, backend=recorder)(input_ids=ids, past_key_values=copy.deepcopy(cache),
                                               attention_mask=padded, use_cache=True)
    assert all(m is not None for m in _sdpa_masks(recorder.graphs[-1]))


def test_the_mask_of_a_decode_step_is_none_only_where_its_query_sees_exactly_the_cached_keys(monkeypatch):
    """`mask` answers None for one query at position q_offset over q_offset + 1 keys from 0 with
    nothing padded; transformers' mask otherwise (keys beyond the query, as a static cache's empty
    slots; a padding mask; a window; a tensor offset, which is not read; two queries past a cache)."""
    from kernel_api.nn import attention as nn_attention

    pytest.importorskip("transformers")
    nn_attention.register()
    built = object()
    monkeypatch.setitem(nn_attention._transformers, "sdpa_mask", lambda **kwargs: built)
    causal = nn_attention._transformers["causal_mask_function"]
    assert nn_attention.mask(2, 1, 9, q_offset=8, kv_offset=0) is None
    assert nn_attention.mask(2, 1, 9, q_offset=8, kv_offset=0, mask_function=causal) is None
    assert nn_attention.mask(2, 1, 12, q_offset=8, kv_offset=0) is built
    assert nn_attention.mask(2, 1, 9, q_offset=8, kv_offset=0, attention_mask=torch.ones(2, 9, dtype=torch.bool)) is built
    assert nn_attention.mask(2, 1, 9, q_offset=8, kv_offset=0, mask_function=lambda b, h, q, kv: kv <= q) is built
    assert nn_attention.mask(2, 1, 9, q_offset=torch.tensor(8), kv_offset=0) is built
    assert nn_attention.mask(2, 1, 9, q_offset=7, kv_offset=1) is built
    assert nn_attention.mask(2, 2, 10, q_offset=8, kv_offset=0) is built
    assert nn_attention.mask(2, 4, 4) is None  # (an empty cache's prefill, as before)


def test_gpt2_prefill_and_training_step_match_the_unpatched_model():
    """A prefill at static shapes and one training step (forward, loss, backward) through the
    compiled patched model equal the unpatched model's, forced to kernel_api's op and by the rule."""
    ref_model = _tiny_gpt2()
    ids = torch.randint(0, 1001, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref_logits = ref_model(input_ids=ids).logits
    ref_model.train()
    ref_loss = ref_model(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref_model.named_parameters()}
    for forced in ("auto", "kernel_api"):
        model = patch(copy.deepcopy(ref_model).eval())
        model.zero_grad(set_to_none=True)
        set_compile_lowering(model, forced)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=_Recorder())
        with torch.no_grad():
            torch.testing.assert_close(compiled(input_ids=ids).logits, ref_logits, rtol=1e-4, atol=1e-4)
        model.train()
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-3, atol=1e-5, msg=name)
        assert not counters["graph_break"], dict(counters["graph_break"])


def _sdpa_calls(recorder):
    sdpa = torch._C._nn.scaled_dot_product_attention
    return [n for gm in recorder.graphs for n in gm.graph.nodes if n.op == "call_function" and n.target is sdpa]


def test_gpt2_prefill_without_a_cache_attends_causally_under_compile():
    """A prefill with no cache and no mask makes GPT-2's own position ids: compiled, the patched
    model runs kernel_api's causal attention op with no mask, where transformers' packed-sequence
    check would make a dense mask for SDPA (the unpatched model's graph); position ids the caller
    passes keep it."""
    ref_model = _tiny_gpt2()
    ids = torch.randint(0, 1001, (2, 16), generator=torch.Generator().manual_seed(6))
    packed = torch.tensor([list(range(9)) + list(range(7))] * 2)
    with torch.no_grad():
        ref = ref_model(input_ids=ids, use_cache=False).logits
        ref_packed = ref_model(input_ids=ids, position_ids=packed, use_cache=False).logits
    recorders = {}
    for name, model in (("unpatched", ref_model), ("patched", patch(copy.deepcopy(ref_model)))):
        torch._dynamo.reset()
        recorders[name] = _Recorder()
        compiled = torch.compile(model, backend=recorders[name])
        with torch.no_grad():
            for _ in range(3):  # (traced once: the calls after the first hold its guards)
                logits = compiled(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
        assert len(recorders[name].graphs) == 1, name
    unpatched = _sdpa_calls(recorders["unpatched"])
    assert len(unpatched) == 2 and not _sdpa_calls(recorders["patched"])
    assert all(n.kwargs.get("attn_mask") is not None for n in unpatched)  # transformers' packed-sequence mask
    causal = [n.args[3] for n in recorders["patched"].graphs[0].graph.nodes
              if n.op == "call_function" and str(n.target) == "kernel_api.attention.default"]
    assert causal == [True, True]
    torch._dynamo.reset()
    recorder = _Recorder()
    with torch.no_grad():
        logits = torch.compile(model, backend=recorder)(input_ids=ids, position_ids=packed, use_cache=False).logits
    torch.testing.assert_close(logits, ref_packed, rtol=1e-4, atol=1e-4)
    assert all(n.kwargs.get("attn_mask") is not None for n in _sdpa_calls(recorder))
    assert not counters["graph_break"], dict(counters["graph_break"])
    unpatch(model)
    assert "forward" not in vars(model.transformer)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_static_rows_under_dynamo(dynamic):
    """The lowering rule's rows: the product of the leading dimensions when Dynamo traces them
    static, None when dynamic (torch 2.11's Dynamo answered None for static ones too: every patched
    projection lowered to aten under torch.compile)."""
    from kernel_api.nn.lowering import static_rows

    seen = {}

    def f(x):
        seen["rows"] = static_rows(x)
        return x + 1

    torch._dynamo.reset()
    torch.compile(f, backend="eager", dynamic=dynamic, fullgraph=True)(torch.zeros(5, 7, 3))
    assert seen["rows"] == (None if dynamic else 35)
    assert static_rows(torch.zeros(5, 7, 3)) == 35 and static_rows(torch.zeros(3)) == 1


def test_the_aten_lowering_traces_the_unpatched_models_graph():
    """Lowered to aten, a patched GPT-2 (its layers; attention, which the lowering does not
    cover, left as it is) traces to the graph of the model it patched: the fused MLP activation
    runs as the model's own gelu_new (tanh and pow), not as F.gelu, whose Inductor kernel ran
    slower on the H200 (0.618 against 0.415 ms a prefill step)."""
    ref_model = _tiny_gpt2().eval()
    ids = torch.randint(0, 1001, (2, 16), generator=torch.Generator().manual_seed(5))
    graphs = {}
    layers = [kind for kind in DEFAULT_KINDS if kind != "attention"]
    for name, model in (("unpatched", ref_model), ("patched", patch(copy.deepcopy(ref_model), kinds=layers))):
        if name == "patched":
            set_compile_lowering(model, "aten")
        torch._dynamo.reset()
        backend = _Recorder()
        with torch.no_grad():
            torch.compile(model, backend=backend)(input_ids=ids)
        # (getattr nodes read attributes and compute nothing: the patched blocks read a few more)
        graphs[name] = sorted(t for g in range(len(backend.graphs)) for t in backend.targets(g)
                              if t != "<built-in function getattr>")
    assert not any("gelu" in t for t in graphs["patched"]), graphs["patched"]
    assert graphs["patched"] == graphs["unpatched"]


_HANDED: list = []


@pytest.mark.parametrize("forced", ["auto", "kernel_api"])
def test_blocks_hand_residuals_over_only_to_projections_that_keep_the_op(forced, monkeypatch):
    """Under torch.compile a block hands its residual to a projection (a module attribute set and
    cleared, which the compiled graph replays in Python after each call) only when the projection
    keeps kernel_api's op: lowered to aten, the block runs its own forward."""
    from kernel_api.nn import fusion

    handed = _HANDED
    enter = fusion.armed.__enter__

    def recording_enter(self):
        _HANDED.append(1)  # (a module global: Dynamo replays its mutation, not a closure list's)
        return enter(self)

    monkeypatch.setattr(fusion.armed, "__enter__", recording_enter)
    ref_model = _tiny_gpt2().eval()
    ids = torch.randint(0, 1001, (2, 16), generator=torch.Generator().manual_seed(6))
    model = patch(copy.deepcopy(ref_model))
    set_compile_lowering(model, forced)
    with torch.no_grad():
        ref = ref_model(input_ids=ids).logits
        handed.clear()  # (the eager reference above runs no patched block)
        logits = torch.compile(model, backend=_Recorder())(input_ids=ids).logits
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    if forced == "auto":
        assert handed == []
    else:
        assert len(handed) == 2 * 2  # each block's two branches


def _guard_lines(model, backend=None) -> int:
    """The guards Dynamo builds for a prefill of ``model`` (lines of its guard tree, from the
    ``guards`` log) compiled with ``backend`` (default `_Recorder`), or 0 when this torch logs
    them otherwise."""
    return len(_guard_tree(model, backend))


def _guard_tree(model, backend=None, inputs=None) -> list[str]:
    """The lines of the guard tree Dynamo builds for a prefill of ``model`` (`_guard_lines`), or
    for its call on ``inputs`` (keyword arguments) when given."""
    import io
    import logging

    torch._dynamo.reset()
    text = io.StringIO()
    handler = logging.StreamHandler(text)
    torch._logging.set_logs(guards=True)
    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_log.addHandler(handler)
    try:
        with torch.no_grad():
            torch.compile(model, backend=backend or _Recorder())(
                **(inputs if inputs is not None else {"input_ids": torch.randint(0, 1001, (2, 8))}))
    finally:
        dynamo_log.removeHandler(handler)
        torch._logging.set_logs()
    if "GUARDS:" not in text.getvalue():
        return []
    return [line for line in text.getvalue().split("GUARDS:")[-1].splitlines() if "+- " in line]


def test_the_blocks_declared_specs_cost_no_guards():
    """A patched block reads its `BlockSpec` through `blocks.declared`, whose answer Dynamo takes
    as a constant: no guard of the compiled model reads the table of declared specs (its fields
    were some 70 guard lines of a 2-layer GPT-2's 1390)."""
    tree = _guard_tree(patch(_tiny_gpt2(2)))
    if not tree:
        pytest.skip("this torch does not log its guards as 'GUARDS:' trees")
    assert not [line for line in tree if "_declared" in line], [line for line in tree if "_declared" in line][:3]


def test_a_patched_layer_costs_the_compiled_graph_few_guards():
    """Dynamo evaluates every guard on every call of a compiled graph: lowered to aten, each
    patched block adds at most 10 % to the guards an unpatched block has (a patched layer reads
    its compile_lowering and activation, not its shapes, epilogue operands or class's method
    order). The layers' marginal count: guards at 4 layers less those at 2."""
    counts = {}
    for layers in (2, 4):
        ref_model = _tiny_gpt2(layers)
        counts["unpatched", layers] = _guard_lines(ref_model)
        counts["patched", layers] = _guard_lines(patch(copy.deepcopy(ref_model)))
    if not all(counts.values()):
        pytest.skip("this torch does not log its guards as 'GUARDS:' trees")
    per_block = {kind: (counts[kind, 4] - counts[kind, 2]) / 2 for kind in ("unpatched", "patched")}
    assert per_block["patched"] <= 1.1 * per_block["unpatched"], (per_block, counts)


def test_a_small_call_in_a_cuda_graph_reads_no_more_of_a_patched_layer_than_without_cuda_graphs():
    """Replayed as CUDA graphs, a call of fewer than COMPILE_MIN_ROWS rows lowers to aten whatever
    the rest of its problem (no tuning records in force): its patched layers read, and Dynamo
    guards, no more than in a graph without CUDA graphs (the guards are evaluated at every replay).
    Per block: guards at 4 layers less those at 2."""
    counts = {}
    for layers in (2, 4):
        model = patch(_tiny_gpt2(layers))
        counts["plain", layers] = _guard_lines(model)
        counts["cuda graphs", layers] = _guard_lines(model, _GraphsRecorder())
    if not all(counts.values()):
        pytest.skip("this torch does not log its guards as 'GUARDS:' trees")
    per_block = {kind: (counts[kind, 4] - counts[kind, 2]) / 2 for kind in ("plain", "cuda graphs")}
    assert per_block["cuda graphs"] == per_block["plain"], (per_block, counts)



def test_a_decode_sized_projection_guards_no_dtype_or_autocast_state():
    """Outside CUDA graphs the bias-and-activation lowering needs prefill rows: a smaller call
    decides before it reads the operands' dtypes or autocast's state, so its graph guards neither
    (guards run at every call)."""
    tree = _guard_tree(patch(_tiny_gpt2(2)), _Recorder())
    if not tree:
        pytest.skip("this torch does not log its guards as 'GUARDS:' trees")
    read = [line for line in tree if "one_dtype" in line or "autocast_enabled" in line]
    assert not read, read[:3]


def test_a_traced_decode_step_s_attention_reads_nothing_but_its_query_length():
    """A traced decode step (one query) goes to SDPA before the attention function reads the
    interface's other keywords or the operands' devices: Dynamo guards what a trace reads, and
    evaluates the guards at every step."""
    ref = _tiny_gpt2(2)
    model = patch(copy.deepcopy(ref))
    with torch.no_grad():
        cache = ref(input_ids=torch.randint(0, 1001, (2, 8)), use_cache=True).past_key_values
    tree = _guard_tree(model, inputs={"input_ids": torch.randint(0, 1001, (2, 1)), "past_key_values": cache,
                                      "use_cache": True})
    if not tree:
        pytest.skip("this torch does not log its guards as 'GUARDS:' trees")
    read = [line for line in tree if "_SDPA_ONLY" in line or "ops_take" in line]
    assert not read, read[:3]
