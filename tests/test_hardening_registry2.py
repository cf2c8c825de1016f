"""Discovery hardening: plugin loading that other threads wait for, plugins that raise
BaseExceptions at import, and the smaller refusals (compile, targets, duplicate names)."""

import importlib.metadata
import sys
import textwrap
import threading
import types
import uuid

import pytest
import torch

import kernel_api
from kernel_api import SoftmaxArguments, registry
from kernel_api.registry import registration


def softmax_args():
    x = torch.randn(4, 8)
    return SoftmaxArguments(x, torch.empty_like(x))


# ---- plugins -------------------------------------------------------------------------------

PLUGIN = textwrap.dedent('''
    import kernel_api
    from kernel_api import CompiledArtifact, Kernel, KernelMetadata, SoftmaxArguments
    from kernel_api.metadata import softmax_operands

    {before}

    @kernel_api.register_provider
    class PluginProvider(kernel_api.Provider):
        name = {provider!r}

    @PluginProvider.register
    class PluginKernel(Kernel):
        supported_args_type = SoftmaxArguments

        @staticmethod
        def generate_kernels(metadata_filter, epilogue_args=None, cc=None):
            return [PluginKernel(KernelMetadata(f"{prefix}_{{i}}", PluginKernel, softmax_operands("f32", 1)))
                    for i in range({count})]

        def _supports(self, args):
            return None

        def get_workspace_size(self, args):
            return 0

        def compile(self, args, cc=None):
            return CompiledArtifact(None, self)

        def _run(self, args, artifact, stream, workspace=None):
            pass

    {after}
''')


@pytest.fixture
def plugins(monkeypatch, tmp_path):
    """``add(source)`` writes a plugin module and lists it as an entry point; ``load()`` starts
    discovery as a fresh process would (plugins not loaded yet). Everything is undone after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    entries, modules, providers = [], [], []

    def add(before="", after="", count=3, raw=None):
        name = f"plugin_{uuid.uuid4().hex[:12]}"
        provider = f"p_{name}"
        source = raw if raw is not None else PLUGIN.format(before=before.strip(),
                                                          after=after.strip(), provider=provider, prefix=name,
                                                          count=count)
        (tmp_path / f"{name}.py").write_text(source)
        entries.append(importlib.metadata.EntryPoint(name=name, value=name, group=registry.ENTRY_POINT_GROUP))
        modules.append(name)
        providers.append(provider)
        return name, provider

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: list(entries))
    monkeypatch.setattr(registration, "_plugins_loaded", False)
    yield add
    for provider in providers:
        cls = registration._providers.get(provider)
        if cls is not None:
            for k in cls.kernel_classes():
                cls.unregister(k)
            registry.unregister_provider(provider)
    for name in modules:
        sys.modules.pop(name, None)
        for label in [k for k in registration._plugin_errors if name in k]:
            registration._plugin_errors.pop(label)
    registry.clear_caches()


@pytest.fixture
def sync():
    """Events a plugin's import and the test share (the plugin imports ``plugin_sync``)."""
    events = types.SimpleNamespace(importing=threading.Event(), release=threading.Event())
    sys.modules["plugin_sync"] = events
    yield events
    events.release.set()
    del sys.modules["plugin_sync"]


def test_other_threads_wait_until_every_plugin_is_loaded(plugins, sync):
    """A thread that starts discovery while another imports a slow plugin gets every kernel."""
    name, provider = plugins(before="import plugin_sync\nplugin_sync.importing.set()\nplugin_sync.release.wait(30)",
                             count=6)
    args = softmax_args()
    found = {}

    def discover(label):
        found[label] = [k.metadata.kernel_name for k in kernel_api.get_kernels(args)]

    first = threading.Thread(target=discover, args=("first",))
    first.start()
    assert sync.importing.wait(30)
    second = threading.Thread(target=discover, args=("second",))
    second.start()
    second.join(0.5)
    waited = second.is_alive()  # the second thread waits for the first to finish loading
    sync.release.set()
    first.join(30)
    second.join(30)
    assert waited
    expected = [f"{name}_{i}" for i in range(6)]
    assert [n for n in found["first"] if n.startswith(name)] == expected
    assert [n for n in found["second"] if n.startswith(name)] == expected
    assert found["first"] == found["second"]


def test_plugin_calling_discovery_while_it_loads_does_not_deadlock(plugins):
    name, provider = plugins(after=textwrap.dedent('''
        import torch
        x = torch.randn(2, 4)
        SEEN = [k.metadata.kernel_name for k in kernel_api.get_kernels(SoftmaxArguments(x, torch.empty_like(x)))]
    '''))
    names = [k.metadata.kernel_name for k in kernel_api.get_kernels(softmax_args())]
    assert f"{name}_0" in names
    assert f"{name}_0" in sys.modules[name].SEEN  # what was registered so far
    assert not [k for k in registry.plugin_errors() if name in k]


class StopEverything(BaseException):
    pass


@pytest.mark.parametrize("raised", ["SystemExit(3)", "GeneratorExit()", "StopEverything('plugin says stop')"])
def test_plugin_raising_a_base_exception_is_reported_and_the_next_loads(plugins, raised, capsys):
    bad, _ = plugins(raw=f"from {__name__} import StopEverything\nraise {raised}\n")
    good, _ = plugins()
    with pytest.warns(RuntimeWarning, match=bad):
        names = [k.metadata.kernel_name for k in kernel_api.get_kernels(softmax_args())]
    assert f"{good}_0" in names
    errors = registry.plugin_errors()
    label = next(k for k in errors if bad in k)
    assert errors[label].startswith(raised.partition("(")[0])


def test_cli_list_survives_a_plugin_calling_sys_exit(plugins, capsys):
    from kernel_api.cli.commands import main

    plugins(raw="import sys\nsys.exit(3)\n")
    good, _ = plugins()
    with pytest.warns(RuntimeWarning, match="SystemExit: 3"):
        status = main(["list", "softmax", "--rows", "4", "--cols", "8", "--dtype", "f32"])
    assert status == 0
    assert f"{good}_0" in capsys.readouterr().out


def test_keyboard_interrupt_at_plugin_import_propagates_and_loading_is_retried(plugins, tmp_path):
    name, _ = plugins(raw="raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        kernel_api.get_kernels(softmax_args())
    assert not registration._plugins_loaded and not [k for k in registration._plugin_errors if name in k]
    # The next discovery loads again: here the plugin has been fixed meanwhile.
    (tmp_path / f"{name}.py").write_text(PLUGIN.format(before="", after="", provider=f"p_{name}", prefix=name,
                                                       count=1))
    assert f"{name}_0" in [k.metadata.kernel_name for k in kernel_api.get_kernels(softmax_args())]
