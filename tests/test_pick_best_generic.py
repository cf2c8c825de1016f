"""PickBest on operations other than GEMM and softmax (CPU): fresh look-alike arguments for every
arguments type (`Arguments.random_like`), verification against float64 references or the torch
provider's kernel, timing, what their tuning records are keyed on, and their description to
compile workers.

PickBest runs on a pretend GPU (`CpuPickBest`: a fixed device name, CPU tensors, each candidate
timed on a simulated clock that its calls advance, `simulated_timer`, instead of CUDA events);
the front door launches on the CPU (`dispatch.LAUNCH_DEVICE_TYPES`). The toy gated-activation
kernels compute with torch, one of them slower, one of them wrong.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

import kernel_api
from kernel_api import (AttentionArguments, CompiledArtifact, CrossEntropyArguments, CrossEntropyBackwardArguments,
                        GatedActivationArguments, KernelMetadata, LinearCrossEntropyArguments, RMSNormArguments,
                        Status, TensorAttributes, ops, registry)
from kernel_api.arguments import AttentionBackwardArguments
from kernel_api.arguments.attention import lse_shape
from kernel_api.metadata.activations import GatedActivationOperandsMetadata
from kernel_api.ops import dispatch
from kernel_api.registry import versions
from kernel_api.tuning import compile_worker, policies, timing
from kernel_api.tuning import reference as references
from kernel_api.tuning.buckets import pow2_m
from kernel_api.tuning.compile_worker import arguments_from_description, describe_arguments
from kernel_api.tuning.records import RecordContext, TuningRecords, operation_key, record_key

#: Simulated ms a call of each toy kernel takes.
COST_MS = {"ToyGated_wrong": 0.5, "ToyGated_slow": 3.0, "ToyGated_fast": 1.0}
CLOCK = [0.0]  # the simulated clock, in ms: each toy kernel's call advances it by its cost


class ToyGatedProvider(kernel_api.Provider):
    name, version = "toygated", "1.0"


class ToyGated(kernel_api.Kernel):
    """SwiGLU on f32 rows with torch: ``ToyGated_fast``; ``ToyGated_slow`` (the same, 3x its
    time, `COST_MS`); ``ToyGated_wrong`` (the fastest, and 10 % off)."""

    supported_args_type = GatedActivationArguments
    runs: dict[str, int] = {}

    def compile(self, args, cc=None):
        return CompiledArtifact(self.metadata.kernel_name, self)

    def _run(self, args, artifact, stream, workspace=None):
        name = self.metadata.kernel_name
        ToyGated.runs[name] = ToyGated.runs.get(name, 0) + 1
        CLOCK[0] += COST_MS[name]
        out = F.silu(args.gate) * args.up
        args.out.copy_(out * 1.1 if name.endswith("wrong") else out)

    @classmethod
    def generate_kernels(cls, metadata_filter, epilogue_args=None, cc=None):
        attrs = TensorAttributes("f32", (0, 1), 1)
        found = []
        for variant in ("wrong", "slow", "fast"):
            md = KernelMetadata(f"ToyGated_{variant}", cls, GatedActivationOperandsMetadata(attrs, attrs, attrs,
                                                                                            activations=("silu",)))
            if metadata_filter is None or metadata_filter(md):
                found.append(cls(md))
        return found

    def _supports(self, args: GatedActivationArguments) -> Status:
        return Status.success()

    def get_workspace_size(self, args):
        return 0


def simulated_timer(runs, sets, repeat, gpu_floor_ms, settle_ms, timing):
    """`time_own_state` on the simulated clock: each run called ``repeat`` times, its median the
    clock's advance per call (a call that leaves the clock alone, a torch kernel's, costs 1)."""
    found = {}
    for key, run in runs.items():
        try:
            samples = []
            for i in range(repeat):
                start = CLOCK[0]
                run(i % sets)
                samples.append(CLOCK[0] - start or 1.0)
            found[key] = {"median_ms": sorted(samples)[len(samples) // 2]}
        except Exception as exc:  # noqa: BLE001 - a failing candidate is that candidate's result
            found[key] = exc
    return found


class CpuPickBest(policies.PickBest):
    """PickBest on a pretend GPU, its candidates compiled in this process."""

    def __init__(self, **kw):
        kw.setdefault("use_records", False)
        super().__init__(num_workers=1, repeat=5, **kw)
        self.measured = 0

    def _device(self, args):
        return "Fake GPU", 90

    def _precompile(self, args, kernels, cc):
        return {}

    def _measure(self, args, kernels):
        self.measured += 1
        return super()._measure(args, kernels)


@pytest.fixture
def cpu(monkeypatch):
    """Kernels run on CPU tensors (checks on), PickBest times on the simulated clock, ops launch
    on the CPU."""
    monkeypatch.setattr(kernel_api.kernel, "_cc_by_device", {-1: 90})
    monkeypatch.setattr(policies, "device_cc", lambda index: 90)
    monkeypatch.setattr(policies, "time_own_state", simulated_timer)
    monkeypatch.setattr(dispatch, "LAUNCH_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    ops.clear_dispatch_cache()
    versions.forget_versions()
    yield
    monkeypatch.undo()
    ops.clear_dispatch_cache()
    versions.forget_versions()


@pytest.fixture
def toy(cpu):
    ToyGatedProvider.register(ToyGated)
    ToyGated.runs = {}
    yield ToyGated
    ToyGatedProvider.unregister(ToyGated)
    registry.unregister_provider("toygated")


def swiglu(rows=64, cols=256, dtype=torch.float32):
    gate, up = torch.randn(rows, cols, dtype=dtype), torch.randn(rows, cols, dtype=dtype)
    return GatedActivationArguments(gate, up, torch.empty_like(gate))


def toy_kernels(args):
    return registry.get_kernels(args, providers=["toygated"])


def by_name(result):
    return {m.kernel_name: m for m in result.measurements}


# ---- PickBest over toy kernels of a non-GEMM operation ----------------------------------------

def test_pick_best_times_the_candidates_and_picks_the_fastest_correct_one(toy, caplog):
    args = swiglu()
    with caplog.at_level(logging.WARNING, logger="kernel_api.tuning.policies"):
        result = CpuPickBest().tune(args, toy_kernels(args))
    found = by_name(result)
    assert result.winner.metadata.kernel_name == "ToyGated_fast"
    assert (found["ToyGated_fast"].median_ms, found["ToyGated_slow"].median_ms) == (1.0, 3.0)
    assert found["ToyGated_fast"].error < 1e-5
    wrong = found["ToyGated_wrong"]
    assert wrong.median_ms is None and "wrong result: relative error" in wrong.failure
    assert "the float64 reference" in wrong.failure
    assert any("ToyGated_wrong" in r.getMessage() and "wrong result" in r.getMessage() for r in caplog.records)


def test_the_front_door_runs_what_pick_best_chose(toy):
    args = swiglu(rows=8, cols=33)
    picker = CpuPickBest()
    with kernel_api.settings(policy=picker, providers=["toygated"]):
        out = ops.call(args)
        before = dict(ToyGated.runs)
        ops.call(args)
    assert picker.measured == 1
    assert {name: n - before[name] for name, n in ToyGated.runs.items()} == {
        "ToyGated_wrong": 0, "ToyGated_slow": 0, "ToyGated_fast": 1}
    torch.testing.assert_close(out, F.silu(args.gate) * args.up)


def test_without_a_float64_reference_the_torch_providers_kernel_decides(toy, monkeypatch):
    """A type with no float64 reference is verified against the torch provider's kernel, also
    when the settings leave the torch provider out of the candidates."""
    monkeypatch.delitem(references._REFERENCES, GatedActivationArguments)
    args = swiglu(rows=16, cols=100)
    with kernel_api.settings(providers=["toygated"]):
        result = CpuPickBest().tune(args, toy_kernels(args))
    found = by_name(result)
    assert result.winner.metadata.kernel_name == "ToyGated_fast"
    assert "against the torch provider's TorchGatedActivation_f32" in found["ToyGated_wrong"].failure


def test_without_any_reference_unwritten_outputs_still_fail(toy, monkeypatch):
    """With neither a float64 reference nor a torch provider kernel, a candidate whose outputs
    are left unwritten (NaN) is excluded; the others are kept."""
    monkeypatch.delitem(references._REFERENCES, GatedActivationArguments)
    monkeypatch.setattr(policies.PickBest, "_torch_reference", lambda self, *a: None)
    monkeypatch.setattr(ToyGated, "_run", lambda self, args, artifact, stream, workspace=None:
                        None if self.metadata.kernel_name.endswith("wrong") else args.out.copy_(args.gate))
    args = swiglu(rows=4, cols=16)
    found = by_name(CpuPickBest().tune(args, toy_kernels(args)))
    assert "no reference" in found["ToyGated_wrong"].failure
    assert found["ToyGated_fast"].failure is None and found["ToyGated_slow"].failure is None


def test_a_record_is_reused_until_the_providers_version_changes(toy, tmp_path, monkeypatch):
    args = swiglu(rows=4, cols=64)
    pool = toy_kernels(args)
    picker = CpuPickBest(records=TuningRecords(tmp_path / "t.sqlite"), use_records=True)
    first = picker.tune(args, pool)
    assert not first.from_record and "toygated:1.0" in first.record.operation
    assert picker.tune(args, pool).from_record and picker.measured == 1
    monkeypatch.setattr(ToyGatedProvider, "version", "1.1")
    versions.forget_versions()  # a new process, after the upgrade
    again = picker.tune(args, pool)
    assert not again.from_record and picker.measured == 2 and "toygated:1.1" in again.record.operation
    assert again.winner.metadata.kernel_name == "ToyGated_fast"


def test_max_candidates_that_leaves_candidates_out_is_in_the_record_key(toy):
    args = swiglu(rows=4, cols=64)
    pool = toy_kernels(args)
    assert "top=" not in record_key(args, CpuPickBest().record_context(args, pool)).operation
    assert "top=3 " not in record_key(args, CpuPickBest(max_candidates=3).record_context(args, pool)).operation
    assert " top=2 " in record_key(args, CpuPickBest(max_candidates=2).record_context(args, pool)).operation
    assert "/settle=0 " not in record_key(args, CpuPickBest().record_context(args, pool)).operation + " "
    assert "timing=as_called/own/settle=0" in record_key(args, CpuPickBest(settle_ms=0).record_context(args)).operation


# ---- the torch provider's real kernels through the generic inputs -----------------------------

def rms_norm():
    x = torch.randn(48, 200, dtype=torch.bfloat16)
    return RMSNormArguments(x, torch.randn(200), torch.empty_like(x))


def rms_norm_residual():
    x = torch.randn(3, 17, 96, dtype=torch.bfloat16)
    return RMSNormArguments(x, torch.randn(96, dtype=torch.bfloat16), torch.empty_like(x), residual=torch.randn_like(x),
                            residual_out=torch.empty_like(x))


def swiglu_halves():
    """Gate and up as the halves of one projection (rows two halves apart)."""
    projected = torch.randn(40, 2 * 70, dtype=torch.bfloat16)
    gate, up = projected.chunk(2, dim=-1)
    return GatedActivationArguments(gate, up, torch.empty_like(gate))


def cross_entropy():
    logits = torch.randn(37, 301, dtype=torch.bfloat16)
    target = torch.randint(0, 301, (37,))
    target[::5] = -100
    return CrossEntropyArguments(logits, target, torch.empty(37), torch.empty(37), label_smoothing=0.1)


def cross_entropy_in_place():
    """The gradient written over the logits, each row's loss weighted by one broadcast scalar."""
    logits = torch.randn(20, 129, dtype=torch.bfloat16)
    return CrossEntropyArguments(logits, torch.randint(0, 129, (20,)), torch.empty(20), torch.empty(20),
                                 grad_logits=logits, grad_loss=torch.tensor(0.25).expand(20), z_loss=1e-3)


