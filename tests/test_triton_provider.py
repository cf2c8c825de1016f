"""The Triton provider on the CPU: registration and its errors, instances per configuration with
their metadata, discovery and explain, compiling for cc=90 without a GPU (a cubin, cached on
disk and reused), and that the provider imports no triton until it compiles."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import kernel_api  # noqa: E402
from kernel_api import SoftmaxArguments  # noqa: E402
from kernel_api.core.cache import DiskCache  # noqa: E402
from kernel_api.core.errors import ArtifactNotCachedError, CompilationError, RegistrationError  # noqa: E402
from kernel_api.kernel import cache_only, compile_from_cache_only  # noqa: E402
from kernel_api.metadata import softmax_operands  # noqa: E402
from kernel_api.providers.triton import TritonDesignMetadata, TritonKernel, TritonProvider  # noqa: E402
from kernel_api.providers.triton import compiler as triton_compiler  # noqa: E402

import triton_example_kernels as examples  # noqa: E402


@pytest.fixture(scope="module")
def families():
    row, looped = examples.define_kernels()
    yield row, looped
    examples.unregister(row, looped)


def meta_args(rows: int = 37, cols: int = 1000, dtype=torch.float32, offset: int = 0) -> SoftmaxArguments:
    x = torch.empty(rows * cols + offset, device="meta", dtype=dtype)[offset:].view(rows, cols)
    return SoftmaxArguments(x, torch.empty(rows, cols, device="meta", dtype=dtype))


def names(kernels) -> list[str]:
    return [k.metadata.kernel_name for k in kernels]


# ---- registration --------------------------------------------------------------------------
def test_a_class_without_a_jit_function_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"NoJit: set `jit_function` to a @triton.jit function") as info:
        @TritonProvider.register
        class NoJit(TritonKernel):
            supported_args_type = SoftmaxArguments
            operands = softmax_operands

            def launch_args(self, args):
                return (), {}

            def grid(self, args):
                return (1,)
    assert isinstance(info.value, RegistrationError)
    assert "NoJit" not in [c.__name__ for c in TritonProvider.kernel_classes()]


def test_a_plain_function_is_no_jit_function():
    with pytest.raises(RegistrationError, match=r"PlainFn: set `jit_function`"):
        @TritonProvider.register
        class PlainFn(TritonKernel):
            jit_function = staticmethod(lambda x: x)
            supported_args_type = SoftmaxArguments
            operands = softmax_operands

            def launch_args(self, args):
                return (), {}

            def grid(self, args):
                return (1,)


def test_a_config_naming_no_parameter_and_missing_hooks_are_refused():
    with pytest.raises(RegistrationError, match=r"BadConfig: a config sets \['BLOCKK'\], which row_softmax has no"):
        @TritonProvider.register
        class BadConfig(TritonKernel):
            jit_function = examples.row_softmax
            configs = [triton.Config({"BLOCKK": 64})]
            supported_args_type = SoftmaxArguments
            operands = softmax_operands

            def launch_args(self, args):
                return (), {}

            def grid(self, args):
                return (1,)
    with pytest.raises(RegistrationError, match=r"NoGrid does not implement abstract method\(s\): grid"):
        @TritonProvider.register
        class NoGrid(TritonKernel):
            jit_function = examples.row_softmax
            supported_args_type = SoftmaxArguments
            operands = softmax_operands

            def launch_args(self, args):
                return (), {}
    with pytest.raises(RegistrationError, match=r"NoOperands: set `operands`"):
        @TritonProvider.register
        class NoOperands(TritonKernel):
            jit_function = examples.row_softmax
            supported_args_type = SoftmaxArguments

            def launch_args(self, args):
                return (), {}

            def grid(self, args):
                return (1,)


# ---- instances and their metadata ----------------------------------------------------------
def test_one_instance_per_config_dtype_and_alignment(families):
    row, looped = families
    kernels = row.generate_kernels(None, cc=90)
    assert len(kernels) == 2 * 3 * 2  # configs x dtypes x alignments
    by_name = {k.metadata.kernel_name: k for k in kernels}
    k = by_name["TritonRowSoftmax_f16_w8_s3_a16"]
    design = k.metadata.design
    assert isinstance(design, TritonDesignMetadata)
    assert (design.num_warps, design.num_stages, design.alignment, design.threads) == (8, 3, 16, 256)
    assert k.metadata.operands.x.divisibility == 8 and k.metadata.provider == "triton"
    assert by_name["TritonRowSoftmax_f16_w8_s3_a1"].metadata.operands.x.divisibility == 1
    assert k.metadata.min_cc == 80 and row.generate_kernels(None, cc=75) == []


def test_an_autotuned_function_lends_its_configs(families):
    _, looped = families
    designs = {k.metadata.design for k in looped.generate_kernels(None, cc=90) if k.dtype is kernel_api.DataType.f32}
    assert {(d.block_sizes["BLOCK"], d.num_warps, d.num_stages) for d in designs} == {(512, 4, 2), (2048, 8, 3)}
    k = next(k for k in looped.generate_kernels(None, cc=90) if k.metadata.design.block_sizes == {"BLOCK": 512})
    assert k.meta == {"BLOCK": 512}


# ---- discovery and explain -----------------------------------------------------------------
def test_get_kernels_finds_them_on_meta_tensors(families):
    found = names(kernel_api.get_kernels(meta_args(), cc=90, providers=["triton"]))
    assert "TritonRowSoftmax_f32_w4_s3_a16" in found and "TritonLoopedSoftmax_f32_BLOCK2048_w8_s3_a1" in found
    assert all(n.split("_")[1] == "f32" for n in found)
    # beside the other providers
    everyone = kernel_api.get_kernels(meta_args(), cc=90)
    assert {"triton", "cuda_src"} <= {k.metadata.provider for k in everyone}


def test_unaligned_operands_find_the_unaligned_instances_only(families):
    found = names(kernel_api.get_kernels(meta_args(cols=999, offset=1), cc=90, providers=["triton"]))
    assert found and all(n.endswith("_a1") for n in found)


def test_supports_and_explain_name_them(families):
    args = meta_args(rows=2, cols=20000)
    found = names(kernel_api.get_kernels(args, cc=90, providers=["triton"]))
    assert found and all(n.startswith("TritonLoopedSoftmax") for n in found)
    text = kernel_api.explain(args, cc=90, providers=["triton"]).all()
    assert "triton/TritonRowSoftmax" in text and "exceed its 16384" in text
    assert "TritonLoopedSoftmax_f32_BLOCK512_w4_s2_a16" in str(kernel_api.explain(meta_args(), cc=90))


# ---- compile without a GPU -----------------------------------------------------------------
def _instance(row, name):
    return next(k for k in row.generate_kernels(None, cc=90) if k.metadata.kernel_name == name)


def test_compile_for_cc90_makes_a_cubin_cached_on_disk_and_reused(families):
    row, _ = families
    kernel = _instance(row, "TritonRowSoftmax_f32_w4_s3_a16")
    args = meta_args()
    artifact = kernel.compile(args, cc=90)
    binary = artifact.compiled_obj
    assert artifact.cc == 90 and artifact.kernel is kernel
    assert binary.cubin[:4] == b"\x7fELF" and not binary.cache_hit
    assert binary.metadata["num_warps"] == 4 and binary.metadata["target"]["arch"] == 90
    assert binary.spec.aligned == ("out_ptr", "x_ptr")
    assert dict(binary.spec.constexprs) == {"BLOCK": 1024}
    # A fresh DiskCache reads the entry back; a new compile (no in-process memo) loads it.
    assert DiskCache("triton").get(binary.key)[4:5] == b"{"
    triton_compiler.clear_memory_cache()
    again = compile_from_cache_only(kernel, args, 90).compiled_obj
    assert again.cache_hit and again.cubin == binary.cubin and again.metadata == binary.metadata


def test_the_cached_artifact_becomes_tritons_own_compiled_kernel(families):
    """What a launch loads (on a GPU, once per device): Triton's CompiledKernel, rebuilt from the
    cubin and metadata read back from the disk cache."""
    row, _ = families
    kernel = _instance(row, "TritonRowSoftmax_f16_w8_s3_a16")
    args = meta_args(dtype=torch.float16)
    fresh = kernel.compile(args, cc=90).compiled_obj
    triton_compiler.clear_memory_cache()
    binary = compile_from_cache_only(kernel, args, 90).compiled_obj
    assert binary.cache_hit
    compiled = binary.compiled_kernel()
    assert compiled.kernel == fresh.cubin and compiled.name == "row_softmax"
    assert (compiled.metadata.num_warps, compiled.metadata.shared) == (8, fresh.metadata["shared"])
    assert compiled.metadata.target.arch == 90 and compiled.hash == fresh.metadata["hash"]
    assert list(compiled.src.signature.values()) == ["*fp16", "*fp16", "i32", "i32", "i32", "constexpr"]
    assert compiled.src.constants == {(5,): 1024} and compiled.function is None  # not loaded: no GPU


def test_nothing_cached_under_cache_only_raises(families):
    row, _ = families
    kernel = _instance(row, "TritonRowSoftmax_bf16_w8_s3_a1")
    args = meta_args(dtype=torch.bfloat16)
    assert compile_from_cache_only(kernel, args, 90) is None
    token = cache_only.set(True)
    try:
        with pytest.raises(ArtifactNotCachedError, match="TritonRowSoftmax_bf16_w8_s3_a1"):
            kernel.compile(args, cc=90)
    finally:
        cache_only.reset(token)


def test_the_compile_key_follows_the_constexprs_and_types(families):
    row, _ = families
    kernel = _instance(row, "TritonRowSoftmax_f32_w4_s3_a16")
    key = kernel.compile_key(meta_args(cols=1000), 90)
    assert key == kernel.compile_key(meta_args(rows=5, cols=900), 90)  # the same BLOCK, i32 values
    assert key != kernel.compile_key(meta_args(cols=1100), 90)  # BLOCK 2048
    assert key != kernel.compile_key(meta_args(cols=1000), 100)


def test_ints_that_are_multiples_of_16_are_specialised_as_tritons_jit_does(families):
    row, _ = families
    kernel = _instance(row, "TritonRowSoftmax_f32_w4_s3_a16")
    assert kernel.spec(meta_args(cols=1024), 90).aligned == ("out_ptr", "x_ptr", "x_row_stride", "out_row_stride",
                                                              "n_cols")
    assert kernel.compile_key(meta_args(cols=1024), 90) != kernel.compile_key(meta_args(cols=1000), 90)


def test_an_artifact_compiled_for_other_arguments_is_refused_before_launching(families):
    from kernel_api.core.errors import UnsupportedArgumentsError

    row, _ = families
    kernel = _instance(row, "TritonRowSoftmax_f32_w4_s3_a16")
    artifact = kernel.compile(meta_args(cols=1000), cc=90)
    with pytest.raises(UnsupportedArgumentsError, match=r"compiled artifact is for .*BLOCK=1024.*need .*BLOCK=4096"):
        kernel._run(meta_args(cols=3000), artifact, 0)
    with pytest.raises(UnsupportedArgumentsError, match=r"16-aligned: out_ptr, x_ptr, x_row_stride"):
        kernel._launcher(meta_args(cols=1008), artifact)


def test_the_unaligned_instance_compiles_without_alignment(families):
    row, _ = families
    kernel = _instance(row, "TritonRowSoftmax_f32_w4_s3_a1")
    binary = kernel.compile(meta_args(cols=999, offset=1), cc=90).compiled_obj
    assert binary.spec.aligned == () and binary.cubin[:4] == b"\x7fELF"


def test_a_triton_error_is_a_compilation_error_naming_the_instance():
    @triton.jit
    def broken(out_ptr, BLOCK: tl.constexpr):
        tl.store(out_ptr + tl.arange(0, BLOCK), undefined_name)  # noqa: F821

    class Broken(TritonKernel):
        jit_function = broken
        supported_args_type = SoftmaxArguments
        operands = softmax_operands
        configs = [triton.Config({"BLOCK": 64})]

        def launch_args(self, args):
            return (args.out,), {}

        def grid(self, args):
            return (1,)

    kernel = Broken.generate_kernels(None, cc=90)[0]
    with pytest.raises(CompilationError, match=r"Broken_f32_BLOCK64_w4_s3_a16: Triton .* could not compile broken"):
        kernel.compile(meta_args(), cc=90)


def test_launch_args_that_do_not_fit_the_function_name_the_parameter(families):
    row, _ = families

    class Twice(row):
        def launch_args(self, args):
            return (args.out, args.x, 1, 1, args.cols, 64), {"BLOCK": 64}

    kernel = Twice.generate_kernels(None, cc=90)[0]
    with pytest.raises(TypeError, match="parameter BLOCK of row_softmax is given twice"):
        kernel.compile_key(meta_args(), 90)

    class Missing(row):
        def launch_args(self, args):
            return (args.out, args.x), {}

    with pytest.raises(TypeError, match="no value for parameter x_row_stride of row_softmax"):
        Missing.generate_kernels(None, cc=90)[0].compile_key(meta_args(), 90)


def test_a_cc_below_the_family_is_refused(families):
    row, _ = families
    kernel = _instance(row, "TritonRowSoftmax_f32_w4_s3_a16")
    with pytest.raises(CompilationError):
        kernel.compile(meta_args(), cc=75)


# ---- layers --------------------------------------------------------------------------------
def test_importing_the_provider_imports_no_triton():
    code = ("import sys, kernel_api.providers.triton as p, kernel_api\n"
            "assert 'triton' not in sys.modules, sorted(m for m in sys.modules if m.startswith('triton'))\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(examples.__file__).rsplit("/tests/", 1)[0])


# ---- the launch path, with Triton's launch stubbed (the real one needs a GPU) ---------------
class _Recorder:
    """Stands in for `TritonBinary`'s GPU side: records what a launch would get."""

    def __init__(self, spec):
        self.spec = spec
        self.launches = []

    def kernel_on(self, device):
        return None

    def launch(self, device, grid, stream, values, label):
        self.launches.append((device, grid, stream, values, label))


