"""Arguments objects: validation messages name the operand and the problem."""

import pytest
import torch

from kernel_api import EpilogueArguments, GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments
from kernel_api.dtypes import DataType


def mats(m=8, n=4, k=6, batch=None, dtype=torch.float32):
    pre = () if batch is None else (batch,)
    return (torch.randn(*pre, m, k, dtype=dtype), torch.randn(*pre, k, n, dtype=dtype),
            torch.empty(*pre, m, n, dtype=dtype))


def test_gemm_records_shapes_and_attributes():
    A, B, out = mats(batch=3)
    args = GemmArguments(A, B, out, accumulator_type=torch.float32)
    assert args.problem_shape == (8, 4, 6, 3)
    a = args.tensor_attributes["A"]
    assert a.dtype is DataType.f32 and a.stride == (0, 0, 1)
    assert args.accumulator_type is DataType.f32
    assert hash(args.signature) == hash(GemmArguments(*mats(batch=3), accumulator_type="f32").signature)


def test_column_major_operands_are_recognised():
    A = torch.randn(6, 8).t()  # (8, 6) column-major
    args = GemmArguments(A, torch.randn(6, 4), torch.empty(8, 4))
    assert args.tensor_attributes["A"].stride == (0, 1, 0)


@pytest.mark.parametrize("accumulator, expected", [(None, DataType.f32), ("f32", DataType.f32),
                                                   (torch.float64, DataType.f64)])
def test_accumulator_defaults_and_spellings(accumulator, expected):
    assert GemmArguments(*mats(), accumulator_type=accumulator).accumulator_type is expected


def test_f64_defaults_to_f64_accumulator():
    assert GemmArguments(*mats(dtype=torch.float64)).accumulator_type is DataType.f64


def test_wrong_rank():
    A, B, out = mats()
    with pytest.raises(ValueError, match="operand A: rank 1"):
        GemmArguments(torch.randn(8), B, out)
    with pytest.raises(ValueError, match="operand B: rank 3"):
        GemmArguments(A, B.unsqueeze(0), out)
    with pytest.raises(ValueError, match="operand out: rank 3"):
        GemmArguments(A, B, out.unsqueeze(0))


def test_k_mismatch():
    A, _, out = mats()
    with pytest.raises(ValueError, match="operand B: K mismatch"):
        GemmArguments(A, torch.randn(7, 4), out)


def test_m_and_n_mismatch():
    A, B, _ = mats()
    with pytest.raises(ValueError, match="operand out: M mismatch"):
        GemmArguments(A, B, torch.empty(9, 4))
    with pytest.raises(ValueError, match="operand out: N mismatch"):
        GemmArguments(A, B, torch.empty(8, 5))


def test_batch_mismatch():
    A, B, out = mats(batch=2)
    with pytest.raises(ValueError, match="operand B: batch mismatch"):
        GemmArguments(A, torch.randn(3, 6, 4), out)
    with pytest.raises(ValueError, match="operand out: batch mismatch"):
        GemmArguments(A, B, torch.empty(3, 8, 4))


def test_non_tensor_operands():
    A, B, out = mats()
    with pytest.raises(TypeError, match="operand A: expected a torch.Tensor, got list"):
        GemmArguments([[1.0]], B, out)
    with pytest.raises(TypeError, match="operand out: expected a torch.Tensor"):
        GemmArguments(A, B, None)


def test_unknown_accumulator_type():
    with pytest.raises(ValueError, match="accumulator_type: unknown type name 'float128'"):
        GemmArguments(*mats(), accumulator_type="float128")
    with pytest.raises(TypeError, match="accumulator_type"):
        GemmArguments(*mats(), accumulator_type=3.5)
    with pytest.raises(ValueError, match="accumulator_type.*not a floating-point"):
        GemmArguments(*mats(), accumulator_type=torch.int32)


def test_unsupported_operand_dtype():
    A, B, out = mats()
    with pytest.raises(TypeError, match="operand A: dtype torch.complex64"):
        GemmArguments(A.to(torch.complex64), B, out)


def test_operands_on_different_devices():
    A, B, out = mats()
    with pytest.raises(ValueError, match="operand B: on meta but A is on cpu"):
        GemmArguments(A, B.to("meta"), out)