def attention_with_lse():
    """More queries than keys, causal: the first two rows see no key (lse -inf, out 0)."""
    q, k = torch.randn(2, 11, 4, 16), torch.randn(2, 9, 2, 16)
    lse = torch.empty(lse_shape(q, False))
    return AttentionArguments(q, k, torch.randn_like(k), torch.empty_like(q), lse, causal=True)


def attention_backward():
    """Its float64 reference is the type's own (`Arguments.reference_outputs`)."""
    q, k = torch.randn(2, 9, 4, 16), torch.randn(2, 11, 2, 16)
    lse = torch.randn(lse_shape(q, False))
    return AttentionBackwardArguments(torch.randn_like(q), q, k, torch.randn_like(k), torch.randn_like(q), lse,
                                      torch.empty_like(q), torch.empty_like(k), torch.empty_like(k), causal=True)


@pytest.mark.parametrize("make", [rms_norm, rms_norm_residual, swiglu_halves, cross_entropy, cross_entropy_in_place,
                                  attention_with_lse, attention_backward])
def test_the_torch_providers_kernels_tune_through_the_generic_inputs(cpu, make):
    args = make()
    pool = registry.get_kernels(args, providers=["torch"])
    with kernel_api.settings(providers=["torch"]):
        result = CpuPickBest().tune(args, pool)
    assert result.winner in pool and set(references.reference(args)) == set(type(args).output_names)
    assert all(m.failure is None and m.error < references.tolerance(args) for m in result.measurements), \
        result.measurements


