"""`LaunchedOps`: the aten ops a block of code runs, views left out (they launch nothing), as a
torch dispatch mode: ``with LaunchedOps() as seen: ...`` then ``seen.ops`` (op names in order)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class LaunchedOps(TorchDispatchMode):
    """Records the name of each non-view aten op run inside it."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))