def test_operand_without_unit_stride():
    A = torch.randn(16, 12)[::2, ::2]
    with pytest.raises(ValueError, match="operand A: strides .* no unit-stride mode"):
        GemmArguments(A, torch.randn(6, 4), torch.empty(8, 4))


def test_size_one_mode_gets_a_unit_stride_view():
    A = torch.randn(8, 12)[:, ::12]  # (8, 1) with stride (12, 12)
    args = GemmArguments(A, torch.randn(1, 4), torch.empty(8, 4))
    assert args.A.stride()[-1] == 1 and args.tensor_attributes["A"].stride == (0, 0, 1)
    assert torch.equal(args.A, A)


def test_epilogue_validation():
    A, B, out = mats()
    with pytest.raises(ValueError, match="beta=0.5 needs a C operand"):
        EpilogueArguments(beta=0.5)
    with pytest.raises(ValueError, match="unknown 'tanh'"):
        EpilogueArguments(activation="tanh")
    with pytest.raises(ValueError, match="operand C: shape"):
        GemmArguments(A, B, out, epilogue=EpilogueArguments(beta=1.0, C=torch.randn(8, 5)))
    with pytest.raises(TypeError, match="operand C: dtype"):
        GemmArguments(A, B, out, epilogue=EpilogueArguments(beta=1.0, C=torch.randn(8, 4).double()))
    with pytest.raises(ValueError, match="operand bias: shape \\(5,\\)"):
        GemmArguments(A, B, out, epilogue=EpilogueArguments(bias=torch.randn(5)))
    with pytest.raises(TypeError, match="operand bias: dtype"):
        GemmArguments(A, B, out, epilogue=EpilogueArguments(bias=torch.randn(4).half()))
    with pytest.raises(ValueError, match="operand bias: on meta"):
        GemmArguments(A, B, out, epilogue=EpilogueArguments(bias=torch.randn(4, device="meta")))
    with pytest.raises(TypeError, match="epilogue alpha"):
        EpilogueArguments(alpha="2")
    with pytest.raises(TypeError, match="epilogue: expected EpilogueArguments"):
        GemmArguments(A, B, out, epilogue={"alpha": 2})


def test_bias_kinds():
    A, B, out = mats()
    row = GemmArguments(A, B, out, epilogue=EpilogueArguments(bias=torch.randn(4)))
    col = GemmArguments(A, B, out, epilogue=EpilogueArguments(bias=torch.randn(8, 1)))
    col1d = GemmArguments(A, B, out, epilogue=EpilogueArguments(bias=torch.randn(8)))
    assert row.epilogue.bias_kind == "row" and col.epilogue.bias_kind == "column"
    assert col1d.epilogue.bias_kind == "column" and col.epilogue.bias.dim() == 1
    assert row.signature != col.signature


def test_epilogue_signature_names_its_fields():
    """`GemmArguments.epilogue_signature` is a record read by field name (it was a 6-tuple read
    as [4] and [:4]); it stays a hashable value equal to one built from equal operands."""
    from kernel_api.arguments import EpilogueSignature

    A, B, out = mats()
    C = torch.randn(4, 8).t()  # column-major, like out's shape
    args = GemmArguments(A, B, out, epilogue=EpilogueArguments(alpha=2.0, beta=0.5, C=C, bias=torch.randn(4),
                                                               activation="gelu"))
    sig = args.epilogue_signature
    assert isinstance(sig, EpilogueSignature)
    assert (sig.scaled, sig.has_c, sig.bias_kind, sig.activation, sig.bias_dtype) == (True, True, "row", "gelu",
                                                                                        DataType.f32)
    assert sig.c_attributes.dtype is DataType.f32 and sig.c_attributes.stride == (0, 1, 0)
    assert sig.c_attributes.divisibility >= 1
    again = GemmArguments(A, B, out, epilogue=EpilogueArguments(alpha=2.0, beta=0.5, C=C, bias=torch.randn(4),
                                                                activation="gelu"))
    assert again.epilogue_signature == sig and hash(again.signature) == hash(args.signature)
    plain = GemmArguments(A, B, out, epilogue=EpilogueArguments(bias=torch.randn(8, 1))).epilogue_signature
    assert (plain.scaled, plain.has_c, plain.c_attributes, plain.bias_kind, plain.activation) == (
        False, False, None, "column", None)


