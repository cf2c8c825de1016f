"""Softmax for long rows in two streaming launches (CudaSoftmaxStream*).

CPU: registration and metadata, the part plan (every vector of a row in exactly one part; small
problems get smaller parts), NVRTC compiles of both kernels for sm_90a without local memory and
with registers for two CTAs of 512 threads per SM, the two launches `_run` makes (statistics
first, the same grid and parameters, which match the kernels' signatures), the workspace and
peeling refusals. GPU (@pytest.mark.gpu): float64 references on fresh random rows (with -inf
rows and huge magnitudes), outputs inside NaN-filled buffers whose margins must stay untouched,
for the long benchmark shapes, odd and misaligned rows, many small parts, other CTA shapes;
forward and backward, all three dtypes; repeated launches bit-identical; memcheck."""

from __future__ import annotations

import pytest
import torch

from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments
from kernel_api.providers.cuda_src.kernels import softmax_stream as ss
from kernel_api.providers.cuda_src.kernels.softmax_stream import (CudaSoftmaxStreamBackward, CudaSoftmaxStreamForward,
                                                                  StreamBuild, plan_parts)

from memcheck import SOFTMAX_PREAMBLE, run_memcheck
from test_softmax import check_backward, check_forward
from test_softmax import input_at as _input_at, margins_untouched as _margins_untouched, poisoned as _poisoned
from test_softmax_smem import _nv_info

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CLASSES = (CudaSoftmaxStreamForward, CudaSoftmaxStreamBackward)
LONG = [(1, 2**20), (8, 2**20), (32, 2**20), (8, 2**22)]


def _kernel(cls, dtype: torch.dtype):
    (k,) = [k for k in cls.generate_kernels(None, cc=90) if k.dtype.to_torch() == dtype]
    return k


def _args(cls, x: torch.Tensor, out: torch.Tensor | None = None):
    out = torch.empty_like(x) if out is None else out
    return SoftmaxBackwardArguments(x, x, out) if cls.backward else SoftmaxArguments(x, out)


def test_instances_names_and_metadata():
    names = [k.metadata.kernel_name for cls in _CLASSES for k in cls.generate_kernels(None, cc=90)]
    assert names == [f"CudaSoftmaxStream{d}_{t}_stream_peel{v}" for d in ("Forward", "Backward")
                     for t, v in (("bf16", 8), ("f16", 8), ("f32", 4))]
    k = _kernel(CudaSoftmaxStreamForward, torch.bfloat16)
    md = k.metadata
    assert md.design.strategy == "stream" and md.min_cc == 80 and md.design.min_cols == ss.long_rows_from(2)
    assert dict(md.design.extra)["launches"] == 2 and dict(md.design.extra)["passes"] == 2
    assert md.operands.x.divisibility == md.operands.out.divisibility == 1  # peeled: any element alignment


@pytest.mark.parametrize("rows,cols,elem", [(32, 2**20, 2), (8, 2**22, 4), (1, 2**20, 2), (1, 8, 2), (5, 3, 4),
                                            (4096, 50257, 2), (3, 1000003, 4), (100000, 33, 2)])
