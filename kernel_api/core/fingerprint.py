"""Fingerprints of the Python code a kernel runs, for compile-cache keys.

A kernel written in a notebook lives in ``__main__``, whose source ``inspect.getsource`` cannot
read, and it may call helpers of other modules: hashing a module's source by name misses both,
and an edited kernel would load the artifact of its old body. `code_fingerprint` hashes what
the interpreter runs instead: the bytecode and constants of every function reachable from a
root object (the methods and attributes of classes, closures, defaults, ``__wrapped__``, and
the globals, module attributes and modules imported inside functions that the code names),
recursively.

Not walked, only named: objects of the standard library and of installed distributions
(site-packages; their versions are part of a key's toolchain) unless they belong to the top
package of the root itself (an installed plugin's own code is walked), and objects of
``package`` (kernel_api, whose version and sources are keyed separately).

A fingerprint is cached per root and reused while everything its walk read (each global,
class namespace, attribute and closure cell) is still the same object: re-running a cell or
rebinding a helper invalidates it, and an unchanged kernel costs only those lookups. Contents
of mutable containers are read when the fingerprint is computed; mutating them in place later
is not followed. Data is keyed coarsely: arrays and tensors by dtype and shape, containers of
more than 4096 items by type and length.
"""

from __future__ import annotations

import dis
import enum
import functools
import importlib.util
import logging
import os
import site
import sys
import sysconfig
import types
import uuid
import weakref
from typing import Any

from .cache import make_key

_log = logging.getLogger(__name__)
_MISSING = object()
_OWN_PACKAGE = __name__.partition(".")[0]  # kernel_api: keyed by its version and sources instead
_PACKAGE, _LIBRARY, _USER = "package", "library", "user"
_PRIMITIVES = (type(None), bool, int, float, complex, str, bytes)
# Class attributes that are not code: names, docs, and the registry's own bookkeeping.
_SKIPPED_CLASS_ATTRIBUTES = frozenset({"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__",
                                       "__abstractmethods__", "_abc_impl", "__annotations__"})
_LARGE = 4096  # containers longer than this are described by type and length only
_CACHED_ROOTS = 512
_code_infos: dict[types.CodeType, tuple[str, tuple[str, ...], tuple[tuple[str, int], ...]]] = {}
_cache: "weakref.WeakKeyDictionary[Any, tuple[str, tuple]]" = weakref.WeakKeyDictionary()
# A per-process token for roots the walk cannot describe: never a stale hit, only a recompile.
_UNDESCRIBED = uuid.uuid4().hex


@functools.lru_cache(maxsize=None)
def _library_prefixes() -> tuple[str, ...]:
    paths = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        paths.update(site.getsitepackages())
    except AttributeError:  # old virtualenv's site module
        pass
    paths.add(getattr(site, "USER_SITE", None))
    return tuple(os.path.realpath(p).rstrip(os.sep) + os.sep for p in paths if p)


@functools.lru_cache(maxsize=1024)
def _installed(path: str) -> bool:
    return os.path.realpath(path).startswith(_library_prefixes())


def _code_info(code: types.CodeType) -> tuple[str, tuple[str, ...], tuple[tuple[str, int], ...]]:
    """(digest of the code and its nested code, names it refers to, modules it imports as
    (name, level)); cached per code object."""
    info = _code_infos.get(code)
    if info is None:
        names: dict[str, None] = {}
        imports: dict[tuple[str, int], None] = {}
        _collect(code, names, imports)
        info = (make_key(_code_parts(code)), tuple(names), tuple(imports))
        if len(_code_infos) > 8192:
            _code_infos.clear()
        _code_infos[code] = info
    return info


def _collect(code: types.CodeType, names: dict, imports: dict) -> None:
    names.update(dict.fromkeys(code.co_names))
    consts: list = []
    for ins in dis.get_instructions(code):
        if ins.opname == "LOAD_CONST":
            consts.append(ins.argval)
        elif ins.opname == "IMPORT_NAME":
            level = consts[-2] if len(consts) >= 2 and isinstance(consts[-2], int) else 0
            imports[(ins.argval, level)] = None
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _collect(const, names, imports)