def test_the_launcher_passes_the_call_operands_and_keeps_none(families, monkeypatch):
    import weakref

    from kernel_api.core.artifact import CompiledArtifact
    from kernel_api.providers.triton import kernel as kernel_module

    row, _ = families
    monkeypatch.setattr(kernel_module, "_device_index", lambda args: 0)
    kernel = _instance(row, "TritonRowSoftmax_f32_w8_s3_a16")
    x = torch.empty(6, 300, dtype=torch.float32)
    out = torch.empty_like(x)
    args = SoftmaxArguments(x, out)
    recorder = _Recorder(kernel.spec(args, 90))
    artifact = CompiledArtifact(recorder, kernel, 90)
    launcher = kernel._launcher(args, artifact)
    assert launcher is not None and launcher.tail == () and not launcher.ffi
    x2, out2 = torch.empty_like(x), torch.empty_like(out)
    launcher.function(x2, out2, 7)
    device, grid, stream, values, label = recorder.launches[-1]
    assert (device, grid, stream, label) == (0, (6, 1, 1), 7, "TritonRowSoftmax_f32_w8_s3_a16")
    assert values[0] is out2 and values[1] is x2 and values[2:] == (300, 300, 300, 512)
    # The recorded launch holds no operand of the arguments it was made from.
    ref = weakref.ref(x)
    del args, x
    assert ref() is None
    args = SoftmaxArguments(x2, out2)
    kernel._run(args, artifact, 5)
    assert recorder.launches[-1][3][:2] == (out2, x2) and recorder.launches[-1][2] == 5


