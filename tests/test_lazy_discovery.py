"""Discovery imports only the kernel modules that serve the arguments type asked for: providers
and plugins declare them per arguments type (``KERNEL_MODULES``), a new process's first softmax
imports no GEMM family (and the reverse), and what it finds equals the full listing filtered to
the type. Listing everything still imports everything; a plugin that declares nothing is imported
whole; failures of declared modules are reported and skipped; other threads wait."""

import importlib
import importlib.metadata
import json
import subprocess
import sys
import textwrap
import threading
import types
import uuid
from pathlib import Path

import pytest
import torch

from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments, registry
from kernel_api.registry import Registry
from kernel_api.registry.plugins import DECLARATION_ATTRIBUTE, BUILTIN_PROVIDER_MODULES, read_declaration

ROOT = Path(__file__).resolve().parents[1]

# A new process: discovery for one arguments type (meta tensors, cc 90), then everything. Prints
# one JSON object: the kernels found first, the kernel modules imported by then, the classes the
# register_kernels modules registered by themselves, and the same query after loading everything.
FIRST_QUERY = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    import torch, kernel_api
    from kernel_api import GemmArguments, SoftmaxArguments, registry
    x = torch.empty(300, 1000, dtype=torch.bfloat16, device="meta")
    queries = {{"softmax": lambda: SoftmaxArguments(x, torch.empty_like(x)),
               "gemm": lambda: GemmArguments(x, x.T.contiguous(), torch.empty(300, 300, dtype=torch.bfloat16,
                                                                              device="meta"))}}

    def classes():
        return [(p.name, c.__module__, c.__qualname__, c.supported_args_type.__name__)
                for p, c in registry.default_registry._catalog.registered()]

    before = classes()
    for name in {builtins!r}:
        __import__(name)
    declared_only = [c for c in classes() if c not in before]
    args = queries[{first!r}]()
    first = [k.metadata.kernel_name for k in kernel_api.get_kernels(args, cc=90)]
    imported = sorted(m for m in sys.modules if m.startswith("kernel_api.providers."))
    kernel_api.get_kernels()  # lists everything: imports every declared module
    full = [k.metadata.kernel_name for k in kernel_api.get_kernels(args, cc=90)]
    print(json.dumps({{"first": first, "imported": imported, "declared_only": declared_only, "full": full,
                      "classes": classes()}}))
""")


def first_query(first):
    code = FIRST_QUERY.format(root=str(ROOT), builtins=list(BUILTIN_PROVIDER_MODULES), first=first)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def modules_serving_only(found, wanted, other):
    """Modules of the classes serving ``wanted`` that define no class serving ``other``."""
    modules = {c[1] for c in found["classes"] if c[3] == wanted}
    return modules - {c[1] for c in found["classes"] if c[3] == other}


@pytest.mark.parametrize("first, wanted, other", [("softmax", "SoftmaxArguments", "GemmArguments"),
                                                  ("gemm", "GemmArguments", "SoftmaxArguments")])
def test_the_first_discovery_imports_only_the_kernel_modules_of_its_arguments_type(first, wanted, other):
    found = first_query(first)
    assert found["declared_only"] == []  # importing a register_kernels module imports no kernel
    assert found["first"] and found["first"] == found["full"]  # the full listing, filtered to the type
    not_imported = modules_serving_only(found, other, wanted)
    assert not_imported and not not_imported & set(found["imported"])
    assert modules_serving_only(found, wanted, other) <= set(found["imported"])


# ---- the built-in providers' declarations ------------------------------------------------------

def builtin_declarations():
    return [read_declaration(name, importlib.import_module(name)) for name in BUILTIN_PROVIDER_MODULES]


def test_every_builtin_kernel_class_is_declared_under_its_arguments_type():
    """A class whose module is not declared for the type it serves would be missing from that
    type's first discovery in a new process."""
    registry.default_registry.load_plugins()
    checked = 0
    for declaration, name in zip(builtin_declarations(), BUILTIN_PROVIDER_MODULES):
        package = name.rpartition(".")[0] + "."
        for provider, kernel_class in registry.default_registry._catalog.registered():
            if kernel_class.__module__.startswith(package):
                served = declaration.for_type(kernel_class.supported_args_type)
                assert kernel_class.__module__ in served, (
                    f"{kernel_class.__qualname__} ({kernel_class.__module__}) serves "
                    f"{kernel_class.supported_args_type.__name__}, for which {name}.{DECLARATION_ATTRIBUTE} "
                    f"lists {served}")
                checked += 1
    assert checked >= 40


