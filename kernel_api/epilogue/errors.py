"""`EpilogueError`: what is wrong with an epilogue function, in one line naming the node and
the line of the function it came from."""

from __future__ import annotations

from ..core.errors import KernelApiError


class EpilogueError(KernelApiError, ValueError):
    """An epilogue function that cannot be parsed, bound or fused.

    ``node`` is the source text of the offending node (or None), ``line`` its line in the file
    the function came from (a source string counts from 1), ``function`` the function's name.
    """

    def __init__(self, message: str, *, function: str | None = None, line: int | None = None,
                 node: str | None = None) -> None:
        self.function, self.line, self.node, self.reason = function, line, node, message
        where = []
        if function:
            where.append(f"epilogue {function!r}")
        if line is not None:
            where.append(f"line {line}")
        if node:
            where.append(f"`{node}`")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)
