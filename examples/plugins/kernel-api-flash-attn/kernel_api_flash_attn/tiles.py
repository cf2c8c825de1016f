"""The forward tiles offered beside FlashAttention-4's own choice on sm_90 (`FORWARD_TILES`), as
plain data (no DSL import): each becomes a `FlashAttnForward` instance, so PickBest can time
them against FA4's default and SDPA per shape.

FA4's sm90 forward takes its configuration from four knobs of ``_flash_attn_fwd``: the
(tile_m, tile_n) CTA tile, whether the P·V matmul reads P from registers (``mma_pv_is_rs``: RS;
otherwise P goes through shared memory, SS) and whether a warpgroup's softmax overlaps its next
QK^T matmul (``intra_wg_overlap``). tile_m sets the consumer warpgroups (64 rows each: 192 is
three consumers at 160 registers a thread, 128 two at 240), so tile_m is 64, 128 or 192.
Everything else (two K/V stages, Q in shared memory, the thread count) follows from them.

FA4's own choice (kept as the instance without a tile in its name): 192x128 RS with overlap up
to head dim 64, 128x128 RS with overlap up to 128 (FlashAttention-3's Hopper table, re-tuned on
an H100 for FA4). The alternatives here are what that choice trades off:
- 128-row tiles at head dim 64: 192-row tiles split 1024 query rows into six blocks, the last a
  third full, and under a causal mask that block does the most work (with 128x128 tiles 89 % of
  the causal matmul work at seqlen 1024 is inside the mask, against 67 % with 192x128); each
  with RS and overlap, P through shared memory (SS), and without the overlap;
- 192x128 SS at head dim 64: three consumers with P out of their registers;
- 128x176 and 128x192 RS with overlap at head dim 128: wider key tiles, fewer iterations
  (FlashAttention-3 takes 176 without a mask; two K/V stages of 192 rows and Q take 224 KB of
  the 227 KB of shared memory).

`ForwardTile.speed_vs_sdpa` is the tile's measured speed against torch's SDPA where it was
measured; None ranks it just behind FA4's default (`UNMEASURED`), so PickAny keeps its choice and
PickBest times the tile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: How much slower than FA4's default choice a tile without a measured speed is ranked: enough to
#: keep PickAny's pick where it was, little enough that the tiles stay next to each other.
UNMEASURED = 1.02


@dataclass(frozen=True)
class ForwardTile:
    """One configuration of FA4's sm90 forward, for head dims ``min_head_dim``..``max_head_dim``.

    Args:
        tile_m, tile_n: the CTA tile (query rows, key rows per iteration).
        mma_pv_is_rs: P·V reads P from registers (RS) rather than shared memory (SS).
        intra_wg_overlap: a warpgroup's softmax overlaps its next QK^T matmul.
        min_head_dim, max_head_dim: the head dims the tile is offered for (it is built for
            that class of head dims; FA4 would compile others too, most of them slower).
        speed_vs_sdpa: its measured forward speed against SDPA's default, or None (unmeasured).
    """

    tile_m: int
    tile_n: int
    mma_pv_is_rs: bool = True
    intra_wg_overlap: bool = True
    min_head_dim: int = 8
    max_head_dim: int = 64
    speed_vs_sdpa: float | None = None

    def __post_init__(self) -> None:
        if self.tile_m not in (64, 128, 192):
            raise ValueError(f"ForwardTile.tile_m: {self.tile_m}, FA4's sm90 forward takes 64, 128 or 192 rows")
        if self.tile_n <= 0 or self.tile_n % 16:
            raise ValueError(f"ForwardTile.tile_n: {self.tile_n}, a positive multiple of 16")

    @property
    def name(self) -> str:
        """The tile as kernel names spell it: ``192x128_rs_ol`` (RS, with overlap), ``..._ss``."""
        return (f"{self.tile_m}x{self.tile_n}_{'rs' if self.mma_pv_is_rs else 'ss'}"
                f"{'_ol' if self.intra_wg_overlap else ''}")

    def takes(self, head_dim: int) -> bool:
        """Whether the tile is offered for ``head_dim``."""
        return self.min_head_dim <= head_dim <= self.max_head_dim

    def options(self) -> dict[str, Any]:
        """The keyword arguments of FA4's forward that select this configuration."""
        return {"tile_mn": (self.tile_m, self.tile_n), "mma_pv_is_rs": self.mma_pv_is_rs,
                "intra_wg_overlap": self.intra_wg_overlap}


#: The tiles offered beside FA4's own choice, dense layouts only (see the module docstring).
FORWARD_TILES = (
    ForwardTile(128, 128),
    ForwardTile(128, 128, mma_pv_is_rs=False),
    ForwardTile(128, 128, intra_wg_overlap=False),
    ForwardTile(192, 128, mma_pv_is_rs=False),
    ForwardTile(128, 176, min_head_dim=72, max_head_dim=128),
    ForwardTile(128, 192, min_head_dim=72, max_head_dim=128),
)
