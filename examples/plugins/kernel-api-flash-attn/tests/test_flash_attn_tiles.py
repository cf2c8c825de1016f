"""kernel-api-flash-attn's forward tiles on the CPU: one instance per `FORWARD_TILES` tile (dense
layouts only) beside the instance that leaves the tile to FA4; each names its tile and carries it
as the metadata's design, is offered for its head dims only (with a one-line reason otherwise),
passes its configuration to FA4's forward, and ranks where PickAny's choice stays what it was
without the tiles (FA4's own at head dim 128, torch's SDPA at 64).

    python3 -m pytest -q examples/plugins/kernel-api-flash-attn/tests/test_flash_attn_tiles.py

Needs flash-attn-4 (skipped otherwise); no GPU. The plugin is used installed, or loaded from its
folder (what an editable install gives) when it is not.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

import kernel_api
from kernel_api import AttentionArguments, PickAny

pytest.importorskip("flash_attn.cute.interface")

FOLDER = Path(__file__).resolve().parent.parent
PACKAGE = "kernel_api_flash_attn"


@pytest.fixture(scope="module")
def plugin():
    """The plugin's package, registered in the default registry (and forgotten afterwards when
    this module loaded it)."""
    if "flash_attn" in kernel_api.available_providers():
        yield importlib.import_module(PACKAGE)
        return
    sys.path.insert(0, str(FOLDER))
    try:
        module = importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(FOLDER))
    yield module
    from kernel_api.registry import unregister_provider
    unregister_provider("flash_attn")
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def dense(b, s, h, d, causal=True, dtype=torch.bfloat16):
    return AttentionArguments(*[meta(b, s, h, d, dtype=dtype) for _ in range(4)], causal=causal)


def names(args, cc=90):
    return [k.metadata.kernel_name for k in kernel_api.get_kernels(args, providers="flash_attn", cc=cc)]


def test_tiles_are_plain_data_named_by_their_knobs(plugin):
    from kernel_api_flash_attn.tiles import FORWARD_TILES, ForwardTile
    assert [t.name for t in FORWARD_TILES] == ["128x128_rs_ol", "128x128_ss_ol", "128x128_rs", "192x128_ss_ol",
                                              "128x176_rs_ol", "128x192_rs_ol"]
    assert len({t.name for t in FORWARD_TILES}) == len(FORWARD_TILES)
    tile = ForwardTile(128, 176, min_head_dim=72, max_head_dim=128)
    assert tile.options() == {"tile_mn": (128, 176), "mma_pv_is_rs": True, "intra_wg_overlap": True}
    assert (tile.takes(64), tile.takes(72), tile.takes(128), tile.takes(136)) == (False, True, True, False)
    with pytest.raises(ValueError, match="tile_m: 96"):
        ForwardTile(96, 128)
    with pytest.raises(ValueError, match="tile_n: 72"):
        ForwardTile(128, 72)


def test_each_head_dim_class_gets_its_tiles_beside_fa4s_own(plugin):
    d64 = names(dense(16, 1024, 16, 64))
    assert d64 == ["FlashAttnForward_bf16_dense_a16", "FlashAttnForward_bf16_dense_128x128_rs_ol_a16",
                   "FlashAttnForward_bf16_dense_128x128_ss_ol_a16", "FlashAttnForward_bf16_dense_128x128_rs_a16",
                   "FlashAttnForward_bf16_dense_192x128_ss_ol_a16"]
    d128 = names(dense(4, 4096, 32, 128, causal=False))
    assert d128 == ["FlashAttnForward_bf16_dense_a16", "FlashAttnForward_bf16_dense_128x176_rs_ol_a16",
                    "FlashAttnForward_bf16_dense_128x192_rs_ol_a16"]
    assert names(dense(2, 100, 3, 96)) == d128  # head dims 72 to 128: the wide tiles
    assert names(dense(2, 64, 2, 8)) == d64  # head dims 8 to 64: the 128-row and SS tiles
    assert names(dense(1, 64, 2, 256)) == ["FlashAttnForward_bf16_dense_a16"]  # FA4's own tile only
    assert names(dense(2, 64, 2, 64, dtype=torch.float16))[1] == "FlashAttnForward_f16_dense_128x128_rs_ol_a16"
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


def test_a_tile_below_its_head_dims_says_so_in_one_line(plugin):
    text = kernel_api.explain(dense(2, 64, 2, 64), providers="flash_attn", cc=90).all()
    assert ("FlashAttnForward_bf16_dense_128x176_rs_ol_a16: operand q: head_dim 64, the 128x176_rs_ol tile is for "
            "head dims 72 to 128") in text
    assert "FlashAttnForward_bf16_dense_128x128_rs_ol_a16: head_dim 96 above the kernel's 64" in \
        kernel_api.explain(dense(2, 64, 2, 96), providers="flash_attn", cc=90).all()
    kern = next(k for k in kernel_api.get_kernels(dense(2, 64, 2, 96), providers="flash_attn", cc=90)
                if k.tile is not None)
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
    kernels = kernel_api.get_kernels(args, providers="flash_attn", cc=90)
    for kern in kernels:
        attention._forward(args, args.q, args.k, args.v, args.out, None, kern.tile)
    assert "tile_mn" not in calls[0]
    assert [c["tile_mn"] for c in calls[1:]] == [(128, 128)] * 3 + [(192, 128)]
    assert [(c["mma_pv_is_rs"], c["intra_wg_overlap"]) for c in calls[1:]] == [(True, True), (False, True),
                                                                                (True, False), (False, True)]
    assert all(c["causal"] and c["softmax_scale"] == args.scale for c in calls)


def test_pick_any_keeps_its_choice_with_the_tiles_behind_fa4s_own(plugin):
    """Unmeasured tiles rank just behind FA4's own tile: PickAny takes FA4's at head dim 128 and
    SDPA at 64, as without them."""
    from kernel_api.tuning.pick_any import rank_candidates
    for args, first in ((dense(4, 4096, 32, 128), "FlashAttnForward_bf16_dense_a16"),
                        (dense(16, 1024, 16, 64), "TorchAttention_bf16_dense")):
        kernels = kernel_api.get_kernels(args, cc=90)
        assert PickAny().choose(args, kernels).metadata.kernel_name == first
        ranked = [k.metadata.kernel_name for k in rank_candidates(kernels, args, 132)]
        fa4 = [n for n in ranked if n.startswith("FlashAttnForward")]
        assert fa4[0] == "FlashAttnForward_bf16_dense_a16"
