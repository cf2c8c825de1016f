"""``kernel-api trust``: the public keys whose signed bundles install without ``--trust``
(`kernel_api.core.trust`; docs/security.md)."""

from __future__ import annotations

from typing import Any, Callable


def run_trust(action: str, key: str | None, show: Callable[..., Any] = print) -> int:
    """``trust add KEY.pub``, ``trust list`` or ``trust remove SHA256:...``; returns the exit status.

    Args:
        action: ``add``, ``list`` or ``remove``.
        key: the public key file (add) or a fingerprint (remove); None for list.
        show: where lines go.

    Returns:
        0.
    """
    from ..core import trust

    if action == "list":
        if key is not None:
            raise ValueError("trust list takes no argument")
        keys = trust.trusted_keys()
        for k in keys:
            show(f"{k.fingerprint}  {k.line}")
        show(f"{len(keys)} trusted key(s) in {trust.config_dir() / trust.KEYS_FILE}")
        return 0
    if key is None:
        raise ValueError(f"trust {action}: give a " + ("public key file" if action == "add" else "fingerprint"))
    if action == "add":
        added = trust.add_trusted_key(key)
        show(f"trusted {added.fingerprint} ({added.line}): bundles it signs install without --trust")
    else:
        removed = trust.remove_trusted_key(key)
        show(f"no longer trusted: {removed.fingerprint} ({removed.line})")
    return 0
