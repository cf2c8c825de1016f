"""kernel_api.ops' front doors as C functions (native/front_door.cc).

A repeated call the native replay serves spends a third of its time over torch's own call in the
Python front door's frame. `c_front_door` makes a C function of a Python front door: it binds the
call's arguments to the Python function's parameters, asks the replay, and calls Python only when
the replay has nothing for the call (then the front door less its replay attempt). Under
``torch.compile`` Dynamo traces the Python front door in its place: each C front door is
registered with ``torch._dynamo.substitute_in_graph`` as soon as Dynamo is imported (kernel_api
does not import Dynamo itself; see `_register_when_dynamo_loads`).

Where the module is not built, disabled (``KERNEL_API_NATIVE=0``), or torch has no
``substitute_in_graph`` (before 2.5), the front doors stay the Python functions.
"""

from __future__ import annotations

import importlib.machinery
import inspect
import logging
import sys
import threading
from typing import Any, Callable

import torch

from .. import native

_log = logging.getLogger(__name__)
_lock = threading.Lock()
# (C front door, Python front door) pairs waiting for Dynamo to be imported
_pending: list[tuple[Any, Callable[..., Any]]] = []
_python_of: dict[int, Callable[..., Any]] = {}  # id(C front door) -> its Python front door


def c_front_door(python: Callable[..., Any], unreplayed: Callable[..., Any], op: int, key: tuple[str, ...],
                 default_only: tuple[str, ...] = ()) -> Callable[..., Any]:
    """The C front door of ``python``, or ``python`` itself where there can be none.

    Args:
        python: the Python front door (positional-or-keyword parameters, then keyword-only ones,
            then optionally ``**kwargs``, which the C function leaves to Python).
        unreplayed: ``python`` less its replay attempt, with the same parameters.
        op: the operation's number in call keys (`kernel_api.native.recipes.op_number`).
        key: the parameters whose values the replay takes, in order (``replay(op, *values)``).
        default_only: parameters the replay serves only at their defaults.

    Returns:
        A builtin function with ``python``'s name, docstring and signature.
    """
    module = native.front_door_module()
    if module is None or not hasattr(torch.compiler, "substitute_in_graph"):
        return python
    signature = inspect.signature(python)
    parameters = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
    if any(p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in parameters):
        raise ValueError(f"{python.__name__}: a C front door takes positional-or-keyword and keyword-only "
                         f"parameters (and **kwargs) only")
    names = tuple(p.name for p in parameters)
    n_positional = sum(p.kind == p.POSITIONAL_OR_KEYWORD for p in parameters)
    defaults = tuple(p.default for p in parameters)
    bare = signature.replace(parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
                             return_annotation=signature.empty)
    text = str(bare)[1:]
    doc = f"{python.__name__}($self{', ' if text != ')' else ''}{text}\n--\n\n{inspect.getdoc(python) or ''}"
    door = module.make(python.__name__, doc, op, python, unreplayed, n_positional, names, defaults,
                       inspect.Parameter.empty, tuple(names.index(n) for n in key),
                       tuple(names.index(n) for n in default_only))
    with _lock:
        _python_of[id(door)] = python
        _pending.append((door, python))
    _register_when_dynamo_loads()
    return door


def python_front_door(door: Callable[..., Any]) -> Callable[..., Any]:
    """The Python front door ``door`` stands for (``door`` itself when it is one): what Dynamo
    traces in its place, and what serves where the native modules are not built."""
    return _python_of.get(id(door), door)


def set_replay(replay_function: Any) -> None:
    """Hand the front doors the native replay (`_launch_table`'s ``replay_function`` capsule)."""
    module = native.front_door_module()
    if module is not None:
        module.set_replay(replay_function)


def _register_pending() -> None:
    with _lock:
        pending = list(_pending)
        _pending.clear()
    for door, python in pending:
        try:
            torch.compiler.substitute_in_graph(door)(python)
        except Exception as exc:  # noqa: BLE001 - Dynamo would graph-break on the C function
            _log.warning("kernel_api: torch.compile cannot trace ops.%s (%s: %s); calls of it under "
                         "torch.compile break the graph", python.__name__, type(exc).__name__, exc)


class _AfterDynamoImport:
    """A meta path finder (the protocol: ``find_spec``) that registers the pending front doors
    right after ``torch._dynamo`` is imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch._dynamo":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _register_pending()

        spec.loader.exec_module = exec_module  # (this spec's loader, made for this import)
        return spec


_finder = _AfterDynamoImport()


def _register_when_dynamo_loads() -> None:
    if "torch._dynamo" in sys.modules:
        _register_pending()
    elif _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
