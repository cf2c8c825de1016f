"""Discovery hardening: plugin loading that other threads wait for, plugins that raise
BaseExceptions at import, and the smaller refusals (compile, targets, duplicate names)."""

import ast
import importlib.metadata
import json
import re
import sys
import textwrap
import threading
import types
import uuid
from pathlib import Path

import pytest
import torch

import kernel_api
from kernel_api import SoftmaxArguments, registry


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
    registry.default_registry.reset_plugins()
    yield add
    for provider in providers:
        registry.unregister_provider(provider)  # (and its classes)
    for name in modules:
        sys.modules.pop(name, None)
    monkeypatch.undo()
    registry.default_registry.reset_plugins()  # the fake plugins' failures are forgotten
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
    assert not registry.default_registry.plugins_loaded
    # The next discovery loads again: here the plugin has been fixed meanwhile.
    (tmp_path / f"{name}.py").write_text(PLUGIN.format(before="", after="", provider=f"p_{name}", prefix=name,
                                                       count=1))
    assert f"{name}_0" in [k.metadata.kernel_name for k in kernel_api.get_kernels(softmax_args())]
    assert not [k for k in registry.plugin_errors() if name in k]  # the interrupt was no plugin failure


# ---- smaller refusals ----------------------------------------------------------------------

class Hardening2Provider(kernel_api.Provider):
    name = "hardening2"


@pytest.fixture
def provider():
    yield Hardening2Provider
    for cls in Hardening2Provider.kernel_classes():
        Hardening2Provider.unregister(cls)
    registry.unregister_provider("hardening2")


def run_in_module(source, **names):
    """Execute ``source`` as the body of a fresh module (a notebook cell's namespace)."""
    module = types.ModuleType(f"cell_{uuid.uuid4().hex[:8]}")
    module.__dict__.update(names)
    exec(compile(textwrap.dedent(source), f"<{module.__name__}>", "exec"), module.__dict__)
    return module


KERNEL_CLASS = '''
    import torch
    from kernel_api import CompiledArtifact, Kernel, KernelMetadata, GemmArguments, GemmOperandsMetadata
    from kernel_api import TensorAttributes

    @Provider.register
    class {cls}(Kernel):
        supported_args_type = GemmArguments

        @staticmethod
        def generate_kernels(metadata_filter, epilogue_args=None, cc=None):
            attrs = TensorAttributes(torch.float64, {pattern}, 1)
            return [{cls}(KernelMetadata({name!r}, {cls}, GemmOperandsMetadata(attrs, attrs, attrs, "f64")))]

        def _supports(self, args):
            return None

        def get_workspace_size(self, args):
            return 0

        def compile(self, args, cc=None):
            return {result}

        def _run(self, args, artifact, stream, workspace=None):
            pass
'''


def kernel_class(provider, cls, name, pattern=(0, 0, 1), result="CompiledArtifact(None, self)"):
    source = KERNEL_CLASS.format(cls=cls, name=name, pattern=pattern, result=result)
    return getattr(run_in_module(source, Provider=provider), cls)


def gemm_args(*shape_l):
    A, B, out = (torch.randn(*shape_l, 4, 4, dtype=torch.float64) for _ in range(3))
    return kernel_api.GemmArguments(A, B, out)


def test_duplicate_name_is_refused_when_generate_kernels_names_its_own_class(provider):
    kernel_class(provider, "FirstOwner", "Hardening2_dup")
    with pytest.raises(kernel_api.RegistrationError, match="Hardening2_dup.*FirstOwner"):
        kernel_class(provider, "SecondOwner", "Hardening2_dup")
    assert [c.__name__ for c in provider.kernel_classes()] == ["FirstOwner"]


def test_cute_dsl_kernel_without_compile_names_the_class_and_the_method():
    from kernel_api.providers.cutedsl import CuTeDSLProvider
    from kernel_api.providers.cutedsl.kernel import CuteDslKernel

    class NoCompile(CuteDslKernel):
        supported_args_type = SoftmaxArguments

        @staticmethod
        def generate_kernels(metadata_filter, epilogue_args=None, cc=None):
            return []

        def _supports(self, args):
            return None

        def get_workspace_size(self, args):
            return 0

        def _run(self, args, artifact, stream, workspace=None):
            pass

    with pytest.raises(kernel_api.RegistrationError) as info:
        CuTeDSLProvider.register(NoCompile)
    assert str(info.value) == "NoCompile does not implement abstract method(s): compile"
    assert NoCompile.__abstractmethods__ == frozenset({"compile"})


