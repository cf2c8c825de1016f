"""Discovery hardening: unique kernel names, broken classes, explain at scale,
CudaSourceKernel name templates."""

import pytest
import torch

import kernel_api
from kernel_api import (CompiledArtifact, DataType, GemmArguments, Kernel, KernelMetadata, Reason, RegistrationError,
                        SoftmaxArguments, Status, registry)
from kernel_api.cli.commands import main
from kernel_api.cli.problems import gemm_arguments
from kernel_api.metadata import softmax_operands
from kernel_api.providers.cuda_src import CudaSourceProvider
from kernel_api.providers.cuda_src.kernel import CudaSourceKernel
from kernel_api.providers.cutedsl.gemm.simt import SimtGemm


class HardeningProvider(kernel_api.Provider):
    name = "hardening"


@pytest.fixture
def provider():
    yield HardeningProvider
    for cls in HardeningProvider.kernel_classes():
        HardeningProvider.unregister(cls)
    registry.unregister_provider("hardening")


def make_class(name, generate, args_type=SoftmaxArguments, supports=None):
    """A complete kernel class ``name`` (of this module) whose instances are ``generate(cls, cc)``."""

    def _supports(self, args):
        return supports(self, args) if supports else Status.success()

    holder = []
    namespace = {
        "__module__": __name__, "__qualname__": name, "supported_args_type": args_type,
        "generate_kernels": staticmethod(
            lambda metadata_filter, epilogue_args=None, cc=None: generate(holder[0], cc)),
        "compile": lambda self, args, cc=None: CompiledArtifact(None, self),
        "_run": lambda self, args, artifact, stream, workspace=None: None,
        "_supports": _supports,
        "get_workspace_size": lambda self, args: 0,
    }
    cls = type(name, (Kernel,), namespace)
    holder.append(cls)
    return cls


def softmax_instances(*names, metadata_type=KernelMetadata):
    def generate(cls, cc):
        return [cls(metadata_type(n, cls, softmax_operands("f32", 1))) for n in names]
    return generate


def softmax_args():
    x = torch.randn(4, 8)
    return SoftmaxArguments(x, torch.empty_like(x))


def simt_instance():
    """A built-in SimtGemm instance that fits ``gemm_arguments(64, 64, 64, dtype="f16")``."""
    return next(k for k in kernel_api.get_kernels(gemm_arguments(64, 64, 64, dtype="f16"), cc=90)
                if isinstance(k, SimtGemm))


def discovered_names(args):
    return [k.metadata.kernel_name for k in kernel_api.get_kernels(args, cc=90)]


# ---- 5. duplicate kernel names --------------------------------------------------------------

def test_builtin_kernel_names_are_unique():
    kernel_api.available_providers()  # loads the built-in providers
    for cc in (None, 80, 90, 100):
        owners = {}
        for provider_name in ("cutedsl", "cuda_src"):
            for cls in kernel_api.registry.get_provider(provider_name).kernel_classes():
                for kernel in cls.generate_kernels(lambda m: True, None, cc):
                    name = kernel.metadata.kernel_name
                    assert owners.setdefault(name, cls) is cls, (name, cls, owners[name], cc)


def test_plugin_reusing_a_builtin_kernel_name_is_refused_naming_both_classes(provider):
    builtin = simt_instance()
    name = builtin.metadata.kernel_name

    def generate(cls, cc):
        return [cls(KernelMetadata(name, cls, builtin.metadata.operands, builtin.metadata.design, min_cc=70))]

    impostor = make_class("Impostor", generate, GemmArguments)
    with pytest.raises(RegistrationError) as info:
        provider.register(impostor)
    message = str(info.value)
    assert "Impostor" in message and "SimtGemm" in message and name in message
    assert impostor not in provider.kernel_classes()
    found = [k for k in kernel_api.get_kernels(gemm_arguments(64, 64, 64, dtype="f16"), cc=90)
             if k.metadata.kernel_name == name]
    assert len(found) == 1 and isinstance(found[0], SimtGemm)


def test_two_plugin_classes_with_one_kernel_name(provider):
    provider.register(make_class("FirstSoftmax", softmax_instances("shared_softmax_f32")))
    with pytest.raises(RegistrationError, match=r"SecondSoftmax.*'shared_softmax_f32'.*FirstSoftmax"):
        provider.register(make_class("SecondSoftmax", softmax_instances("shared_softmax_f32")))
    with pytest.raises(RegistrationError, match=r"Twice.*two instances named 'twice_f32'"):
        provider.register(make_class("Twice", softmax_instances("twice_f32", "twice_f32")))


