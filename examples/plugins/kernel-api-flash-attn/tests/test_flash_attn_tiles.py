"""kernel-api-flash-attn's forward tiles on the CPU: one instance per `FORWARD_TILES` tile (dense
layouts only) beside the instance that leaves the tile to FA4; each names its tile and carries it
as the metadata's design, is offered for its head dims only (with a one-line reason otherwise),
passes its configuration to FA4's forward, and ranks by its speed where it was measured (and
just behind FA4's own elsewhere): PickAny's choice stays what it was without the tiles (FA4's
own at head dim 128, torch's SDPA at 64).

    python3 -m pytest -q examples/plugins/kernel-api-flash-attn/tests/test_flash_attn_tiles.py

Needs flash-attn-4 (skipped otherwise); no GPU. conftest.py registers the plugin (installed, or
from its folder).
"""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api import AttentionArguments, PickAny

pytest.importorskip("flash_attn.cute.interface")


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def dense(b, s, h, d, causal=True, dtype=torch.bfloat16):
    return AttentionArguments(*[meta(b, s, h, d, dtype=dtype) for _ in range(4)], causal=causal)


def names(args, cc=90):
    return [k.metadata.kernel_name for k in kernel_api.get_kernels(args, providers="flash_attn", cc=cc)]


def test_tiles_are_plain_data_named_by_their_knobs(plugin):
    from kernel_api_flash_attn.tiles import FORWARD_TILES, ForwardTile
    assert [t.name for t in FORWARD_TILES] == ["128x128_rs_ol"]
    assert len({t.name for t in FORWARD_TILES}) == len(FORWARD_TILES)
    tile = ForwardTile(128, 176, mma_pv_is_rs=False, intra_wg_overlap=False, min_head_dim=72, max_head_dim=128)
    assert tile.name == "128x176_ss"
    assert tile.options() == {"tile_mn": (128, 176), "mma_pv_is_rs": False, "intra_wg_overlap": False}
    assert (tile.takes(64), tile.takes(72), tile.takes(128), tile.takes(136)) == (False, True, True, False)
    with pytest.raises(ValueError, match="tile_m: 96"):
        ForwardTile(96, 128)
    with pytest.raises(ValueError, match="tile_n: 72"):
        ForwardTile(128, 72)


def test_a_measured_speed_holds_where_it_was_measured_only(plugin):
    from kernel_api_flash_attn.tiles import FORWARD_TILES, ForwardTile, Measured
    tile = ForwardTile(128, 128, measured=(Measured(causal=True, max_seqlen=1024, speed_vs_sdpa=0.87),
                                           Measured(causal=False, max_seqlen=512, speed_vs_sdpa=1.2)))
    assert tile.speed_vs_sdpa(dense(16, 1024, 16, 64)) == 0.87
    assert tile.speed_vs_sdpa(dense(1, 77, 2, 64)) == 0.87
    assert tile.speed_vs_sdpa(dense(16, 1025, 16, 64)) is None  # longer: not measured
    assert tile.speed_vs_sdpa(dense(2, 512, 2, 64, causal=False)) == 1.2
    assert tile.speed_vs_sdpa(dense(2, 1024, 2, 64, causal=False)) is None
    cross = AttentionArguments(meta(1, 64, 2, 64), meta(1, 2048, 2, 64), meta(1, 2048, 2, 64), meta(1, 64, 2, 64),
                               causal=True)
    assert tile.speed_vs_sdpa(cross) is None  # (the keys count too)
    assert FORWARD_TILES[0].speed_vs_sdpa(dense(16, 1024, 16, 64)) == 0.87


def test_each_head_dim_class_gets_its_tiles_beside_fa4s_own(plugin):
    d64 = names(dense(16, 1024, 16, 64))
    assert d64 == ["FlashAttnForward_bf16_dense_a16", "FlashAttnForward_bf16_dense_128x128_rs_ol_a16"]
    assert names(dense(16, 1024, 16, 64, causal=False)) == d64
    assert names(dense(2, 64, 2, 8)) == d64  # head dims 8 to 64
    assert names(dense(4, 4096, 32, 128)) == ["FlashAttnForward_bf16_dense_a16"]  # FA4's own tile only
    assert names(dense(2, 100, 3, 72)) == ["FlashAttnForward_bf16_dense_a16"]
    assert names(dense(2, 64, 2, 64, dtype=torch.float16)) == ["FlashAttnForward_f16_dense_a16",
                                                              "FlashAttnForward_f16_dense_128x128_rs_ol_a16"]
    assert names(dense(2, 64, 2, 64), cc=80) == []