def _code_parts(code: types.CodeType) -> tuple:
    """What a code object runs: bytecode, constants (nested code included), names, signature
    and flags. Line numbers are left out: moving code does not change what it does."""
    consts = tuple(_code_parts(c) if isinstance(c, types.CodeType) else _constant(c) for c in code.co_consts)
    return (code.co_name, code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags,
            code.co_code, consts, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars)


def _constant(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_constant(v) for v in value))
    if isinstance(value, (frozenset, set)):  # iteration order follows the per-process str hash
        return (type(value).__name__, tuple(sorted(repr(_constant(v)) for v in value)))
    return (type(value).__name__, value) if isinstance(value, _PRIMITIVES) else (type(value).__name__, repr(value))


class _Walk:
    """One walk from a root: the description (nested tuples) and what it read (``reads``)."""

    def __init__(self, package: str, own_roots: set[str]) -> None:
        self.package = package
        self.own_roots = own_roots
        self.seen: dict[int, int] = {}
        self.alive: list = []  # keeps visited objects alive, so their ids stay unique
        self.modules: dict[tuple[int, tuple[str, ...]], int] = {}
        self.reads: list[tuple] = []

    # ---- reads that the cached result depends on -------------------------------------
    def item(self, mapping: Any, key: str) -> Any:
        value = mapping.get(key, _MISSING)
        self.reads.append((0, mapping, key, value))
        return value

    def attr(self, obj: Any, name: str) -> Any:
        value = getattr(obj, name, _MISSING)
        self.reads.append((1, obj, name, value))
        return value

    def namespace(self, cls: type) -> tuple:
        items = tuple(cls.__dict__.items())
        self.reads.append((2, cls, None, items))
        return items

    def cell(self, cell: Any) -> Any:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            value = _MISSING
        self.reads.append((3, cell, None, value))
        return value

    # ---- classification ----------------------------------------------------------------
    def kind(self, module: Any, namespace: Any = None) -> str:
        if not isinstance(module, str):
            return _USER
        if module == self.package or module.startswith(self.package + "."):
            return _PACKAGE
        root = module.partition(".")[0]
        if root in self.own_roots:
            return _USER
        if root in sys.stdlib_module_names or module in sys.builtin_module_names:
            return _LIBRARY
        if namespace is None:
            namespace = getattr(sys.modules.get(module), "__dict__", None) or {}
        path = namespace.get("__file__")
        return _LIBRARY if isinstance(path, str) and _installed(path) else _USER

    def class_kind(self, cls: type) -> str:
        # The namespace the class was defined in, through one of its functions: a module of the
        # same name in sys.modules may be another one (a notebook's __main__ under a runner).
        for value in cls.__dict__.values():
            fn = getattr(value, "__func__", value)
            if isinstance(fn, types.FunctionType) and fn.__globals__.get("__name__") == cls.__module__:
                return self.kind(cls.__module__, fn.__globals__)
        return self.kind(cls.__module__)

    # ---- descriptions ------------------------------------------------------------------
    def describe(self, obj: Any, names: tuple[str, ...] = ()) -> Any:
        if isinstance(obj, _PRIMITIVES):
            return obj
        if isinstance(obj, types.ModuleType):
            return self.module(obj, names)
        index = self.seen.get(id(obj))
        if index is not None:
            return ("ref", index)
        self.seen[id(obj)] = len(self.seen)
        self.alive.append(obj)
        return self._describe(obj, names)

    def _describe(self, obj: Any, names: tuple[str, ...]) -> Any:
        if isinstance(obj, types.FunctionType):
            return self.function(obj)
        if isinstance(obj, type):
            return self.klass(obj)
        if isinstance(obj, (staticmethod, classmethod)):
            return (type(obj).__name__, self.describe(obj.__func__))
        if isinstance(obj, property):
            return ("property", self.describe(obj.fget), self.describe(obj.fset), self.describe(obj.fdel))
        if isinstance(obj, types.MethodType):
            return ("method", self.describe(obj.__func__), self.describe(obj.__self__))
        if isinstance(obj, functools.partial):
            return ("partial", self.describe(obj.func), self.describe(obj.args), self.describe(obj.keywords))
        if isinstance(obj, types.CodeType):
            return ("code", _code_info(obj)[0])
        if isinstance(obj, (tuple, list, frozenset, set, dict)):
            return self.container(obj, names)
        if isinstance(obj, enum.Enum):
            return ("enum", self.describe(type(obj)), obj.name)
        cls = type(obj)
        if isinstance(obj, (types.BuiltinFunctionType, types.WrapperDescriptorType, types.MethodDescriptorType)):
            return ("builtin", getattr(obj, "__module__", None), getattr(obj, "__qualname__", repr(cls)))
        if self.class_kind(cls) != _USER:
            return _library_object(obj)
        state = getattr(obj, "__dict__", None)
        slots = tuple((s, getattr(obj, s, None)) for c in cls.__mro__ for s in c.__dict__.get("__slots__", ()) if
                      isinstance(s, str))
        return ("instance", self.describe(cls), self.describe(dict(state) if state is not None else {}),
                self.describe(slots))

    def container(self, obj: Any, names: tuple[str, ...]) -> Any:
        if len(obj) > _LARGE:
            return (type(obj).__name__, len(obj))
        if isinstance(obj, dict):
            return ("dict", tuple((self.describe(k), self.describe(v, names)) for k, v in obj.items()))
        if isinstance(obj, (set, frozenset)):
            return (type(obj).__name__, tuple(sorted(repr(self.describe(v)) for v in obj)))
        return (type(obj).__name__, tuple(self.describe(v, names) for v in obj))

    def function(self, fn: types.FunctionType) -> Any:
        namespace = fn.__globals__
        module = namespace.get("__name__")
        kind = self.kind(module, namespace)
        wrapped = self.attr(fn, "__wrapped__")
        if kind is not _USER:
            # A decorator's wrapper (e.g. cute.jit's) is library code; what it wraps may not be.
            inner = self.describe(wrapped) if wrapped is not _MISSING else None
            return (kind, module, fn.__qualname__, inner)
        code = self.attr(fn, "__code__")
        digest, code_names, imports = _code_info(code)
        parts: list = ["function", module, fn.__qualname__, digest, self.describe(self.attr(fn, "__defaults__")),
                       self.describe(self.attr(fn, "__kwdefaults__"))]
        closure = self.attr(fn, "__closure__") or ()
        parts.append(tuple(self.describe(v) if (v := self.cell(c)) is not _MISSING else None for c in closure))
        for name in code_names:
            value = self.item(namespace, name)
            if value is not _MISSING:
                parts.append((name, self.describe(value, code_names)))
        for name, level in imports:
            try:
                resolved = importlib.util.resolve_name("." * level + name, namespace.get("__package__")) \
                    if level else name
            except (ImportError, ValueError):
                continue
            found = self.item(sys.modules, resolved)
            if found is not _MISSING:
                parts.append(("import", resolved, self.describe(found, code_names)))
        if wrapped is not _MISSING:
            parts.append(("wrapped", self.describe(wrapped)))
        return tuple(parts)

    def klass(self, cls: type) -> Any:
        kind = self.class_kind(cls)
        if kind is not _USER:
            return (kind, cls.__module__, cls.__qualname__)
        parts: list = ["class", cls.__module__, cls.__qualname__, tuple(self.describe(b) for b in cls.__bases__)]
        for name, value in self.namespace(cls):
            if name in _SKIPPED_CLASS_ATTRIBUTES or name.startswith("_kernel_api_"):
                continue
            parts.append((name, self.describe(value)))
        return tuple(parts)

    def module(self, module: types.ModuleType, names: tuple[str, ...]) -> Any:
        """A module as the code that reached it sees it: the attributes among ``names``."""
        name = getattr(module, "__name__", None)
        namespace = getattr(module, "__dict__", {})
        kind = self.kind(name, namespace)
        if kind is not _USER:
            version = getattr(sys.modules.get(str(name).partition(".")[0]), "__version__", None)
            return ("module", kind, name, version if isinstance(version, str) else None)
        key = (id(module), names)
        index = self.modules.get(key)
        if index is not None:
            return ("module-ref", index)
        self.modules[key] = len(self.modules)
        self.alive.append(module)
        return ("module", name, tuple((n, self.describe(v, names)) for n in names
                                      if (v := self.item(namespace, n)) is not _MISSING))


