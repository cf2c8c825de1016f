"""Interface of the persistent warp-specialized TMA + WGMMA GEMM for sm_90a (Hopper).

`Sm90WarpSpecializedGemm` registers with the CuTe DSL provider. Each instance is one
configuration: operand types and layouts, CTA tile, cluster shape (TMA multicast),
consumer schedule (cooperative or pingpong), tile rasterisation and the shared-memory stage
count (sized from the 227 KB Hopper allows one CTA). The implementation
(``implementations/sm90_warpspecialized_impl.py``) is imported only when compiling, so
discovery neither needs nor imports cutlass.

TMA needs 16-byte aligned base pointers and strides, so every operand's metadata demands a
divisibility of 16 bytes (8 elements of a 16-bit type, 4 of f32): discovery never hands such
a kernel misaligned operands.

f32 operands come in two math types (``metadata.operands.math_type``): ``tf32`` (the tf32
wgmma reads A and B K-major only: A row-major, B column-major; K tile 32) and ``tf32x3``
(3xTF32: a pre-pass splits A and B into tf32 big and small parts in the workspace, so any
layout and alignment of A and B is taken, and the products are summed to about f32 accuracy;
see the implementation's docstring). ``kernel_api.ops`` leaves tf32 out unless torch allows
TF32 for matmuls (docs/kernels.md, "f32 GEMM precision").

An epilogue function's whole (M, N) inputs and extra outputs that TMA can take (16- or 32-bit,
one unit stride, 16-byte aligned: `staging.tma_loadable` / `tma_storable`, decided from the
operands' keys, so part of the artifact's key) go through shared-memory rings by TMA; their
rings take an A/B stage where the shared memory is full (`plan_staged`). Others are read and
written element-wise.

Stream-K configurations (``_streamk_`` in the name) need a workspace (`get_workspace_size`: one
f32 tile per CTA of the persistent grid plus completion flags); ``Kernel.run`` allocates it when
none is given. What it reaches and what limits it: docs/performance.md, "SM90 GEMM tiles".
"""

from __future__ import annotations

import dataclasses
import random
import threading
from dataclasses import dataclass
from typing import Any, Callable

from ....arguments import GemmArguments
from ....core.dtypes import DataType
from ....cost import GEMM_COST_UNITS_PER_SECOND, SKINNY_GEMM, gemm_cost
from ....launcher import Launcher
from ....metadata import COLUMN_MAJOR, ROW_MAJOR, BLASDesignMetadata, GemmOperandsMetadata, KernelMetadata, TensorAttributes
from ....core.status import Status
from ....utils import strides_to_layout_string
from .. import CuTeDSLProvider
from ..kernel import fake_tensor
from .common import (FUSED_EPILOGUE, LAYOUT_COMBOS, EpilogueSpec, GemmKernelBase, epilogue_supported_by_generation,
                     epilogue_tail, function_epilogue_launcher, launch_workspace)
from .staging import tma_loadable, tma_storable

#: Shared memory one CTA may use on sm_90 (227 KB).
SM90_SMEM_BYTES = 232448
#: Room kept for the mbarriers (padded to the 1 KB alignment of the operand buffers).
_BARRIER_BYTES = 1024
#: K tile of 16-bit operands (128 bytes: the widest swizzle); f32 operands take 32 (`k_tile`).
K_TILE = 64
_INT32_MAX = 2**31 - 1
#: Stream-K workspace layout (mirrors the implementation): completion flags, then partial tiles.
_FLAG_BYTES = 8192
_MAX_SLOTS = _FLAG_BYTES // 8
# Stream-K completion flags carry a per-launch 64-bit value: a random per-process prefix and a
# launch counter, so stale or uninitialised workspace contents never read as "done".
_EPOCH_PREFIX = random.SystemRandom().getrandbits(30) << 32
_epoch_counter = [0]
_epoch_lock = threading.Lock()


def next_epoch() -> int:
    """The next stream-K launch's completion-flag value (this process's prefix and counter)."""
    with _epoch_lock:
        _epoch_counter[0] = (_epoch_counter[0] + 1) & 0xFFFFFFFF
        return _EPOCH_PREFIX | _epoch_counter[0] | (1 << 62)


