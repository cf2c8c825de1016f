"""Discovery: registration, plugins, get_kernels, explain, caching."""

import warnings

import pytest
import torch

import kernel_api
from kernel_api import GemmArguments, Kernel, RegistrationError, Status, registry

from toy_kernels import ToyGemm, ToyProvider


@pytest.fixture
def toy():
    ToyProvider.register(ToyGemm)
    ToyGemm.max_k = None
    yield ToyGemm
    ToyProvider.unregister(ToyGemm)
    registry.unregister_provider("toy")


def gemm_args(dtype=torch.float16, m=64, n=32, k=16, layout="ttt", **kw):
    def mat(r, c, row):
        return torch.randn(r, c).to(dtype) if row else torch.randn(c, r).to(dtype).t()
    A = mat(m, k, layout[0] == "t")
    B = mat(k, n, layout[1] == "t")
    out = mat(m, n, layout[2] == "t")
    return GemmArguments(A, B, out, **kw)


def toy_only(md):
    return md.kernel_class is ToyGemm


def test_builtin_providers_are_available():
    assert {"cutedsl", "cuda_src"} <= set(kernel_api.available_providers())


def test_register_returns_class_and_sets_provider(toy):
    assert toy._kernel_api_provider is ToyProvider
    assert "toy" in kernel_api.available_providers()
    kernels = kernel_api.get_kernels(gemm_args(), metadata_filter=toy_only, cc=90)
    assert kernels and all(k.metadata.provider == "toy" for k in kernels)


def test_get_kernels_preserves_generation_order(toy):
    args = gemm_args()
    names = [k.metadata.kernel_name for k in kernel_api.get_kernels(args, metadata_filter=toy_only, cc=90)]
    generated = [k.metadata.kernel_name for k in ToyGemm.generate_kernels(lambda m: True)]
    assert names == [n for n in generated if n in names]
    assert names[0].startswith("ToyGemm_f16_ttt_tile128x128x64")


def test_get_kernels_matches_dtype_layout_and_alignment(toy):
    args = gemm_args(torch.bfloat16, layout="tnt")
    kernels = kernel_api.get_kernels(args, metadata_filter=toy_only, cc=90)
    assert kernels
    for k in kernels:
        ops = k.metadata.operands
        assert ops.A.dtype.value == "bf16" and ops.B.layout == "n" and ops.out.layout == "t"


def test_misaligned_operand_only_gets_alignment_1_kernels(toy):
    A = torch.randn(64, 17, dtype=torch.float16)  # K=17: no 8-element alignment
    B = torch.randn(17, 32, dtype=torch.float16)
    out = torch.empty(64, 32, dtype=torch.float16)
    kernels = kernel_api.get_kernels(GemmArguments(A, B, out), metadata_filter=toy_only, cc=90)
    assert kernels and all(k.metadata.operands.A.divisibility == 1 for k in kernels)


def test_offset_pointer_lowers_divisibility(toy):
    base = torch.randn(64 * 64 + 1, dtype=torch.float16)
    A = base[1:].view(64, 64)
    args = GemmArguments(A, torch.randn(64, 64, dtype=torch.float16), torch.empty(64, 64, dtype=torch.float16))
    assert args.tensor_attributes["A"].divisibility == 1
    kernels = kernel_api.get_kernels(args, metadata_filter=toy_only, cc=90)
    assert all(k.metadata.operands.A.divisibility == 1 for k in kernels)


def test_filter_cc_providers_and_limit(toy):
    args = gemm_args()
    assert kernel_api.get_kernels(args, metadata_filter=toy_only, cc=75) == []  # min_cc 80
    assert len(kernel_api.get_kernels(args, metadata_filter=toy_only, cc=90, limit=3)) == 3
    assert kernel_api.get_kernels(args, cc=90, providers=["cuda_src"], metadata_filter=toy_only) == []
    assert kernel_api.get_kernels(args, cc=90, providers=[ToyProvider])
    only_64 = kernel_api.get_kernels(args, cc=90, metadata_filter=lambda m: toy_only(m) and m.design.tile_shape[0] == 64)
    assert only_64 and all(k.metadata.design.tile_shape[0] == 64 for k in only_64)


