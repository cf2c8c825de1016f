"""Process-wide and scoped settings: which selection policy the front door (`kernel_api.ops`) uses.

    with kernel_api.settings(policy=kernel_api.PickBest, num_workers=8):
        y = kernel_api.ops.gemm(A, B)
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

from .policies import PickAny, PickBest, Policy


@dataclass(frozen=True)
class Settings:
    policy: Policy
    num_workers: int | None = None
    # id(policy), read by every kernel_api.ops call (the C launch table's tags are made from it)
    policy_id: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy_id", id(self.policy))


_current: contextvars.ContextVar[Settings] = contextvars.ContextVar("kernel_api_settings", default=Settings(PickAny()))


def current() -> Settings:
    return _current.get()


def _make_policy(policy: Any, num_workers: int | None) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, type) and issubclass(policy, Policy):
        return policy(num_workers=num_workers) if issubclass(policy, PickBest) else policy()
    if isinstance(policy, str) and policy.lower() in ("pickany", "any"):
        return PickAny()
    if isinstance(policy, str) and policy.lower() in ("pickbest", "best"):
        return PickBest(num_workers=num_workers)
    raise TypeError(f"policy: expected PickAny, PickBest (class or instance) or a Policy, got {policy!r}")


@contextlib.contextmanager
def settings(policy: Any = None, num_workers: int | None = None) -> Iterator[Settings]:
    """Scope in which ``kernel_api.ops`` choose kernels with ``policy``."""
    if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 1):
        raise ValueError(f"num_workers: expected a positive int, got {num_workers!r}")
    base = _current.get()
    new = replace(base, num_workers=num_workers if num_workers is not None else base.num_workers)
    if policy is not None:
        new = replace(new, policy=_make_policy(policy, new.num_workers))
    token = _current.set(new)
    try:
        yield new
    finally:
        _current.reset(token)