def test_parts_cover_each_row_once(rows, cols, elem):
    p = plan_parts(rows, cols, elem, 132)
    vec = 16 // elem
    nvec = -(-cols // vec)
    assert p.grid == rows * p.parts_per_row and p.part_vectors >= 1
    assert p.parts_per_row * p.part_vectors >= nvec > (p.parts_per_row - 1) * p.part_vectors
    assert p.part_vectors * 16 <= ss.PART_BYTES
    # Full-size parts once the problem has enough of them; smaller ones (not below the floor) before.
    if rows * -(-nvec // (ss.PART_BYTES // 16)) >= ss.MIN_PARTS_PER_SM * 132:
        assert p.part_vectors * 16 == ss.PART_BYTES
    else:
        assert p.part_vectors * 16 >= ss.MIN_PART_BYTES // 2 or p.grid >= ss.MIN_PARTS_PER_SM * 132
    assert p.workspace_bytes(False) == 8 * p.grid and p.workspace_bytes(True) == 4 * p.grid


def test_plans_for_the_long_benchmark_shapes():
    assert plan_parts(32, 2**20, 2) == ss.StreamPlan(32, 4096, 1024)  # 64 KB parts of bf16
    assert plan_parts(8, 2**22, 4) == ss.StreamPlan(256, 4096, 2048)
    assert plan_parts(1, 2**20, 2).grid >= 132  # a lone row: smaller parts fill the SMs


@pytest.mark.parametrize("cls", _CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiles_for_sm90a_without_spills(cls, dtype):
    """Both kernels in one module: no local memory, registers for one CTA per SM at least
    (the forward's statistics kernel: two), the output kernel's launcher in the artifact's
    `StreamBuild`."""
    k = _kernel(cls, dtype)
    artifact = k.compile(_args(cls, torch.empty(4, 100000, dtype=dtype)), cc=90)
    build = artifact.extra
    assert isinstance(build, StreamBuild) and build.threads == ss.THREADS == k.threads
    compiled = artifact.compiled_obj.compiled
    assert compiled.arch == "sm_90a" and build.output.compiled is compiled
    info = _nv_info(compiled.cubin)
    for expr in k.name_expressions():
        res = info[compiled.symbols[expr]]
        assert res.get(0x11, 0) == 0 and res.get(0x12, 0) == 0, (expr, res)  # no spill stores / loads
        assert 0 < res[0x2f] <= 65536 // ss.THREADS, (expr, res)
    if not cls.backward:  # two CTAs per SM at least
        stats = info[compiled.symbols[k.name_expressions()[0]]]
        assert stats[0x2f] <= 65536 // (2 * ss.THREADS), stats


def test_tuning_attributes_reach_the_template():
    k = _kernel(CudaSoftmaxStreamForward, torch.float16)
    k.threads, k.unroll = 256, 8
    try:
        assert k.name_expressions() == ("ka_softmax::fwd_stream_stats<ka_softmax::F16, 8, 8, 256>",
                                        "ka_softmax::fwd_stream_out<ka_softmax::F16, 8, 8, 256>")
        args = _args(CudaSoftmaxStreamForward, torch.empty(64, 70000, dtype=torch.float16))  # (9 parts a row)
        assert k.compile(args, cc=90).extra.threads == 256
        k.part_bytes = 16 * 1024
        assert k.plan(args).part_vectors == 1024
    finally:
        k.threads, k.unroll, k.part_bytes = ss.THREADS, ss.default_unroll(False, 2), ss.PART_BYTES


class _FakeLauncher:
    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def launch(self, stream, device, grid, block, smem, params):
        self.calls.append((self.name, grid, block, smem, params))


@pytest.mark.parametrize("cls", _CLASSES)
def test_run_launches_statistics_then_output(cls, monkeypatch):
    """Two launches on the caller's stream, the same grid and parameters: the operands' row
    parameters, then the workspace, the parts per row and the vectors per part (the kernels'
    signatures: 6 or 8 row parameters plus 3)."""
    monkeypatch.setattr(ss, "stream_handle", lambda stream, device: 0)
    monkeypatch.setattr(ss, "_sm_count", lambda device: 132)
    k = _kernel(cls, torch.bfloat16)
    x = torch.empty(8, 2**20, dtype=torch.bfloat16)
    args = _args(cls, x)
    monkeypatch.setattr(type(args), "device", property(lambda self: torch.device("cuda", 0)), raising=False)
    calls = []
    artifact = type("A", (), {"compiled_obj": _FakeLauncher(calls, "stats"),
                              "extra": StreamBuild(_FakeLauncher(calls, "out"), 512)})()
    ws = torch.empty(k.get_workspace_size(args) // 4, dtype=torch.float32)
    k._run(args, artifact, None, ws)
    p = k.plan(args)
    assert [c[0] for c in calls] == ["stats", "out"]
    assert calls[0][1:] == calls[1][1:] and calls[0][1:4] == (p.grid, 512, 0)
    params = calls[0][4]
    assert len(params) == (8 if cls.backward else 6) + 3
    assert params[-3:] == (ws.data_ptr(), p.parts_per_row, p.part_vectors)


@pytest.mark.parametrize("cls", _CLASSES)
def test_workspace_refusals(cls, monkeypatch):
    monkeypatch.setattr(ss, "_sm_count", lambda device: 132)
    k = _kernel(cls, torch.float32)
    args = _args(cls, torch.empty(4, 2**17, dtype=torch.float32))
    monkeypatch.setattr(type(args), "device", property(lambda self: torch.device("cuda", 0)), raising=False)
    need = k.get_workspace_size(args)
    artifact = type("A", (), {"compiled_obj": None, "extra": None})()
    with pytest.raises(ValueError, match=f"needs an 8-byte aligned workspace of {need} bytes.*got none"):
        k._run(args, artifact, None, None)
    small = torch.empty(need // 4 - 1, dtype=torch.float32)
    with pytest.raises(ValueError, match=f"workspace of {need} bytes"):
        k._run(args, artifact, None, small)


@pytest.mark.parametrize("cls", _CLASSES)
def test_refuses_a_grid_past_the_x_limit(cls):
    """2^31 rows of 7 parts each: more CTAs than gridDim.x takes, refused with the count."""
    k = _kernel(cls, torch.bfloat16)
    x = torch.empty(2**31, 200000, dtype=torch.bfloat16, device="meta")
    status = k.supports(_args(cls, x))
    assert not status and "past the grid's x limit" in status.error and "7 parts" in status.error


def test_peeling_needs_one_offset():
    k = _kernel(CudaSoftmaxStreamForward, torch.bfloat16)
    flat = torch.empty(2 * 50001 + 16, dtype=torch.bfloat16)
    x = flat[1:1 + 2 * 50001].view(2, 50001)
    out = flat[:2 * 50001].view(2, 50001)  # rows at another offset from a 16-byte boundary
    status = k.supports(SoftmaxArguments(x, out))
    assert not status and "different offsets" in status.error
    other = torch.empty(2 * 50001 + 16, dtype=torch.bfloat16)[9:9 + 2 * 50001].view(2, 50001)  # 8 + 1: same phase
    assert k.supports(SoftmaxArguments(x, other))


# ----------------------------------------------------------------------------------- GPU
def _check(cls, k, rows: int, cols: int, dtype: torch.dtype, offset: int, workspace=None, describe=None) -> None:
    """One launch of ``k`` against float64 inside a poisoned buffer, then a second one bit for
    bit; ``workspace`` is passed to both runs, ``describe(args)`` (if given) joins the message."""
    what = f"{k.metadata.kernel_name} {rows}x{cols}+{offset}"
    buf, out = _poisoned(rows, cols, dtype, offset)
    if cls.backward:
        g = _input_at(rows, cols, dtype, offset)
        g.copy_(torch.randn(rows, cols, device="cuda") * 4)
        y = _input_at(rows, cols, dtype, offset)
        y.copy_(torch.softmax(torch.randn(rows, cols, device="cuda") * 2, -1))
        args = SoftmaxBackwardArguments(g, y, out)
    else:
        x = _input_at(rows, cols, dtype, offset)
        args = SoftmaxArguments(x, out)
    assert k.supports(args), k.supports(args).error
    if describe is not None:
        what += f" {describe(args)}"
    k.run(args, workspace=workspace)
    torch.cuda.synchronize()
    if cls.backward:
        check_backward(out, g, y, what)
    else:
        check_forward(out, x, what)
    _margins_untouched(buf, rows, cols, offset, what)
    first = out.clone()
    k.run(args, workspace=workspace)  # again on the same buffers: the same bits (a fixed order of the partials)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.uint8) if out.dtype == torch.float32 else out.view(torch.int16),
                       first.view(torch.uint8) if out.dtype == torch.float32 else first.view(torch.int16)), what


# (rows, cols, element offset past a 16-byte boundary): the long benchmark shapes, odd rows
# (every row at another phase), misaligned bases, many rows of a few parts, short rows (one
# part, mostly edges), a row shorter than a vector.
_SHAPES = [(*s, 0) for s in LONG] + [(3, 1000003, 0), (2, 2**20 + 5, 3), (257, 131075, 1), (67, 4097, 5),
                                     (5, 3, 1), (4, 50257, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("cls", _CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shapes(cls, dtype):
    k = _kernel(cls, dtype)
    torch.manual_seed(len(str(dtype)) + 7 * cls.backward)
    for rows, cols, offset in _SHAPES:
        _check(cls, k, rows, cols, dtype, offset)
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("cls", _CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_small_parts_and_other_ctas(cls, dtype):
    """Parts of 1 KB (hundreds per row, the partials combined over many loop turns) and CTAs of
    256 threads with 8 loads in flight each."""
    k = _kernel(cls, dtype)
    torch.manual_seed(11 + cls.backward)
    try:
        for threads, unroll, part in [(512, k.unroll, 1024), (256, 8, 4096), (128, 1, 16 * 1024)]:
            k.threads, k.unroll, k.part_bytes = threads, unroll, part
            for rows, cols, offset in [(5, 300007, 3), (2, 2**20, 0), (33, 40003, 1)]:
                _check(cls, k, rows, cols, dtype, offset)
    finally:
        k.threads, k.unroll, k.part_bytes = ss.THREADS, ss.default_unroll(cls.backward, k.dtype.bytes), ss.PART_BYTES


_SANITIZED = SOFTMAX_PREAMBLE + r"""
from kernel_api.providers.cuda_src.kernels.softmax_stream import CudaSoftmaxStreamBackward, CudaSoftmaxStreamForward
for cls in (CudaSoftmaxStreamForward, CudaSoftmaxStreamBackward):
    for k in cls.generate_kernels(None, cc=90):
        dtype = k.dtype.to_torch()
        for part, rows, cols, offset in [(65536, 3, 200003, 3), (1024, 5, 30011, 1)]:
            k.part_bytes = part
            launch(k, cls.backward, rows, cols, dtype, offset)
torch.cuda.synchronize()
print("launches", n)
"""


@pytest.mark.gpu
def test_memcheck():
    """Both directions, every dtype, large and small parts, misaligned rows, under
    compute-sanitizer memcheck (each operand and workspace its own allocation)."""
    out = run_memcheck(_SANITIZED)
    assert int(out.split("launches")[-1].split()[0]) == 12, out[-3000:]