# One process loads the declared types one after the other (in the order given) and records the
# classes serving each right after its load; then everything, and the same lists again.
IN_SEQUENCE = textwrap.dedent("""
    import importlib, json, sys
    sys.path.insert(0, {root!r})
    import kernel_api
    from kernel_api.registry import default_registry as reg
    from kernel_api.registry.plugins import BUILTIN_PROVIDER_MODULES, read_declaration
    types = []
    for name in BUILTIN_PROVIDER_MODULES:
        for t in read_declaration(name, importlib.import_module(name)).by_type:
            if t not in types:
                types.append(t)
    if {reverse!r}:
        types.reverse()

    def serving(t):
        return [f"{{p.name}}/{{c.__qualname__}}" for p, c in reg._catalog.registered()
                if issubclass(t, c.supported_args_type)]

    lazily = {{}}
    for t in types:
        reg._load(t)
        lazily[t.__name__] = serving(t)
    reg.load_plugins()
    print(json.dumps({{"lazily": lazily, "full": {{t.__name__: serving(t) for t in types}}}}))
""")


@pytest.mark.parametrize("reverse", [False, True], ids=["declared-order", "reverse-order"])
def test_each_type_loaded_in_turn_sees_the_classes_and_order_of_the_full_load(reverse):
    code = IN_SEQUENCE.format(root=str(ROOT), reverse=reverse)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found["full"]) >= 15 and all(found["full"].values())
    assert found["lazily"] == found["full"]


# ---- a plugin that declares its kernel modules ---------------------------------------------------

