"""The package's layers: the bottom layer (`kernel_api.core`) imports nothing above it and no
DSL, so `import kernel_api` stays light and the core can be reused by every layer above; the
layers above import downwards only, and no modules import each other at import time."""

import ast
from pathlib import Path
from typing import Any

import pytest

import kernel_api

PACKAGE = Path(kernel_api.__file__).parent


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _top_level(tree: ast.Module) -> list[ast.AST]:
    """Statements that run at import time (module body, and inside its if/try blocks, but for
    ``if TYPE_CHECKING:``)."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        found.append(node)
        if isinstance(node, (ast.If, ast.Try)) and not _is_type_checking(node):
            todo += node.body + node.orelse + getattr(node, "finalbody", []) + \
                [n for h in getattr(node, "handlers", []) for n in h.body]
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, import_time_only: bool = False, modules: Any = None,
             source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in ``path`` (function-level ones included unless
    ``import_time_only``). Given the package's ``modules``, ``from pkg import name`` counts as
    importing the submodule ``pkg.name`` where there is one. ``source``: the text to read as
    ``path``'s (default: the file's)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    tree = ast.parse(path.read_text() if source is None else source)
    for node in _top_level(tree) if import_time_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            if modules is None:
                found.append((node.lineno, name))
            else:
                found += [(node.lineno, f"{name}.{alias.name}" if f"{name}.{alias.name}" in modules else name)
                          for alias in node.names]
    return found


def test_core_imports_only_core_and_no_dsl_at_import_time():
    offences = []
    for path in sorted((PACKAGE / "core").glob("*.py")):
        for line, name in _imports(path):
            if name.startswith("kernel_api") and not name.startswith("kernel_api.core"):
                offences.append(f"{path.name}:{line} imports {name}")
        for line, name in _imports(path, import_time_only=True):
            if name.split(".")[0] in ("cutlass", "tvm_ffi", "cuda"):
                offences.append(f"{path.name}:{line} imports the toolchain module {name} at import time")
    assert not offences, "\n".join(offences)


def test_the_layer_check_sees_relative_imports():
    """Guard for the check itself: a relative import out of core is resolved to its module."""
    probe = PACKAGE / "core" / "status.py"
    names = [name for _, name in _imports(probe)]
    assert all(n == "__future__" or n.startswith(("kernel_api.core", "dataclasses", "enum", "typing")) for n in names), names


def _import_graph() -> dict[str, set[str]]:
    """kernel_api module -> the kernel_api modules it imports while it is imported. (A submodule's
    import runs its parent packages' __init__ first; those edges are implied, not counted: every
    module would otherwise depend on kernel_api/__init__.py.)"""
    modules = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    return {name: {m for _, m in _imports(path, True, modules) if m in modules and m != name}
            for name, path in modules.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None when it is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_module_level_import_cycles():
    cycle = _find_cycle(_import_graph())
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def _full_import_graph() -> dict[str, set[str]]:
    """kernel_api module -> the kernel_api modules it imports anywhere: at import time or inside a
    function (a lazy import still ties the two modules together)."""
    modules = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    return {name: {m for _, m in _imports(path, False, modules) if m in modules and m != name}
            for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of ``graph`` with more than one module: each holds the
    modules of one or more cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_even_through_imports_inside_functions():
    """No two modules import each other, counting the imports inside functions too: a shared
    piece lives in a module below both (e.g. `kernel_api.cli.problems` for the CLI commands)."""
    cycles = [sorted(c) for c in _cycles(_full_import_graph())]
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle_and_submodule_imports():
    """Guard for the check itself: ``from . import x`` is an edge to the submodule x, and a
    cycle is reported as the path around it."""
    graph = _import_graph()
    assert "kernel_api.providers" in graph["kernel_api"]  # from . import registry, kernel, providers
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    assert _cycles({"a": {"b"}, "b": {"a", "c"}, "c": set(), "d": {"d"}}) == [{"a", "b"}]
    assert "kernel_api.cli.problems" in _full_import_graph()["kernel_api.cli.precompile"]


def _layer_offences(prefixes: tuple[str, ...], allowed: tuple[str, ...] = (), forbidden: tuple[str, ...] = ()) -> list[str]:
    """"module imports module" for each import-time import, by a module under ``prefixes``, of a
    kernel_api module outside ``allowed`` (when given) or under ``forbidden``."""
    return [f"{name} imports {edge}" for name, edges in sorted(_import_graph().items()) if name.startswith(prefixes)
            for edge in sorted(edges)
            if (allowed and not edge.startswith(allowed)) or (forbidden and edge.startswith(forbidden))]


# The layers, bottom up: core and native (the C module's loader) import nothing above them;
# epilogue -> arguments -> metadata -> kernel -> cost (the run-time estimates) and registry -> tuning -> ops;
# providers and cli on top.
BOTTOM = ("kernel_api.core", "kernel_api.native")


@pytest.mark.parametrize("layer, allowed", [
    ("kernel_api.native", ("kernel_api.native",)),
    # the epilogue IR (front end, binding, reference): on core alone, below the arguments that hold it
    ("kernel_api.epilogue", BOTTOM + ("kernel_api.epilogue",)),
    ("kernel_api.arguments", BOTTOM + ("kernel_api.epilogue", "kernel_api.arguments")),
    ("kernel_api.metadata", BOTTOM + ("kernel_api.arguments", "kernel_api.metadata")),
    # NVRTC compiles and cubin launches: above the kernel layer (the cache-only switch), below
    # the providers that share it
    ("kernel_api.nvrtc", BOTTOM + ("kernel_api.arguments", "kernel_api.metadata", "kernel_api.kernel",
                                   "kernel_api.launcher", "kernel_api.utils", "kernel_api.nvrtc")),
    # the analytic estimates: above the kernel contract, below the policies that rank by them
    # and the providers that price their kernels with them
    ("kernel_api.cost", BOTTOM + ("kernel_api.arguments", "kernel_api.metadata", "kernel_api.kernel",
                                  "kernel_api.launcher", "kernel_api.utils", "kernel_api.cost")),
])
def test_layer_imports_only_itself_and_the_layers_below(layer, allowed):
    offences = _layer_offences((layer,), allowed)
    assert not offences, "\n".join(offences)


def test_ops_and_nn_import_no_provider():
    """The front door reaches kernels through the registry only: what an operation and a provider
    both need (e.g. attention's definition in torch) lives in a layer below both."""
    offences = _layer_offences(("kernel_api.ops", "kernel_api.nn"), forbidden=("kernel_api.providers",))
    assert not offences, "\n".join(offences)


def test_lower_layers_import_no_ops_cli_tuning_or_providers():
    lower = BOTTOM + ("kernel_api.epilogue", "kernel_api.arguments", "kernel_api.metadata", "kernel_api.kernel", "kernel_api.registry",
                      "kernel_api.utils", "kernel_api.nvrtc", "kernel_api.cost")
    upper = ("kernel_api.ops", "kernel_api.cli", "kernel_api.tuning", "kernel_api.providers")
    offences = _layer_offences(lower, forbidden=upper)
    assert not offences, "\n".join(offences)


def test_providers_never_import_each_other():
    """A provider package imports no module of another provider, at import time or inside a
    function: what two providers share lives in a layer below them (e.g. `kernel_api.nvrtc`)."""
    root = PACKAGE / "providers"
    packages = sorted(p.name for p in root.iterdir() if (p / "__init__.py").exists())
    assert {"cutedsl", "cuda_src", "torch_ops"} <= set(packages)
    offences = []
    for own in packages:
        for path in sorted((root / own).rglob("*.py")):
            for line, name in _imports(path):
                other = name.split(".")[2] if name.startswith("kernel_api.providers.") else None
                if other in packages and other != own:
                    offences.append(f"{path.relative_to(root)}:{line} imports {name}")
    assert not offences, "\n".join(offences)


def _tuning_imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, module) for each import of `kernel_api.tuning` in ``path``, at import time or inside a
    function: import statements, and ``importlib.import_module`` / ``__import__`` of a literal name."""
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    found = _imports(path, False, modules, source)
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if (isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in ("import_module", "__import__")
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return sorted({(line, name) for line, name in found
                   if name == "kernel_api.tuning" or name.startswith("kernel_api.tuning.")})


def test_providers_never_import_tuning():
    """A provider prices its kernels with `kernel_api.cost`, the layer below it that the policies
    rank by too; it never reaches up into `kernel_api.tuning`, at import time or inside a function."""
    offences = [f"{path.relative_to(PACKAGE)}:{line} imports {name}"
                for path in sorted((PACKAGE / "providers").rglob("*.py")) for line, name in _tuning_imports(path)]
    assert not offences, "\n".join(offences)


def test_the_tuning_check_sees_imports_inside_functions():
    """Guard for the check itself: relative, absolute, package and dynamic imports in a function."""
    probe = PACKAGE / "providers" / "torch_ops" / "probe.py"  # not on disk: its source is given
    source = ("def cost():\n"
              "    from ...tuning.policies import gemm_cost\n"
              "    from ... import tuning\n"
              "    import kernel_api.tuning.settings\n"
              "    importlib.import_module('kernel_api.tuning.policies')\n"
              "    from ...cost import gemm_cost\n")
    assert [name for _, name in _tuning_imports(probe, source)] == [
        "kernel_api.tuning.policies", "kernel_api.tuning", "kernel_api.tuning.settings", "kernel_api.tuning.policies"]