def test_args_none_lists_everything_generated(toy):
    everything = kernel_api.get_kernels(None, metadata_filter=toy_only, cc=90)
    assert len(everything) == len(ToyGemm.generate_kernels(lambda m: True))


def test_supports_rejection_is_respected_and_explained(toy):
    ToyGemm.max_k = 8
    args = gemm_args(k=16)
    assert kernel_api.get_kernels(args, metadata_filter=toy_only, cc=90) == []
    reasons = [r.reason for r in kernel_api.explain(args, cc=90) if r.kernel_class == "ToyGemm"]
    assert any("K=16 exceeds 8" in r for r in reasons)


def test_epilogue_kernels_only_when_epilogue_supported(toy):
    A, B = torch.randn(16, 8).half(), torch.randn(8, 4).half()
    relu = GemmArguments(A, B, torch.empty(16, 4).half(), epilogue=kernel_api.EpilogueArguments(activation="relu"))
    assert kernel_api.get_kernels(relu, metadata_filter=toy_only, cc=90)
    silu = GemmArguments(A, B, torch.empty(16, 4).half(), epilogue=kernel_api.EpilogueArguments(activation="silu"))
    assert kernel_api.get_kernels(silu, metadata_filter=toy_only, cc=90) == []
    reasons = {r.reason for r in kernel_api.explain(silu, cc=90) if r.kernel_class == "ToyGemm"}
    assert any("silu" in r for r in reasons)


def test_trivial_epilogue_is_dropped():
    A, B = torch.randn(16, 8), torch.randn(8, 4)
    args = GemmArguments(A, B, torch.empty(16, 4), epilogue=kernel_api.EpilogueArguments())
    assert args.epilogue is None and args.epilogue_signature is None


def test_repeated_discovery_is_cached(toy, monkeypatch):
    calls = []
    original = ToyGemm.generate_kernels

    def counting(metadata_filter, epilogue_args=None, cc=None):
        calls.append(cc)
        return original(metadata_filter, epilogue_args, cc)

    monkeypatch.setattr(ToyGemm, "generate_kernels", staticmethod(counting))
    registry.clear_caches()
    args = gemm_args()
    first = kernel_api.get_kernels(args, metadata_filter=toy_only, cc=90)
    second = kernel_api.get_kernels(gemm_args(m=128, n=64), metadata_filter=toy_only, cc=90)
    assert calls == [90]
    assert [k.metadata.kernel_name for k in first] == [k.metadata.kernel_name for k in second]
    assert first[0] is second[0]  # instances are reused


def test_get_kernels_rejects_bad_queries():
    with pytest.raises(TypeError, match="args"):
        kernel_api.get_kernels("not args")
    with pytest.raises(TypeError, match="metadata_filter"):
        kernel_api.get_kernels(gemm_args(), metadata_filter=42)
    with pytest.raises(ValueError, match="cc"):
        kernel_api.get_kernels(gemm_args(), cc=-3)
    with pytest.raises(ValueError, match="cc"):
        kernel_api.get_kernels(gemm_args(), cc="hopper")
    with pytest.raises(TypeError, match="cc"):
        kernel_api.get_kernels(gemm_args(), cc=9.0)
    with pytest.raises(ValueError, match="unknown provider"):
        kernel_api.get_kernels(gemm_args(), providers=["nope"])
    with pytest.raises(ValueError, match="limit"):
        kernel_api.get_kernels(gemm_args(), limit=-1)


def test_register_rejects_non_kernels():
    with pytest.raises(TypeError, match="not a subclass of kernel_api.Kernel"):
        ToyProvider.register(int)
    with pytest.raises(TypeError, match="expects a class"):
        ToyProvider.register(lambda: None)


def test_register_names_missing_abstract_methods():
    class Half(Kernel):
        supported_args_type = GemmArguments

        def compile(self, args, cc=None):
            return None

    with pytest.raises(RegistrationError, match="_run.*_supports|_supports.*_run") as info:
        ToyProvider.register(Half)
    assert "generate_kernels" in str(info.value) and "get_workspace_size" in str(info.value)


