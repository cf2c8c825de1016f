"""Outcome of a support check: truthy on success, carries the reason on failure."""

from __future__ import annotations


class Status:
    """Result of `Kernel.supports` and friends.

    ``Status.success()`` is truthy; ``Status.fail(message)`` is falsy and keeps the
    message in ``.error`` so callers can say *why* a kernel does not fit.
    """

    __slots__ = ("error",)

    def __init__(self, error: str | None = None) -> None:
        self.error = error

    @classmethod
    def success(cls) -> "Status":
        return _SUCCESS

    @classmethod
    def fail(cls, message: str) -> "Status":
        if not message:
            raise ValueError("Status.fail needs a message saying what is unsupported")
        return cls(str(message))

    @property
    def ok(self) -> bool:
        return self.error is None

    def __bool__(self) -> bool:
        return self.error is None

    def __repr__(self) -> str:
        return "Status.success()" if self.error is None else f"Status.fail({self.error!r})"


_SUCCESS = Status()
