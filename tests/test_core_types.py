"""dtypes, arch, status, metadata and the Kernel base's run-time checks."""

import pytest
import torch

import kernel_api
from kernel_api import (DataType, DeviceError, GemmArguments, KernelMetadata, Status, TensorAttributes,
                        UnsupportedArgumentsError)
from kernel_api.core.arch import arch_string, normalize_cc, resolve_cc
from kernel_api.dtypes import to_dtype
from kernel_api.utils import layout_string_to_strides, strides_to_layout_string, stream_handle

from toy_kernels import ToyGemm


def test_dtype_vocabulary_maps_torch_names_and_cutlass():
    cutlass = pytest.importorskip("cutlass")
    assert to_dtype(torch.bfloat16) is DataType.bf16
    assert to_dtype("bfloat16") is to_dtype("bf16") is DataType.bf16
    assert to_dtype(cutlass.Float64) is DataType.f64
    assert to_dtype(cutlass.TFloat32) is DataType.tf32
    assert DataType.f16.to_torch() is torch.float16 and DataType.f16.bytes == 2
    assert DataType.bf16.to_cutlass() is cutlass.BFloat16


def test_dtype_errors_name_the_operand():
    with pytest.raises(ValueError, match="accumulator_type: unknown type name 'f7'"):
        to_dtype("f7", "accumulator_type")
    with pytest.raises(TypeError, match="TensorAttributes.dtype"):
        TensorAttributes(object(), (0, 0, 1), 1)


def test_cc_parsing():
    assert normalize_cc("sm_90a") == normalize_cc(90) == normalize_cc((9, 0)) == 90
    assert normalize_cc(None) is None
    for bad in (-1, 7, 1000, "sm_x"):
        with pytest.raises(ValueError):
            normalize_cc(bad)
    with pytest.raises(TypeError):
        normalize_cc(True)
    assert arch_string(90) == "sm_90a" and arch_string(80) == "sm_80"


def test_explicit_cc_wins():
    assert resolve_cc(100) == 100
    if not torch.cuda.is_available():
        assert resolve_cc(None) is None


def test_status():
    assert Status.success() and Status.success().error is None
    failed = Status.fail("too big")
    assert not failed and failed.error == "too big" and "too big" in repr(failed)
    with pytest.raises(ValueError):
        Status.fail("")


def test_status_carries_a_reason_kind_and_values():
    """A failure carries a `Reason` (OTHER unless given) and the operand, actual and required
    values, so explain groups by them instead of searching message text; Status stays slotted."""
    from kernel_api import Reason

    plain = Status.fail("too big")
    assert plain.kind is Reason.OTHER and (plain.operand, plain.actual, plain.required) == (None, None, None)
    assert Status.success().kind is None
    shaped = Status.fail("grid too small", kind=Reason.SHAPE, operand="out", actual=70000, required=65535)
    assert not shaped and shaped.error == "grid too small" and shaped.kind is Reason.SHAPE
    assert (shaped.operand, shaped.actual, shaped.required) == ("out", 70000, 65535)
    assert "Reason.SHAPE" in repr(shaped) and "65535" in repr(shaped)
    assert not hasattr(shaped, "__dict__")
    with pytest.raises(TypeError, match="Reason"):
        Status.fail("x", kind="dtype")
    assert kernel_api.status.Reason is Reason


def test_tensor_attributes_accepts_sets_the_reason_kind():
    from kernel_api import Reason

    need = TensorAttributes("f16", (0, 0, 1), 8)
    dtype = need.accepts(TensorAttributes("bf16", (0, 0, 1), 8), "B")
    assert (dtype.kind, dtype.operand, dtype.actual, dtype.required) == (Reason.DTYPE, "B", DataType.bf16, DataType.f16)
    layout = need.accepts(TensorAttributes("f16", (0, 1, 0), 8), "out")
    assert (layout.kind, layout.operand, layout.actual, layout.required) == (Reason.LAYOUT, "out", (0, 1, 0), (0, 0, 1))
    align = need.accepts(TensorAttributes("f16", (0, 0, 1), 2), "A")
    assert (align.kind, align.operand, align.actual, align.required) == (Reason.ALIGNMENT, "A", 2, 8)


