"""A registry of one's own: `Registry()` holds its providers, classes, plugins and caches, and
the default registry (what `kernel_api.get_kernels` searches) never sees them."""

import importlib.metadata
import sys
import textwrap
import uuid

import pytest
import torch

import kernel_api
from kernel_api import (CompiledArtifact, Kernel, KernelMetadata, NoKernelFoundError, Provider, RegistrationError,
                        SoftmaxArguments, Status, registry)
from kernel_api.metadata import softmax_operands
from kernel_api.registry import Registry


class PrivateProvider(Provider):
    name = "private"


class PrivateSoftmax(Kernel):
    """f32 softmax instances of two widths; ``_supports`` takes rows of at most ``max_cols``."""

    supported_args_type = SoftmaxArguments
    max_cols = 64

    @staticmethod
    def generate_kernels(metadata_filter, epilogue_args=None, cc=None):
        found = [PrivateSoftmax(KernelMetadata(f"PrivateSoftmax_f32_w{w}", PrivateSoftmax, softmax_operands("f32", 1)))
                 for w in (1, 2)]
        return [k for k in found if metadata_filter(k.metadata)]

    def _supports(self, args):
        if args.cols > self.max_cols:
            return Status.fail(f"rows of {args.cols} columns are longer than {self.max_cols}")
        return Status.success()

    def get_workspace_size(self, args):
        return 0

    def compile(self, args, cc=None):
        return CompiledArtifact(None, self)

    def _run(self, args, artifact, stream, workspace=None):
        pass


def softmax_args(cols=8, dtype=torch.float32):
    x = torch.randn(4, cols, dtype=dtype)
    return SoftmaxArguments(x, torch.empty_like(x))


def names(kernels):
    return [k.metadata.kernel_name for k in kernels]


@pytest.fixture
def private():
    reg = Registry()
    reg.register(PrivateSoftmax, PrivateProvider)
    yield reg
    type.__setattr__(PrivateSoftmax, "_kernel_api_provider", None)


def test_a_private_registry_sees_only_its_own_kernels(private):
    assert private.available_providers() == ["private"]
    assert private.kernel_classes(PrivateProvider) == [PrivateSoftmax]
    assert names(private.get_kernels(softmax_args(), cc=90)) == ["PrivateSoftmax_f32_w1", "PrivateSoftmax_f32_w2"]
    assert names(private.get_kernels(softmax_args(), cc=90, limit=1)) == ["PrivateSoftmax_f32_w1"]
    assert private.get_kernels(softmax_args(cols=128), cc=90) == []  # _supports refuses
    assert private.get_kernels(softmax_args(dtype=torch.float16), cc=90) == []  # metadata refuses
    assert names(private.get_kernels(None, cc=90)) == ["PrivateSoftmax_f32_w1", "PrivateSoftmax_f32_w2"]
    assert private.plugin_errors() == {}
    # the instances are generated once, until a change or clear_caches
    first = private.get_kernels(softmax_args(), cc=90)
    assert private.get_kernels(softmax_args(), cc=90) == first
    private.clear_caches()
    again = private.get_kernels(softmax_args(), cc=90)
    assert names(again) == names(first) and again[0] is not first[0]


def test_the_default_registry_is_unaffected(private):
    assert "private" not in kernel_api.available_providers()
    assert PrivateSoftmax not in PrivateProvider.kernel_classes()  # Provider's methods act on the default
    found = names(kernel_api.get_kernels(softmax_args(), cc=90))
    assert found and not [n for n in found if n.startswith("PrivateSoftmax")]
    assert not [label for label in kernel_api.plugin_errors() if "PrivateSoftmax" in label]
    # and a private registry imports neither the built-in providers nor the installed plugins
    assert Registry().available_providers() == []


def test_registration_checks_hold_per_registry(private):
    class Twin(PrivateSoftmax):
        @staticmethod
        def generate_kernels(metadata_filter, epilogue_args=None, cc=None):  # PrivateSoftmax's names
            return [Twin(KernelMetadata("PrivateSoftmax_f32_w1", Twin, softmax_operands("f32", 1)))]

    with pytest.raises(RegistrationError, match=r"Twin \(test_registry_object\) generates kernel name "
                                                r"'PrivateSoftmax_f32_w1', which private/PrivateSoftmax"):
        private.register(Twin, PrivateProvider)
    other = Registry()
    other.register(Twin, PrivateProvider)  # another registry knows no PrivateSoftmax
    assert other.kernel_classes(PrivateProvider) == [Twin]
    assert [type(k) for k in other.get_kernels(softmax_args(), cc=90)] == [Twin]
    with pytest.raises(RegistrationError, match="already registered"):
        private.register_provider(type("Impostor", (Provider,), {"name": "private"}))


