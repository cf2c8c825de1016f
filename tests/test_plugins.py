"""The plugin packages under examples/plugins on the CPU: each declares its entry point, version
and library range; loaded through those entry points it registers its provider and kernels; a
missing or out-of-range library is reported in plugin_errors() and discovery goes on; metadata
and supports say what the wrapped kernels take (with one-line reasons); Liger's kernels compile
for sm_90 without a GPU, and the others say why they cannot; explain and the provider versions
(tuning records' keys) see every provider.

The plugins are not installed: their folders go on sys.path, as an editable install would."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest
import torch

import kernel_api
from kernel_api import (AttentionArguments, CompilationError, GemmArguments, LayerNormArguments, RMSNormArguments,
                        SoftmaxArguments, SoftmaxBackwardArguments)
from kernel_api.registry import Registry, default_registry
from kernel_api.registry.versions import provider_versions
from kernel_api.providers.torch_ops import TorchProvider
from kernel_api.providers.torch_ops.kernels import TorchSoftmax

import plugin_packages as pp

pytest.importorskip("tomllib")
ALL = tuple(pp.PACKAGES)


INSTALLED = tuple(p for p in ALL if pp.installed(p))


@pytest.fixture(scope="module")
def plugins():
    """Every plugin whose library is installed, imported into the default registry for this module."""
    modules = pp.load_into_default(*INSTALLED)
    yield modules
    pp.unload(*INSTALLED)


def _names(args, provider, cc=90):
    return [k.metadata.kernel_name for k in kernel_api.get_kernels(args, providers=provider, cc=cc)]


def _need(*providers):
    missing = [p for p in providers if p not in INSTALLED]
    if missing:
        pytest.skip(f"library not installed for {missing}")


def meta(*shape, dtype=torch.bfloat16, offset=0):
    n = 1
    for s in shape:
        n *= s
    return torch.empty(n + offset, device="meta", dtype=dtype)[offset:].view(*shape)


# ---- packaging: entry point, version, library range ------------------------------------------
@pytest.mark.parametrize("provider", ALL)
def test_each_package_declares_its_entry_point_version_and_library_range(provider):
    project = pp.pyproject(provider)["project"]
    package = pp.PACKAGES[provider][1]
    assert project["name"] == pp.PACKAGES[provider][0]
    [ep] = pp.entry_points(provider)
    assert (ep.name, ep.value, ep.group) == (provider, package, "kernel_api.providers")
    library = pp.library(provider)
    assert project["version"] == library.PLUGIN_VERSION
    low, high = library.SUPPORTED
    # the dependency pip resolves is the range the import checks (one range, stated twice)
    wanted = [d for d in project["dependencies"] if d.startswith(library.DISTRIBUTION)]
    assert len(wanted) == 1 and wanted[0].replace(" ", "").split(">=")[1].split(",<")[1] == high
    assert library.release(wanted[0].split(">=")[1].split(",")[0]) == library.release(low)
    assert any(d.startswith("kernel-api") for d in project["dependencies"])
    assert pp.pyproject(provider)["tool"]["setuptools"]["packages"]["find"]["include"] == [f"{package}*"]


def test_release_numbers_ignore_pre_releases_and_local_parts():
    release = pp.library("liger").release
    assert release("0.8.5") == (0, 8, 5)
    assert release("4.0.0b36") == (4, 0, 0)
    assert release("2.11.0+cu128") == (2, 11, 0)
    assert release("1.2.dev3") == (1, 2)


# ---- loading through the entry points -----------------------------------------------------------
@pytest.mark.parametrize("provider", INSTALLED)
def test_the_entry_point_registers_the_provider_in_a_registry_of_its_own(provider):
    registry = Registry()
    with pp.on_path(provider):
        registry.load_plugins(pp.entry_points(provider))
    try:
        assert registry.plugin_errors() == {}
        assert provider in registry.available_providers()
        found = registry.get_provider(provider)
        classes = registry.kernel_classes(found)
        assert classes and all(c.__module__.startswith(pp.PACKAGES[provider][1]) for c in classes)
        # the version holds the plugin's and the library's: a new release of either re-tunes
        library = pp.library(provider)
        version = importlib.metadata.version(library.DISTRIBUTION)
        assert found.version.startswith(f"{library.PLUGIN_VERSION}+{library.DISTRIBUTION}-{version}")
    finally:
        pp.forget_modules(provider)


@pytest.mark.parametrize("provider", ALL)
def test_a_missing_library_is_reported_and_discovery_goes_on(provider, monkeypatch):
    module = pp.PACKAGES[provider][2]
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    registry = Registry()
    registry.register_provider(TorchProvider)
    registry.register(TorchSoftmax, TorchProvider)
    with pp.on_path(provider):
        registry.load_plugins(pp.entry_points(provider))
    try:
        errors = registry.plugin_errors()
        [(label, message)] = errors.items()
        assert label.startswith(provider) and "ImportError" in message or "ModuleNotFoundError" in message
        assert provider not in registry.available_providers()
        x = torch.randn(4, 8)
        assert registry.get_kernels(SoftmaxArguments(x, torch.empty_like(x)))  # the torch provider still serves
    finally:
        pp.forget_modules(provider)


@pytest.mark.parametrize("provider", ALL)
def test_a_library_outside_the_range_is_refused_naming_both_versions(provider, monkeypatch):
    library = pp.library(provider)
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "99.0" if name == library.DISTRIBUTION else real(name))
    registry = Registry()
    with pp.on_path(provider):
        registry.load_plugins(pp.entry_points(provider))
    try:
        [(label, message)] = registry.plugin_errors().items()
        low, high = library.SUPPORTED
        assert f"wraps {library.DISTRIBUTION}>={low},<{high}; 99.0 is installed" in message
        assert provider not in registry.available_providers()
    finally:
        pp.forget_modules(provider)


# ---- Liger ------------------------------------------------------------------------------------
def test_liger_rms_norm_takes_liger_s_warps_and_refuses_the_rest_with_the_reason(plugins):
    _need("liger")
    x = meta(37, 4096)
    args = RMSNormArguments(x, meta(4096), meta(37, 4096))
    assert _names(args, "liger") == ["LigerRMSNorm_bf16_w8_s3_a16", "LigerRMSNorm_bf16_w8_s3_a1"]
    text = kernel_api.explain(args, providers="liger", cc=90).all()
    assert "Liger runs rows of 4096 elements with 8 warps, this instance with 4" in text
    f32_weight = RMSNormArguments(x, meta(4096, dtype=torch.float32), meta(37, 4096))
    assert _names(f32_weight, "liger")[0] == "LigerRMSNormF32Weight_bf16_w8_s3_a16"
    long_rows = RMSNormArguments(meta(2, 70000), meta(70000), meta(2, 70000))
    assert _names(long_rows, "liger") == []
    assert "at most 65536" in kernel_api.explain(long_rows, providers="liger", cc=90).all()
    odd = RMSNormArguments(meta(5, 1001, offset=1), meta(1001), meta(5, 1001))
    assert _names(odd, "liger") == ["LigerRMSNorm_bf16_w4_s3_a1"]  # any alignment: masked loads
    residual = RMSNormArguments(x, meta(4096), meta(37, 4096), residual=meta(37, 4096), residual_out=meta(37, 4096))
    assert _names(residual, "liger") == ["LigerFusedAddRMSNorm_bf16_w8_s3_a16", "LigerFusedAddRMSNorm_bf16_w8_s3_a1"]
    assert "operand residual: Liger's fused-add kernel needs one" in \
        kernel_api.explain(args, providers="liger", cc=90).all()


def test_liger_layer_norm_and_its_metadata(plugins):
    _need("liger")
    args = LayerNormArguments(meta(3, 5, 768, dtype=torch.float16), meta(768), meta(768), meta(3, 5, 768,
                                                                                               dtype=torch.float16))
    assert _names(args, "liger") == []  # weight bf16 under f16 rows: no instance
    w = meta(768, dtype=torch.float32)
    args = LayerNormArguments(meta(3, 5, 768, dtype=torch.float16), w, w, meta(3, 5, 768, dtype=torch.float16))
    [first, _] = kernel_api.get_kernels(args, providers="liger", cc=90)
    assert first.metadata.kernel_name == "LigerLayerNormF32Weight_f16_w4_s3_a16"
    assert first.metadata.operands.max_cols == 65536 and not first.metadata.operands.residual
    assert first.metadata.design.num_warps == 4 and first.metadata.min_cc == 80


@pytest.mark.parametrize("cls_name,make", [
    ("LigerRMSNorm", lambda: RMSNormArguments(meta(37, 4096), meta(4096), meta(37, 4096))),
    ("LigerLayerNorm", lambda: LayerNormArguments(meta(6, 1000, dtype=torch.float32), meta(1000, dtype=torch.float32),
                                                  meta(1000, dtype=torch.float32), meta(6, 1000, dtype=torch.float32))),
])
def test_liger_kernels_compile_for_sm90_without_a_gpu(plugins, cls_name, make):
    _need("liger")
    args = make()
    kernel = kernel_api.get_kernels(args, providers="liger", cc=90)[0]
    artifact = kernel.compile(args, cc=90)
    assert artifact.cc == 90
    binary = artifact.compiled_obj
    assert binary.spec.cc == 90 and "casting_mode" in dict(binary.spec.constexprs) or cls_name == "LigerLayerNorm"
    assert dict(binary.spec.constexprs)["BLOCK_SIZE"] == (4096 if cls_name == "LigerRMSNorm" else 1024)


def test_liger_launcher_keeps_the_statistics_scratch_and_no_operand(plugins, monkeypatch):
    _need("liger")
    from kernel_api.providers.triton import kernel as triton_kernel

    monkeypatch.setattr(triton_kernel, "_device_index", lambda args: 0)
    x = torch.randn(4, 64)
    args = RMSNormArguments(x, torch.randn(64), torch.empty_like(x))
    kernel = kernel_api.get_kernels(args, providers="liger", cc=90)[0]
    artifact = kernel.compile(args, cc=90)
    calls = []

    class Binary:
        spec = artifact.compiled_obj.spec

        def kernel_on(self, device):
            return None

        def launch(self, device, grid, stream, values, label):
            calls.append((grid, values))

    from kernel_api.core.artifact import CompiledArtifact

    launcher = kernel._launcher(args, CompiledArtifact(Binary(), kernel, 90))
    assert launcher is not None
    x2, out2 = torch.randn(4, 64), torch.empty(4, 64)
    launcher.function(x2, args.weight, out2, 0)
    (grid, values), = calls
    assert grid == (4, 1, 1) and values[0] is out2 and values[2] is x2
    assert values[6] is triton_kernel.scratch_buffer(torch.device("cpu")) and values[7] == 0


def test_liger_gated_activations_walk_rows_with_one_stride(plugins):
    _need("liger")
    from kernel_api.arguments.activations import GatedActivationArguments

    dense = GatedActivationArguments(meta(8, 100, 11008), meta(8, 100, 11008), meta(8, 100, 11008))
    assert _names(dense, "liger") == ["LigerSwiGLU_bf16_w16_s3_a16", "LigerSwiGLU_bf16_w16_s3_a1"]
    geglu = GatedActivationArguments(meta(4, 1000), meta(4, 1000), meta(4, 1000), activation="gelu_tanh")
    assert _names(geglu, "liger")[0] == "LigerGeGLU_bf16_w4_s3_a16"
    erf = GatedActivationArguments(meta(4, 1000), meta(4, 1000), meta(4, 1000), activation="gelu")
    assert _names(erf, "liger") == []
    gate, up = meta(8, 100, 2 * 11008).chunk(2, -1)
    halves = GatedActivationArguments(gate, up, meta(8, 100, 11008))
    assert _names(halves, "liger") == []
    assert "operand out: Liger walks gate, up and out with one row stride; theirs differ" in \
        str(kernel_api.explain(halves, providers="liger", cc=90))
    kernel = kernel_api.get_kernels(dense, providers="liger", cc=90)[0]
    spec = kernel.compile(dense, cc=90).compiled_obj.spec
    assert dict(spec.constexprs) == {"n_cols": 11008, "BLOCK_SIZE": 16384}


def test_liger_linear_cross_entropy_is_a_candidate_beside_ours(plugins):
    _need("liger")
    from kernel_api.arguments.cross_entropy import LinearCrossEntropyArguments

    args = LinearCrossEntropyArguments(meta(1000, 512), meta(32000, 512), torch.empty(1000, dtype=torch.long,
                                                                                       device="meta"),
                                       meta(1000, dtype=torch.float32), grad_hidden=meta(1000, 512),
                                       grad_loss=torch.empty((), device="meta").expand(1000))
    assert _names(args, "liger") == ["LigerLinearCrossEntropy_bf16_i64"]
    assert "TorchLinearCrossEntropy_bf16_i64" in [k.metadata.kernel_name for k in kernel_api.get_kernels(args, cc=90)]


# ---- QuACK --------------------------------------------------------------------------------------
def test_quack_softmax_requires_the_alignment_quack_compiles_in(plugins):
    _need("quack")
    args = SoftmaxArguments(meta(64, 1024), meta(64, 1024))
    assert _names(args, "quack") == ["QuackSoftmax_bf16"]
    misaligned = SoftmaxArguments(meta(64, 1024, offset=2), meta(64, 1024))
    assert _names(misaligned, "quack") == []
    assert "operand x: QuACK assumes rows and pointer aligned to 8 elements, got 2" in \
        kernel_api.explain(misaligned, providers="quack", cc=90).all()
    # QuACK's softmax asserts rows of whole 16-byte vectors at its compile: an odd row is declined
    odd = SoftmaxArguments(meta(3, 1001, dtype=torch.float32), meta(3, 1001, dtype=torch.float32))
    assert _names(odd, "quack") == []
    assert "operand x: rows of 1001 elements, QuACK takes rows of whole 16-byte vectors (4 elements)" in \
        kernel_api.explain(odd, providers="quack", cc=90).all()
    assert _names(SoftmaxArguments(meta(3, 1000, dtype=torch.float32), meta(3, 1000, dtype=torch.float32)),
                  "quack") == ["QuackSoftmax_f32"]
    back = SoftmaxBackwardArguments(meta(8, 32000, dtype=torch.float32), meta(8, 32000, dtype=torch.float32),
                                    meta(8, 32000, dtype=torch.float32))
    assert _names(back, "quack") == ["QuackSoftmaxBackward_f32"]
    assert _names(args, "quack", cc=80) == []


def test_quack_norms_gemm_metadata(plugins):
    _need("quack")
    rms = RMSNormArguments(meta(16, 4096), meta(4096), meta(16, 4096), residual=meta(16, 4096),
                           residual_out=meta(16, 4096))
    assert _names(rms, "quack") == ["QuackRMSNorm_bf16"]
    ln = LayerNormArguments(meta(16, 4096), meta(4096), meta(4096), meta(16, 4096))
    assert _names(ln, "quack") == []  # QuACK's LayerNorm takes f32 weight and bias only
    w = meta(4096, dtype=torch.float32)
    assert _names(LayerNormArguments(meta(16, 4096), w, w, meta(16, 4096)), "quack") == ["QuackLayerNorm_bf16_wf32"]
    # a 2-byte row of odd length copies 2 bytes at a time, which QuACK's cp.async cannot: declined;
    # f32 rows of odd length copy 4 bytes and compile
    odd_rows = RMSNormArguments(meta(3, 7), meta(7), meta(3, 7))
    assert _names(odd_rows, "quack") == []
    assert "operand x: rows of 7 bf16 elements copy in 2-byte pieces, QuACK's copies take 4 bytes or more" in \
        kernel_api.explain(odd_rows, providers="quack", cc=90).all()
    f32 = torch.float32
    assert _names(RMSNormArguments(meta(3, 7, dtype=f32), meta(7, dtype=f32), meta(3, 7, dtype=f32)), "quack") == \
        ["QuackRMSNorm_f32"]
    gemm = GemmArguments(meta(256, 512), meta(512, 128), meta(256, 128))
    assert _names(gemm, "quack") == ["QuackGemm_bf16_ttt_a16"]
    col_out = GemmArguments(meta(256, 512), meta(512, 128), meta(128, 256).t())
    assert _names(col_out, "quack") == []
    odd = GemmArguments(meta(255, 511), meta(511, 129), meta(255, 129))
    assert _names(odd, "quack") == []
    assert "QuackGemm_bf16_ttt_a16: operand A: aligned to 1 element(s) but the kernel needs 8" in \
        kernel_api.explain(odd, providers="quack", cc=90).all()
    assert _names(GemmArguments(meta(4, 64, 32), meta(4, 32, 16), meta(4, 64, 16)), "quack") == \
        ["QuackGemm_bf16_ttt_a16"]


def test_pick_any_ranks_quack_s_gemm_below_the_kernels_measured_faster(plugins):
    """QuACK's GEMM ran 1.09x slower than kernel_api's tile of the same design and cuBLAS at 4096^3
    bf16 on an H200: PickAny, over every provider, ranks it after them there."""
    _need("quack")
    from kernel_api.tuning.pick_any import rank_candidates
    args = GemmArguments(meta(4096, 4096), meta(4096, 4096), meta(4096, 4096))
    ranked = [k.metadata.kernel_name for k in rank_candidates(kernel_api.get_kernels(args, cc=90), args, sm_count=132)]
    assert "QuackGemm_bf16_ttt_a16" in ranked
    assert not ranked[0].startswith("Quack")


def test_quack_cross_entropy_forward_without_gradient_and_backward(plugins):
    _need("quack")
    from kernel_api.arguments.cross_entropy import CrossEntropyArguments, CrossEntropyBackwardArguments

    x, t = meta(8, 100, 32000), torch.empty(8, 100, dtype=torch.long, device="meta")
    loss, lse = meta(8, 100, dtype=torch.float32), meta(8, 100, dtype=torch.float32)
    assert _names(CrossEntropyArguments(x, t, loss, lse), "quack") == ["QuackCrossEntropy_bf16_i64"]
    smoothed = CrossEntropyArguments(x, t, loss, lse, label_smoothing=0.1)
    assert _names(smoothed, "quack") == []
    assert "label_smoothing: 0.1, QuACK's cross-entropy has none" in str(kernel_api.explain(smoothed, providers="quack",
                                                                                             cc=90))
    with_grad = CrossEntropyArguments(x, t, loss, lse, grad_logits=x, grad_loss=meta(8, 100, dtype=torch.float32))
    assert _names(with_grad, "quack") == []
    scalar = torch.empty((), device="meta").expand(8, 100)
    back = CrossEntropyBackwardArguments(scalar, x, t.int(), lse, x)
    assert _names(back, "quack") == ["QuackCrossEntropyBackward_bf16_i32"]
    odd_vocab, rows = meta(8, 50257, dtype=torch.float16), meta(8, dtype=torch.float32)
    odd = CrossEntropyArguments(odd_vocab, torch.empty(8, dtype=torch.long, device="meta"), rows, rows)
    assert _names(odd, "quack") == []  # 2-byte pieces: QuACK's copies take 4 bytes or more
    f64 = meta(4, 10, dtype=torch.float64)
    assert _names(CrossEntropyArguments(f64, t[0, :4], meta(4, dtype=torch.float64), meta(4, dtype=torch.float64)),
                  "quack") == []


# ---- FlashAttention-4 ---------------------------------------------------------------------------
def test_flash_attn_layouts_head_dims_and_dtypes(plugins):
    _need("flash_attn")
    q = meta(2, 128, 8, 64)
    dense = AttentionArguments(q, meta(2, 128, 2, 64), meta(2, 128, 2, 64), meta(2, 128, 8, 64), causal=True)
    # FA4's own tile first, then the plugin's forward tiles for head dim 64 (examples/plugins/
    # kernel-api-flash-attn/tests/test_flash_attn_tiles.py checks them)
    assert _names(dense, "flash_attn")[0] == "FlashAttnForward_bf16_dense_a16"
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    varlen = AttentionArguments(meta(256, 8, 128), meta(256, 8, 128), meta(256, 8, 128), meta(256, 8, 128),
                                cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=156, max_seqlen_k=156)
    assert _names(varlen, "flash_attn") == ["FlashAttnForward_bf16_varlen_a16"]
    odd = AttentionArguments(meta(1, 16, 2, 12), meta(1, 16, 2, 12), meta(1, 16, 2, 12), meta(1, 16, 2, 12))
    assert _names(odd, "flash_attn") == []
    text = kernel_api.explain(odd, providers="flash_attn", cc=90).all()
    assert "FlashAttnForward_bf16_dense_a16: operand q: aligned to 4 element(s) but the kernel needs 8" in text
    f32 = meta(1, 16, 2, 64, dtype=torch.float32)
    assert _names(AttentionArguments(f32, f32, f32, meta(1, 16, 2, 64, dtype=torch.float32)), "flash_attn") == []
    big = meta(1, 16, 1, 512)
    assert _names(AttentionArguments(big, big, big, meta(1, 16, 1, 512)), "flash_attn") == []
    assert _names(dense, "flash_attn", cc=80) == []


# ---- cutlass.operators ----------------------------------------------------------------------------
def test_cutlass_operators_offers_its_sm90_operator_per_layout_tile_and_cluster(plugins):
    _need("cutlass_operators")
    args = GemmArguments(meta(512, 256), meta(256, 384), meta(512, 384))
    names = _names(args, "cutlass_operators")
    assert len(names) == 24 and all(n.startswith("CutlassOperatorsSm90Gemm_bf16_ttt_") for n in names)
    assert "CutlassOperatorsSm90Gemm_bf16_ttt_128x256x64_c2x1_a16" in names
    col = GemmArguments(meta(512, 256), meta(384, 256).t(), meta(384, 512).t())
    assert all("_tnn_" in n for n in _names(col, "cutlass_operators"))
    assert _names(args, "cutlass_operators", cc=100) == []  # wgmma: sm_90 only
    assert _names(GemmArguments(meta(64, 33), meta(33, 64), meta(64, 64)), "cutlass_operators") == []
    f32 = meta(64, 64, dtype=torch.float32)
    assert _names(GemmArguments(f32, f32, meta(64, 64, dtype=torch.float32)), "cutlass_operators") == []


# ---- compiling without a GPU ----------------------------------------------------------------------
@pytest.mark.parametrize("provider,make,why", [
    ("quack", lambda: SoftmaxArguments(meta(64, 1024), meta(64, 1024)), "QuACK compiles for the GPU it runs on"),
    ("flash_attn", lambda: AttentionArguments(meta(1, 64, 2, 64), meta(1, 64, 2, 64), meta(1, 64, 2, 64),
                                              meta(1, 64, 2, 64)), "FlashAttention-4 compiles for the GPU it runs on"),
    ("cutlass_operators", lambda: GemmArguments(meta(256, 256), meta(256, 256), meta(256, 256)),
     "reads the GPU's active-cluster limit when it compiles"),
])
def test_libraries_that_compile_for_the_present_gpu_say_so_without_one(plugins, provider, make, why):
    _need(provider)
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    args = make()
    kernel = kernel_api.get_kernels(args, providers=provider, cc=90)[0]
    with pytest.raises(CompilationError, match=why):
        kernel.compile(args, cc=90)


# ---- one ranking ---------------------------------------------------------------------------------
def test_explain_and_discovery_cover_every_provider(plugins):
    _need("liger", "quack")
    x = meta(16384, 4096)
    args = RMSNormArguments(x, meta(4096), meta(16384, 4096))
    names = [k.metadata.kernel_name for k in kernel_api.get_kernels(args, cc=90)]
    assert any(n.startswith("Liger") for n in names) and any(n.startswith("Quack") for n in names)
    assert any(n.startswith("TorchRMSNorm") for n in names)
    text = str(kernel_api.explain(args, cc=90))
    assert "liger/LigerRMSNorm" in text and "quack/QuackRMSNorm" in text


def test_pick_any_ranks_the_plugins_beside_ours(plugins):
    """FA4 is ranked over SDPA at head dim 128 and under it at 64 (its measured speed against
    SDPA); cutlass.operators' GEMM ranks among ours and cuBLAS's, QuACK's after them at 4096^3 (its
    measured speed there)."""
    _need("flash_attn", "quack", "cutlass_operators")
    from kernel_api import PickAny

    def choice(args):
        return PickAny().choose(args, kernel_api.get_kernels(args, cc=90)).metadata.kernel_name

    big = [meta(4, 4096, 32, 128) for _ in range(4)]
    assert choice(AttentionArguments(*big, causal=True)).startswith("FlashAttnForward")
    small = [meta(16, 1024, 16, 64) for _ in range(4)]
    assert choice(AttentionArguments(*small, causal=True)).startswith("TorchAttention")
    gemm = GemmArguments(meta(4096, 4096), meta(4096, 4096), meta(4096, 4096))
    from kernel_api.tuning.pick_any import rank_candidates
    ranked = [k.metadata.kernel_name for k in rank_candidates(kernel_api.get_kernels(gemm, cc=90), gemm, 132)]
    assert ranked.index("QuackGemm_bf16_ttt_a16") > ranked.index("TorchGemm_bf16_ttt")
    assert any(n.startswith("CutlassOperatorsSm90Gemm") for n in ranked[:8])


@pytest.mark.parametrize("provider", INSTALLED)
def test_the_command_line_lists_a_plugin_provider(plugins, provider, capsys):
    from kernel_api.cli import main

    assert main(["list", "--provider", provider]) == 0
    text = capsys.readouterr().out
    version = default_registry.get_provider(provider).version
    assert version in text and pp.PACKAGES[provider][1] not in text  # (classes, not modules)
    for cls in default_registry.kernel_classes(default_registry.get_provider(provider)):
        assert cls.__name__ in text


def test_provider_versions_key_the_records_on_the_library_versions(plugins):
    pairs = dict(provider_versions([default_registry.get_provider(p) for p in INSTALLED]))
    for p in INSTALLED:
        library = pp.library(p)
        assert f"+{library.DISTRIBUTION}-{importlib.metadata.version(library.DISTRIBUTION)}" in pairs[p]