def test_a_scratch_buffer_is_kept_by_the_launcher(families, monkeypatch):
    """A value the jit function stores and nobody reads (a library's per-row statistics) goes to
    a `scratch_buffer`: one per device, dtype and size, which the recorded launch holds."""
    from kernel_api.core.artifact import CompiledArtifact
    from kernel_api.providers.triton import kernel as kernel_module, scratch_buffer

    row, _ = families
    monkeypatch.setattr(kernel_module, "_device_index", lambda args: 0)
    assert scratch_buffer("cpu") is scratch_buffer(torch.device("cpu"), 1, torch.float32)
    assert scratch_buffer("cpu", 4) is not scratch_buffer("cpu") and scratch_buffer("cpu", 4).shape == (4,)

    class WithScratch(row):
        def launch_args(self, args):  # the scratch in x's place: written, never an operand
            return (args.out, scratch_buffer(args.device), 0, args.cols, args.cols), {"BLOCK": 64}

    kernel = WithScratch.generate_kernels(None, cc=90)[0]
    args = SoftmaxArguments(torch.empty(2, 64), torch.empty(2, 64))
    recorder = _Recorder(kernel.spec(args, 90))
    launcher = kernel._launcher(args, CompiledArtifact(recorder, kernel, 90))
    assert launcher is not None
    out2 = torch.empty(2, 64)
    launcher.function(torch.empty(2, 64), out2, 3)
    values = recorder.launches[-1][3]
    assert values[0] is out2 and values[1] is scratch_buffer("cpu") and values[2] == 0


