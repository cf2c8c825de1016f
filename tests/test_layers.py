"""The package's layers: the bottom layer (`kernel_api.core`) imports nothing above it and no
DSL, so `import kernel_api` stays light and the core can be reused by every layer above."""

import ast
from pathlib import Path

import kernel_api

PACKAGE = Path(kernel_api.__file__).parent


def _top_level(tree: ast.Module) -> list[ast.AST]:
    """Statements that run at import time (module body, and inside its if/try blocks)."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        found.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", []) + \
                [n for h in getattr(node, "handlers", []) for n in h.body]
    return found


def _imports(path: Path, import_time_only: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in ``path`` (function-level ones included unless
    ``import_time_only``)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    found = []
    tree = ast.parse(path.read_text())
    for node in _top_level(tree) if import_time_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            found.append((node.lineno, name))
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
    assert all(n == "__future__" or n.startswith(("kernel_api.core", "dataclasses", "typing")) for n in names), names