def test_unregistering_a_class_or_a_provider(private):
    private.unregister(PrivateSoftmax)
    assert private.kernel_classes(PrivateProvider) == [] and private.get_kernels(softmax_args(), cc=90) == []
    private.register(PrivateSoftmax, PrivateProvider)
    private.unregister_provider("private")
    assert private.available_providers() == [] and private.get_kernels(softmax_args(), cc=90) == []


def test_explain_and_no_kernel_error_on_a_private_registry(private):
    explanation = private.explain(softmax_args(cols=128), cc=90)
    assert explanation.accepted == []
    assert {r.kernel_class for r in explanation} == {"PrivateSoftmax"}
    assert [r.kernel_name for r in explanation] == ["PrivateSoftmax_f32_w1", "PrivateSoftmax_f32_w2"]
    assert "longer than 64" in explanation[0].reason
    error = private.no_kernel_error(softmax_args(cols=128), cc=90)
    assert isinstance(error, NoKernelFoundError) and "PrivateSoftmax_f32_w1" in str(error)
    fits = private.explain(softmax_args(), cc=90)
    assert fits.accepted == ["PrivateSoftmax_f32_w1", "PrivateSoftmax_f32_w2"] and len(fits) == 0


# ---- plugins ---------------------------------------------------------------------------------

PLUGIN = textwrap.dedent('''
    import kernel_api
    from kernel_api import CompiledArtifact, Kernel, KernelMetadata, SoftmaxArguments
    from kernel_api.metadata import softmax_operands

    @kernel_api.register_provider
    class PluginProvider(kernel_api.Provider):
        name = {provider!r}

    @PluginProvider.register
    class PluginKernel(Kernel):
        supported_args_type = SoftmaxArguments

        @staticmethod
        def generate_kernels(metadata_filter, epilogue_args=None, cc=None):
            return [PluginKernel(KernelMetadata({prefix!r} + "_0", PluginKernel, softmax_operands("f32", 1)))]

        def _supports(self, args):
            return None

        def get_workspace_size(self, args):
            return 0

        def compile(self, args, cc=None):
            return CompiledArtifact(None, self)

        def _run(self, args, artifact, stream, workspace=None):
            pass
''')


@pytest.fixture
def plugin_dir(monkeypatch, tmp_path):
    """``write(source) -> module name``: a plugin module importable for this test only."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(source):
        name = f"private_plugin_{uuid.uuid4().hex[:12]}"
        (tmp_path / f"{name}.py").write_text(source)
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


def entry_point(name, value):
    return importlib.metadata.EntryPoint(name=name, value=value, group="private.plugins")


def test_plugins_load_into_the_registry_that_imports_them(plugin_dir):
    module = plugin_dir(PLUGIN.format(provider="plugged", prefix="Plugged"))
    broken = plugin_dir("raise RuntimeError('plugin exploded')\n")
    reg = Registry()
    with pytest.warns(RuntimeWarning, match="plugin exploded"):
        reg.load_plugins(entry_points=[entry_point("good", module), entry_point("bad", broken)])
    assert reg.available_providers() == ["plugged"]
    assert names(reg.get_kernels(softmax_args(), cc=90)) == ["Plugged_0"]
    assert reg.plugin_errors() == {f"bad ({broken})": "RuntimeError: plugin exploded"}
    # the default registry saw none of it
    assert "plugged" not in kernel_api.available_providers()
    assert "Plugged_0" not in names(kernel_api.get_kernels(softmax_args(), cc=90))
    assert not [label for label in kernel_api.plugin_errors() if broken in label]


def test_a_provider_named_by_its_entry_point_is_registered(plugin_dir):
    module = plugin_dir("import kernel_api\n\nclass Named(kernel_api.Provider):\n    name = 'named'\n")
    reg = Registry()
    reg.load_plugins(entry_points=[entry_point("named", f"{module}:Named")])
    assert reg.available_providers() == ["named"] and "named" not in kernel_api.available_providers()


def test_a_registry_loads_its_own_entry_point_group_once(plugin_dir, monkeypatch):
    module = plugin_dir(PLUGIN.format(provider="grouped", prefix="Grouped"))
    calls = []

    def entry_points(group=None):
        calls.append(group)
        return [entry_point("grouped", module)] if group == "private.plugins" else []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    reg = Registry(entry_point_group="private.plugins")
    assert not reg.plugins_loaded
    assert names(reg.get_kernels(softmax_args(), cc=90)) == ["Grouped_0"]  # discovery loads them
    reg.get_kernels(softmax_args(), cc=90)
    assert calls == ["private.plugins"] and reg.plugins_loaded
    reg.reset_plugins()
    assert not reg.plugins_loaded and reg.available_providers() == ["grouped"] and len(calls) == 2