def test_the_front_door_tunes_a_norm_with_pick_best(cpu):
    args = rms_norm()
    picker = CpuPickBest()
    with kernel_api.settings(policy=picker, providers=["torch"]):
        out = ops.call(args)
    assert picker.measured == 1
    x, w = args.x.double(), args.weight.double()
    expected = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + args.eps) * w
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


# ---- fresh arguments of the same metadata -----------------------------------------------------

def test_random_like_keeps_the_metadata_and_index_values_and_poisons_the_outputs():
    args = cross_entropy()
    new = args.random_like()
    assert type(new) is type(args) and new.problem_key() == args.problem_key()
    assert new.logits.data_ptr() != args.logits.data_ptr() and not torch.equal(new.logits, args.logits)
    assert torch.equal(new.target, args.target) and new.target.data_ptr() != args.target.data_ptr()
    assert new.loss.isnan().all() and new.lse.isnan().all()
    assert new._binding is None and new._verdicts is None


def test_random_like_keeps_in_place_outputs_and_broadcast_operands():
    args = cross_entropy_in_place()
    new = args.random_like()
    assert new.grad_logits is new.logits and not new.logits.isnan().any()
    assert new.grad_loss.stride() == (0,) and new.problem_key() == args.problem_key()


def test_random_like_keeps_strided_views_and_their_alignment():
    projected = torch.randn(10, 2 * 40 + 1)
    gate, up = projected[:, 1:41], projected[:, 41:]
    args = GatedActivationArguments(gate, up, torch.empty(10, 40))
    new = args.random_like()
    assert new.gate.stride() == gate.stride() and new.signature == args.signature