@dataclass(frozen=True)
class Sm90Config:
    """One design point: CTA tile (M, N), cluster (M, N), schedule, rasterisation."""

    tile_mn: tuple[int, int]
    cluster_mn: tuple[int, int]
    schedule: str            # "cooperative" | "pingpong"
    swizzle: int = 1         # clusters per raster band (1 = plain row order)
    raster_along_m: bool = True
    epi_n: int = 32          # N extent of one epilogue subtile (the TMA store box)
    stream_k: bool = False   # split the last waves' tiles along K so every SM gets equal work
    #: stream-K also splits a fuller last wave when K has at most this many k-tiles and there
    #: are 4+ waves (0 = never: only a last wave at most a quarter full). Measured neutral at
    #: K=4096 and a loss at K>=14336 (H200, paired with cuBLAS), so off by default.
    sk_any_wave_max_k_tiles: int = 0
    #: add the wgmma accumulator into a register f32 accumulator every this many k-tiles (0 =
    #: never): the tensor cores' truncating accumulation then spans only those k-tiles (3xTF32)
    promote_every: int = 0
    #: (with stream_k) cut every tile along K and share all tiles' k-iterations equally over the
    #: whole persistent grid, a tile's pieces summed by its head cluster: outputs of fewer tiles
    #: than SMs (decode and prefill tails), where a tile per CTA leaves most SMs idle
    split_all: bool = False
    #: the deepest A/B ring plan_stages may give (narrow decode tiles stream B through more,
    #: smaller stages: bytes in flight per SM, not stage count, hide DRAM latency)
    max_ab_stages: int = 8
    #: PickAny's factor on the generic tile model's cost (`estimated_cost`), where a design point
    #: measured slower than that model puts it
    cost_factor: float = 1.0

    @property
    def narrow(self) -> bool:
        """A decode tile: at most 64 columns, so that about one tile per SM streams its slab of B
        over the whole K (`narrow_tile_cost`)."""
        return self.tile_mn[1] <= 64 and not self.split_all

    @property
    def tag(self) -> str:
        return self.tag_for(K_TILE)

    def tag_for(self, k_tile: int) -> str:
        """The name part of this design point with a K tile of ``k_tile``."""
        raster = "m" if self.raster_along_m else "n"
        return (f"tile{self.tile_mn[0]}x{self.tile_mn[1]}x{k_tile}_cluster{self.cluster_mn[0]}x{self.cluster_mn[1]}"
                f"_{self.schedule}{'_splitall' if self.split_all else '_streamk' if self.stream_k else ''}"
                f"{f'_skk{self.sk_any_wave_max_k_tiles}' if self.sk_any_wave_max_k_tiles else ''}"
                f"_swz{self.swizzle}{raster}_epi{self.epi_n}"
                f"{f'_promote{self.promote_every}' if self.promote_every else ''}"
                f"{f'_maxst{self.max_ab_stages}' if self.max_ab_stages != 8 else ''}")


#: The design points generate_kernels emits for every operand type/layout combination with a
#: 16-bit output. Large problems: 128x256 / 256x128 cooperative and 128x128 / 64x256 pingpong,
#: each with 2-CTA multicast; stream-K variants remove the partial last wave (tile counts are
#: rarely multiples of the SM count); skinny M: 64x128 pingpong keeps more SMs busy, split_all
#: cuts every tile along K, and 64x64 tiles with A multicast along N (1x2, 1x4 clusters; deeper
#: rings of their small stages) stream B without split-K at M <= 64. The 128x192 cooperative tile
#: fits outputs whose 128x128 tiles leave a partial wave and whose 128x256 tiles leave SMs idle:
#: bf16 512x6144x4096 (a Llama-3-8B qkv projection at 512 tokens) is 128 tiles, one wave, at
#: 1.01x cuBLAS on the H100 and the H200, where the other tiles ran 0.76x; the 128x160 one,
#: bf16 256x10240x8192 (Llama-3-70B's qkv at 256 tokens, 128 tiles) at 1.04x where the others
#: ran 0.90-0.92x, and GPT-2's c_fc weight gradient (768x3072x8192, 120 tiles) at 1.00x
#: and the 128x224 one, Qwen2-7B's o and down projections at 1024 tokens (1024x3584, 128 tiles)
#: at 0.99x and 1.02x (H200; 1.04x and 1.10x on an H100) where the others ran 0.90-0.94x
#: (gemm_shapes.py --group models,models_more,wave_fit; docs/performance.md, "SM90 GEMM tiles").
CONFIGS: tuple[Sm90Config, ...] = (
    Sm90Config((128, 256), (2, 1), "cooperative", swizzle=4),
    Sm90Config((256, 128), (1, 2), "cooperative", swizzle=4, raster_along_m=False),
    Sm90Config((128, 128), (2, 1), "pingpong", swizzle=8),
    Sm90Config((128, 128), (1, 2), "pingpong", swizzle=4, raster_along_m=False),
    Sm90Config((64, 256), (2, 1), "pingpong", swizzle=4),
    Sm90Config((64, 128), (2, 1), "pingpong", swizzle=1),
    Sm90Config((128, 128), (2, 1), "pingpong", swizzle=8, stream_k=True),
    Sm90Config((128, 128), (1, 2), "pingpong", swizzle=4, raster_along_m=False, stream_k=True),
    Sm90Config((64, 128), (1, 1), "pingpong", stream_k=True, split_all=True),
    Sm90Config((128, 128), (1, 1), "pingpong", stream_k=True, split_all=True),
    Sm90Config((64, 64), (1, 2), "pingpong", raster_along_m=False, max_ab_stages=16),
    Sm90Config((64, 64), (1, 4), "pingpong", raster_along_m=False, max_ab_stages=12),
    Sm90Config((128, 192), (2, 1), "cooperative", swizzle=4),
    # (1.05: GPT-2's mlp.c_proj weight gradient, 3072x768x8192, ran 0.84x cuBLAS on an H100 and
    # 1.00x on an H200 on this tile, ranked 3.6 % ahead of cuBLAS by the tile model; the factor
    # gives that one to cuBLAS and keeps the tile where it ranks 9-20 % ahead: c_fc's weight
    # gradient, 0.97x / 1.00x, and 256x10240x8192, 1.00x / 1.04x)
    Sm90Config((128, 160), (2, 1), "cooperative", swizzle=4, cost_factor=1.05),
    # (1.05 as the 128x160 tile's: unmeasured on most shapes, it ranks first only where it fills
    # a wave the others leave partial, 7 % ahead of them: Qwen2-7B's 3584-column projections)
    Sm90Config((128, 224), (2, 1), "cooperative", swizzle=4, cost_factor=1.05),
    # The ping-pong tiles in raster bands of 16 clusters: a wave's 264 tiles then span about as
    # many rows as columns of the output, so A's and B's panels are read from DRAM fewer times:
    # at bf16 8192^3, 2.16 GB against 3.56 (bands of 8) and 4.73 (1x2 in bands of 4 along N) under
    # ncu; paired with cuBLAS 1.035-1.043x at 4096^3 / 8192^3 against 1.016-1.037x, and 1-3 %
    # faster each in its own power state (H200; docs/performance.md, "SM90 GEMM tiles"). After
    # their twins (the stream-K ones too): the tile model ties them, so
    # PickAny's choice is unchanged and PickBest measures both.
    Sm90Config((128, 128), (2, 1), "pingpong", swizzle=16),
    Sm90Config((128, 128), (1, 2), "pingpong", swizzle=16, raster_along_m=False),
    Sm90Config((128, 128), (2, 1), "pingpong", swizzle=16, stream_k=True),
    Sm90Config((128, 128), (1, 2), "pingpong", swizzle=16, raster_along_m=False, stream_k=True),
)
#: The subset also emitted with an f32 output (one per schedule and shape class).
F32_OUT_CONFIGS: tuple[Sm90Config, ...] = (CONFIGS[0], CONFIGS[2], CONFIGS[5], CONFIGS[6])

