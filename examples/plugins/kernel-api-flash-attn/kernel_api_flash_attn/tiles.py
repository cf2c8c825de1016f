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
an H100 for FA4). What it trades off at head dim 64: 192-row tiles (three consumers) do more
per iteration than 128-row ones (two), but split 1024 query rows into six blocks, the last a
third full, and under a causal mask that block does the most work (at seqlen 1024, 89 % of the
causal matmul work of 128x128 tiles is inside the mask, 67 % of 192x128's).

Forward speed against SDPA's default (cuDNN), measured on an H200 in one process (bf16, each
configuration an instance of this plugin, CUDA events, medians, operands rotated past L2; the
offered ones are in ``benchmarks/attention.py --cases d64,d128``'s kernel rows):

| tile | b16 h16 s1024 d64 causal | full | b4 h32 s4096 d128 causal | full |
|---|---|---|---|---|
| FA4's own | 0.80 | 0.93 | 1.11 | 1.07 |
| 128x128 RS, overlap | **0.87** | 0.89 | | |
| 128x128 SS, overlap | 0.85 | 0.87 | | |
| 128x128 RS, no overlap | 0.86 | 0.89 | | |
| 192x128 SS, overlap | 0.75 | 0.87 | | |
| 128x176 RS, overlap | | | 1.09 | 1.03 |
| 128x192 RS, overlap | | | 1.11 | 0.99 |

Only 128x128 RS with overlap beats FA4's own choice anywhere (causal, short sequences), so it is
the one tile offered; the others lost on every shape and are not offered (each instance costs
PickBest a compile). Its speed is used where it was measured (`Measured`): causal, sequences up
to 1024 (shorter ones waste more of a 192-row tile); elsewhere it ranks just behind FA4's own
(`UNMEASURED`), so PickAny keeps FA4's choice there and PickBest times both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: How much slower than FA4's default choice a tile without a measured speed is ranked: enough to
#: keep PickAny's pick where it was, little enough that the tiles stay next to each other.
UNMEASURED = 1.02


@dataclass(frozen=True)
class Measured:
    """A tile's measured forward speed against SDPA's default, and where it holds: with or
    without the causal mask, for query and key lengths up to ``max_seqlen``."""

    causal: bool
    max_seqlen: int
    speed_vs_sdpa: float

    def covers(self, args: Any) -> bool:
        """Whether ``args`` (`AttentionArguments`) is where the measurement holds."""
        return args.causal == self.causal and max(args.seqlen_q, args.seqlen_k) <= self.max_seqlen


@dataclass(frozen=True)
class ForwardTile:
    """One configuration of FA4's sm90 forward, for head dims ``min_head_dim``..``max_head_dim``.

    Args:
        tile_m, tile_n: the CTA tile (query rows, key rows per iteration).
        mma_pv_is_rs: P·V reads P from registers (RS) rather than shared memory (SS).
        intra_wg_overlap: a warpgroup's softmax overlaps its next QK^T matmul.
        min_head_dim, max_head_dim: the head dims the tile is offered for (it is built for
            that class of head dims; FA4 would compile others too, most of them slower).
        measured: its measured speeds (`Measured`); none cover a problem it was not measured on.
    """

    tile_m: int
    tile_n: int
    mma_pv_is_rs: bool = True
    intra_wg_overlap: bool = True
    min_head_dim: int = 8
    max_head_dim: int = 64
    measured: tuple[Measured, ...] = ()

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

    def speed_vs_sdpa(self, args: Any) -> float | None:
        """Its measured forward speed against SDPA's default on problems like ``args``, or None
        where it was not measured."""
        for entry in self.measured:
            if entry.covers(args):
                return entry.speed_vs_sdpa
        return None

    def options(self) -> dict[str, Any]:
        """The keyword arguments of FA4's forward that select this configuration."""
        return {"tile_mn": (self.tile_m, self.tile_n), "mma_pv_is_rs": self.mma_pv_is_rs,
                "intra_wg_overlap": self.intra_wg_overlap}


#: The tiles offered beside FA4's own choice, dense layouts only (see the module docstring).
FORWARD_TILES = (
    ForwardTile(128, 128, measured=(Measured(causal=True, max_seqlen=1024, speed_vs_sdpa=0.87),)),
)
