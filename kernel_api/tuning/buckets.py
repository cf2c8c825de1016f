"""Shape buckets for `PickBest`: one tuning record for a range of problem sizes.

A server whose batch (M for a GEMM, rows for a row-wise op) varies from call to call would
otherwise tune every new size it meets. With ``PickBest(bucket="pow2_m")`` the records are keyed
by the bucket instead of the exact shape: the first size seen in a bucket is tuned (with the
caller's own arguments) and its winner serves every later size of that bucket.

A bucket is a function ``bucket(args) -> str | None``: the label of the bucket ``args`` fall
in (the other dimensions and anything else the winner may depend on must be part of it), or
None to key ``args`` by their exact shape. Labels are stored as the records' shape, prefixed
with ``bucket:`` so they never meet an exact shape's key.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from ..arguments import GemmArguments

Bucket = Callable[[Any], "str | None"]
#: The prefix of a bucketed record's shape.
PREFIX = "bucket:"


def pow2_range(size: int) -> tuple[int, int]:
    """The power-of-two bucket ``(lo, hi)`` holding ``size``: ``hi`` is the smallest power of
    two >= size and ``lo = hi / 2 + 1`` (1, 2, 3..4, 5..8, ..., 65..128, ...)."""
    hi = 1 << max(size - 1, 0).bit_length()
    return (hi // 2 + 1 if hi > 2 else hi), hi


def pow2_m(args: Any) -> str | None:
    """GEMM: M in a power-of-two bucket (`pow2_range`), N, K and the batch exact. Row-wise
    operations (softmax, the norms, cross-entropy): rows bucketed the same way, columns exact,
    and any other size of their `problem_key` exact too (the linear cross-entropy's vocabulary).
    Other arguments: None."""
    if isinstance(args, GemmArguments):
        lo, hi = pow2_range(args.M)
        return f"pow2_m M={lo}..{hi} N={args.N} K={args.K} L={args.L}"
    rows, cols = getattr(args, "rows", None), getattr(args, "cols", None)
    if isinstance(rows, int) and isinstance(cols, int):
        lo, hi = pow2_range(rows)
        return f"pow2_m rows={lo}..{hi} cols={cols}" + _other_sizes(args, rows, cols)
    return None


def _other_sizes(args: Any, rows: int, cols: int) -> str:
    """The values of ``args.problem_key()`` besides its type, its signature, one ``rows`` and one
    ``cols``, as a label suffix ("" when none)."""
    key = getattr(args, "problem_key", None)
    if key is None:
        return ""
    rest = [v for v in key() if not isinstance(v, type) and v is not getattr(args, "signature", None)]
    for size in (rows, cols):
        if size in rest:
            rest.remove(size)
    return f" rest={','.join(map(str, rest))}" if rest else ""


#: Buckets known by name (``PickBest(bucket="pow2_m")``).
NAMED: dict[str, Bucket] = {"pow2_m": pow2_m}


def resolve_bucket(bucket: str | Bucket | None) -> Bucket | None:
    """The bucket function for ``bucket``: None, a name of `NAMED`, ``"module:function"``, or a
    callable.

    Raises:
        ValueError: an unknown name, or a ``module:function`` that cannot be imported.
        TypeError: anything else.
    """
    if bucket is None or callable(bucket):
        return bucket
    if not isinstance(bucket, str):
        raise TypeError(f"bucket: expected None, one of {sorted(NAMED)}, 'module:function' or a callable, "
                        f"got {bucket!r}")
    if bucket in NAMED:
        return NAMED[bucket]
    module, sep, name = bucket.partition(":")
    if not sep:
        raise ValueError(f"bucket: unknown bucket {bucket!r}; expected one of {sorted(NAMED)} or 'module:function'")
    try:
        found: Any = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"bucket: cannot import {bucket!r}: {type(exc).__name__}: {exc}") from None
    if not callable(found):
        raise ValueError(f"bucket: {bucket!r} is not callable")
    return found


def bucket_reference(bucket: str | Bucket | None) -> str | None:
    """A string another process resolves to the same bucket (`resolve_bucket`): a name as it
    is, a module-level function as ``"module:qualname"``.

    Raises:
        ValueError: a function another process cannot import (defined in ``__main__``, in a
            function, or a lambda).
    """
    if bucket is None or isinstance(bucket, str):
        resolve_bucket(bucket)  # fails here, not in every worker
        return bucket
    for name, known in NAMED.items():
        if bucket is known:
            return name
    module, qualname = getattr(bucket, "__module__", None), getattr(bucket, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        raise ValueError(f"bucket: {bucket!r} cannot be sent to a worker process; define it at module level "
                         f"in an importable module (not __main__) or pass 'module:function'")
    return f"{module}:{qualname}"
