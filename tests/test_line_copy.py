"""The realigned GEMM's line-copy kernel (`copy_lines`): what it takes and declines (CPU), and
bit-exact copies between every alignment of source and destination, inside sentinel-filled
buffers (GPU)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernel_api import GemmArguments
from kernel_api.providers.cutedsl.gemm import sm90_realigned
from kernel_api.providers.cutedsl.gemm.implementations import line_copy
from kernel_api.providers.cutedsl.gemm.implementations.line_copy import copy_lines, line_geometry

SENTINEL = -3.0


def test_the_kernel_compiles_for_sm90_without_a_gpu():
    compiled = line_copy._launcher(2, line_copy.UNITS[0]).compiled
    assert compiled.arch == "sm_90a"
    assert set(compiled.symbols) == {f"ka_line_copy::line_copy<{e}, {g}, {u}>" for e in (2, 4)
                                     for g, u in line_copy.UNITS}


def test_prepare_compiles_it_and_honours_cache_only(tmp_path, monkeypatch):
    """`prepare` (the realigned GEMM's compile calls it) compiles or loads the cubin; under
    `compile_from_cache_only` an uncached cubin raises instead of compiling."""
    from kernel_api.core.errors import ArtifactNotCachedError
    from kernel_api.kernel import cache_only
    from kernel_api.nvrtc import compiler

    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path))  # an empty cache
    monkeypatch.setattr(line_copy, "_launchers", {})
    compiler.clear_memory_cache()
    token = cache_only.set(True)
    try:
        with pytest.raises(ArtifactNotCachedError):
            line_copy.prepare()
    finally:
        cache_only.reset(token)
    assert not line_copy._launchers
    line_copy.prepare()
    assert len(line_copy._launchers) == 2 * len(line_copy.UNITS)
    compiler.clear_memory_cache()  # as a new process: only the disk cache holds it
    monkeypatch.setattr(line_copy, "_launchers", {})
    token = cache_only.set(True)
    try:
        line_copy.prepare()
    finally:
        cache_only.reset(token)
    assert len(line_copy._launchers) == 2 * len(line_copy.UNITS)
    compiler.clear_memory_cache()


def test_the_realigned_compile_prepares_it(monkeypatch):
    from types import SimpleNamespace

    called = []
    monkeypatch.setattr(sm90_realigned, "prepare_line_copy", lambda: called.append(True))
    kernel = sm90_realigned.Sm90RealignedGemm.generate_kernels(None, cc=90)[0]
    monkeypatch.setattr(kernel.inner, "compile", lambda args, cc=None: SimpleNamespace(compiled_obj="inner"))
    A = torch.empty(64, 64, dtype=torch.bfloat16)
    args = GemmArguments(A, torch.empty(64, 64, dtype=torch.bfloat16), torch.empty(64, 64, dtype=torch.bfloat16),
                         accumulator_type=torch.float32)
    artifact = kernel.compile(args, 90)
    assert called and artifact.compiled_obj == "inner"


def test_line_geometry():
    t = torch.empty(5, 9)
    assert line_geometry(t, True) == (1, 5, 9, 9, 0)
    assert line_geometry(t.t(), False) == (1, 5, 9, 9, 0)  # the transpose's columns are t's rows
    assert line_geometry(t.t(), True) is None  # rows of stride 9: not contiguous lines
    b = torch.empty(3, 4, 10)[:, :, 1:]
    assert line_geometry(b, True) == (3, 4, 9, 10, 40)
    assert line_geometry(torch.empty(2, 3, 4, 5), True) is None


@pytest.mark.parametrize("why,dst,src", [
    ("one-byte elements", torch.empty(4, 5, dtype=torch.uint8), torch.empty(4, 5, dtype=torch.uint8)),
    ("eight-byte elements", torch.empty(4, 5, dtype=torch.float64), torch.empty(4, 5, dtype=torch.float64)),
    ("dtypes differ", torch.empty(4, 5, dtype=torch.float16), torch.empty(4, 5, dtype=torch.bfloat16)),
    ("shapes differ", torch.empty(4, 5, dtype=torch.float16), torch.empty(4, 6, dtype=torch.float16)),
    ("CPU tensors", torch.empty(4, 5, dtype=torch.float16), torch.empty(4, 5, dtype=torch.float16)),
    ("lines not contiguous", torch.empty(4, 10, dtype=torch.float16)[:, ::2], torch.empty(4, 5, dtype=torch.float16)),
])
def test_declines_what_it_does_not_take(why, dst, src):
    """Declined pairs return False before anything is compiled or launched (CPU tensors here)."""
    assert copy_lines(dst, src, True, 0, 0) is False, why


gpu = pytest.mark.gpu


def _needs_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _view(buf: torch.Tensor, rows: int, cols: int, row_major: bool, offset: int, pitch: int) -> torch.Tensor:
    """A rows x cols operand at element ``offset`` of ``buf`` with line pitch ``pitch``."""
    if row_major:
        return buf.as_strided((rows, cols), (pitch, 1), offset)
    return buf.as_strided((rows, cols), (1, pitch), offset)


def _check(rows, cols, row_major, s_off, d_off, s_pad, d_pad, dtype, unit=None):
    width = cols if row_major else rows
    lines = rows if row_major else cols
    s_pitch, d_pitch = width + s_pad, width + d_pad
    src_buf = torch.randn(s_off + lines * s_pitch + 8, device="cuda").to(dtype)
    dst_buf = torch.full((d_off + lines * d_pitch + 8,), SENTINEL, device="cuda", dtype=dtype)
    src = _view(src_buf, rows, cols, row_major, s_off, s_pitch)
    dst = _view(dst_buf, rows, cols, row_major, d_off, d_pitch)
    expect = dst_buf.clone()
    _view(expect, rows, cols, row_major, d_off, d_pitch).copy_(src)
    stream = torch.cuda.current_stream().cuda_stream
    assert copy_lines(dst, src, row_major, stream, torch.cuda.current_device(), unit)
    torch.cuda.synchronize()
    assert torch.equal(dst_buf.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       expect.view(torch.int16 if dtype != torch.float32 else torch.int32)), \
        (rows, cols, row_major, s_off, d_off, s_pad, d_pad, dtype, unit)


@gpu
@pytest.mark.parametrize("unit", line_copy.UNITS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_alignment_of_source_and_destination(dtype, unit):
    """Source and destination at every element offset within 16 bytes, odd and even pitches,
    lines from 1 element to a few thousand (one and several segments)."""
    _needs_gpu()
    per = 16 // torch.empty((), dtype=dtype).element_size()
    for s_off, d_off in itertools.product(range(per), range(per)):
        for cols in (1, 2, per - 1, per, per + 1, 3 * per + 1, 1023):
            _check(3, cols, True, s_off, d_off, s_off % 3, (per - d_off) % per + 1, dtype, unit)
    for cols in (4095, 8191, 8192 + 5, 3 * 4096 + 1):  # lines over several units
        _check(5, cols, True, 3 % per, 1, 1, 7, dtype, unit)
    _check(5000, 7, True, 1, 2, 0, 1, dtype, unit)  # many short lines


@gpu
@pytest.mark.parametrize("row_major", [True, False])
@pytest.mark.parametrize("direction", ["in", "out"])
def test_operand_shapes_both_directions(row_major, direction):
    """An odd operand into its padded copy and the padded copy back, as the realigned GEMM does."""
    _needs_gpu()
    for rows, cols in ((1, 77), (77, 1), (4097, 33), (17, 5001), (1000, 1001)):
        width = cols if row_major else rows
        padded = -(-width // 8) * 8
        if direction == "in":
            _check(rows, cols, row_major, 1, 0, 0, padded - width, torch.float16)
        else:
            _check(rows, cols, row_major, 0, 3, padded - width, 0, torch.float16)


@gpu
def test_batched_and_expanded_sources():
    _needs_gpu()
    stream, dev = torch.cuda.current_stream().cuda_stream, torch.cuda.current_device()
    src = torch.randn(3, 65, 131, device="cuda").to(torch.bfloat16)[:, :, 1:]  # batches of odd rows
    buf = torch.full((3, 66, 136), SENTINEL, device="cuda", dtype=torch.bfloat16)
    dst = buf[:, :65, :130]
    expect = buf.clone()
    expect[:, :65, :130] = src
    assert copy_lines(dst, src, True, stream, dev)
    torch.cuda.synchronize()
    assert torch.equal(buf, expect)
    row = torch.randn(1, 999, device="cuda").to(torch.bfloat16)
    wide = row.expand(40, 999)  # line pitch 0
    out = torch.full((40, 1008), SENTINEL, device="cuda", dtype=torch.bfloat16)
    assert copy_lines(out[:, :999], wide, True, stream, dev)
    torch.cuda.synchronize()
    assert torch.equal(out[:, :999], wide) and bool((out[:, 999:] == SENTINEL).all())
    assert not copy_lines(wide, out[:, :999], True, stream, dev)  # a destination with overlapping lines


@gpu
def test_realigned_gemm_is_identical_with_either_copy():
    """The staged operands are the same bytes, so the product is too (out staged as well)."""
    _needs_gpu()
    import kernel_api

    A = torch.randn(515, 1001, device="cuda").to(torch.float16)
    B = torch.randn(1001, 777, device="cuda").to(torch.float16)
    outs = []
    for use in (True, False):
        out = torch.full((515, 777), float("nan"), device="cuda", dtype=torch.float16)
        args = kernel_api.GemmArguments(A, B, out)
        kernel = next(k for k in sm90_realigned.Sm90RealignedGemm.generate_kernels(None, cc=90)
                      if k.supports(args) and "cooperative" in k.metadata.kernel_name)
        previous = sm90_realigned.USE_LINE_COPY
        sm90_realigned.USE_LINE_COPY = use
        try:
            kernel.run(args)
        finally:
            sm90_realigned.USE_LINE_COPY = previous
        torch.cuda.synchronize()
        outs.append(out)
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1])


@gpu
def test_memcheck_clean():
    """compute-sanitizer memcheck (each tensor its own allocation) over misaligned copies into and
    out of padded buffers: the aligned source vectors read around a line's ends stay inside
    the allocation."""
    _needs_gpu()
    from memcheck import run_memcheck

    out = run_memcheck(
        "import torch\n"
        "from kernel_api.providers.cutedsl.gemm.implementations.line_copy import copy_lines\n"
        "s = torch.cuda.current_stream().cuda_stream\n"
        "for off, rows, cols in ((1, 33, 7), (3, 33, 1023), (7, 5, 4097), (0, 9, 9), (5, 3000, 3)):\n"
        "    src = torch.randn(rows * cols + off, device='cuda').half()[off:].view(rows, cols)\n"
        "    dst = torch.empty(rows, -(-cols // 8) * 8, device='cuda', dtype=torch.half)[:, :cols]\n"
        "    assert copy_lines(dst, src, True, s, 0)\n"
        "    back = torch.empty(rows * cols + 1, device='cuda', dtype=torch.half)[1:].view(rows, cols)\n"
        "    assert copy_lines(back, dst, True, s, 0)\n"
        "    torch.cuda.synchronize()\n"
        "    assert torch.equal(back, src)\n"
        "print('probe ok')\n")
    assert "probe ok" in out