def test_register_infers_args_type_from_annotation_or_complains():
    class Annotated(ToyGemm):
        supported_args_type = None

        def _supports(self, args: GemmArguments) -> Status:
            return Status.success()

    ToyProvider.register(Annotated)
    try:
        assert Annotated.supported_args_type is GemmArguments
    finally:
        ToyProvider.unregister(Annotated)
        registry.unregister_provider("toy")

    class Unannotated(ToyGemm):
        supported_args_type = None

        def _supports(self, args):
            return Status.success()

    with pytest.raises(RegistrationError, match="supported_args_type"):
        ToyProvider.register(Unannotated)


def test_run_and_supports_are_final():
    with pytest.raises(TypeError, match="final"):
        class Bad(ToyGemm):
            def run(self, *a, **k):
                pass
    # Assigned after the class exists (no metaclass sees that): refused when it is next instantiated.
    class Late(ToyGemm):
        pass

    Late.supports = lambda self, args, cc=None: Status.success()
    with pytest.raises(TypeError, match="Late.supports is final"):
        Late(ToyGemm.generate_kernels(lambda m: True)[0].metadata)


def test_provider_names_are_unique():
    class Clash(kernel_api.Provider):
        name = "cutedsl"

    with pytest.raises(RegistrationError, match="already registered"):
        kernel_api.register_provider(Clash)


def test_failing_plugin_is_reported_and_others_still_load(monkeypatch):
    class EP:
        def __init__(self, name, value):
            self.name, self.value = name, value

    import importlib.metadata as md
    import sys
    import types

    good = types.ModuleType("kernel_api_test_good_plugin")

    class GoodProvider(kernel_api.Provider):
        name = "good_plugin"

    good.GoodProvider = GoodProvider
    monkeypatch.setitem(sys.modules, "kernel_api_test_good_plugin", good)
    monkeypatch.setattr(md, "entry_points", lambda group=None: [
        EP("broken", "kernel_api_test_no_such_module"), EP("good", "kernel_api_test_good_plugin:GoodProvider")])
    registry.default_registry.reset_plugins()  # the next discovery loads them, as a fresh process would
    try:
        with pytest.warns(RuntimeWarning, match="broken"):
            providers = kernel_api.available_providers()
        assert "good_plugin" in providers and "cutedsl" in providers
        errors = kernel_api.plugin_errors()
        assert any("broken" in k and "ModuleNotFoundError" in v for k, v in errors.items())
    finally:
        registry.unregister_provider("good_plugin")
        registry.default_registry.reset_plugins()  # (the failure of the fake plugin is forgotten)


def test_explain_reports_wrong_args_type_per_class(toy):
    x = torch.randn(4, 8)
    sm = kernel_api.SoftmaxArguments(x, torch.empty_like(x))
    # (without the torch provider: its GEMM class would take ToyGemm's place in the one-line summary)
    explanation = kernel_api.explain(sm, cc=90, providers=[p for p in kernel_api.available_providers() if p != "torch"])
    toy_rows = [r for r in explanation if r.kernel_class == "ToyGemm"]
    assert toy_rows and toy_rows[0].kernel_name is None and "GemmArguments" in toy_rows[0].reason
    assert "ToyGemm" in str(explanation)


def test_explain_names_every_class_that_takes_other_arguments(toy):
    """The one line of classes taking another arguments type wraps instead of being clipped at
    the summary's width: a class past the width was named nowhere (ToyGemm went missing once
    the shipped GEMM classes filled the line)."""
    none = staticmethod(lambda *args, **kwargs: [])  # (instance names must be unique: none needed here)
    extra = [type(f"ToyGemmWithAQuiteLongClassName{i}", (ToyGemm,), {"generate_kernels": none}) for i in range(6)]
    for cls in extra:
        ToyProvider.register(cls)
    try:
        x = torch.randn(4, 8)
        text = str(kernel_api.explain(kernel_api.SoftmaxArguments(x, torch.empty_like(x)), cc=90))
        for cls in (ToyGemm, *extra):
            assert cls.__name__ in text, text
        assert all(len(line) <= 120 for line in text.splitlines())
    finally:
        for cls in extra:
            ToyProvider.unregister(cls)