#: 3xTF32 adds its wgmma accumulator into a register f32 accumulator every this many k-tiles:
#: 2 measured as accurate as 1 (0.2x cuBLAS FP32's error at K = 4096 and 8192) and 10-25% faster
#: (98-108 TFLOP/s at 128x128 cooperative, 1.9-2.3x cuBLAS FP32); 4 is no faster and 1.5x the
#: error (H200).
TF32X3_PROMOTE_EVERY = 2

#: f32 operands (f32 output): tf32 takes the f32-output subset. 3xTF32 needs f32 accuracy, so it
#: promotes its wgmma accumulator (`Sm90Config.promote_every`): twice the accumulator registers,
#: which fit with a 64 x 128 share per consumer warpgroup (128x128 cooperative, 64x128 pingpong);
#: no stream-K (its workspace holds the split operands).
#: tf32 adds the 128x256 cooperative tile in raster bands of 8 clusters: 1.009-1.010x cuBLAS TF32
#: at 4096^3 in two paired runs where the bands of 4 ran at 0.999-1.000x (H200; at 8192^3
#: 0.996x, where the ping-pong tiles lead).
TF32_CONFIGS: tuple[Sm90Config, ...] = F32_OUT_CONFIGS + (dataclasses.replace(CONFIGS[0], swizzle=8),)
TF32X3_CONFIGS: tuple[Sm90Config, ...] = (
    Sm90Config((128, 128), (2, 1), "cooperative", swizzle=8, promote_every=TF32X3_PROMOTE_EVERY),
    Sm90Config((64, 128), (2, 1), "pingpong", swizzle=1, promote_every=TF32X3_PROMOTE_EVERY),
)

_AB_TYPES = (DataType.bf16, DataType.f16)
#: f16-accumulating instances (accumulator_type=torch.float16, f16 operands): the large
#: cooperative tile, the 128x128 and 64x128 ping-pong ones; no stream-K (its partial tiles are f32).
F16_ACC_CONFIGS: tuple[Sm90Config, ...] = (CONFIGS[0], CONFIGS[2], CONFIGS[5])


#: A cooperative tile whose epilogue function reads or writes a whole (M, N) tensor costs this much
#: more: both warpgroups run the epilogue together, with no mainloop beside them, where a ping-pong
#: warpgroup's epilogue runs under the other's mainloop. Measured with bf16 residual / gated /
#: extra-output epilogues at 4096^3 and 8192x8192x4096: the cooperative 128x256 tile PickAny
#: ranked first ran 1.05-1.09x the 128x128 ping-pong tile with those tensors moved by TMA through
#: shared memory (then with A/B stages 3 against 5: the staged rings took one), 1.12-1.24x when
#: they were read and written element-wise, with the plain epilogue 1.02-1.08x (H200,
#: benchmarks/epilogue.py: fused@ and fused_ops against fused).
FUSED_TILE_COOPERATIVE_FACTOR = 1.15


def fused_tile_io(args: GemmArguments) -> bool:
    """Whether ``args``' epilogue is a function that reads an input varying along both M and N
    or writes an extra output."""
    keys = getattr(args.epilogue_signature, "operand_keys", None)
    return bool(keys) and any(k.kind == "store" or (k.kind == "load" and k.pattern[1] and k.pattern[2])
                              for k in keys)


#: The split share of a stream-K launch costs this much more per tile-equivalent than whole
#: tiles (the k offsets that no longer line up between neighbouring clusters: less L2 reuse) ...
STREAM_K_SPLIT_COST = 0.03
#: ... plus this many k-tiles of work: a split tile's partial accumulators (128 KB for 128x256
#: in f32) go out through L2 and come back for the fix-up, about 5 us at an SM's share of the
#: bandwidth, whatever K is. Fitted on the 123 recorded pairs of the 128x256 cooperative tile
#: with and without the split (rms log error of their time ratio 0.037; a flat 0.15 term,
#: 0.058): the split measured 7-17 % slower than its data-parallel twin at K of 7-9 k-tiles
#: (staged 1800x2500x400 and 777x5001x555, H200 and H100: gemm_shapes.py's odd_sweep and
#: odd_heldout groups), where the flat term rated it 30 % faster, and 0.93-0.96x at 4097^3
#: (65 k-tiles: 0.15 in all, the flat term's value). 0.03 rather than the fit's 0.05-0.15 keeps f16 / bf16
#: 4097^3 on the split tile (more leaves them on the ping-pong tile, 0.85-0.90 of it).
STREAM_K_FIXUP_K_TILES = 8