KERNEL_MODULE = textwrap.dedent('''
    import kernel_api
    from kernel_api import CompiledArtifact, Kernel, KernelMetadata, SoftmaxArguments, SoftmaxBackwardArguments
    from kernel_api.metadata import softmax_operands
    from {package} import DeclaredProvider
    {before}

    @DeclaredProvider.register
    class {cls}(Kernel):
        supported_args_type = {args}

        @staticmethod
        def generate_kernels(metadata_filter, epilogue_args=None, cc=None):
            return [{cls}(KernelMetadata("{cls}_f32", {cls}, softmax_operands("f32", 1, backward={backward})))]

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
def declared_plugin(monkeypatch, tmp_path):
    """``make(table, modules) -> (package, registry)``: a plugin package whose ``__init__``
    registers a provider and declares ``table`` ({arguments type name: relative module names}),
    with ``modules`` ({name: source}); a Registry of its own lists it as its entry point."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made = []

    def make(table, modules):
        package = f"declared_{uuid.uuid4().hex[:10]}"
        folder = tmp_path / package
        folder.mkdir()
        entries = ", ".join(f"{t}: {tuple(m)!r}" for t, m in table.items())
        (folder / "__init__.py").write_text(textwrap.dedent(f'''
            import kernel_api
            from kernel_api import GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments

            @kernel_api.register_provider
            class DeclaredProvider(kernel_api.Provider):
                name = "{package}"
                version = "1"

            KERNEL_MODULES = {{{entries}}}
        '''))
        for name, source in modules.items():
            (folder / f"{name}.py").write_text(source.replace("{package}", package))
        made.append(package)
        group = f"group.{package}"
        monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [
            importlib.metadata.EntryPoint(name=package, value=package, group=group)])
        return package, Registry(entry_point_group=group)

    yield make
    for package in made:
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[name]


def kernel_module(cls, before="", backward=False):
    args = "SoftmaxBackwardArguments" if backward else "SoftmaxArguments"
    return (KERNEL_MODULE.replace("{cls}", cls).replace("{before}", before).replace("{args}", args)
            .replace("{backward}", str(backward)))


def softmax_args(cls=SoftmaxArguments):
    x = torch.randn(4, 8)
    return cls(x, torch.empty_like(x))


def backward_args():
    x = torch.randn(4, 8)
    return SoftmaxBackwardArguments(x, torch.empty_like(x), torch.empty_like(x))


def names(kernels):
    return [k.metadata.kernel_name for k in kernels]


class MySoftmaxArguments(SoftmaxArguments):
    """A user's arguments type: the kernels declared for its base serve it."""


def test_a_declaring_plugin_imports_a_types_modules_on_its_first_discovery(declared_plugin):
    package, reg = declared_plugin(
        {"SoftmaxArguments": [".soft", ".soft_more"], "GemmArguments": [".gemm"]},
        {"soft": kernel_module("SoftA"), "soft_more": kernel_module("SoftB"),
         "gemm": "import sys\nsys.modules[__name__].IMPORTED = True\n"})
    assert reg.available_providers() == [package]  # the provider, from the plugin's own import
    assert f"{package}.soft" not in sys.modules
    assert names(reg.get_kernels(softmax_args(MySoftmaxArguments), cc=90)) == ["SoftA_f32", "SoftB_f32"]
    assert f"{package}.gemm" not in sys.modules
    reg.get_kernels()  # lists everything
    assert sys.modules[f"{package}.gemm"].IMPORTED
    assert reg.plugin_errors() == {}


def test_kernel_modules_imported_later_leave_the_instances_in_use_alone(declared_plugin):
    """Another type's modules register classes: the kernels found before (and the artifacts
    compiled on them) are still the ones discovery returns."""
    package, reg = declared_plugin({"SoftmaxArguments": [".soft"], "SoftmaxBackwardArguments": [".back"]},
                                   {"soft": kernel_module("SoftA"), "back": kernel_module("BackA", backward=True)})
    [forward] = reg.get_kernels(softmax_args(), cc=90)
    assert f"{package}.back" not in sys.modules
    assert names(reg.get_kernels(backward_args(), cc=90)) == ["BackA_f32"]
    [again] = reg.get_kernels(softmax_args(), cc=90)
    assert again is forward
    # a class registered again (a re-run notebook cell) gets new instances
    reg.register(type(forward), type(forward)._kernel_api_provider)
    [renewed] = reg.get_kernels(softmax_args(), cc=90)
    assert renewed is not forward and renewed.metadata.kernel_name == forward.metadata.kernel_name


def test_a_failing_declared_module_is_reported_and_the_others_load(declared_plugin):
    package, reg = declared_plugin({"SoftmaxArguments": [".broken", ".soft"], "GemmArguments": [".absent"]},
                                   {"broken": "raise ImportError('needs a library that is not installed')\n",
                                    "soft": kernel_module("SoftA")})
    with pytest.warns(RuntimeWarning, match="not installed"):
        assert names(reg.get_kernels(softmax_args(), cc=90)) == ["SoftA_f32"]
    with pytest.warns(RuntimeWarning, match="absent"):  # plugin_errors imports every declared module
        errors = reg.plugin_errors()
    assert list(errors) == [f"{package} ({package}.broken)", f"{package} ({package}.absent)"]
    # (reported once: the next discovery does not import it again)
    assert names(reg.get_kernels(softmax_args(), cc=90)) == ["SoftA_f32"]


def test_a_malformed_declaration_is_reported(declared_plugin, tmp_path):
    package, reg = declared_plugin({"'softmax'": [".soft"]}, {"soft": kernel_module("SoftA")})
    with pytest.warns(RuntimeWarning, match="KERNEL_MODULES: key 'softmax' is not an arguments type"):
        assert reg.get_kernels(softmax_args(), cc=90) == []
    assert list(reg.plugin_errors()) == [f"{package} ({package})"]


def test_a_keyboard_interrupt_in_a_declared_module_propagates_and_it_is_imported_again(declared_plugin):
    interrupt = "import interrupt_switch\nif interrupt_switch.on: raise KeyboardInterrupt"
    package, reg = declared_plugin({"SoftmaxArguments": [".soft"]}, {"soft": kernel_module("SoftA", before=interrupt)})
    switch = types.SimpleNamespace(on=True)
    sys.modules["interrupt_switch"] = switch
    try:
        with pytest.raises(KeyboardInterrupt):
            reg.get_kernels(softmax_args(), cc=90)
        switch.on = False
        assert names(reg.get_kernels(softmax_args(), cc=90)) == ["SoftA_f32"]
        assert reg.plugin_errors() == {}
    finally:
        del sys.modules["interrupt_switch"]


def test_other_threads_wait_for_the_kernel_modules_of_a_type(declared_plugin):
    package, reg = declared_plugin({"SoftmaxArguments": [".slow"], "SoftmaxBackwardArguments": [".soft"]},
                                   {"slow": kernel_module("SlowSoft", before="import plugin_gate\n"
                                                                             "plugin_gate.importing.set()\n"
                                                                             "plugin_gate.release.wait(30)"),
                                    "soft": kernel_module("SoftB")})
    gate = types.SimpleNamespace(importing=threading.Event(), release=threading.Event())
    sys.modules["plugin_gate"] = gate
    found = {}

    def discover(label):
        found[label] = names(reg.get_kernels(softmax_args(), cc=90))

    try:
        first = threading.Thread(target=discover, args=("first",))
        first.start()
        assert gate.importing.wait(30)
        second = threading.Thread(target=discover, args=("second",))
        second.start()
        second.join(0.5)
        waited = second.is_alive()
        gate.release.set()
        first.join(30)
        second.join(30)
    finally:
        gate.release.set()
        del sys.modules["plugin_gate"]
    assert waited
    assert found["first"] == found["second"] == ["SlowSoft_f32"]
    assert f"{package}.soft" not in sys.modules


def test_a_plugin_declaring_nothing_is_imported_whole(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"whole_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(
        "import kernel_api\n\n@kernel_api.register_provider\nclass Whole(kernel_api.Provider):\n"
        f"    name = {name!r}\n    version = '1'\n\n" + kernel_module("WholeSoft").replace(
            "from {package} import DeclaredProvider", "DeclaredProvider = Whole"))
    reg = Registry()
    try:
        reg.load_plugins(entry_points=[importlib.metadata.EntryPoint(name=name, value=name, group="g")])
        assert names(reg.get_kernels(softmax_args(), cc=90)) == ["WholeSoft_f32"]
    finally:
        sys.modules.pop(name, None)