def test_compile_refuses_another_operations_arguments_and_a_result_that_is_no_artifact(provider):
    gemm = kernel_class(provider, "GemmOnly", "Hardening2_gemm")
    kernel = kernel_api.get_kernels(gemm_args(), metadata_filter=lambda m: m.kernel_class is gemm)[0]
    with pytest.raises(TypeError, match=r"^Hardening2_gemm.compile: expected GemmArguments, got SoftmaxArguments"):
        kernel.compile(softmax_args(), cc=90)
    assert kernel.compile(gemm_args(), cc=90).cc == 90
    nothing = kernel_class(provider, "ReturnsNone", "Hardening2_none", result="None")
    kernel = nothing(kernel.metadata)
    with pytest.raises(TypeError, match=r"^ReturnsNone.compile returned NoneType .*not a CompiledArtifact"):
        kernel.compile(gemm_args(), cc=90)


def test_pick_any_without_candidates_says_none_were_given():
    with pytest.raises(kernel_api.NoKernelFoundError, match="^PickAny.choose: no candidates given"):
        kernel_api.PickAny().choose(softmax_args(), [])


@pytest.mark.parametrize("cc, error", [("0", ValueError), (0, ValueError), ("sm_5", ValueError), (250, ValueError),
                                       ("ninety", ValueError), (9.0, TypeError), (True, TypeError)])
def test_targets_that_are_no_compute_capability_are_refused_naming_cc(cc, error):
    with pytest.raises(error, match="^cc: "):
        kernel_api.get_kernels(softmax_args(), cc=cc)
    assert kernel_api.get_kernels(softmax_args(), cc=35, providers="cutedsl") == []  # valid: none for it


def test_demo_names_the_target_it_compiles_for(monkeypatch, capsys):
    from kernel_api.cli import demo

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(registry, "get_kernels", lambda args, cc=None: [])
    monkeypatch.setattr(registry, "explain", lambda args, cc=None: f"explained for cc {cc}")
    assert demo.run_demo(64, 64, 64, "f16", 1, cc="80") == 1
    out = capsys.readouterr().out
    assert "targeting sm_80," in out and "sm_90a" not in out and "explained for cc 80" in out
    demo.run_demo(64, 64, 64, "f16", 1)
    assert "targeting sm_90a," in capsys.readouterr().out


def test_k_mismatch_names_the_dimension_and_the_operand():
    A, B = torch.empty(64, 32), torch.empty(64, 64)
    with pytest.raises(ValueError, match=r"^operand B: K mismatch \(K dimension: A has 32, B has 64; "):
        kernel_api.GemmArguments(A, B, torch.empty(64, 64))
    with pytest.raises(ValueError, match=r"^operand out: N mismatch \(N dimension: B has 64, out has 8; "):
        kernel_api.GemmArguments(torch.empty(64, 64), B, torch.empty(64, 8))


def test_rank2_stride_pattern_takes_rank2_operands_only(provider):
    matrices = kernel_class(provider, "MatricesOnly", "Hardening2_rank2", pattern=(0, 1))
    batched = kernel_class(provider, "AnyRank", "Hardening2_rank3", pattern=(0, 0, 1))
    mine = lambda m: m.kernel_class in (matrices, batched)  # noqa: E731
    assert [k.name for k in kernel_api.get_kernels(gemm_args(), metadata_filter=mine)] == \
        ["Hardening2_rank2", "Hardening2_rank3"]
    assert [k.name for k in kernel_api.get_kernels(gemm_args(2), metadata_filter=mine)] == ["Hardening2_rank3"]
    assert [k.name for k in kernel_api.get_kernels(gemm_args(1), metadata_filter=mine)] == ["Hardening2_rank3"]
    reasons = [r for r in kernel_api.explain(gemm_args(2)) if r.kernel_class == "MatricesOnly"]
    assert [(r.operand, r.kind) for r in reasons] == [("A", kernel_api.Reason.SHAPE)]
    assert reasons[0].reason.startswith("operand A: rank 3 (batched) but the kernel's stride pattern (0, 1) is rank 2")


# ---- arguments on fake tensors (torch.compile's strict tracing) -------------------------------

def test_arguments_on_fake_tensors_never_ask_for_a_data_pointer():
    import torch._functorch.config as functorch_config
    from torch._subclasses.fake_tensor import FakeTensorMode

    with functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=False):
        with FakeTensorMode():
            A, B, out = torch.empty(64, 32), torch.empty(32, 16), torch.empty(64, 16)
            shifted = torch.empty(64 * 32 + 1)[1:].view(64, 32)  # one element past the storage's start
            x = torch.empty(8, 32)
            bias = torch.empty(16)
        with pytest.raises(RuntimeError, match="data pointer"):
            A.data_ptr()  # strict mode: what kernel_api must not call
        args = kernel_api.GemmArguments(A, B, out)
        assert args.tensor_attributes["A"].divisibility == 32  # the storage offset's alignment (0)
        args.check_memory()
        odd = kernel_api.GemmArguments(shifted, B, out)
        assert odd.tensor_attributes["A"].divisibility == 1
        assert any("data pointer (4 bytes past" in r.reason for r in kernel_api.explain(odd, cc=90))
        epilogue = kernel_api.EpilogueArguments(bias=bias)
        assert kernel_api.GemmArguments(A, B, out, epilogue=epilogue).epilogue is not None
        soft = kernel_api.SoftmaxArguments(x, torch.empty_like(x))
        assert soft.tensor_attributes["x"].divisibility == 32


