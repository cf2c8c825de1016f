"""Design knobs of kernel instances: how a kernel maps its problem onto the machine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BLASDesignMetadata:
    """Design knobs of a GEMM kernel instance.

    ``tile_shape`` is the CTA tile (M, N, K); ``cluster_shape`` the thread-block cluster
    (M, N, K). Optional: pipeline ``stages``, a ``schedule`` name (e.g. "cooperative",
    "pingpong", "multistage", "simt"), a rasterisation ``swizzle`` and free-form ``extra``.
    """

    tile_shape: tuple[int, ...]
    cluster_shape: tuple[int, ...] = (1, 1, 1)
    stages: int | None = None
    schedule: str | None = None
    swizzle: int | None = None
    extra: tuple = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "tile_shape", tuple(self.tile_shape))
        object.__setattr__(self, "cluster_shape", tuple(self.cluster_shape))


@dataclass(frozen=True)
class RowReductionDesignMetadata:
    """Design of a row-wise kernel (softmax): how rows map onto the machine.

    ``strategy``: "warp" (one warp per row), "block" (one CTA per row) or "cluster".
    ``threads_per_row``, ``vector_bytes`` per access, and the row lengths it handles well
    (``min_cols``..``max_cols``; None = unbounded).
    """

    strategy: str
    threads_per_row: int
    vector_bytes: int = 16
    min_cols: int = 1
    max_cols: int | None = None
    extra: tuple = field(default=())