def test_random_like_shares_tensors_outside_the_operands():
    """Sequence offsets of variable-length attention are no operand: shared, values kept."""
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)
    args = AttentionArguments(q, k, torch.randn_like(k), torch.empty_like(q), causal=True, cu_seqlens_q=cu,
                              cu_seqlens_k=cu)
    new = references.random_like(args)
    assert new.cu_seqlens_q is cu and new.q.data_ptr() != q.data_ptr() and new.out.isnan().all()


# ---- what the records are keyed on ------------------------------------------------------------

def test_record_shapes_hold_every_size_of_the_problem_key():
    def lce(vocab):
        h = torch.empty(16, 32, device="meta")
        return LinearCrossEntropyArguments(h, torch.empty(vocab, 32, device="meta"),
                                           torch.empty(16, dtype=torch.int64, device="meta"),
                                           torch.empty(16, device="meta"))

    assert operation_key(lce(100))[1] != operation_key(lce(200))[1]
    assert pow2_m(lce(100)) != pow2_m(lce(200))

    def attention(seqlen_k):
        q = torch.empty(2, 9, 4, 16, device="meta")
        k = torch.empty(2, seqlen_k, 2, 16, device="meta")
        return AttentionArguments(q, k, torch.empty_like(k), torch.empty_like(q))

    # key lengths up to the query length exactly, longer ones by their power-of-two bucket (the
    # front door's key: a growing KV cache keeps its record)
    assert operation_key(attention(5))[1] != operation_key(attention(6))[1]
    assert operation_key(attention(11))[1] != operation_key(attention(20))[1]
    assert operation_key(attention(11))[1] == operation_key(attention(16))[1]
    x = torch.empty(100, 4096, device="meta")
    assert pow2_m(kernel_api.SoftmaxArguments(x, torch.empty_like(x))) == "pow2_m rows=65..128 cols=4096"


@pytest.fixture
def tf32_flag():
    before = torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_problems_with_f32_matrices_are_keyed_on_the_tf32_flag(tf32_flag):
    """The linear cross-entropy's kernels multiply its f32 matrices through torch: the TF32 flag
    changes their math and speed; bf16 problems do not depend on it."""
    def lce(dtype):
        h = torch.empty(16, 32, device="meta", dtype=dtype)
        return LinearCrossEntropyArguments(h, torch.empty(40, 32, device="meta", dtype=dtype),
                                           torch.empty(16, dtype=torch.int64, device="meta"),
                                           torch.empty(16, device="meta"))

    torch.backends.cuda.matmul.allow_tf32 = False
    assert policies.math_setting(lce(torch.float32)) == "f32"
    assert policies.math_setting(lce(torch.bfloat16)) == "native"
    torch.backends.cuda.matmul.allow_tf32 = True
    assert policies.math_setting(lce(torch.float32)) == "tf32"
    base = RecordContext("f32", None, "as_called/own")
    assert record_key(lce(torch.float32), base) != record_key(lce(torch.float32), base._replace(math="tf32"))


