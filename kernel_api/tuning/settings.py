"""Process-wide and scoped settings: which selection policy the front door (`kernel_api.ops`) uses,
and which providers' kernels it considers.

    with kernel_api.settings(policy=kernel_api.PickBest, num_workers=8):
        y = kernel_api.ops.gemm(A, B)
    with kernel_api.settings(providers=["cutedsl", "cuda_src"]):   # our kernels only, no torch
        y = kernel_api.ops.gemm(A, B)
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Iterator

from .. import registry
from .pick_any import PickAny, Policy
from .policies import PickBest
from .scope import CURRENT, Settings, current

__all__ = ["Settings", "current", "settings"]


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


def _provider_names(providers: Any) -> tuple[str, ...]:
    """Registered provider names (or Provider classes) -> their sorted names; unknown ones raise."""
    if isinstance(providers, (str, type)):
        providers = [providers]
    try:
        chosen = registry.select_providers(providers)
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    if not chosen:
        raise ValueError("providers: expected at least one provider name")
    return tuple(sorted({p.name for p in chosen}))


@contextlib.contextmanager
def settings(policy: Any = None, num_workers: int | None = None, providers: Any = None) -> Iterator[Settings]:
    """Scope in which ``kernel_api.ops`` choose kernels with ``policy`` among those of
    ``providers`` (names such as "cutedsl", "cuda_src", "torch", or Provider classes; default:
    the enclosing scope's, at the top every registered provider)."""
    if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 1):
        raise ValueError(f"num_workers: expected a positive int, got {num_workers!r}")
    base = CURRENT.get()
    new = replace(base, num_workers=num_workers if num_workers is not None else base.num_workers)
    if providers is not None:
        registry.available_providers()  # loads the plugins, so their names are known
        new = replace(new, providers=_provider_names(providers))
    if policy is not None:
        new = replace(new, policy=_make_policy(policy, new.num_workers))
    token = CURRENT.set(new)
    try:
        yield new
    finally:
        CURRENT.reset(token)