def test_reregistering_the_same_class_replaces_it(provider):
    # A re-run notebook cell defines a new class object of the same module and qualified name.
    first = provider.register(make_class("Rerun", softmax_instances("rerun_softmax_f32")))
    second = provider.register(make_class("Rerun", softmax_instances("rerun_softmax_f32")))
    assert provider.kernel_classes() == [second] and first is not second
    kernels = kernel_api.get_kernels(softmax_args(), cc=90, providers="hardening")
    assert [type(k) for k in kernels] == [second]


def test_names_that_clash_only_at_discovery_keep_the_registered_first(provider):
    builtin = simt_instance()
    name = builtin.metadata.kernel_name

    def generate(cls, cc):
        # The name exists only for a concrete cc, so registration (cc=None) cannot see the clash.
        if cc is None:
            return []
        return [cls(KernelMetadata(name, cls, builtin.metadata.operands, builtin.metadata.design, min_cc=70)),
                cls(KernelMetadata("LateImpostor_own_name", cls, builtin.metadata.operands, builtin.metadata.design))]

    late = provider.register(make_class("LateImpostor", generate, GemmArguments))
    args = gemm_arguments(64, 64, 64, dtype="f16")
    with pytest.warns(RuntimeWarning, match=r"LateImpostor.*SimtGemm"):
        kernels = kernel_api.get_kernels(args, cc=90)
    named = [k for k in kernels if k.metadata.kernel_name == name]
    assert len(named) == 1 and isinstance(named[0], SimtGemm)
    assert any(k.metadata.kernel_name == "LateImpostor_own_name" for k in kernels)
    assert any("LateImpostor" in label for label in kernel_api.plugin_errors())
    # also when the query leaves out the provider of the class that owns the name
    only_late = kernel_api.get_kernels(args, cc=90, providers="hardening")
    assert [k.metadata.kernel_name for k in only_late] == ["LateImpostor_own_name"]
    everything = kernel_api.get_kernels(None, cc=90)
    assert [type(k) for k in everything if k.metadata.kernel_name == name] == [SimtGemm]
    skipped = [r for r in kernel_api.explain(args, cc=90) if r.kernel_class == "LateImpostor"]
    assert [r.kernel_name for r in skipped] == [name] and "SimtGemm" in skipped[0].reason
    assert late in provider.kernel_classes()


# ---- 8. a broken class does not break discovery ------------------------------------------------

@pytest.mark.parametrize("items", [["not a kernel"], [None]])
def test_generate_kernels_returning_non_kernels_is_refused_at_registration(provider, items):
    broken = make_class("ReturnsJunk", lambda cls, cc: list(items))
    with pytest.raises(RegistrationError, match=r"ReturnsJunk\.generate_kernels returned .* not a Kernel"):
        provider.register(broken)


def _raise(cls, cc):
    raise RuntimeError("generation exploded")


@pytest.mark.parametrize("generate, error", [
    (lambda cls, cc: ["not a kernel"], "not a Kernel instance"),
    (lambda cls, cc: [None], "not a Kernel instance"),
    (_raise, "generation exploded"),
])
def test_class_broken_after_registration_is_skipped_and_reported(provider, generate, error):
    args = softmax_args()
    expected = discovered_names(args)
    assert expected
    # Registered while complete, then broken (notebooks assign methods after registering).
    broken = provider.register(make_class("BrokenLater", softmax_instances("broken_later_f32")))
    broken.generate_kernels = staticmethod(lambda metadata_filter, epilogue_args=None, cc=None: generate(broken, cc))
    with pytest.warns(RuntimeWarning, match="BrokenLater"):
        names = [k.metadata.kernel_name for k in kernel_api.get_kernels(args, cc=90)]
    assert names == expected
    errors = {k: v for k, v in kernel_api.plugin_errors().items() if "BrokenLater" in k}
    assert errors and error in next(iter(errors.values()))
    explanation = kernel_api.explain(args, cc=90)
    rows = [r for r in explanation if r.kernel_class == "BrokenLater"]
    assert rows and error in rows[0].reason and "BrokenLater" in str(explanation)
    assert sorted(explanation.accepted) == sorted(expected)


def test_raising_support_checks_skip_only_their_instance(provider):
    class RaisingMetadata(KernelMetadata):
        __slots__ = ()

        def supports(self, args, cc=None):
            raise ValueError("metadata check exploded")

    def supports(kernel, args):
        if kernel.metadata.kernel_name == "raises_in_supports_f32":
            raise ZeroDivisionError("supports exploded")
        return Status.success()

    def generate(cls, cc):
        return (softmax_instances("fine_f32", "raises_in_supports_f32")(cls, cc)
                + softmax_instances("raises_in_metadata_f32", metadata_type=RaisingMetadata)(cls, cc))

    provider.register(make_class("PartlyBroken", generate, supports=supports))
    args = softmax_args()
    with pytest.warns(RuntimeWarning, match="PartlyBroken") as record:
        names = [k.metadata.kernel_name for k in kernel_api.get_kernels(args, cc=90)]
    assert "fine_f32" in names and "raises_in_supports_f32" not in names and "raises_in_metadata_f32" not in names
    text = " ".join(str(w.message) for w in record)
    assert "metadata check exploded" in text and "supports exploded" in text
    reasons = {r.kernel_name: r.reason for r in kernel_api.explain(args, cc=90) if r.kernel_class == "PartlyBroken"}
    assert "supports exploded" in reasons["raises_in_supports_f32"]
    assert "metadata check exploded" in reasons["raises_in_metadata_f32"]


