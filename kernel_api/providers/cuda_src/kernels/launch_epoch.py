"""Per-launch epochs for kernels whose workspace slots carry tags (the row-group softmax's
meeting slots): a tag holds the launch's epoch, so a slot left by another launch, or never
written, does not read as current."""

from __future__ import annotations

import random
import threading

# A random start, then a counter: two processes sharing a workspace by accident still differ.
_epoch = [random.SystemRandom().getrandbits(32)]
_epoch_lock = threading.Lock()


def next_epoch() -> int:
    """This process's next launch epoch (32 bits)."""
    with _epoch_lock:
        _epoch[0] = (_epoch[0] + 1) & 0xFFFFFFFF
        return _epoch[0]


__all__ = ["next_epoch"]
