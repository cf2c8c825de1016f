"""The edits `kernel_api.nn.patch` makes to a model, each a record that can undo itself.

Three kinds: a child module swapped for a kernel_api one (`Swapped`), an attribute set on an
object such as a config or the model (`Assigned`), and a function in a Python module replaced
for as long as one patched model needs it (`GlobalHook`, counted in `GlobalHooks`). `unpatch`
undoes a model's records latest first. Each undo leaves alone a value that someone changed
after `patch`.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Callable


class _Missing:
    """"The attribute was not set": undo deletes it. One object, kept by copies and pickles."""

    def __repr__(self) -> str:
        return "MISSING"

    def __reduce__(self) -> str:
        return "MISSING"


MISSING = _Missing()


@dataclass(frozen=True)
class Swapped:
    """``parent.<attr>`` (a child module) was ``original`` and is now ``replacement``; a None
    ``parent`` means the patched module itself was replaced."""

    parent: Any
    attr: str
    original: Any
    replacement: Any

    def undo(self) -> None:
        if self.parent is not None and getattr(self.parent, self.attr, None) is self.replacement:
            setattr(self.parent, self.attr, self.original)


@dataclass(frozen=True)
class Assigned:
    """``target.<attr>`` was ``before`` (`MISSING`: unset) and is now ``after``. With
    ``instance``, the values are those in the instance's own ``__dict__`` (a method set on one
    object over its class's)."""

    target: Any
    attr: str
    before: Any
    after: Any
    instance: bool = False

    def undo(self) -> None:
        now = _current(self.target, self.attr, self.instance)
        if now is not self.after and not (isinstance(now, str) and now == self.after):
            return  # changed since: left alone
        if self.before is MISSING:
            delattr(self.target, self.attr)
        else:
            setattr(self.target, self.attr, self.before)


def _current(target: Any, attr: str, instance: bool) -> Any:
    return vars(target).get(attr, MISSING) if instance else getattr(target, attr, MISSING)


def positional_names(method: Callable) -> list[str]:
    """The names ``method`` (a function taking ``self`` first) binds positional arguments to, after
    ``self``: how a forward installed in place of a class's maps the positional arguments of a
    call (read once, when it is installed)."""
    return [p.name for p in inspect.signature(method).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]


def assign(target: Any, attr: str, value: Any, *, instance: bool = False) -> Assigned:
    """Set ``target.<attr> = value`` and return the record that undoes it (``instance``: see
    `Assigned`)."""
    before = _current(target, attr, instance)
    setattr(target, attr, value)
    return Assigned(target, attr, before, value, instance)


@dataclass
class GlobalHooks:
    """Functions of Python modules replaced while at least one patched model holds them:
    (module, name) -> [the original, the replacement, holders]."""

    held: dict[tuple[int, str], list] = field(default_factory=dict)

    def acquire(self, module: types.ModuleType, name: str, make: Callable[[Any], Any]) -> "GlobalHook":
        """Replace ``module.<name>`` by ``make(original)`` unless a patched model already did;
        count one more holder. Returns the record that releases it."""
        key = (id(module), name)
        entry = self.held.get(key)
        if entry is None:
            original = getattr(module, name)
            entry = self.held[key] = [original, make(original), 0]
            setattr(module, name, entry[1])
        entry[2] += 1
        return GlobalHook(self, module, name)

    def release(self, module: types.ModuleType, name: str) -> None:
        """One holder fewer; the last one puts the original back (if the replacement is still there)."""
        key = (id(module), name)
        entry = self.held.get(key)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] <= 0:
            del self.held[key]
            if getattr(module, name, None) is entry[1]:
                setattr(module, name, entry[0])

    def replacement(self, module: types.ModuleType, name: str) -> Any:
        """The function installed in ``module.<name>``, or None."""
        entry = self.held.get((id(module), name))
        return None if entry is None else entry[1]


@dataclass(frozen=True)
class GlobalHook:
    """A model's hold on a replaced module function (`GlobalHooks.acquire`)."""

    hooks: GlobalHooks
    module: types.ModuleType
    name: str

    def undo(self) -> None:
        self.hooks.release(self.module, self.name)

    def __deepcopy__(self, memo: dict) -> "GlobalHook":
        # A deep copy of a patched model holds the function too (Python modules are not copied).
        return self.hooks.acquire(self.module, self.name, lambda original: original)


#: The module functions replaced by patched models in this process.
GLOBAL_HOOKS = GlobalHooks()