SCALE_SOURCE = r"""
template <typename T>
__global__ void scale(const T* x, T* y, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * T(2);
}
"""


def _cuda_scale_class(name, kernel_name, variants):
    def launch_config(self, args):
        return (args.x.numel() + 255) // 256, 256

    return type(name, (CudaSourceKernel,), {
        "__module__": __name__, "__qualname__": name, "source": SCALE_SOURCE, "kernel_name": kernel_name,
        "variants": variants, "operands": softmax_operands("f32", 1), "supported_args_type": SoftmaxArguments,
        "launch_config": launch_config,
        "kernel_arguments": lambda self, args: (args.x, args.out, args.x.numel()),
    })


def test_cuda_source_kernel_without_kernel_name_is_refused():
    nameless = _cuda_scale_class("NamelessScale", None, [{"T": "float"}])
    with pytest.raises(RegistrationError, match=r"NamelessScale.*kernel_name"):
        CudaSourceProvider.register(nameless)
    assert nameless not in CudaSourceProvider.kernel_classes()


def test_cuda_source_kernel_losing_its_name_does_not_break_discovery():
    args = softmax_args()
    expected = discovered_names(args)
    scale = CudaSourceProvider.register(_cuda_scale_class("LaterNamelessScale", "scale<{T}>", [{"T": "float"}]))
    try:
        scale.kernel_name = None
        with pytest.warns(RuntimeWarning, match=r"LaterNamelessScale.*kernel_name"):
            names = [k.metadata.kernel_name for k in kernel_api.get_kernels(args, cc=90)]
        assert names == expected
        assert any("LaterNamelessScale" in r.kernel_class for r in kernel_api.explain(args, cc=90))
    finally:
        CudaSourceProvider.unregister(scale)


# ---- 14. kernel_name fields that a variant lacks -------------------------------------------------

def test_kernel_name_field_missing_from_a_variant_is_refused_at_registration():
    wrong = _cuda_scale_class("WrongFieldScale", "scale<{T}>", [{"T": "float"}, {"dtype": "float"}])
    with pytest.raises(RegistrationError, match=r"WrongFieldScale.*'T'.*variant 1"):
        CudaSourceProvider.register(wrong)
    positional = _cuda_scale_class("PositionalScale", "scale<{}>", [{"T": "float"}])
    with pytest.raises(RegistrationError, match=r"PositionalScale.*named"):
        CudaSourceProvider.register(positional)


def test_kernel_name_field_missing_is_caught_at_generation():
    scale = _cuda_scale_class("ChangedScale", "scale<{T}>", [{"T": "float"}])
    scale.variants = [{"type": "float"}]  # e.g. changed after registration
    with pytest.raises(TypeError, match=r"ChangedScale.*'T'"):
        scale.generate_kernels(lambda m: True, None, 90)


# ---- 13. explain at scale -------------------------------------------------------------------------

def _screen(text):
    lines = text.splitlines()
    return len(lines), max(len(line) for line in lines)


def _first_accepted_per_class(args):
    firsts = {}
    for k in kernel_api.get_kernels(args, cc=90):
        firsts.setdefault(type(k).__name__, k.metadata.kernel_name)
    return firsts


def test_explain_summary_fits_one_screen_and_all_keeps_everything():
    args = gemm_arguments(4095, 4096, 4096, dtype="f16")
    explanation = kernel_api.explain(args, cc=90)
    text = str(explanation)
    rows, cols = _screen(text)
    assert rows <= 40 and cols <= 120, text
    assert "M=4095" in text and "f16" in text
    firsts = _first_accepted_per_class(args)
    assert len(firsts) >= 2 and explanation.accepted
    for cls, name in firsts.items():
        assert cls in text and name in text, (cls, name)
    assert f"{len(explanation.accepted)} of" in text
    # the full text and the list itself keep every rejection
    full = explanation.all()
    assert len(explanation) > 500 and all(isinstance(r, registry.Rejection) for r in explanation)
    for r in explanation:
        assert (f"{r.kernel_name}: {r.reason}" if r.kernel_name else f"{r.kernel_class}: {r.reason}") in full
    assert all(name in full for name in explanation.accepted)
    assert explanation.nearest(3)