def test_one_epilogue_serves_gemms_with_different_outputs():
    """An EpilogueArguments is a description: building GemmArguments with it leaves it as it was,
    so one object serves outputs of other shapes and layouts, each GEMM getting its own bias kind.
    (It used to flatten its bias and record the first GEMM's bias kind on itself: a (8, 1) column
    bias then read as a row bias of a later 8 x 8 GEMM, and the first GEMM's kind changed too.)"""
    from kernel_api.tuning.reference import gemm_reference

    bias = torch.randn(8, 1)
    epi = EpilogueArguments(alpha=2.0, bias=bias, activation="relu")
    before = {name: getattr(epi, name) for name in EpilogueArguments.__slots__}
    A = torch.randn(8, 6)
    narrow = GemmArguments(A, torch.randn(6, 4), torch.empty(8, 4), epilogue=epi)
    square = GemmArguments(A, torch.randn(6, 8), torch.empty(8, 8), epilogue=epi)
    column_major = GemmArguments(A, torch.randn(6, 4), torch.empty(4, 8).t(), epilogue=epi)
    assert all(getattr(epi, name) is value for name, value in before.items()), before
    assert epi.bias is bias and epi.bias_kind is None
    for args in (narrow, square, column_major):
        assert args.epilogue_signature.bias_kind == "column" and args.epilogue.bias_kind == "column"
        assert args.epilogue.bias.dim() == 1 and args.epilogue.alpha == 2.0
        expected = torch.relu(2.0 * (args.A.double() @ args.B.double()) + bias.double())
        assert torch.allclose(gemm_reference(args), expected)
    assert column_major.tensor_attributes["out"].stride == (0, 1, 0)
    assert narrow.epilogue_signature == column_major.epilogue_signature

    C = torch.randn(8, 12)[:, ::12]  # (8, 1) without a unit stride: GEMMs read a re-strided view
    with_c = EpilogueArguments(beta=1.0, C=C)
    for out in (torch.empty(8, 1), torch.empty(1, 8).t()):
        args = GemmArguments(A, torch.randn(6, 1), out, epilogue=with_c)
        assert args.epilogue.C.stride()[-1] == 1 and torch.equal(args.epilogue.C, C)
        assert args.epilogue_signature.c_attributes.stride == (0, 0, 1)
    assert with_c.C is C and with_c.C.stride() == (12, 12)


def test_softmax_arguments():
    x = torch.randn(3, 5, 7)
    args = SoftmaxArguments(x, torch.empty_like(x))
    assert (args.rows, args.cols) == (15, 7)
    with pytest.raises(ValueError, match="operand out: shape"):
        SoftmaxArguments(x, torch.empty(3, 5, 6))
    with pytest.raises(TypeError, match="operand out: dtype"):
        SoftmaxArguments(x, torch.empty_like(x, dtype=torch.float16))
    with pytest.raises(ValueError, match="operand out: must be contiguous"):
        SoftmaxArguments(x, torch.empty(3, 7, 5).transpose(1, 2))
    with pytest.raises(ValueError, match="dim: softmax kernels reduce over the last dimension"):
        SoftmaxArguments(x, torch.empty_like(x), dim=1)
    with pytest.raises(ValueError, match="dim: 3 out of range"):
        SoftmaxArguments(x, torch.empty_like(x), dim=3)
    with pytest.raises(ValueError, match="operand x: softmax dim must be contiguous"):
        SoftmaxArguments(torch.randn(7, 5).t(), torch.empty(5, 7))


def test_softmax_backward_arguments():
    y = torch.randn(4, 9)
    args = SoftmaxBackwardArguments(torch.randn_like(y), y, torch.empty_like(y))
    assert (args.rows, args.cols) == (4, 9)
    with pytest.raises(ValueError, match="operand grad_in: shape"):
        SoftmaxBackwardArguments(torch.randn_like(y), y, torch.empty(4, 8))
    with pytest.raises(TypeError, match="operand grad_out: dtype"):
        SoftmaxBackwardArguments(torch.randn_like(y).half(), y, torch.empty_like(y))
