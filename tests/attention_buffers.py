"""Outputs of attention kernel tests: inside a sentinel-filled buffer whose extra heads on either
side show a write outside the output, and the tolerances against the float64 definition."""

import torch

SENTINEL = 1234.5
TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}


def out_in_sentinel(q):
    """(out, buffer): out of q's shape inside a sentinel-filled buffer with two more heads."""
    b, lq, h, d = q.shape
    buf = torch.full((b, lq, h + 2, d), SENTINEL, dtype=q.dtype, device=q.device)
    return buf[:, :, 1:1 + h], buf


def outside_untouched(buf) -> bool:
    """Whether the heads around the output still hold the sentinel."""
    return bool((buf[:, :, 0] == SENTINEL).all()) and bool((buf[:, :, -1] == SENTINEL).all())


def check_out(out, buf, ref, dtype, what: str) -> None:
    """``out`` against the float64 ``ref`` at ``dtype``'s tolerance, nothing written around it."""
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")
    assert outside_untouched(buf), f"{what}: a kernel wrote outside its output"