def test_tensor_attributes_validation_and_matching():
    with pytest.raises(ValueError, match="exactly one contiguous mode"):
        TensorAttributes("f16", (1, 0, 1), 8)
    with pytest.raises(ValueError, match="divisibility"):
        TensorAttributes("f16", (0, 0, 1), 0)
    need = TensorAttributes("f16", (0, 1), 8)  # rank-2 pattern compares as rank 3
    assert need.accepts(TensorAttributes("f16", (0, 0, 1), 16), "A")
    assert "aligned to 4" in need.accepts(TensorAttributes("f16", (0, 0, 1), 4), "A").error
    assert "dtype bf16" in need.accepts(TensorAttributes("bf16", (0, 0, 1), 8), "A").error
    assert "column-major" in need.accepts(TensorAttributes("f16", (0, 1, 0), 8), "A").error


def test_layout_strings():
    assert strides_to_layout_string((0, 0, 1), (0, 1, 0), (0, 1)) == "tnt"
    assert layout_string_to_strides("ntn") == ((0, 1, 0), (0, 0, 1), (0, 1, 0))
    with pytest.raises(ValueError):
        layout_string_to_strides("tx")


def test_stream_handle_spellings():
    assert stream_handle(0) == 0 and stream_handle(1234) == 1234
    with pytest.raises(TypeError, match="stream"):
        stream_handle("default")


def test_kernel_metadata_validation():
    ops = ToyGemm.generate_kernels(lambda m: True)[0].metadata.operands
    with pytest.raises(TypeError, match="kernel_name"):
        KernelMetadata("", ToyGemm, ops)
    with pytest.raises(TypeError, match="operands"):
        KernelMetadata("x", ToyGemm, operands=None)
    md = KernelMetadata("x", ToyGemm, ops, min_cc=80, max_cc=89)
    assert not md.supports_cc(90) and "<= 89" in md.supports_cc(90).error
    assert not md.supports_cc(75) and md.supports_cc(86)


def test_metadata_failures_carry_their_reason_kind():
    """The framework's own checks set their kinds: architecture, accumulator, epilogue features."""
    from kernel_api import EpilogueArguments, Reason
    from kernel_api.metadata import EpilogueMetadata

    ops = ToyGemm.generate_kernels(lambda m: True)[0].metadata.operands
    md = KernelMetadata("x", ToyGemm, ops, min_cc=80, max_cc=89)
    for cc in (75, 90):
        status = md.supports_cc(cc)
        assert status.kind is Reason.CC and status.actual == cc and status.required == (80, 89)
    args = GemmArguments(*(torch.randn(8, 8) for _ in range(3)), accumulator_type=torch.float64)
    acc = _toy_kernel_for(GemmArguments(*(torch.randn(8, 8) for _ in range(3)))).metadata.supports(args)
    assert (acc.kind, acc.operand, acc.actual, acc.required) == (Reason.ACCUMULATOR, "accumulator_type",
                                                                 DataType.f64, DataType.f32)
    A, B, out = (torch.randn(8, 8) for _ in range(3))
    silu = GemmArguments(A, B, out, epilogue=EpilogueArguments(activation="silu")).epilogue_signature
    status = EpilogueMetadata(activations=frozenset({"relu"})).supports(silu)
    assert (status.kind, status.operand, status.actual) == (Reason.EPILOGUE, "activation", "silu")
    column = GemmArguments(A, B, out, epilogue=EpilogueArguments(bias=torch.randn(8, 1))).epilogue_signature
    status = EpilogueMetadata(bias=frozenset({"row"})).supports(column)
    assert (status.kind, status.operand, status.actual) == (Reason.EPILOGUE, "bias", "column")
    assert EpilogueMetadata(alpha_beta=False).supports(
        GemmArguments(A, B, out, epilogue=EpilogueArguments(alpha=2.0)).epilogue_signature).kind is Reason.EPILOGUE


def test_kernel_metadata_checks_the_arguments_type_not_its_name():
    """Operand metadata names its arguments class, checked with isinstance: another class that
    is merely called GemmArguments is refused, a subclass of the real one is accepted."""
    A, B, out = (torch.randn(8, 8) for _ in range(3))
    real = GemmArguments(A, B, out)
    md = _toy_kernel_for(real).metadata
    assert kernel_api.GemmOperandsMetadata.arguments_type is GemmArguments

    class Impostor(kernel_api.Arguments):  # same operands and summary, another type
        __slots__ = ("A", "B", "out", "accumulator_type", "epilogue_signature")

    Impostor.__name__ = Impostor.__qualname__ = "GemmArguments"
    fake = Impostor()
    fake.tensor_attributes, fake.accumulator_type = dict(real.tensor_attributes), real.accumulator_type
    fake.epilogue_signature = None
    status = md.supports(fake)
    assert not status and "kernel takes GemmArguments, got GemmArguments" in status.error
    assert status.kind is kernel_api.Reason.ARGUMENTS and status.required is GemmArguments

    class Subclass(GemmArguments):
        __slots__ = ()

    assert md.supports(Subclass(A, B, out))


