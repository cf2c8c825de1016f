"""The settings in force in this context (`Settings`, `current`): which policy chooses kernels,
among which providers' kernels. `kernel_api.settings` scopes them and the policies read them
(`PickBest` keys its records on the providers), so they live below both.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

from .pick_any import PickAny, Policy


class _ProviderScope:
    """Stands for (policy, providers) in the front door's choice caches and call keys,
    which key on its id(); one per policy and provider set, kept on the policy."""

    __slots__ = ("policy", "providers", "__weakref__")

    def __init__(self, policy: Policy, providers: tuple[str, ...]) -> None:
        self.policy, self.providers = policy, providers


def _scope_token(policy: Policy, providers: tuple[str, ...] | None) -> Any:
    if providers is None:
        return policy  # no restriction: the caches key on the policy itself
    scopes = policy.__dict__.setdefault("_kernel_api_provider_scopes", {})
    token = scopes.get(providers)
    if token is None:
        token = scopes[providers] = _ProviderScope(policy, providers)
    return token


@dataclass(frozen=True)
class Settings:
    """The policy in force, its compile workers (None: the policy's default) and the providers."""

    policy: Policy
    num_workers: int | None = None
    # provider names the front door considers (None: all), sorted
    providers: tuple[str, ...] | None = None
    # What the front door's caches key on: the policy, or a token for (policy, providers) when
    # providers are restricted; ``policy_id`` is its id(), read by every kernel_api.ops call
    # (the native replay's call keys are made from it), so a restriction costs repeated calls nothing.
    scope_token: Any = field(init=False, repr=False, compare=False)
    policy_id: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        token = _scope_token(self.policy, self.providers)
        object.__setattr__(self, "scope_token", token)
        object.__setattr__(self, "policy_id", id(token))


#: The settings in force: `kernel_api.settings` sets it for a scope, and the front door reads it on
#: every call (the variable itself, so a read costs no call frame).
CURRENT: contextvars.ContextVar[Settings] = contextvars.ContextVar("kernel_api_settings", default=Settings(PickAny()))


def current() -> Settings:
    """The `Settings` in force in this context."""
    return CURRENT.get()