def stream_k_waves(cfg: Sm90Config, args: GemmArguments, sm_count: int, k_tile_elems: int) -> tuple[int, float] | None:
    """(whole waves a data-parallel grid runs, the busiest cluster's tile-equivalents with the
    stream-K split, its share costed `STREAM_K_SPLIT_COST` and `STREAM_K_FIXUP_K_TILES` more)
    for ``cfg`` on ``args`` with ``sm_count`` SMs, or None where the kernel's rule splits nothing (mirrors the implementation: the last wave, with one whole wave before
    it, is cut along K when it is at most a quarter full, or any last wave after 4 whole ones
    at K of at most ``sk_any_wave_max_k_tiles`` k-tiles)."""
    (tm, tn), (cm, cn) = cfg.tile_mn, cfg.cluster_mn
    clusters = -(-args.M // (tm * cm)) * -(-args.N // (tn * cn)) * max(args.L, 1)
    grid = max(1, min(sm_count // (cm * cn), clusters))  # the persistent grid: never more clusters than tiles
    rem = clusters % grid
    k_tiles = -(-max(args.K, 1) // k_tile_elems)
    any_wave = k_tiles <= cfg.sk_any_wave_max_k_tiles and clusters >= 4 * grid
    if rem == 0 or rem > (grid if any_wave else grid // 4):
        return None
    split = rem + grid
    split_cost = 1.0 + STREAM_K_SPLIT_COST + STREAM_K_FIXUP_K_TILES / k_tiles
    return -(-clusters // grid), (clusters - split) // grid + split / grid * split_cost


def k_tile(ab_type: DataType) -> int:
    """K extent of one shared-memory stage: 128 bytes of a row (64 16-bit or 32 f32 elements)."""
    return 128 // ab_type.bytes


def split3_row_words(K: int) -> int:
    """Words per row of a 3xTF32 workspace operand: 3K, padded to TMA's 16 bytes."""
    return -(-3 * K // 4) * 4


def tma_divisibility(dtype: DataType) -> int:
    """Elements in 16 bytes: TMA's alignment unit for base pointers and strides."""
    return 16 // dtype.bytes


def plan_stages(cfg: Sm90Config, ab_type: DataType, out_type: DataType) -> tuple[int, int, tuple[int, int]]:
    """(A/B stages, epilogue stages, epilogue tile) filling the shared memory of one CTA.

    A/B stages get priority (they hide the load latency); epilogue stages take what is left
    over in the last partial A/B stage, between 2 and 4.
    """
    tm, tn = cfg.tile_mn
    epi_tile = (64 if cfg.schedule == "pingpong" else 128, cfg.epi_n)
    rings = 2 if cfg.schedule == "pingpong" else 1
    epi_stage_bytes = epi_tile[0] * epi_tile[1] * out_type.bytes * rings
    ab_stage_bytes = (tm + tn) * k_tile(ab_type) * ab_type.bytes
    budget = SM90_SMEM_BYTES - _BARRIER_BYTES
    ab_stages = min(cfg.max_ab_stages, (budget - 2 * epi_stage_bytes) // ab_stage_bytes)
    if ab_stages < 2:
        raise ValueError(f"{cfg.tag}: tile too large for shared memory")
    epi_stages = max(2, min(4, (budget - ab_stages * ab_stage_bytes) // epi_stage_bytes))
    return ab_stages, epi_stages, epi_tile


#: Staged-input slots per epilogue ring an epilogue function's TMA-loaded inputs get at most:
#: a tile's first subtiles load under its main loop, the rest that many subtiles ahead.
MAX_INPUT_STAGES = 4


def plan_staged(cfg: Sm90Config, ab_type: DataType, out_type: DataType, input_bytes: int,
                output_bytes: int) -> tuple[int, int, int, bool]:
    """(A/B stages, epilogue stages, staged-input stages, whether extra outputs are staged) when
    an epilogue function's inputs of ``input_bytes`` bytes per element in all
    (`staging.tma_loadable`) are loaded in tiles through shared memory, and its extra outputs of
    ``output_bytes`` (`staging.tma_storable`) stored in tiles through rings as deep as D's.
    Inputs get one epilogue subtile of each per slot, at least 2 and `MAX_INPUT_STAGES` at most
    per ring. The room comes from D's ring first (down to 2 subtiles), then from A/B stages:
    with the gelu-gated epilogue, keeping the 128x128 tile's 6 A/B stages (D's ring 2, 2 input
    slots) ran 1.064x the plain GEMM where 5 A/B stages (D's ring 4, 4 input slots) ran 1.105x;
    the residual and extra-output epilogues ran alike both ways, 1.01-1.02x (H200, bf16 4096^3,
    benchmarks/epilogue.py). Nothing is staged when even 2 A/B stages leave no room."""
    ab_stages, epi_stages, epi_tile = plan_stages(cfg, ab_type, out_type)
    rings = 2 if cfg.schedule == "pingpong" else 1
    subtiles = (cfg.tile_mn[0] // epi_tile[0]) * (cfg.tile_mn[1] // epi_tile[1])
    area = epi_tile[0] * epi_tile[1] * rings
    ab_stage_bytes = (cfg.tile_mn[0] + cfg.tile_mn[1]) * k_tile(ab_type) * ab_type.bytes
    budget = SM90_SMEM_BYTES - 2 * _BARRIER_BYTES  # (the input slots' mbarriers pad to another 1 KB)
    for ab in range(ab_stages, 1, -1):
        for epi in range(epi_stages, 1, -1):
            left = budget - ab * ab_stage_bytes - area * (out_type.bytes + output_bytes) * epi
            if left < 0:
                continue
            if not input_bytes:
                return ab, epi, 0, output_bytes > 0
            fit = left // (area * input_bytes)
            if fit >= 2:
                return ab, epi, min(fit, MAX_INPUT_STAGES, subtiles), output_bytes > 0
    return ab_stages, epi_stages, 0, False


_max_clusters: dict[tuple[int, int], int] = {}
_max_clusters_lock = threading.Lock()
#: Why a cluster count fell back to SMs / cluster size (diagnostics), by (device, cluster size).
max_clusters_fallbacks: dict[tuple[int, int], str] = {}


def max_active_clusters(device_index: int, cluster_size: int) -> int:
    """How many clusters of ``cluster_size`` CTAs (one CTA per SM) fit on the device at once."""
    key = (device_index, cluster_size)
    value = _max_clusters.get(key)
    if value is None:
        with _max_clusters_lock:
            value = _max_clusters.get(key)
            if value is None:
                import torch

                sms = torch.cuda.get_device_properties(device_index).multi_processor_count
                value = sms // cluster_size
                if cluster_size > 1:
                    # GPCs need not hold a multiple of the cluster size: ask the driver.
                    # Asked with an empty PTX kernel, not the DSL's HardwareInfo, so a warm-cache
                    # first launch imports no DSL (cluster_occupancy.py's docstring says why the
                    # answer is the same).
                    try:
                        from ..cluster_occupancy import max_active_clusters as driver_max_active_clusters

                        value = driver_max_active_clusters(device_index, cluster_size)
                    except Exception as exc:  # pragma: no cover - a driver without the query
                        max_clusters_fallbacks[key] = f"{type(exc).__name__}: {exc}"
                        value = sms // cluster_size
                _max_clusters[key] = value = max(1, value)
    return value


#: `split_all_cost`'s terms, fitted to the split instances' times at M = 64 and 128 (N, K in
#: 4096..14336, H200, gemm_shapes.py --group small_m; within 15 %): the grid
#: streams its operands at 4.2 TB/s (4.4 for the 64x128 tile at M = 64, as cuBLAS) behind a
#: fixed 12 us (cuBLAS: 6.8), the launch, the pipeline fill and the head clusters' fix-up.
SPLIT_ALL_STREAM_BYTES_PER_SECOND = 4.2e12
SPLIT_ALL_FIXED_SECONDS = 12e-6


def split_all_cost(kernel: "Sm90WarpSpecializedGemm", args: GemmArguments, sm_count: int) -> float:
    """PickAny's cost of a split_all instance: its tiles' MMA work spread evenly over every SM
    (no wave quantisation: the k-iterations are shared), or streaming the operands when that
    is longer (B once per row of tiles, A once per column), plus a fixed cost."""
    tm, tn = kernel.config.tile_mn
    m_tiles, n_tiles = -(-args.M // tm), -(-args.N // tn)
    intensity = tm * tn / (tm + tn)
    efficiency = kernel.performance_hint * intensity / (intensity + 32)
    compute = m_tiles * n_tiles * args.L * tm * tn * max(args.K, 1) / max(sm_count, 1) / efficiency
    elem = args.A.element_size()
    streamed = (args.K * args.N * m_tiles + args.M * args.K * n_tiles + args.M * args.N) * args.L * elem
    stream = (streamed / SPLIT_ALL_STREAM_BYTES_PER_SECOND + SPLIT_ALL_FIXED_SECONDS) * GEMM_COST_UNITS_PER_SECOND
    return max(compute, stream)


#: `narrow_tile_cost`'s terms, fitted to the 64x64 tiles (1x2 and 1x4 clusters) at M = 64 and
#: 128 on the H200 (paired with cuBLAS; N, K in 4096..14336): DRAM
#: streams the unique bytes at 4.0 TB/s, an SM takes in its tiles' B slabs and its multicast
#: share of A at 68 GB/s (64 SMs at 64x4096x14336 ran at 3.3 TB/s), behind a fixed 3.5 us; the
#: MMAs run at most at 5 TFLOP/s per SM (660 over 132 SMs, the family's best).
NARROW_DRAM_BYTES_PER_SECOND = 4.0e12
NARROW_SM_BYTES_PER_SECOND = 68e9
NARROW_FIXED_SECONDS = 3.5e-6
NARROW_SM_FLOPS = 5e12
#: A tile whose rows are mostly past M (M < 64: TMA zero-fills the rest of every A box) ran
#: 1.2-1.3x the time of M = 64 on the same B (1x8192x8192, 8x, 16x: 44.8-54.8 us against
#: 36.9-50.7; the 64x128 tile alike, 1.22x). The cause is not known; measured, so charged.
NARROW_PARTIAL_M = 1.3


def narrow_tile_cost(kernel: "Sm90WarpSpecializedGemm", args: GemmArguments, sm_count: int) -> float:
    """PickAny's cost of a narrow (decode) tile: the longer of DRAM streaming B once per row of
    tiles (plus A and out), the busiest SM taking in its tiles' operands and its MMAs, the grid
    being whole clusters in waves of the co-resident ones, plus a fixed cost
    (`NARROW_PARTIAL_M` where M fills less than one tile)."""
    tm, tn = kernel.config.tile_mn
    cm, cn = kernel.config.cluster_mn
    m_tiles, n_tiles = -(-args.M // tm), -(-args.N // tn)
    clusters = -(-m_tiles // cm) * -(-n_tiles // cn) * args.L
    if args.device.type == "cuda":
        resident = max_active_clusters(args.device.index or 0, cm * cn)
    else:
        resident = max(1, sm_count // (cm * cn))
    waves = -(-clusters // resident)  # tiles per SM of the busiest SM
    elem = args.A.element_size()
    per_sm = waves * args.K * (tn + tm / cn) * elem  # A arrives multicast: 1/cn of it per CTA
    unique = (args.K * args.N * m_tiles + args.M * args.K + args.M * args.N) * args.L * elem
    seconds = NARROW_FIXED_SECONDS + max(unique / NARROW_DRAM_BYTES_PER_SECOND,
                                         per_sm / NARROW_SM_BYTES_PER_SECOND,
                                         2.0 * waves * tm * tn * args.K / NARROW_SM_FLOPS)
    if args.M < tm:
        seconds *= NARROW_PARTIAL_M
    return seconds * GEMM_COST_UNITS_PER_SECOND


@CuTeDSLProvider.register
class Sm90WarpSpecializedGemm(GemmKernelBase):
    """Persistent warp-specialized TMA + WGMMA GEMM for sm_90a (f16/bf16 in, f32 accumulate).

    ``out = act(alpha * A @ B + beta * C + bias)``; A, B, out in any row/column-major
    combination, rank 2 or batched rank 3, any M, N, K (TMA zero-fills and clips edges).
    Beyond the template's arguments, a launch takes the number of clusters of the persistent
    grid, the stream-K workspace (None for other configurations) and a stream-K launch counter.
    """

    #: relative peak for the PickAny heuristic (wgmma: the fastest family on Hopper)
    performance_hint = 1.0
    batch_on_grid_z = False  # persistent: the tile scheduler walks the batches
    specialise_c_alignment = True  # compiled with C's alignment from the arguments

    def __init__(self, metadata: KernelMetadata, config: Sm90Config, ab_stages: int, epi_stages: int) -> None:
        super().__init__(metadata)
        self.config = config
        self.ab_stages = ab_stages
        self.epi_stages = epi_stages
        self._split3 = metadata.operands.math_type is DataType.tf32x3
        self.workspace_free = not (config.stream_k or self._split3)
        self._stream_k = config.stream_k
        self._clusters: dict[int, int] = {}

    # ---- discovery -----------------------------------------------------------------
    @staticmethod
    def generate_kernels(metadata_filter: Callable[[KernelMetadata], bool] | None, epilogue_args: Any = None,
                         cc: int | None = None) -> list["Sm90WarpSpecializedGemm"]:
        """Every (types, layouts, config) instance passing ``metadata_filter``; none unless cc is 90."""
        if cc is not None and cc != 90:
            return []  # wgmma/setmaxnreg exist on sm_90a only (not forward compatible)
        if not epilogue_supported_by_generation(epilogue_args, FUSED_EPILOGUE):
            return []
        kernels = []
        for ab in _AB_TYPES:
            for out_type in (ab, DataType.f32):
                for stride_A, stride_B, stride_out in LAYOUT_COMBOS:
                    for cfg in (CONFIGS if out_type is ab else F32_OUT_CONFIGS):
                        kernel = Sm90WarpSpecializedGemm._make(ab, out_type, stride_A, stride_B, stride_out, cfg)
                        if metadata_filter is None or metadata_filter(kernel.metadata):
                            kernels.append(kernel)
        # f16 accumulation: f16 operands, any 16-bit or f32 output; only for callers asking for
        # accumulator_type=f16 (the metadata's accumulator type is matched exactly)
        for out_type in (DataType.f16, DataType.bf16, DataType.f32):
            for stride_A, stride_B, stride_out in LAYOUT_COMBOS:
                for cfg in F16_ACC_CONFIGS:
                    kernel = Sm90WarpSpecializedGemm._make(DataType.f16, out_type, stride_A, stride_B, stride_out,
                                                           cfg, acc=DataType.f16)
                    if metadata_filter is None or metadata_filter(kernel.metadata):
                        kernels.append(kernel)
        f32 = DataType.f32
        for math, configs in ((DataType.tf32, TF32_CONFIGS), (DataType.tf32x3, TF32X3_CONFIGS)):
            for stride_A, stride_B, stride_out in LAYOUT_COMBOS:
                if math is DataType.tf32 and (stride_A != ROW_MAJOR or stride_B != COLUMN_MAJOR):
                    continue  # the tf32 wgmma reads K-major A and B only
                for cfg in configs:
                    kernel = Sm90WarpSpecializedGemm._make(f32, f32, stride_A, stride_B, stride_out, cfg, math)
                    if metadata_filter is None or metadata_filter(kernel.metadata):
                        kernels.append(kernel)
        return kernels

    @staticmethod
    def _make(ab: DataType, out_type: DataType, stride_A: tuple, stride_B: tuple, stride_out: tuple,
              cfg: Sm90Config, math: DataType | None = None, acc: DataType = DataType.f32) -> "Sm90WarpSpecializedGemm":
        """One instance; ``math`` is tf32 or tf32x3 for f32 operands (None: the operand type);
        ``acc`` the accumulator type (f16 for f16 operands only)."""
        ab_stages, epi_stages, _ = plan_stages(cfg, ab, out_type)
        # 3xTF32 reads A and B with plain loads in its pre-pass: any alignment
        ab_div = 1 if math is DataType.tf32x3 else tma_divisibility(ab)
        out_div = tma_divisibility(out_type)
        operands = GemmOperandsMetadata(
            TensorAttributes(ab, stride_A, ab_div), TensorAttributes(ab, stride_B, ab_div),
            TensorAttributes(out_type, stride_out, out_div), accumulator_type=acc, math_type=math)
        kt = k_tile(ab)
        name = (f"Sm90WarpSpecializedGemm_{ab}{ab}_{out_type}_{f'{math}_' if math else ''}{acc}acc_"
                f"{strides_to_layout_string(stride_A, stride_B, stride_out)}_{cfg.tag_for(kt)}"
                f"_stages{ab_stages}x{epi_stages}_align{ab_div}x{ab_div}x{out_div}")
        design = BLASDesignMetadata(tile_shape=(*cfg.tile_mn, kt), cluster_shape=(*cfg.cluster_mn, 1),
                                    stages=ab_stages, schedule=cfg.schedule, swizzle=cfg.swizzle,
                                    extra=(("raster", "m" if cfg.raster_along_m else "n"),
                                           ("epilogue_stages", epi_stages)))
        metadata = KernelMetadata(name, Sm90WarpSpecializedGemm, operands, design, min_cc=90, max_cc=90,
                                  epilogue=FUSED_EPILOGUE)
        return Sm90WarpSpecializedGemm(metadata, cfg, ab_stages, epi_stages)

    def _family_supports(self, args: GemmArguments) -> Status | None:
        # The template has checked the 32-bit extents (TMA coordinates are 32-bit too) and a
        # single batch's stride (TMA descriptors encode it).
        if args.K == 0:
            return Status.fail("K=0: a TMA descriptor cannot describe an empty operand")
        if self._split3 and split3_row_words(args.K) > _INT32_MAX - 256:
            return Status.fail(f"K={args.K:,}: the 3xTF32 workspace rows of 3K words exceed the 32-bit extents "
                               f"of this kernel")
        # The persistent scheduler counts cluster tiles (clusters_m * clusters_n * L) in an Int32
        # and steps its cursor past the last one by up to one wave of clusters. (There are never
        # more cluster tiles than outputs.)
        if args.M * args.N * args.L > _INT32_MAX - _MAX_SLOTS:
            cm, cn = self.config.cluster_mn
            tm, tn = self.config.tile_mn
            clusters = -(-args.M // (tm * cm)) * -(-args.N // (tn * cn)) * args.L
            if clusters > _INT32_MAX - _MAX_SLOTS:
                return Status.fail(
                    f"M x N x L = {args.M:,} x {args.N:,} x {args.L:,} makes {clusters:,} cluster tiles of "
                    f"{tm * cm}x{tn * cn}, past the 32-bit tile counter of this kernel (2^31-1 less one wave of "
                    f"{_MAX_SLOTS:,})")
        return None

    def estimated_cost(self, args: GemmArguments, sm_count: int) -> float | None:
        """`_tile_cost`, times `FUSED_TILE_COOPERATIVE_FACTOR` for a cooperative tile whose epilogue
        function reads or writes a whole (M, N) tensor (`fused_tile_io`)."""
        cost = self._tile_cost(args, sm_count)
        if self.config.schedule == "cooperative" and fused_tile_io(args):
            return (gemm_cost(self, args, sm_count) if cost is None else cost) * FUSED_TILE_COOPERATIVE_FACTOR
        return cost

    def _tile_cost(self, args: GemmArguments, sm_count: int) -> float | None:
        """split_all: `split_all_cost`; narrow tiles: `narrow_tile_cost`; a ``cost_factor`` other
        than 1: that factor on the generic tile model's cost. 3xTF32: the tile model's
        time of a GEMM with K' = 3K, plus the split pre-pass (about a tenth more at K=4096).
        Stream-K that splits fuller last waves (``sk_any_wave_max_k_tiles``), where it splits:
        the tile model's with the split share for the last waves (`stream_k_waves`). Other
        configurations use the generic model: the stream-K twins that split only a last wave at
        most a quarter full are ranked as their data-parallel twins, as the recorded choices
        were (no GPU run has timed the choices a split-aware rank would change for them: GPT-2's
        dW products)."""
        if self.config.split_all:
            return split_all_cost(self, args, sm_count)
        if self.config.narrow:
            return narrow_tile_cost(self, args, sm_count)
        if not (self._split3 or self.config.sk_any_wave_max_k_tiles or self.config.cost_factor != 1.0):
            return None  # (the generic model, `kernel_api.cost.gemm_cost`, ranks it)
        if not (self._split3 or self.config.sk_any_wave_max_k_tiles):
            return self.config.cost_factor * gemm_cost(self, args, sm_count)
        if self._split3:
            return 3.3 * gemm_cost(self, args, sm_count)
        if self.config.stream_k and min(args.M, args.N) > SKINNY_GEMM:
            waves = stream_k_waves(self.config, args, sm_count, k_tile(self.metadata.operands.A.dtype))
            if waves is not None:
                return gemm_cost(self, args, sm_count) * waves[1] / waves[0]
        return None

    def get_workspace_size(self, args: GemmArguments) -> int:
        """Stream-K configurations keep one partial f32 tile per CTA of the persistent grid;
        3xTF32 keeps the split A (M x 3K) and B (N x 3K), rows padded to 16 bytes."""
        if self._split3:
            return 4 * split3_row_words(args.K) * (args.M + args.N) * args.L
        if not self.config.stream_k or args.device.type != "cuda":
            return 0
        cm, cn = self.config.cluster_mn
        slots = max_active_clusters(args.device.index or 0, cm * cn) * cm * cn
        return _FLAG_BYTES + slots * self.config.tile_mn[0] * self.config.tile_mn[1] * 4

    # ---- compile / run: the template's, with three extra launch arguments ------------
    def compile_key(self, args: GemmArguments, cc: int | None) -> tuple:
        """The whole argument signature (`Kernel.compile_key`'s default), as this family has
        always keyed its artifacts."""
        return (args.signature, cc)

    def _make_impl(self, args: GemmArguments) -> Any:
        from .implementations.sm90_warpspecialized_impl import Sm90FusedEpilogueGemmImpl, Sm90WarpSpecializedGemmImpl

        cfg = self.config
        spec = EpilogueSpec.from_signature(args.epilogue_signature)
        impl = Sm90WarpSpecializedGemmImpl if spec.fusion is None else Sm90FusedEpilogueGemmImpl
        ab_stages, epi_stages, staged = self.ab_stages, self.epi_stages, {}
        if spec.fusion is not None:
            # an epilogue function's tensors TMA can load or store go through shared memory (`plan_staged`)
            input_bytes = sum(key.dtype.bytes for key in spec.fusion[1] if tma_loadable(key))
            output_bytes = sum(key.dtype.bytes for key in spec.fusion[1] if tma_storable(key))
            if input_bytes or output_bytes:
                ops = self.metadata.operands
                ab_stages, epi_stages, in_stages, outputs = plan_staged(cfg, ops.A.dtype, ops.out.dtype, input_bytes,
                                                                        output_bytes)
                staged = {"in_stages": in_stages, "stage_outputs": outputs}
        return impl(cfg.tile_mn, cfg.cluster_mn, cfg.schedule, cfg.swizzle,
                                           cfg.raster_along_m, ab_stages, epi_stages,
                                           spec, cfg.epi_n,
                                           cfg.stream_k, cfg.sk_any_wave_max_k_tiles,
                                           k_tile=k_tile(self.metadata.operands.A.dtype), split3=self._split3,
                                           promote_every=cfg.promote_every, split_all=cfg.split_all,
                                           acc_f16=self.metadata.operands.accumulator_type is DataType.f16,
                                           **staged)

    def _extra_compile_args(self, args: GemmArguments) -> tuple:
        """Cluster count, stream-K workspace (bytes; None without stream-K), launch counter."""
        import cutlass

        workspace = fake_tensor(DataType.u8, 1, 0, 256) if (self.config.stream_k or self._split3) else None
        return (cutlass.Int32(1), workspace, cutlass.Int64(0))

    def _extra_launch_args(self, args: GemmArguments, workspace: Any) -> tuple:
        # Launch-time constants per device, looked up once (repeated runs take the bound launch).
        clusters = self._clusters.get(args.device_index)
        if clusters is None:
            cm, cn = self.config.cluster_mn
            clusters = self._clusters[args.device_index] = max_active_clusters(max(args.device_index, 0), cm * cn)
        if self._split3:
            if workspace is None or workspace.numel() < self.get_workspace_size(args):
                raise ValueError(f"{self.name}: needs a workspace of {self.get_workspace_size(args)} bytes")
            return (clusters, workspace, 0)
        if not self._stream_k:
            return (clusters, None, 0)
        cm, cn = self.config.cluster_mn
        if workspace is None or workspace.numel() < self.get_workspace_size(args):
            raise ValueError(f"{self.name}: needs a workspace of {self.get_workspace_size(args)} bytes")
        if clusters * cm * cn > _MAX_SLOTS:
            raise ValueError(f"{self.name}: {clusters} clusters exceed the {_MAX_SLOTS} stream-K slots")
        return (clusters, workspace, next_epoch())

    def _launcher(self, args: GemmArguments, artifact: CompiledArtifact) -> Launcher | None:
        """The launch with C, bias, alpha, beta, clusters, workspace, epoch after the tensors
        (no C operand, a non-empty problem, a device seen before); a bias and alpha are
        constants of the tail (`epilogue_tail`). Without a workspace it is the compiled function
        itself (a TVM-FFI function: the native replay records it as a call's launch). Stream-K and 3xTF32
        configurations take a workspace per launch (the partial tiles; the split A and B) from
        torch's caching allocator on the launch stream, and stream-K a new epoch, in a Python
        function around the compiled one. An epilogue function's launch ends with its bound
        operands (`function_epilogue_launcher`; not for stream-K or 3xTF32)."""
        if not (args.M and args.N and args.L):
            return None
        clusters = self._clusters.get(args.device_index)
        if args.epilogue is not None and args.epilogue.bound is not None:  # an epilogue function
            if clusters is None or self._stream_k or self._split3:
                return None
            return function_epilogue_launcher(artifact, (clusters, None, 0), args)
        tail = epilogue_tail(args)
        if clusters is None or tail is None:
            return None
        if not (self._stream_k or self._split3):
            return Launcher(artifact, (*tail, clusters, None, 0))
        cm, cn = self.config.cluster_mn
        if self._stream_k and clusters * cm * cn > _MAX_SLOTS:
            return None  # (`_extra_launch_args` refuses it with the reason)
        compiled, size, device = artifact.compiled_obj, self.get_workspace_size(args), args.device_index
        stream_k = self._stream_k

        def sm90_with_workspace(A: Any, B: Any, out: Any, C: Any, bias: Any, alpha: Any, beta: Any,
                                stream: Any) -> None:
            workspace, _ = launch_workspace(size, device, stream)
            compiled(A, B, out, C, bias, alpha, beta, clusters, workspace, next_epoch() if stream_k else 0, stream)

        return Launcher(sm90_with_workspace, tail)