def _toy_kernel_for(args):
    return next(k for k in ToyGemm.generate_kernels(lambda m: True) if k.metadata.supports(args))


def test_run_with_cpu_tensors_raises_device_error():
    A, B = torch.randn(16, 8).half(), torch.randn(8, 4).half()
    args = GemmArguments(A, B, torch.empty(16, 4).half())
    kernel = _toy_kernel_for(args)
    with pytest.raises(DeviceError, match="operand A is on cpu"):
        kernel.run(args)


def test_run_rejects_non_arguments():
    kernel = ToyGemm.generate_kernels(lambda m: True)[0]
    with pytest.raises(TypeError, match="expected an arguments object"):
        kernel.run((1, 2, 3))
    with pytest.raises(TypeError, match="expected an arguments object"):
        kernel.supports("A")


def test_supports_reports_the_kernels_reason():
    A, B = torch.randn(16, 64).half(), torch.randn(64, 4).half()
    args = GemmArguments(A, B, torch.empty(16, 4).half())
    kernel = _toy_kernel_for(args)
    ToyGemm.max_k = 32
    try:
        status = kernel.supports(args)
        assert not status and "K=64 exceeds 32" in status.error
    finally:
        ToyGemm.max_k = None


def _pretend_gpu(monkeypatch, available=True):
    """Let run reach its checks on a machine without a GPU (meta tensors posing as cuda:0)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(kernel_api.kernel, "device_cc", lambda index=None: 90)
    monkeypatch.setattr(kernel_api.kernel, "_cc_by_device", {})


def _meta_gemm_args(m=16, n=4, k=8, tensors=None):
    meta = dict(dtype=torch.float16, device="meta")
    A, B, out = tensors or (torch.empty(m, k, **meta), torch.empty(k, n, **meta), torch.empty(m, n, **meta))
    args = GemmArguments(A, B, out)
    object.__setattr__(args, "device", torch.device("cuda", 0))
    object.__setattr__(args, "device_index", 0)
    return args


def test_unsupported_args_raise_with_reason_when_run(monkeypatch):
    _pretend_gpu(monkeypatch)
    args = _meta_gemm_args(k=64)
    kernel = _toy_kernel_for(args)
    ToyGemm.max_k = 32
    try:
        with pytest.raises(UnsupportedArgumentsError, match="K=64 exceeds 32"):
            kernel.run(args)
    finally:
        ToyGemm.max_k = None
    # A kernel of another dtype is rejected by its metadata, with the operand named.
    bf16 = next(k for k in ToyGemm.generate_kernels(lambda m: True) if k.metadata.operands.A.dtype is DataType.bf16)
    with pytest.raises(UnsupportedArgumentsError, match="operand A: dtype f16"):
        bf16.run(args)


def test_no_gpu_run_is_a_clear_error(monkeypatch):
    _pretend_gpu(monkeypatch, available=False)
    args = _meta_gemm_args()
    with pytest.raises(DeviceError, match="no CUDA GPU"):
        _toy_kernel_for(args).run(args)


def test_run_checks_each_arguments_object_once_per_kernel(monkeypatch):
    _pretend_gpu(monkeypatch)
    args = _meta_gemm_args()
    kernel = _toy_kernel_for(args)
    calls = []
    monkeypatch.setattr(ToyGemm, "_supports", lambda self, a: calls.append(1) or Status.success())
    monkeypatch.setattr(ToyGemm, "_run", lambda self, a, art, stream, ws=None: None)
    artifact = kernel.compile(args, cc=90)
    kernel.run(args, compiled_artifact=artifact)
    kernel.run(args, compiled_artifact=artifact)
    assert len(calls) == 1  # the verdict is remembered on the arguments object
    kernel.run(args)  # a different artifact (None: compile on demand) is checked again
    assert len(calls) == 2
    kernel.run(_meta_gemm_args(tensors=(args.A, args.B, args.out)), compiled_artifact=artifact)
    assert len(calls) == 3  # new arguments are checked


def test_next_pow2():
    from kernel_api.utils import next_pow2

    assert [next_pow2(n) for n in (1, 2, 3, 4, 5, 1024, 1025)] == [1, 2, 4, 4, 8, 1024, 2048]
