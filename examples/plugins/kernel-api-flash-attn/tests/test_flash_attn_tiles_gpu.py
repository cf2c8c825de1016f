"""kernel-api-flash-attn's forward tiles on an sm_90 GPU: each `FORWARD_TILES` instance against
a float64 reference, with fresh random data, the output written into a view of a sentinel-filled
buffer (the heads around it must stay the sentinel), sequence lengths that are no multiple of the
tile (a partial last block of rows and of keys), causal (bottom-right) and full, GQA, and the row
log-sum-exp where it is asked for.

    python3 -m pytest -q examples/plugins/kernel-api-flash-attn/tests/test_flash_attn_tiles_gpu.py

Needs flash-attn-4 and an sm_90 GPU (skipped otherwise). FA4 compiles each configuration on first
use (several seconds each); ``-n 4`` (pytest-xdist) spreads the compiles. The CPU half is
test_flash_attn_tiles.py; conftest.py registers the plugin.
"""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api import AttentionArguments
from kernel_api.arguments.attention_math import attention_with_lse

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                 reason="needs an sm_90 GPU"),
              pytest.mark.usefixtures("plugin")]

pytest.importorskip("flash_attn.cute.interface")

SENTINEL = 1234.5
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3}  # max |error| against the float64 output


def instance(args: AttentionArguments, tile: str):
    """The plugin's forward instance with ``tile`` for ``args``."""
    found = [k for k in kernel_api.get_kernels(args, providers="flash_attn")
             if k.tile is not None and k.tile.name == tile]
    assert len(found) == 1, [k.metadata.kernel_name for k in kernel_api.get_kernels(args, providers="flash_attn")]
    return found[0]


@pytest.mark.parametrize("tile,dtype,b,sq,sk,hq,hkv,d,causal,lse", [
    ("128x128_rs_ol", torch.bfloat16, 2, 1000, 1000, 3, 3, 64, True, False),
    ("128x128_rs_ol", torch.bfloat16, 2, 300, 517, 3, 3, 64, False, False),
    ("128x128_rs_ol", torch.bfloat16, 2, 77, 300, 8, 2, 64, True, True),
    ("128x128_rs_ol", torch.float16, 1, 1024, 1024, 2, 1, 40, True, True),
], ids=lambda v: str(v).replace("torch.", ""))
def test_tile_against_float64(tile, dtype, b, sq, sk, hq, hkv, d, causal, lse):
    q = torch.randn(b, sq, hq, d, device="cuda").to(dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda").to(dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda").to(dtype)
    buffer = torch.full((b, sq, hq + 1, d), SENTINEL, dtype=dtype, device="cuda")
    out = buffer[:, :, 1:]  # (the head before it stays the sentinel)
    row_lse = torch.full((b, hq, sq), SENTINEL, dtype=torch.float32, device="cuda") if lse else None
    args = AttentionArguments(q, k, v, out, row_lse, causal=causal)
    instance(args, tile).run(args)
    torch.cuda.synchronize()
    expected, expected_lse = attention_with_lse(q.double(), k.double(), v.double(), causal, d ** -0.5)
    err = (out.double() - expected).abs().max().item()
    assert err < TOLERANCE[dtype] * expected.abs().max().item(), err
    assert (buffer[:, :, 0] == SENTINEL).all()
    if lse:
        torch.testing.assert_close(row_lse.double(), expected_lse.double(), atol=1e-3, rtol=1e-4)