def test_a_cross_entropy_backward_reference_uses_the_saved_lse():
    logits = torch.randn(6, 11, dtype=torch.float64)
    target = torch.randint(0, 11, (6,))
    lse = torch.logsumexp(logits, -1)
    args = CrossEntropyBackwardArguments(torch.ones(6, dtype=torch.float64), logits, target, lse,
                                         torch.empty_like(logits))
    expected = references.reference(args)["grad_logits"]
    torch.testing.assert_close(expected, torch.softmax(logits, -1) - F.one_hot(target, 11).double())


def test_the_shortlist_keeps_every_providers_best_ranked_kernel():
    """max_candidates cuts PickAny's order, but never a provider's best-ranked kernel: the
    analytic model may rank a whole provider low (a plugin's kernels)."""
    def kernel(name, provider):
        return type(name, (), {"_kernel_api_provider": type(provider, (), {"name": provider})})()

    ranked = [kernel(f"a{i}", "a") for i in range(5)] + [kernel("b0", "b"), kernel("b1", "b")]
    assert policies.shortlist(ranked, 3) == [ranked[0], ranked[1], ranked[5]]
    assert policies.shortlist(ranked, 1) == [ranked[0], ranked[5]]
    assert policies.shortlist(ranked, None) == ranked and policies.shortlist(ranked, 7) == ranked


# ---- compile workers and tune_shapes rebuild any arguments type --------------------------------

def test_any_arguments_type_is_described_to_a_worker_and_rebuilt():
    kind, description = describe_arguments(cross_entropy_in_place())
    json.dumps(description)  # the protocol's messages are JSON
    args = cross_entropy_in_place()
    kind, description = describe_arguments(args)
    on_meta = arguments_from_description(kind, description)
    assert kind == "arguments" and type(on_meta) is type(args) and on_meta.signature == args.signature
    assert on_meta.logits.device.type == "meta" and on_meta.grad_logits is on_meta.logits
    on_cpu = arguments_from_description(kind, description, device="cpu")
    assert on_cpu.problem_key() == args.problem_key() and torch.equal(on_cpu.target, args.target)
    assert on_cpu.grad_loss.stride() == (0,) and on_cpu.device_index == -1


def test_sequence_offsets_travel_with_their_values():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)
    args = AttentionArguments(q, k, torch.randn_like(k), torch.empty_like(q), causal=True, cu_seqlens_q=cu,
                              cu_seqlens_k=cu)
    rebuilt = arguments_from_description(*describe_arguments(args), device="cpu")
    assert rebuilt.problem_key() == args.problem_key() and rebuilt.cu_seqlens_q.tolist() == [0, 3, 7]


def test_class_indices_too_many_to_describe_refuse_a_rebuild_on_a_device(monkeypatch):
    monkeypatch.setattr(compile_worker, "MAX_DESCRIBED_VALUES", 10)
    kind, description = describe_arguments(cross_entropy())
    arguments_from_description(kind, description)  # a compile needs no values
    with pytest.raises(ValueError, match="operand target: its values matter"):
        arguments_from_description(kind, description, device="cpu")


def test_a_worker_compiles_a_non_gemm_candidate():
    args = cross_entropy()
    kernel = registry.get_kernels(args, providers=["torch"], cc=90)[0]
    request = compile_worker.compile_request(kernel, 90, *describe_arguments(args))
    assert compile_worker.compile_requests([request], 1) == [None]


def test_equal_infinities_are_no_error_and_other_non_finite_outputs_are():
    ref = torch.tensor([1.0, -float("inf"), 2.0])
    assert float(timing.relative_error_tensor(ref.clone(), ref)) == 0.0
    assert float(timing.relative_error_tensor(torch.tensor([1.0, 0.0, 2.0]), ref)) == float("inf")
    assert float(timing.relative_error_tensor(torch.tensor([1.0, -float("inf"), float("nan")]), ref)) == float("inf")


def test_linear_cross_entropy_inputs_make_logits_of_unit_variance():
    h = torch.empty(256, 1024)
    args = LinearCrossEntropyArguments(h, torch.empty(512, 1024), torch.randint(0, 512, (256,)), torch.empty(256))
    new = references.random_like(args)
    assert 0.8 < float((new.hidden @ new.weight.t()).std()) < 1.2
    assert torch.equal(new.target, args.target) and new.loss.isnan().all()


def test_pick_best_compiles_other_operations_in_its_own_process(monkeypatch):
    """Worker processes are for GEMM and softmax (CuTe DSL tiles, seconds each to compile); the
    other operations' candidates compile faster than a worker starts."""
    monkeypatch.setattr(compile_worker, "compile_in_workers", lambda *a, **k: pytest.fail("started workers"))
    args = rms_norm()
    pool = registry.get_kernels(args, providers=["torch"], cc=90)
    assert policies.PickBest(num_workers=4)._precompile(args, pool * 2, 90) == {}