# ---- the walkthrough notebooks say what is true ------------------------------------------------

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def notebook_cells(name, kind=None):
    cells = json.loads((NOTEBOOKS / name).read_text())["cells"]
    return ["".join(c["source"]) for c in cells if kind is None or c["cell_type"] == kind]


def run_cells(cells, monkeypatch):
    """Run notebook code cells on the CPU in a fresh namespace (from notebooks/, as Jupyter
    does); returns the namespace and the value of the last cell's last expression."""
    monkeypatch.chdir(NOTEBOOKS)
    monkeypatch.syspath_prepend(str(NOTEBOOKS))
    namespace = {"__name__": "__main__"}
    *body, last = [c.replace('device="cuda"', 'device="cpu"') for c in cells]
    for source in body:
        exec(compile(source, "<cell>", "exec"), namespace)
    tree = ast.parse(last)
    tail = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<cell>", "exec"), namespace)
    value = eval(compile(ast.Expression(tail.value), "<cell>", "eval"), namespace) if tail else None
    return namespace, value


def test_notebook_001_last_cell_shows_the_rank_reason(monkeypatch):
    cells = notebook_cells("001_bring_your_own_cutedsl_kernel.ipynb")
    assert "Rank-2 problems are refused by `_supports`" in cells[6]
    namespace, value = run_cells([cells[1], cells[2], cells[4], cells[7]], monkeypatch)  # (cell 5 runs on a GPU)
    try:
        assert value == ["operands must be rank 3 (L, M, K) x (L, K, N)"]
    finally:
        namespace["CuTeDSLProvider"].unregister(namespace["OurF64Gemm"])


def test_notebook_002_last_cell_lists_the_users_kernel_among_the_candidates(monkeypatch, capsys):
    cells = notebook_cells("002_bring_your_own_cuda_kernel.ipynb")
    setup = "x = torch.randn(1000, 37)\nargs = SoftmaxArguments(x, torch.full_like(x, float('nan')))\n"
    namespace, _ = run_cells([cells[1], cells[2], setup, cells[5]], monkeypatch)  # (cell 3 runs on a GPU)
    printed = capsys.readouterr().out
    assert "RowSoftmaxPerThread_Tfloat   <- ours" in printed and "PickAny chooses" in printed
    assert namespace["RowSoftmaxPerThread"] not in namespace["CudaSourceProvider"].kernel_classes()


def test_notebook_004_says_the_native_module_is_built_at_install():
    import kernel_api.native

    text = "\n".join(notebook_cells("004_host_latency_best_practices.ipynb"))
    assert "first use" not in text and "built when kernel-api is installed" in text
    assert "built when kernel-api is installed" in kernel_api.native.__doc__


def test_notebooks_use_no_private_dispatch_functions():
    for path in NOTEBOOKS.glob("*.ipynb"):
        code = "\n".join(notebook_cells(path.name, "code"))
        assert not re.search(r"\bdispatch\b", code), path.name
        assert not re.search(r"kernel_api(\.\w+)*\._\w", code), path.name


def test_gemm_arguments_are_those_ops_gemm_runs():
    """Notebook 005 asks policies about a layer's GEMM through ops.gemm_arguments."""
    A = torch.randn(300, 64, dtype=torch.bfloat16)
    B = torch.randn(64, 1001, dtype=torch.bfloat16)  # 1001 columns: rows not a multiple of 16 bytes
    bias = torch.randn(1001, dtype=torch.bfloat16)
    head, rest = kernel_api.ops.gemm_arguments(A, B, bias=bias, activation="gelu")
    assert (head.N, rest.N) == (1000, 1) and head.out.stride() == rest.out.stride() == (1008, 1)
    assert head.out.untyped_storage().data_ptr() == rest.out.untyped_storage().data_ptr()
    assert head.epilogue.bias.shape == (1000,) and head.epilogue.activation == "gelu"
    [whole] = kernel_api.ops.gemm_arguments(A, B[:, :1000])
    assert whole.N == 1000 and whole.epilogue is None
    out = torch.empty(300, 1001, dtype=torch.bfloat16)
    assert kernel_api.ops.gemm_arguments(A, B, out, alpha=2.0)[0].out is out