def _library_object(obj: Any) -> Any:
    """A library's object by type and value: its repr when that is short and holds no address
    (``torch.float16``), an array's dtype and shape (its data is a runtime value, not code)."""
    cls = type(obj)
    if hasattr(obj, "shape") and hasattr(obj, "dtype"):
        return ("array", cls.__module__, cls.__qualname__, repr(obj.dtype), repr(tuple(obj.shape)))
    try:
        text = repr(obj)
    except Exception:  # noqa: BLE001 - a repr that fails names nothing
        text = ""
    if len(text) > 256 or " at 0x" in text:
        text = ""
    return ("object", cls.__module__, cls.__qualname__, text)


def _still_valid(reads: tuple) -> bool:
    for kind, obj, key, value in reads:
        if kind == 0:
            now = obj.get(key, _MISSING)
        elif kind == 1:
            now = getattr(obj, key, _MISSING)
        elif kind == 2:
            items = obj.__dict__
            if len(items) != len(value) or any(items.get(k, _MISSING) is not v for k, v in value):
                return False
            continue
        else:
            try:
                now = obj.cell_contents
            except ValueError:
                now = _MISSING
        if now is not value:
            return False
    return True


def _root_module(obj: Any) -> str:
    owner = obj if isinstance(obj, (type, types.FunctionType, types.ModuleType)) else type(obj)
    if isinstance(owner, types.FunctionType):
        name = owner.__globals__.get("__name__")
    else:
        name = getattr(owner, "__module__" if not isinstance(owner, types.ModuleType) else "__name__", None)
    return name.partition(".")[0] if isinstance(name, str) else ""


