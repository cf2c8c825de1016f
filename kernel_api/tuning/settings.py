"""Process-wide and scoped settings: which selection policy the front door (`kernel_api.ops`) uses,
and which providers' kernels it considers.

    with kernel_api.settings(policy=kernel_api.PickBest, num_workers=8):
        y = kernel_api.ops.gemm(A, B)
    with kernel_api.settings(providers=["cutedsl", "cuda_src"]):   # our kernels only, no torch
        y = kernel_api.ops.gemm(A, B)
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

from .. import registry
from .policies import PickAny, PickBest, Policy


class _ProviderScope:
    """Stands for (policy, providers) in the front door's choice caches and launch tables,
    which key on its id(); one per policy and provider set, kept on the policy."""

    __slots__ = ("policy", "providers", "__weakref__")

    def __init__(self, policy: Policy, providers: tuple[str, ...]) -> None:
        self.policy, self.providers = policy, providers


def _scope_token(policy: Policy, providers: tuple[str, ...] | None) -> Any:
    if providers is None:
        return policy  # no restriction: the caches key on the policy itself, as always
    scopes = policy.__dict__.setdefault("_kernel_api_provider_scopes", {})
    token = scopes.get(providers)
    if token is None:
        token = scopes[providers] = _ProviderScope(policy, providers)
    return token


@dataclass(frozen=True)
class Settings:
    policy: Policy
    num_workers: int | None = None
    # provider names the front door considers (None: all), sorted
    providers: tuple[str, ...] | None = None
    # What the front door's caches key on: the policy, or a token for (policy, providers) when
    # providers are restricted; ``policy_id`` is its id(), read by every kernel_api.ops call
    # (the C launch table's tags are made from it), so a restriction costs repeated calls nothing.
    scope_token: Any = field(init=False, repr=False, compare=False)
    policy_id: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        token = _scope_token(self.policy, self.providers)
        object.__setattr__(self, "scope_token", token)
        object.__setattr__(self, "policy_id", id(token))


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


def _provider_names(providers: Any) -> tuple[str, ...]:
    """Registered provider names (or Provider classes) -> their sorted names; unknown ones raise."""
    if isinstance(providers, (str, type)):
        providers = [providers]
    try:
        chosen = registry.registration._select_providers(providers)
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
    base = _current.get()
    new = replace(base, num_workers=num_workers if num_workers is not None else base.num_workers)
    if providers is not None:
        registry.available_providers()  # loads the plugins, so their names are known
        new = replace(new, providers=_provider_names(providers))
    if policy is not None:
        new = replace(new, policy=_make_policy(policy, new.num_workers))
    token = _current.set(new)
    try:
        yield new
    finally:
        _current.reset(token)