def test_explain_names_the_value_that_breaks_alignment():
    args = gemm_arguments(4096, 4096, 4095, dtype="f16")
    explanation = kernel_api.explain(args, cc=90)
    text = str(explanation)
    rows, cols = _screen(text)
    assert rows <= 40 and cols <= 120, text
    assert "K=4095 not a multiple of 8" in text
    assert any("K=4095" in r.reason for r in explanation if "aligned to" in r.reason)
    column_major_out = kernel_api.explain(gemm_arguments(4095, 4096, 4096, dtype="f16", layout="ttn"), cc=90)
    assert "M=4095 not a multiple of 8" in str(column_major_out)


def test_cli_explain_summary_and_all(capsys):
    argv = ["explain", "gemm", "--m", "4095", "--n", "4096", "--k", "4096", "--dtype", "f16", "--cc", "90"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows, cols = _screen(out)
    assert rows <= 40 and cols <= 120, out
    assert "M=4095, N=4096, K=4096" in out and "f16t*f16t->f16t" in out
    args = gemm_arguments(4095, 4096, 4096, dtype="f16")
    for name in _first_accepted_per_class(args).values():
        assert name in out
    assert main(argv + ["--all"]) == 0
    full = capsys.readouterr().out
    assert all(k.metadata.kernel_name in full for k in kernel_api.get_kernels(args, cc=90))
    assert "operand A: dtype f16 but the kernel takes bf16" in full and len(full.splitlines()) > 500


def test_explain_groups_and_ranks_by_reason_kind_not_message_text(monkeypatch):
    """Rejections are grouped and ranked by their `Status`'s kind and values: a kernel's own
    failures worded freely (none of explain's old text patterns match them) are summarised like
    the built-in ones, an alignment requirement gets the problem's values that break it, and text
    that merely reads like a dtype message, without a kind, is listed as it is."""
    args = gemm_arguments(64, 64, 40, dtype="f16")  # K=40: aligned to 8, not to 16

    def supports(self, a):
        tile = self.metadata.design.tile_shape
        if tile[0] == 128 and self.metadata.operands.A.divisibility == 8:
            return Status.fail("wants 16-wide rows of the left operand", kind=Reason.ALIGNMENT, operand="A",
                               actual=a.tensor_attributes["A"].divisibility, required=16)
        if tile[0] == 128:
            return Status.fail("right operand: only single precision here", kind=Reason.DTYPE, operand="B",
                               actual=DataType.f16, required=DataType.f32)
        return Status.fail("operand A: dtype f16 but the kernel takes bf16")  # OTHER: not parsed

    monkeypatch.setattr(SimtGemm, "_supports", supports)
    explanation = kernel_api.explain(args, cc=90, providers=["cutedsl"])
    simt = [r for r in explanation if r.kernel_class == "SimtGemm" and r.kernel_name]
    own = [r for r in simt if r.reason.startswith("wants 16-wide")]
    assert own and all(r.kind is Reason.ALIGNMENT and r.detail == "K=40 not a multiple of 16" for r in own)
    assert all(r.reason == "wants 16-wide rows of the left operand: K=40 not a multiple of 16" for r in own)
    line = next(x for x in explanation.summary(width=1000).splitlines() if x.startswith("  cutedsl/SimtGemm:"))
    pieces = line.split(": ", 2)[2].split("; ")
    texts = [p.rsplit(" (", 1)[0] for p in pieces]
    assert "A: K=40 not a multiple of 16" in texts and "needs B f32" in texts
    assert "operand A: dtype f16 but the kernel takes bf16" in texts
    # nearer kinds first: alignment and the unparsed text (3), layouts (2), dtypes (1)
    assert texts.index("A: K=40 not a multiple of 16") < texts.index("needs A column-major") < texts.index("needs B f32")
    nearest = explanation.nearest(len(own) + 1)
    assert {r.closeness for r in nearest} == {3}


def test_explain_summary_stays_on_one_screen_with_many_classes():
    rejections = [registry.Rejection("p", f"Rejected{i}", f"Rejected{i}_k{j}",
                                     "operand A: dtype f16 but the kernel takes bf16", Reason.DTYPE, "A", DataType.f16,
                                     DataType.bf16)
                  for i in range(50) for j in range(3)]
    accepted = [f"Fits{i}_k{j}_{'x' * 150}" for i in range(60) for j in range(2)]
    explanation = registry.Explanation(rejections, accepted, problem="GemmArguments(M=1, ...)", cc=90,
                                       accepted_classes=[("p", f"Fits{i}") for i in range(60) for j in range(2)])
    rows, cols = _screen(str(explanation))
    assert rows <= 40 and cols <= 120
    assert "Fits0_k0" in str(explanation) and "Rejected0: 3 of 3: needs A bf16 (3)" in str(explanation)
    assert "more line(s)" in str(explanation)
    assert all(r.kernel_name in explanation.all() for r in explanation)