def test_no_launcher_for_a_tensor_that_is_no_operand_or_an_empty_grid(families, monkeypatch):
    from kernel_api.core.artifact import CompiledArtifact
    from kernel_api.providers.triton import kernel as kernel_module

    row, _ = families
    monkeypatch.setattr(kernel_module, "_device_index", lambda args: 0)
    scratch = torch.empty(4)

    class WithScratch(row):
        def launch_args(self, args):
            return (args.out, scratch, 1, 1, args.cols), {"BLOCK": 64}

    kernel = WithScratch.generate_kernels(None, cc=90)[0]
    args = SoftmaxArguments(torch.empty(2, 64), torch.empty(2, 64))
    assert kernel._launcher(args, CompiledArtifact(_Recorder(kernel.spec(args, 90)), kernel, 90)) is None
    empty = SoftmaxArguments(torch.empty(0, 64), torch.empty(0, 64))
    recorder = _Recorder(_instance(row, "TritonRowSoftmax_f32_w4_s3_a16").spec(empty, 90))
    plain = _instance(row, "TritonRowSoftmax_f32_w4_s3_a16")
    assert plain._launcher(empty, CompiledArtifact(recorder, plain, 90)) is None
    plain._run(empty, CompiledArtifact(recorder, plain, 90), 0)
    assert recorder.launches == []
