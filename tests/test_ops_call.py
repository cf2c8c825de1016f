"""The generic front door on the CPU: `kernel_api.ops.call` and operations generated from one
`Operation` description.

A toy operation (``out = x * y``) with a toy kernel that computes with torch stands in for a
GPU operation: the front door launches on CPU tensors here because the tests add "cpu" to
`dispatch.LAUNCH_DEVICE_TYPES` (the shipped kernels are CUDA kernels, so ops refuse other
devices otherwise). The example vector add is traced through its generated op; running it
needs a GPU (tests/test_example_vector_add.py).
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch

import kernel_api
from kernel_api import (Arguments, CompiledArtifact, Kernel, KernelMetadata, NoKernelFoundError, Status,
                        TensorAttributes, ops, registry)
from kernel_api.dtypes import from_torch
from kernel_api.metadata import OperandsMetadata
from kernel_api.ops import Operation, define_operation, dispatch, like_input

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


# ---- a toy operation: out = x * y on contiguous tensors, with a kernel computing with torch ----

class ToyMulArguments(Arguments):
    """``out = x * y``: contiguous tensors of one shape, dtype and device."""

    __slots__ = ("x", "y", "out")
    output_names = ("out",)

    def __init__(self, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> None:
        for name, t in (("x", x), ("y", y), ("out", out)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"operand {name}: expected a torch.Tensor, got {type(t).__name__}")
            if t.shape != x.shape:
                raise ValueError(f"operand {name}: shape {tuple(t.shape)} must equal x's {tuple(x.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"operand {name}: must be contiguous (call .contiguous())")
        self.x, self.y, self.out = x, y, out
        self.device, self.device_index = x.device, x.get_device()
        self._verdicts = self._binding = None
        self.tensor_attributes = {name: TensorAttributes(from_torch(t.dtype), (1,), 1)
                                  for name, t in (("x", x), ("y", y), ("out", out))}
        self.signature = ("toy_mul", *(a.key() for a in self.tensor_attributes.values()), self.device_index)


class ToyMulOperands(OperandsMetadata):
    operand_names = ("x", "y", "out")
    arguments_type = ToyMulArguments

    def __init__(self, x: TensorAttributes, y: TensorAttributes, out: TensorAttributes) -> None:
        self.x, self.y, self.out = x, y, out


class ToyOpsProvider(kernel_api.Provider):
    name = "toy_ops_call"


class ToyMul(Kernel):
    supported_args_type = ToyMulArguments
    workspace_free = True
    compiles = runs = 0

    @staticmethod
    def generate_kernels(metadata_filter, epilogue_args=None, cc=None):
        found = []
        for dt in ("f32", "f64"):
            attrs = TensorAttributes(dt, (1,), 1)
            md = KernelMetadata(f"ToyMul_{dt}", ToyMul, ToyMulOperands(attrs, attrs, attrs))
            if metadata_filter is None or metadata_filter(md):
                found.append(ToyMul(md))
        return found

    def _supports(self, args: ToyMulArguments) -> Status:
        return Status.success()

    def get_workspace_size(self, args: ToyMulArguments) -> int:
        return 0

    def estimated_cost(self, args: ToyMulArguments, sm_count: int) -> float:
        return 1.0

    def compile(self, args, cc=None):
        type(self).compiles += 1
        return CompiledArtifact(("toy_mul", self.metadata.kernel_name), self)

    def _run(self, args, artifact, stream, workspace=None):
        type(self).runs += 1
        torch.mul(args.x, args.y, out=args.out)


def _mul_backward(saved, grad):
    # Written with the operation itself: d(x*y)/dx = grad * y, d(x*y)/dy = grad * x.
    grad = grad.contiguous()  # autograd may hand over an expanded (stride-0) gradient
    return (toy_mul(grad, saved.y) if saved.needs_input_grad[0] else None,
            toy_mul(grad, saved.x) if saved.needs_input_grad[1] else None)


TOY_MUL = Operation(name="toy_ops::mul", schema="(Tensor x, Tensor y) -> Tensor", arguments=ToyMulArguments,
                    outputs=("out",), fake=like_input(0), backward=_mul_backward)
toy_mul = define_operation(TOY_MUL)


@pytest.fixture
def cpu_front_door(monkeypatch):
    """The toy kernel registered, the front door launching on CPU tensors, a fresh dispatch
    cache, and a count of the choices made (calls of ``registry.get_kernels`` by the front door)."""
    kernel_api.register_provider(ToyOpsProvider)
    ToyOpsProvider.register(ToyMul)
    monkeypatch.setattr(dispatch, "LAUNCH_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    ops.clear_dispatch_cache()
    choices = []
    get_kernels = dispatch.registry.get_kernels

    def counting(args, *a, **kw):
        choices.append(args.problem_key())
        return get_kernels(args, *a, **kw)

    monkeypatch.setattr(dispatch.registry, "get_kernels", counting)
    ToyMul.compiles = ToyMul.runs = 0
    yield choices
    monkeypatch.undo()
    ops.clear_dispatch_cache()
    registry.unregister_provider("toy_ops_call")


# ---- ops.call ---------------------------------------------------------------------------------

def test_call_chooses_once_per_problem_key_and_reuses_the_choice(cpu_front_door):
    choices = cpu_front_door
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    out = torch.empty(4, 5)
    assert ops.call(ToyMulArguments(x, y, out)) is out
    torch.testing.assert_close(out, x * y)
    again = torch.empty(4, 5)
    assert ops.call(ToyMulArguments(torch.randn(4, 5), torch.randn(4, 5), again)) is again
    # One choice and one compile for both calls: the second hit the dispatch cache under the
    # arguments' own problem_key (no rule of this operation in dispatch.py).
    assert len(choices) == 1 and ToyMul.compiles == 1 and ToyMul.runs == 2
    assert any(key[1] == ToyMulArguments(x, y, out).problem_key() for key in dispatch._dispatch)
    # ops.chosen_kernels shows the choice under the same key, without reading private state.
    assert [(key, type(k)) for key, k in ops.chosen_kernels()] == [(ToyMulArguments(x, y, out).problem_key(), ToyMul)]
    # A new shape (or dtype) is a new problem: chosen again.
    ops.call(ToyMulArguments(torch.randn(3), torch.randn(3), torch.empty(3)))
    ops.call(ToyMulArguments(*(torch.randn(3, dtype=torch.float64) for _ in range(3))))
    assert len(choices) == 3 and ToyMul.compiles == 3


def test_call_bumps_the_outputs_version_and_returns_none_without_outputs(cpu_front_door):
    x = torch.randn(6)
    out = torch.empty(6)
    version = out._version
    ops.call(ToyMulArguments(x, x, out))
    assert out._version == version + 2  # the toy kernel's torch.mul(out=) and the front door's bump

    class NoOutputs(ToyMulArguments):
        __slots__ = ()
        output_names = ()

    assert ops.call(NoOutputs(x, x, out)) is None


def test_default_problem_key_holds_type_signature_shapes_and_declared_fields():
    x = torch.randn(2, 3)
    key = ToyMulArguments(x, x, torch.empty(2, 3)).problem_key()
    assert key[0] is ToyMulArguments and key[2:] == ((2, 3), (2, 3), (2, 3))
    assert key != ToyMulArguments(*(torch.randn(3, 2) for _ in range(3))).problem_key()

    class WithField(ToyMulArguments):
        __slots__ = ("alpha",)
        problem_fields = ("alpha",)

        def __init__(self, x, y, out, alpha):
            super().__init__(x, y, out)
            self.alpha = alpha

    assert WithField(x, x, x, 2.0).problem_key()[-1] == 2.0
    assert WithField(x, x, x, 2.0).problem_key() != WithField(x, x, x, 3.0).problem_key()


def test_bad_inputs_get_one_clear_error_naming_the_operand(cpu_front_door):
    with pytest.raises(TypeError, match=r"^args: expected a kernel_api Arguments object .*got str$"):
        ops.call("x")
    with pytest.raises(ValueError, match=r"^operand y: shape \(3,\) must equal x's \(4,\)$"):
        toy_mul(torch.randn(4), torch.randn(3))
    with pytest.raises(NoKernelFoundError, match="operand x"):  # no toy kernel takes f16
        toy_mul(torch.randn(4).half(), torch.randn(4).half())
    with pytest.raises(TypeError, match=r"^toy_ops::mul: missing a required argument: 'y'$"):
        toy_mul(torch.randn(4))


def test_call_refuses_other_devices_and_tracing():
    x = torch.randn(4)
    with pytest.raises(kernel_api.DeviceError, match="operand x is on cpu"):  # only CUDA outside tests
        ops.call(ToyMulArguments(x, x, torch.empty(4)))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        with pytest.raises(RuntimeError, match="eagerly"):
            ops.call(ToyMulArguments(fx, fx, torch.empty_like(fx)))


# ---- the generated torch op and function ----------------------------------------------------

def test_generated_op_schema_tags_and_function_signature():
    import inspect

    overload = torch.ops.toy_ops.mul.default
    assert str(overload._schema) == "toy_ops::mul(Tensor x, Tensor y) -> Tensor"
    assert torch.Tag.pt2_compliant_tag in overload.tags
    assert toy_mul.op is overload and toy_mul.operation is TOY_MUL
    assert str(inspect.signature(toy_mul)) == "(x, y, *, out=None, stream=None)"
    assert define_operation(TOY_MUL) is toy_mul  # the same description again: the same function
    assert ops.defined_operations()["toy_ops::mul"] is TOY_MUL


def test_define_operation_refuses_bad_descriptions():
    with pytest.raises(ValueError, match="already defined"):
        define_operation(Operation(name="toy_ops::mul", schema="(Tensor x, Tensor y) -> Tensor",
                                   arguments=ToyMulArguments))
    with pytest.raises(ValueError, match="namespace::name"):
        Operation(name="mul", schema="(Tensor x) -> Tensor", arguments=ToyMulArguments)
    with pytest.raises(ValueError, match="returns 1 value"):
        define_operation(Operation(name="toy_ops::two", schema="(Tensor x, Tensor y) -> Tensor",
                                   arguments=ToyMulArguments, outputs=("out", "other")))
    with pytest.raises(ValueError, match=r"\['x'\] name both an input and an output"):
        define_operation(Operation(name="toy_ops::clash", schema="(Tensor x) -> Tensor", arguments=ToyMulArguments,
                                   outputs=("x",)))


def test_generated_function_runs_eagerly_through_call_with_out_and_keywords(cpu_front_door):
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(toy_mul(x, y), x * y)
    out = torch.empty(3, 4)
    assert toy_mul(x, y=y, out=out) is out
    torch.testing.assert_close(out, x * y)
    torch.testing.assert_close(torch.ops.toy_ops.mul(x, y), x * y)  # the op's eager body: ops.call too
    assert len(cpu_front_door) == 1  # one problem: chosen once for all three


def test_fake_implementation_and_make_fx():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    meta = torch.empty(5, 7, device="meta", dtype=torch.float64)
    assert toy_mul(meta, meta).shape == (5, 7)  # meta: through the op, no launch
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(torch.randn(5, 7))
        got = toy_mul(fx, fx)
        assert type(got).__name__ == "FakeTensor" and got.shape == (5, 7) and got.dtype == torch.float32
    gm = make_fx(lambda a, b: toy_mul(a, b) + 1, tracing_mode="fake")(torch.randn(2, 3), torch.randn(2, 3))
    assert "toy_ops.mul.default" in [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_autograd_formula_passes_gradcheck_in_f64(cpu_front_door):
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(toy_mul, (x, y))
    z = toy_mul(x, y)
    assert z.grad_fn is not None and "toy_ops_mul" in type(z.grad_fn).__name__
    z.sum().backward()
    torch.testing.assert_close(x.grad, y.detach())
    torch.testing.assert_close(y.grad, x.detach())


def test_opcheck_passes_for_the_generated_op(cpu_front_door):
    args = (torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64))
    result = torch.library.opcheck(torch.ops.toy_ops.mul.default, args)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_torch_compile_fullgraph_captures_the_generated_op(cpu_front_door):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x, y = torch.randn(8), torch.randn(8)
    got = torch.compile(lambda a, b: toy_mul(a, b) * 2, fullgraph=True, backend=backend)(x, y)
    torch.testing.assert_close(got, x * y * 2)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert any("toy_ops.mul" in t for t in targets), targets


# ---- a plugin's operation: the example vector add, declared in its own package -----------------

@pytest.fixture(scope="module")
def vector_add():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import vector_add
    finally:
        sys.path.remove(str(EXAMPLES))
    return vector_add


def test_vector_add_op_is_generated_from_its_description(vector_add):
    overload = torch.ops.kernel_api_examples.vector_add.default
    assert str(overload._schema) == "kernel_api_examples::vector_add(Tensor x, Tensor y) -> Tensor"
    assert vector_add.add.op is overload and vector_add.add.operation is vector_add.VECTOR_ADD


def test_vector_add_traces_under_fake_tensor_mode_and_make_fx(vector_add):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(1000, dtype=torch.float16))
        got = vector_add.add(x, x)
        assert type(got).__name__ == "FakeTensor" and got.shape == (1000,) and got.dtype == torch.float16
    gm = make_fx(lambda a, b: vector_add.add(a, b), tracing_mode="fake")(torch.randn(64), torch.randn(64))
    assert "kernel_api_examples.vector_add.default" in [str(n.target) for n in gm.graph.nodes
                                                        if n.op == "call_function"]
    # Its backward (the gradient passed to both inputs) on meta tensors: no launch.
    a = torch.empty(16, device="meta", requires_grad=True)
    b = torch.empty(16, device="meta", requires_grad=True)
    vector_add.add(a, b).sum().backward()
    assert a.grad.shape == b.grad.shape == (16,)


def test_vector_add_through_call_on_cpu_names_the_operand(vector_add):
    x = torch.randn(8)
    with pytest.raises(kernel_api.DeviceError, match="operand x is on cpu"):
        ops.call(vector_add.VectorAddArguments(x, x.clone(), torch.empty_like(x)))


def test_inputs_by_position_and_outputs_by_name_need_no_signature_binding(cpu_front_door, monkeypatch):
    """The common call (every input by position, outputs by name) skips `inspect` binding, which
    costs microseconds a call and walks a mapping proxy under Dynamo; other forms still bind."""
    binds = []
    real_bind = inspect.Signature.bind

    def counting_bind(self, *args, **kwargs):
        binds.append(args)
        return real_bind(self, *args, **kwargs)

    monkeypatch.setattr(inspect.Signature, "bind", counting_bind)
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    out = torch.empty(4, 5)
    assert toy_mul(x, y, out=out) is out and toy_mul(x, y, out=None).shape == (4, 5) and not binds
    torch.testing.assert_close(out, x * y)
    torch.testing.assert_close(toy_mul(x, y=y), x * y)  # an input by name binds
    assert len(binds) == 1
    with pytest.raises(TypeError, match="toy_ops::mul"):
        toy_mul(x, y, nonsense=1)
