"""What a Python path records for the native entry points to replay: a recipe per call key.

A front door (``kernel_api.ops.gemm``, ``softmax``, a patched ``nn.Linear``) first asks C to
replay the call (``replay(op, *args)``); on a miss its Python path runs: it checks, chooses,
compiles and launches, then records what it did for calls keyed as this one. The key is one C
function of the call (python_entry.cc, ``CallKey``): the settings' policy id, the operation's
number (`op_number`), torch's per-thread state that changes what a call means (grad mode, torch
dispatch and function modes, autocast, cuBLAS's TF32 flag) and every argument (a tensor's type,
lazy bit, requires_grad under grad mode and raw metadata; the value of None, a bool, an int, a
float or a str). C holds no rule of any operation: what runs, which arguments it takes, how an
output is made, are all in the recipe, decided here in Python.

A recipe is one of:

- `Call`: ``callable(*picked, out=argument)`` and its result, for a torch function (which sees
  grad mode, dispatch modes and autocast itself);
- `Launch`: a TVM-FFI function called with picked arguments (or views of them) and constants,
  the output an argument or made as recorded (a dense tensor of the recorded shape, like an
  argument, whose pointer alignment must be the recorded one), on the current stream of the
  first tensor's device; the output is returned, a given one's version counter bumped.

A recipe naming an output argument replays only while that argument's bytes meet no other
tensor argument's (C checks it per call; the Python path judges such calls exactly).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any

#: In a recipe's ``order``: the made output (C's ``kMade``).
MADE = -(1 << 20)
_VIEW = 1 << 20

#: The parts of torch's per-thread state a call key can hold (python_entry.cc's StateBit): grad
#: mode, a torch dispatch mode, a torch function mode, autocast, cuBLAS's TF32 flag.
GRAD_MODE, DISPATCH_MODE, FUNCTION_MODE, AUTOCAST, TF32 = 1, 2, 4, 8, 16
ALL_STATE = GRAD_MODE | DISPATCH_MODE | FUNCTION_MODE | AUTOCAST | TF32
#: With `TF32`: the flag is read and held only for calls with a float32 tensor argument (it
#: changes float32 math only), for an operation whose choices read it for float32 operands alone.
TF32_FOR_FLOAT32 = 32
_STATE_SHIFT = 32

_numbers: dict[str, int] = {}
_counter = itertools.count(1)
_lock = threading.Lock()


def op_number(name: str, state: int = ALL_STATE) -> int:
    """The number of the operation ``name`` in call keys: one per name for the process. It
    carries the parts of torch's state its keys hold (``state``; C reads only those): leave out
    only a part on which no call of the operation, nor what its Python path records, depends."""
    found = _numbers.get(name)
    if found is None:
        with _lock:
            found = _numbers.setdefault(name, next(_counter) | state << _STATE_SHIFT)
    return found


def constant(index: int) -> int:
    """In a recipe's ``order``: the recipe's constant ``index``."""
    return -1 - index


def view(index: int) -> int:
    """In a `Launch`'s ``order``: its view ``index``."""
    return _VIEW + index


@dataclass(frozen=True)
class Call:
    """``callable(*[args[i] or constants[j] per order], out=args[out])``, its result returned.

    Attributes:
        callable: the function called (a torch function: it handles autograd, dispatch modes and
            autocast itself).
        order: per positional argument passed, the call's argument index (>= 0) or a constant
            (`constant`).
        constants: the constants `order` names.
        out: the call's argument passed as ``out=`` (and not overlapping the other tensor
            arguments), or -1.
    """

    callable: Any
    order: tuple[int, ...]
    constants: tuple = ()
    out: int = -1

    def spec(self) -> tuple:
        return (self.callable, False, self.order, self.constants, self.out, self.out, None, ())


@dataclass(frozen=True)
class Launch:
    """A TVM-FFI function launched with ``order``'s arguments, then the current stream.

    Attributes:
        function: the TVM-FFI function (a `Launcher`'s ``function`` with ``ffi`` set).
        order: per argument passed, the call's argument index (>= 0), a constant (`constant`),
            the made output (`MADE`) or a view (`view`).
        constants: the constants `order` names (None, bool, int, float).
        output: the call's argument that is the output (its version counter is bumped; it must
            not overlap the other tensor arguments), or -1 for a made one.
        made: for a made output, ``(like, shape, alignment)``: a dense tensor of ``shape`` with
            the dtype and device of argument ``like``, replayed only when its pointer's lowest set
            bit (up to 1024) is ``alignment``; None otherwise.
        views: ``(argument, shape, strides, offset)`` per view `order` names: the tensor argument's
            memory from ``offset`` elements on, seen with that shape and those strides (fixed by
            the argument's keyed metadata).
    """

    function: Any
    order: tuple[int, ...]
    constants: tuple = ()
    output: int = -1
    made: tuple[int, tuple[int, ...], int] | None = None
    views: tuple[tuple[int, tuple[int, ...], tuple[int, ...], int], ...] = ()

    def spec(self) -> tuple:
        return (self.function, True, self.order, self.constants, -1, self.output, self.made, self.views)


def remap(spec: tuple, moved: dict[int, int]) -> tuple | None:
    """A recorded recipe (as ``record`` was given it: ``entry.recipe`` returns it) for another
    front door's calls, whose argument ``moved[i]`` is the recorded call's argument ``i``; None
    when the recipe reads an argument ``moved`` does not map, or writes into a given output."""
    callable_, launch, order, constants, out_keyword, output, made, views = spec
    if out_keyword >= 0 or output >= 0 or (made is not None and made[0] not in moved):
        return None
    if any(0 <= s < _VIEW and s not in moved for s in order) or any(v[0] not in moved for v in views):
        return None
    order = tuple(moved[s] if 0 <= s < _VIEW else s for s in order)
    views = tuple((moved[v[0]], *v[1:]) for v in views)
    made = None if made is None else (moved[made[0]], *made[1:])
    return (callable_, launch, order, constants, -1, -1, made, views)


def alignment(data_ptr: int) -> int:
    """A pointer's lowest set bit up to 1024 (`Launch.made`'s alignment)."""
    low = data_ptr & 1023
    return 1024 if low == 0 else low & -low


def record(entry: Any, op: int, recipe: Call | Launch, *args: Any) -> bool:
    """Record ``recipe`` for calls of ``op`` keyed as ``args`` (in the current state) in the
    entry points ``entry``; whether the call could be keyed."""
    return bool(entry.record(op, recipe.spec(), *args))


__all__ = ["ALL_STATE", "AUTOCAST", "DISPATCH_MODE", "FUNCTION_MODE", "GRAD_MODE", "MADE", "TF32", "TF32_FOR_FLOAT32", "Call", "Launch", "alignment", "constant", "op_number", "record", "remap", "view"]