def test_the_tile_is_the_metadata_design_and_varlen_keeps_fa4s_own(plugin):
    from kernel_api_flash_attn.tiles import FORWARD_TILES
    kernels = kernel_api.get_kernels(dense(16, 1024, 16, 64), providers="flash_attn", cc=90)
    assert kernels[0].metadata.design is None and kernels[0].tile is None
    for kern in kernels[1:]:
        assert kern.tile in FORWARD_TILES and kern.metadata.design is kern.tile
        assert kern.metadata.kernel_name == f"FlashAttnForward_bf16_dense_{kern.tile.name}_a16"
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    varlen = AttentionArguments(*[meta(256, 8, 64) for _ in range(4)], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                max_seqlen_q=156, max_seqlen_k=156)
    assert names(varlen) == ["FlashAttnForward_bf16_varlen_a16"]


def test_a_tile_outside_its_head_dims_says_so_in_one_line(plugin):
    from kernel_api import KernelMetadata
    from kernel_api_flash_attn.tiles import ForwardTile
    text = kernel_api.explain(dense(2, 64, 2, 96), providers="flash_attn", cc=90).all()
    assert "FlashAttnForward_bf16_dense_128x128_rs_ol_a16: head_dim 96 above the kernel's 64" in text
    # a tile for head dims 72 to 128 (as a tile of FORWARD_TILES would be), asked about 64
    offered = kernel_api.get_kernels(dense(2, 64, 2, 64), providers="flash_attn", cc=90)[1]
    wide = ForwardTile(128, 176, min_head_dim=72, max_head_dim=128)
    m = offered.metadata
    kern = type(offered)(KernelMetadata(m.kernel_name, m.kernel_class, m.operands, design=wide, min_cc=m.min_cc))
    status = kern.supports(dense(2, 64, 2, 64))
    assert not status
    assert status.error == "operand q: head_dim 64, the 128x176_rs_ol tile is for head dims 72 to 128"
    assert status.operand == "q"


def test_the_tile_reaches_fa4s_forward(plugin, monkeypatch):
    """What `_forward` hands FA4: the tile's knobs, or none for FA4's own choice (no GPU: the
    call is recorded)."""
    from kernel_api_flash_attn import attention
    calls = []
    monkeypatch.setattr(attention, "_flash_attn_fwd", lambda *a, **kw: calls.append(kw))
    args = dense(2, 64, 2, 64)
    for kern in kernel_api.get_kernels(args, providers="flash_attn", cc=90):
        attention._forward(args, args.q, args.k, args.v, args.out, None, kern.tile)
    assert len(calls) == 2 and "tile_mn" not in calls[0]
    assert (calls[1]["tile_mn"], calls[1]["mma_pv_is_rs"], calls[1]["intra_wg_overlap"]) == ((128, 128), True, True)
    assert all(c["causal"] and c["softmax_scale"] == args.scale for c in calls)


def test_pick_any_ranks_the_tile_by_its_measured_speed(plugin):
    """Causal up to 1024, where it was measured faster than FA4's own, the 128-row tile ranks
    first among FA4's forwards (still behind SDPA, which PickAny keeps at head dim 64);
    elsewhere it ranks just behind FA4's own, and PickAny's choice is what it was without it."""
    from kernel_api.tuning.pick_any import rank_candidates

    def fa4_order(args):
        ranked = [k.metadata.kernel_name for k in rank_candidates(kernel_api.get_kernels(args, cc=90), args, 132)]
        return [n for n in ranked if n.startswith("FlashAttnForward")]

    tile, own = "FlashAttnForward_bf16_dense_128x128_rs_ol_a16", "FlashAttnForward_bf16_dense_a16"
    assert fa4_order(dense(16, 1024, 16, 64)) == [tile, own]
    assert fa4_order(dense(16, 1024, 16, 64, causal=False)) == [own, tile]
    assert fa4_order(dense(4, 2048, 16, 64)) == [own, tile]
    for args, first in ((dense(4, 4096, 32, 128), own), (dense(16, 1024, 16, 64), "TorchAttention_bf16_dense"),
                        (dense(16, 1024, 16, 64, causal=False), "TorchAttention_bf16_dense")):
        assert PickAny().choose(args, kernel_api.get_kernels(args, cc=90)).metadata.kernel_name == first
