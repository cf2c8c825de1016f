"""CPU checks of the CuTe DSL GEMM family: discovery, metadata, names, errors, sm_90a compiles.

The GPU correctness sweep lives in test_gemm_family_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api import EpilogueArguments, GemmArguments
from kernel_api.dtypes import DataType

from gemm_family_utils import operand, problem

FAMILY = ("SimtGemm", "Sm80TensorOpGemm")


def family(cc=90, cls=None):
    ks = [k for k in kernel_api.get_kernels(None, cc=cc, providers="cutedsl") if type(k).__name__ in FAMILY]
    return [k for k in ks if cls is None or type(k).__name__ == cls]


def found(args, cls=None, cc=90):
    return [k for k in kernel_api.get_kernels(args, cc=cc) if type(k).__name__ in (FAMILY if cls is None else (cls,))]


def test_both_classes_register_a_reasonable_number_of_configurations():
    for cls in FAMILY:
        n = len(family(cls=cls))
        assert 20 <= n <= 260, (cls, n)
    names = [k.metadata.kernel_name for k in family()]
    assert len(names) == len(set(names)), "kernel names must be unique"


def test_names_encode_layouts_dtypes_tile_and_alignment():
    for k in family():
        md = k.metadata
        ops = md.operands
        letters = ops.A.layout + ops.B.layout + ops.out.layout
        name = md.kernel_name
        assert f"_{letters}_" in name
        assert name.startswith(f"{type(k).__name__}_{ops.A.dtype}{ops.out.dtype}")
        assert "x".join(map(str, md.design.tile_shape)) in name
        assert name.endswith(f"_a{ops.A.divisibility}")
        assert md.epilogue is not None and md.epilogue.bias == frozenset({"row", "column"})


def test_layout_letters_have_one_name():
    """utils.strides_to_layout_string names the layouts; the GEMM module keeps no alias of it."""
    from kernel_api.providers.cutedsl.gemm import common

    assert not hasattr(common, "layout_name")


def test_all_eight_layout_combinations_for_every_dtype():
    for cls in FAMILY:
        combos = {}
        for k in family(cls=cls):
            ops = k.metadata.operands
            combos.setdefault((ops.A.dtype, ops.out.dtype, ops.math_type), set()).add(
                ops.A.layout + ops.B.layout + ops.out.layout)
        assert combos and all(len(v) == 8 for v in combos.values()), combos


def test_simt_covers_every_dtype_at_alignment_one_and_accumulates_wide():
    seen = {}
    for k in family(cls="SimtGemm"):
        ops = k.metadata.operands
        seen.setdefault(ops.A.dtype, set()).add(ops.A.divisibility)
        assert ops.accumulator_type is (DataType.f64 if ops.A.dtype is DataType.f64 else DataType.f32)
    assert set(seen) == {DataType.f64, DataType.f32, DataType.f16, DataType.bf16}
    assert all(1 in divs and max(divs) > 1 for divs in seen.values())


def test_tensorop_metadata_tf32_is_marked_and_filterable():
    tf32 = [k for k in family(cls="Sm80TensorOpGemm") if k.metadata.operands.math_type is DataType.tf32]
    assert tf32 and all(k.metadata.operands.A.dtype is DataType.f32 for k in tf32)
    A, B, out = (operand(s, torch.float32, False, "cpu") for s in ((256, 64), (64, 128), (256, 128)))
    args = GemmArguments(A, B, out)
    with_tf32 = found(args)
    without = [k for k in kernel_api.get_kernels(args, cc=90, metadata_filter=lambda m: str(m.operands.math_type) != "tf32")
               if type(k).__name__ in FAMILY]
    assert any(type(k).__name__ == "Sm80TensorOpGemm" for k in with_tf32)
    assert without and all(type(k).__name__ == "SimtGemm" for k in without)


def test_tensorop_needs_cc80():
    assert family(cc=75, cls="Sm80TensorOpGemm") == []
    assert family(cc=75, cls="SimtGemm")
    assert family(cc=100, cls="Sm80TensorOpGemm")


def test_discovery_prefers_aligned_configurations_and_falls_back_to_alignment_1():
    A, B, out = (operand(s, torch.bfloat16, False, "cpu") for s in ((2, 128, 64), (2, 64, 96), (2, 128, 96)))
    aligned = found(GemmArguments(A, B, out))
    # (classes are listed in registration order, which depends on what imported them first)
    tensorop = [k for k in aligned if type(k).__name__ == "Sm80TensorOpGemm"]
    assert tensorop and tensorop[0].metadata.operands.A.divisibility == 8
    # A shifted by one element: only alignment-1 SIMT configurations remain.
    A1 = operand((2, 128, 64), torch.bfloat16, False, "cpu", offset=1)
    args = GemmArguments(A1, B, out)
    fallback = found(args)
    assert fallback and all(type(k).__name__ == "SimtGemm" and k.metadata.operands.A.divisibility == 1
                            for k in fallback)
    # Odd K: A's rows are not 16-byte multiples, also alignment 1.
    A2, B2 = operand((67, 33), torch.bfloat16, False, "cpu"), operand((33, 96), torch.bfloat16, False, "cpu")
    assert all(k.metadata.operands.A.divisibility == 1 for k in found(GemmArguments(A2, B2, torch.empty(67, 96, dtype=torch.bfloat16))))


def test_misaligned_pointer_rejected_by_supports_of_aligned_kernels():
    A, B, out = (operand(s, torch.float32, False, "cpu") for s in ((64, 64), (64, 64), (64, 64)))
    good = GemmArguments(A, B, out)
    bad = GemmArguments(operand((64, 64), torch.float32, False, "cpu", offset=2), B, out)
    aligned = [k for k in family() if k.metadata.operands.A.divisibility > 1
               and k.metadata.operands.A.dtype is DataType.f32 and k.metadata.operands.A.layout == "t"
               and k.metadata.operands.B.layout == "t" and k.metadata.operands.out.layout == "t"]
    assert aligned
    for k in aligned:
        assert k.supports(good, cc=90), k.metadata.kernel_name
        status = k.supports(bad, cc=90)
        assert not status and "operand A" in status.error and "aligned" in status.error


def test_single_batch_with_misaligned_batch_stride_is_rejected():
    base = torch.randn(1 * 64 * 64 + 3, dtype=torch.float16)
    A = base.as_strided((1, 64, 64), (64 * 64 + 3, 64, 1))  # batch stride odd, rows aligned
    B = torch.randn(1, 64, 64, dtype=torch.float16)
    out = torch.empty(1, 64, 64, dtype=torch.float16)
    args = GemmArguments(A, B, out)
    for cls in FAMILY:
        k = _pick(cls, "f16f16", "ttt", align=8)
        status = k.supports(args, cc=90)
        assert not status and "operand A: batch stride" in status.error
    assert found(args) and all(k.metadata.operands.A.divisibility == 1 for k in found(args))


def test_every_epilogue_kind_is_discoverable():
    A, B, out = (operand(s, torch.float16, False, "cpu") for s in ((64, 32), (32, 48), (64, 48)))
    variants = [EpilogueArguments(alpha=2.0), EpilogueArguments(beta=1.0, C=torch.randn(64, 48).half()),
                EpilogueArguments(bias=torch.randn(48).half(), activation="relu"),
                EpilogueArguments(bias=torch.randn(64, 1).half(), activation="gelu"),
                EpilogueArguments(activation="silu")]
    for ep in variants:
        args = GemmArguments(A, B, out, epilogue=ep)
        ks = found(args)
        assert {type(k).__name__ for k in ks} == set(FAMILY), ep
        assert all(k.metadata.epilogue.supports(args.epilogue_signature) for k in ks)


def test_generate_kernels_honours_epilogue_args():
    from kernel_api.providers.cutedsl.gemm.common import epilogue_supported_by_generation
    from kernel_api.metadata import EpilogueMetadata

    full = len(family(cls="SimtGemm"))
    cls = type(family(cls="SimtGemm")[0])
    assert len(cls.generate_kernels(lambda m: True, EpilogueArguments(activation="gelu"), 90)) == full
    assert len(cls.generate_kernels(lambda m: m.operands.A.dtype is DataType.f64, None, 90)) == full // 4
    with pytest.raises(TypeError, match="epilogue_args"):
        cls.generate_kernels(lambda m: True, "relu", 90)
    # A kernel family without activations would have to emit nothing for a gelu epilogue.
    no_act = EpilogueMetadata(activations=frozenset())
    assert not epilogue_supported_by_generation(EpilogueArguments(activation="gelu"), no_act)
    assert epilogue_supported_by_generation(EpilogueArguments(alpha=2.0), no_act)


@pytest.mark.parametrize("make, exc, match", [
    (lambda A, B, out: EpilogueArguments(beta=0.5), ValueError, "beta=0.5 needs a C operand"),
    (lambda A, B, out: EpilogueArguments(activation="tanh"), ValueError, "unknown 'tanh'"),
    (lambda A, B, out: EpilogueArguments(alpha="2"), TypeError, "alpha"),
    (lambda A, B, out: GemmArguments(A, B, out, epilogue=EpilogueArguments(beta=1.0, C=torch.randn(64, 47).half())),
     ValueError, "operand C: shape"),
    (lambda A, B, out: GemmArguments(A, B, out, epilogue=EpilogueArguments(beta=1.0, C=torch.randn(64, 48))),
     TypeError, "operand C: dtype"),
    (lambda A, B, out: GemmArguments(A, B, out, epilogue=EpilogueArguments(
        beta=1.0, C=torch.randn(64, 48, device="meta").half())), ValueError, "operand C: on meta"),
    (lambda A, B, out: GemmArguments(A, B, out, epilogue=EpilogueArguments(bias=torch.randn(47).half())),
     ValueError, "operand bias: shape \\(47,\\)"),
    (lambda A, B, out: GemmArguments(A, B, out, epilogue=EpilogueArguments(bias=torch.randn(64, 2).half())),
     ValueError, "operand bias"),
    (lambda A, B, out: GemmArguments(A, B, out, epilogue=EpilogueArguments(bias=torch.randn(48).float())),
     TypeError, "operand bias: dtype"),
    (lambda A, B, out: GemmArguments(A, B, out, epilogue=EpilogueArguments(bias=torch.randn(48, device="meta").half())),
     ValueError, "operand bias: on meta"),
    (lambda A, B, out: GemmArguments(A, B, out, epilogue=EpilogueArguments(bias=torch.randn(96).half()[::2])),
     ValueError, "operand bias: elements must be contiguous"),
    (lambda A, B, out: GemmArguments(A, B, out, epilogue="relu"), TypeError, "epilogue: expected EpilogueArguments"),
])
def test_bad_epilogue_inputs_raise_clear_errors(make, exc, match):
    A, B, out = (operand(s, torch.float16, False, "cpu") for s in ((64, 32), (32, 48), (64, 48)))
    with pytest.raises(exc, match=match):
        make(A, B, out)


def test_compile_key_is_shared_across_sizes_and_alignments():
    k = family(cls="SimtGemm")[0]
    a1, _ = problem(k.metadata, 64, 64, 64, 2, 3, "cpu")
    a2, _ = problem(k.metadata, 128, 96, 256, 5, 3, "cpu")
    assert k.compile_key(a1, 90) == k.compile_key(a2, 90)
    a3, _ = problem(k.metadata, 64, 64, 64, 1, 2, "cpu")
    assert k.compile_key(a1, 90) != k.compile_key(a3, 90)
    a4, _ = problem(k.metadata, 64, 64, 64, 2, 3, "cpu", epilogue=dict(bias="row", activation="relu"))
    assert k.compile_key(a1, 90) != k.compile_key(a4, 90)


def test_compile_key_follows_c_layout_not_c_alignment():
    """The compile key names C's dtype and layout from the epilogue signature's C attributes (one
    artifact serves any C alignment, not any C layout)."""
    k = family(cls="SimtGemm")[0]
    args, _ = problem(k.metadata, 64, 64, 64, 1, 2, "cpu")
    keys, aligned = {}, {}
    for c_col in (False, True):
        for offset in (0, 1):
            C = operand((64, 64), args.out.dtype, c_col, "cpu", offset)
            with_c = GemmArguments(args.A, args.B, args.out, accumulator_type=args.accumulator_type,
                                   epilogue=EpilogueArguments(alpha=2.0, beta=1.0, C=C))
            keys[c_col, offset] = k.compile_key(with_c, 90)
            aligned[c_col, offset] = with_c.epilogue_signature.c_attributes.divisibility
    assert aligned[False, 0] > aligned[False, 1] == 1  # the C operands do differ in alignment
    assert keys[False, 0] == keys[False, 1] and keys[True, 0] == keys[True, 1]
    assert keys[False, 0] != keys[True, 0]


def test_run_on_cpu_tensors_raises_device_error():
    k = family(cls="SimtGemm")[0]
    args, _ = problem(k.metadata, 8, 8, 8, 1, 3, "cpu")
    with pytest.raises(kernel_api.errors.DeviceError, match="CUDA"):
        k.run(args)


def test_every_gemm_family_is_written_against_the_template():
    """The three families leave compile, run and the shared checks to GemmKernelBase; the
    realigned wrapper keeps the shared checks and compiles/launches its inner Sm90 kernel."""
    from kernel_api.providers.cutedsl.gemm.common import GemmKernelBase

    classes = {type(k) for k in kernel_api.get_kernels(None, cc=90, providers="cutedsl")
               if k.metadata.kernel_class.__name__.endswith("Gemm")}
    assert {c.__name__ for c in classes} == {"SimtGemm", "Sm80TensorOpGemm", "Sm90WarpSpecializedGemm",
                                             "Sm90RealignedGemm"}
    for cls in classes:
        assert issubclass(cls, GemmKernelBase), cls
        own = {"compile", "_run"} if cls.__name__ == "Sm90RealignedGemm" else set()
        assert {"compile", "_run", "_supports", "_common_supports"} & set(vars(cls)) == own, cls


def test_template_hooks_add_launch_arguments_and_checks():
    """A family's extra launch arguments go between beta and the stream; its own checks run
    after the shared ones (a recording stub stands in for the compiled function)."""
    from cuda.bindings import driver
    from kernel_api import CompiledArtifact
    from kernel_api.core.status import Status

    simt = _pick("SimtGemm", "f16f16", "ttt", align=8)

    class Counted(type(simt)):
        def _extra_launch_args(self, args, workspace):
            return (args.K, workspace)

        def _family_supports(self, args):
            return Status.fail("N=40 is not for this family") if args.N == 40 else None

    kernel = Counted(simt.metadata)
    A, B, out = (operand(s, torch.float16, False, "cpu") for s in ((64, 32), (32, 48), (64, 48)))
    calls, stream = [], driver.CUstream(0)
    artifact = CompiledArtifact(lambda *a: calls.append(a), kernel, 90)
    args = GemmArguments(A, B, out)
    kernel._run(args, artifact, stream, "ws")
    assert calls == [(A, B, out, None, None, 1.0, 0.0, 32, "ws", stream)]
    ep = EpilogueArguments(alpha=2.0, beta=0.5, C=torch.randn(64, 48).half())
    kernel._run(GemmArguments(A, B, out, epilogue=ep), artifact, stream)
    assert calls[1][3:] == (ep.C, None, 2.0, 0.5, 32, None, stream)
    assert kernel.supports(args, cc=90)
    status = kernel.supports(GemmArguments(A, B[:, :40], out[:, :40]), cc=90)
    assert not status and status.error == "N=40 is not for this family"
    # the shared checks come first: a misaligned single-batch stride is named before the family's
    flat = torch.randn(64 * 32 + 3).half()
    A3 = flat.as_strided((1, 64, 32), (64 * 32 + 3, 32, 1))
    status = kernel.supports(GemmArguments(A3, B[None, :, :40], out[None, :, :40]), cc=90)
    assert not status and "operand A: batch stride 2051" in status.error


def _pick(cls, types, layouts, align=None, tile=None):
    for k in family(cls=cls):
        ops = k.metadata.operands
        if (f"{ops.A.dtype}{ops.out.dtype}" == types and ops.A.layout + ops.B.layout + ops.out.layout == layouts
                and (align is None or ops.A.divisibility == align)
                and (tile is None or k.metadata.design.tile_shape == tile)):
            return k
    raise LookupError((cls, types, layouts, align, tile))


# A representative subset (all compile the same code paths as the full GPU sweep).
COMPILES = [
    ("SimtGemm", "f64f64", "ttt", 2, None, 3, None),
    ("SimtGemm", "f16f16", "ntn", 1, None, 2, None),
    ("SimtGemm", "bf16bf16", "tnt", 8, None, 3, dict(alpha=2.0, beta=0.5, C=True, bias="row", activation="gelu")),
    ("Sm80TensorOpGemm", "bf16bf16", "tnt", None, (128, 256, 64), 3, None),
    ("Sm80TensorOpGemm", "f16f32", "nnn", None, (64, 128, 32), 2, dict(bias="column", activation="silu")),
    ("Sm80TensorOpGemm", "f32f32", "ntn", None, (128, 128, 32), 3, None),
    ("Sm80TensorOpGemm", "f64f64", "tnt", 1, (64, 64, 16), 3, dict(alpha=2.0, beta=-1.0, C=True, activation="relu")),
]


@pytest.mark.parametrize("cls, types, layouts, align, tile, rank, epilogue", COMPILES)
def test_compiles_for_sm90a_without_a_gpu(cls, types, layouts, align, tile, rank, epilogue):
    k = _pick(cls, types, layouts, align, tile)
    args, _ = problem(k.metadata, 72, 48, 40, 2 if rank == 3 else 1, rank, "cpu", epilogue)
    assert k.supports(args, cc=90), k.supports(args, cc=90).error
    artifact = k.compile(args, cc=90)
    assert artifact.kernel is k and artifact.cc == 90 and artifact.compiled_obj is not None


@pytest.mark.parametrize("cc, expected", [(90, {(128, 128): 16, (64, 64): 8}), (80, {(128, 128): 4, (64, 64): 4})])
def test_f64_instances_pick_the_measured_dmma_shape(cc, expected):
    """The f64 configurations name their sm_90 DMMA (m16n8k16 for the 128x128 tile, m16n8k8 for
    the 64x64 one, the faster shape of each as measured); before sm_90 only m8n8k4 exists."""
    from kernel_api.kernel import compile_target_cc

    kernels = [k for k in family(cc=cc, cls="Sm80TensorOpGemm") if k.metadata.operands.A.dtype is DataType.f64]
    assert len(kernels) == 2 * 8 * len(expected)  # alignments x layouts x tiles
    token = compile_target_cc.set(cc)
    try:
        for k in kernels:
            args, _ = problem(k.metadata, 33, 17, 9, 1, 2, "cpu")
            impl = k._make_impl(args)
            assert impl.mma_k == expected[k.metadata.design.tile_shape[:2]], k.metadata.kernel_name
    finally:
        compile_target_cc.reset(token)