def code_fingerprint(obj: Any, package: str = _OWN_PACKAGE) -> str:
    """A hex digest of the code ``obj`` (a class, function, module or instance) runs; see the
    module docstring. Objects of ``package`` are named rather than walked. A class, function
    or module's fingerprint is cached until something its walk read is rebound; an instance's
    is its class's (cached) and its attributes'."""
    if not isinstance(obj, (type, types.FunctionType, types.ModuleType)):
        cls = type(obj)
        state = getattr(obj, "__dict__", None)
        slots = tuple((s, getattr(obj, s, None)) for c in cls.__mro__ for s in c.__dict__.get("__slots__", ())
                      if isinstance(s, str))
        return make_key(code_fingerprint(cls, package), _fingerprint((dict(state or {}), slots), cls, package)[0])
    try:
        found = _cache.get(obj)
    except TypeError:  # not weakly referenceable
        return _fingerprint(obj, obj, package)[0]
    if found is not None and _still_valid(found[1]):
        return found[0]
    digest, reads = _fingerprint(obj, obj, package)
    if reads is not None:
        if len(_cache) >= _CACHED_ROOTS:  # an entry's reads may hold its root: bound them
            _cache.clear()
        _cache[obj] = (digest, reads)
    return digest


def _fingerprint(obj: Any, root: Any, package: str) -> tuple[str, tuple | None]:
    """(digest, what the walk read), or a per-process digest and None for what cannot be walked."""
    walk = _Walk(package, {_root_module(root)})
    try:
        description = walk.module(obj, tuple(vars(obj))) if isinstance(obj, types.ModuleType) else walk.describe(obj)
        return make_key(description), tuple(walk.reads)
    except Exception as exc:  # noqa: BLE001 - RecursionError included: an odd object must not break compiling
        _log.warning("cannot fingerprint the code of %r (%s: %s); its artifacts are not reused across processes",
                     root, type(exc).__name__, exc)
        return make_key(_UNDESCRIBED, id(root)), None
