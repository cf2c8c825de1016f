"""Softmax forward/backward, every provider: discovery and bad input on the CPU; on a GPU,
every kernel instance generate_kernels emits against a float64 reference on fresh random rows
(with -inf rows, huge magnitudes, length-1 rows) and NaN-poisoned outputs."""

from __future__ import annotations

import math

import pytest
import torch

import kernel_api
from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments
from kernel_api.errors import DeviceError

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1.5e-3, torch.bfloat16: 8e-3}
_ATOL = {torch.float64: 1e-300, torch.float32: 1e-35, torch.float16: 1e-7, torch.bfloat16: 1e-35}
_BIG = {torch.float64: 1e30, torch.float32: 1e30, torch.float16: 3e4, torch.bfloat16: 1e30}  # (drawn in f32)
# Row lengths tried per instance (filtered by its alignment and longest row).
_COLS = (1, 3, 8, 40, 200, 1000, 1024, 1536, 4096, 5000, 16384, 32768, 262144, 262147)


def all_instances(args_type: type) -> list:
    """Every instance any provider generates for ``args_type`` (for sm_90)."""
    return [k for k in kernel_api.get_kernels(None, cc=90) if issubclass(args_type, type(k).supported_args_type)]


def instance_params(kernel) -> list[tuple[torch.dtype, int]]:
    """(dtype, cols) pairs an instance is tested on: its shortest, longest and a few between."""
    x = kernel.metadata.operands.tensor_attributes()
    first = next(iter(x.values()))
    dtype = first.dtype.to_torch()
    div = first.divisibility
    design = kernel.metadata.design
    longest = getattr(design, "max_cols", None)
    cols = [c for c in _COLS if c % div == 0 and (longest is None or c <= longest)]
    if longest is not None and longest not in cols:
        cols.append(longest)
    if len(cols) > 5:
        cols = [cols[0], cols[1], cols[len(cols) // 2], cols[-2], cols[-1]]
    return [(dtype, c) for c in cols]


def make_rows(rows: int, cols: int, dtype: torch.dtype, device: str = "cuda") -> torch.Tensor:
    """Random rows with the hard cases in the first rows: all -inf, half -inf, huge magnitudes."""
    x = torch.randn(rows, cols, device=device, dtype=torch.float32) * 3
    big = _BIG[dtype]
    if rows >= 4:
        x[0] = -math.inf
        x[1, : max(1, cols // 2)] = -math.inf
        x[2] = torch.rand(cols, device=device) * big * 2 - big
        x[3] = x[3] * (big / 10)
    return x.to(dtype)


def check_forward(out: torch.Tensor, x: torch.Tensor, what: str) -> None:
    ref = torch.softmax(x.double(), dim=-1)
    o = out.double()
    nan_ref, nan_out = ref.isnan(), o.isnan()
    assert torch.equal(nan_ref, nan_out), f"{what}: NaN pattern differs ({int((nan_ref != nan_out).sum())} elements)"
    ok = ~nan_ref
    err = (o[ok] - ref[ok]).abs()
    bound = _ATOL[x.dtype] + _RTOL[x.dtype] * ref[ok].abs()
    assert bool((err <= bound).all()), f"{what}: max error {err.max().item():.3e} beyond tolerance"


def check_backward(grad_in: torch.Tensor, grad_out: torch.Tensor, y: torch.Tensor, what: str,
                   slack: float = 1.0) -> None:
    g, yy = grad_out.double(), y.double()
    dot = (g * yy).sum(-1, keepdim=True)
    ref = yy * (g - dot)
    scale = yy.abs() * (g.abs() + dot.abs())  # the size of the terms, for a relative bound
    o = grad_in.double()
    assert not o.isnan().any(), f"{what}: unwritten (NaN) elements"
    err = (o - ref).abs()
    # Rounding of the output (relative to the terms' size), of outputs in the subnormal range
    # (f16, absolute), and of the f32 dot product over the row (at most n*u*sum|g*y|, times y).
    dot_err = grad_out.shape[-1] * 2.0**-24 * (g * yy).abs().sum(-1, keepdim=True)
    bound = slack * (_ATOL[y.dtype] + 2 * _RTOL[y.dtype] * scale + yy.abs() * dot_err)
    worst = int((err / bound).argmax())
    assert bool((err <= bound).all()), (f"{what}: error {err.flatten()[worst].item():.3e} > bound "
                                        f"{bound.flatten()[worst].item():.3e} (max error {err.max().item():.3e})")


# ------------------------------------------------------------------------------ CPU
def test_discovery_returns_softmax_kernels_for_every_dtype():
    for dtype in DTYPES:
        x = torch.randn(16, 4096, dtype=dtype)
        args = SoftmaxArguments(x, torch.empty_like(x))
        kernels = kernel_api.get_kernels(args, cc=90)
        assert kernels, dtype
        assert {k.metadata.provider for k in kernels} >= {"cuda_src"}
        for k in kernels:
            assert k.supports(args, 90)
        bwd = SoftmaxBackwardArguments(x, x.clone(), torch.empty_like(x))
        assert kernel_api.get_kernels(bwd, cc=90)


def test_every_instance_has_a_distinct_descriptive_name():
    for args_type in (SoftmaxArguments, SoftmaxBackwardArguments):
        names = [k.metadata.kernel_name for k in all_instances(args_type)]
        assert len(names) == len(set(names))
        for dt in ("f32", "f16", "bf16"):
            assert any(dt in n for n in names)


def test_providers_share_the_family_configuration_and_one_naming_rule():
    """Both providers generate the same register-resident configurations, named
    ``<Class>_<dtype>_<strategy>_a<alignment>`` like the GEMMs; cuda_src adds ``looped``."""
    import re

    for args_type, classes in ((SoftmaxArguments, ("CuteSoftmaxForward", "CudaSoftmaxForward")),
                               (SoftmaxBackwardArguments, ("CuteSoftmaxBackward", "CudaSoftmaxBackward"))):
        configs = {}
        for k in all_instances(args_type):
            cls = type(k).__name__
            if cls not in classes:
                continue
            md = k.metadata
            m = re.fullmatch(rf"{cls}_(bf16|f16|f32)_(warp|block_ept16|block_ept32|looped)_(a|peel)(\d+)",
                             md.kernel_name)
            assert m, md.kernel_name
            x = next(iter(md.operands.tensor_attributes().values()))
            if m[3] == "peel":  # cuda_src's peeled instances: any alignment, 16-byte vectors inside
                assert x.divisibility == 1 and md.design.vector_bytes == 16, md.kernel_name
                continue
            m = re.fullmatch(rf"{cls}_(bf16|f16|f32)_(warp|block_ept16|block_ept32|looped)_a(\d+)", md.kernel_name)
            assert (m[1], int(m[3])) == (str(x.dtype), x.divisibility), md.kernel_name
            if m[2] != "looped":
                configs.setdefault(cls, set()).add((m[1], m[2], m[3], repr(md.design), repr(md.operands), md.min_cc))
        cute, cuda = (configs[c] for c in classes)
        assert len(cute) == 15 and cute == cuda


def test_misaligned_rows_get_only_unvectorised_kernels():
    base = torch.randn(4 * 4096 + 1, dtype=torch.bfloat16)
    x = base[1:].view(4, 4096)  # 2-byte offset: no 16-byte accesses possible
    args = SoftmaxArguments(x, torch.empty(4, 4096, dtype=torch.bfloat16))
    kernels = kernel_api.get_kernels(args, cc=90)
    assert kernels
    for k in kernels:
        assert k.metadata.operands.x.divisibility == 1, k.metadata.kernel_name
    odd = SoftmaxArguments(torch.randn(3, 4095), torch.empty(3, 4095))
    assert all(k.metadata.operands.x.divisibility == 1 for k in kernel_api.get_kernels(odd, cc=90))


def test_long_rows_leave_short_row_kernels_out():
    x = torch.randn(2, 300000, dtype=torch.bfloat16)
    args = SoftmaxArguments(x, torch.empty_like(x))
    kernels = kernel_api.get_kernels(args, cc=90)
    assert kernels
    for k in kernels:
        longest = getattr(k.metadata.design, "max_cols", None)
        assert longest is None or longest >= 300000
    reasons = [r.reason for r in kernel_api.explain(args, cc=90) if r.kernel_name and "warp" in r.kernel_name]
    assert reasons and any("exceed" in r for r in reasons)


def test_bad_inputs_are_clear_errors():
    x = torch.randn(8, 64)
    with pytest.raises(ValueError, match="operand out: shape"):
        SoftmaxArguments(x, torch.empty(8, 32))
    with pytest.raises(TypeError, match="operand out: dtype"):
        SoftmaxArguments(x, torch.empty(8, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="operand out: must be contiguous"):
        SoftmaxArguments(x, torch.empty(64, 8).t())
    with pytest.raises(ValueError, match="dim"):
        SoftmaxArguments(x, torch.empty_like(x), dim=0)
    with pytest.raises(ValueError, match="operand x: softmax dim must be contiguous"):
        SoftmaxArguments(torch.randn(64, 8).t(), torch.empty(8, 64))
    with pytest.raises(TypeError, match="operand x"):
        SoftmaxArguments(x.numpy(), torch.empty_like(x))
    with pytest.raises(ValueError, match="operand grad_out: shape"):
        SoftmaxBackwardArguments(torch.randn(8, 32), x, torch.empty_like(x))
    with pytest.raises(TypeError, match="operand grad_in: dtype"):
        SoftmaxBackwardArguments(x, x, torch.empty(8, 64, dtype=torch.bfloat16))


def test_running_cpu_tensors_is_a_device_error():
    x = torch.randn(4, 64)
    args = SoftmaxArguments(x, torch.empty_like(x))
    kernel = kernel_api.get_kernels(args, cc=90, providers="cuda_src")[0]
    with pytest.raises(DeviceError, match="operand x is on cpu"):
        kernel.run(args)


# ------------------------------------------------------------------------------ GPU
def _fwd_ids():
    return [k.metadata.kernel_name for k in all_instances(SoftmaxArguments)]


def _bwd_ids():
    return [k.metadata.kernel_name for k in all_instances(SoftmaxBackwardArguments)]


def _instance(args_type, name):
    return next(k for k in all_instances(args_type) if k.metadata.kernel_name == name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", _fwd_ids())
def test_forward_every_instance(name):
    kernel = _instance(SoftmaxArguments, name)
    torch.manual_seed(hash(name) % 2**31)
    for dtype, cols in instance_params(kernel):
        rows = 67 if cols <= 4096 else 5
        x = make_rows(rows, cols, dtype)
        out = torch.full_like(x, float("nan"))
        args = SoftmaxArguments(x, out)
        assert kernel.supports(args), (name, cols, kernel.supports(args).error)
        kernel.run(args)
        torch.cuda.synchronize()
        check_forward(out, x, f"{name} rows={rows} cols={cols}")
        if cols == 1:
            assert bool((out[~x.isinf()[:, 0]] == 1).all())


@pytest.mark.gpu
@pytest.mark.parametrize("name", _bwd_ids())
def test_backward_every_instance(name):
    kernel = _instance(SoftmaxBackwardArguments, name)
    torch.manual_seed(hash(name) % 2**31)
    for dtype, cols in instance_params(kernel):
        rows = 67 if cols <= 4096 else 5
        y = torch.softmax(torch.randn(rows, cols, device="cuda") * 2, -1).to(dtype)
        g = (torch.randn(rows, cols, device="cuda") * 4).to(dtype)
        grad_in = torch.full_like(y, float("nan"))
        args = SoftmaxBackwardArguments(g, y, grad_in)
        assert kernel.supports(args), (name, cols)
        kernel.run(args)
        torch.cuda.synchronize()
        # torch's own bf16/f16 backward (the torch provider) rounds a few elements about 3x past
        # the bound our kernels meet (measured on an H200): it is held to 4x.
        check_backward(grad_in, g, y, f"{name} rows={rows} cols={cols}",
                       slack=4.0 if kernel.metadata.provider == "torch" else 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_batched_shapes(dtype):
    """Rows of a wider buffer (row stride > row length) and a 3-d batch, on every kernel that takes them."""
    wide = make_rows(40, 1100, dtype)
    x = wide[:, :1024]  # evenly spaced rows, stride 1100
    out = torch.full((40, 1024), float("nan"), device="cuda", dtype=dtype)
    args = SoftmaxArguments(x, out)
    kernels = kernel_api.get_kernels(args)
    assert kernels
    for k in kernels:
        out.fill_(float("nan"))
        k.run(args)
        torch.cuda.synchronize()
        check_forward(out, x, f"{k.metadata.kernel_name} strided")
    x3 = make_rows(6 * 7, 520, dtype).view(6, 7, 520)
    out3 = torch.full_like(x3, float("nan"))
    args3 = SoftmaxArguments(x3, out3)
    for k in kernel_api.get_kernels(args3):
        out3.fill_(float("nan"))
        k.run(args3)
        torch.cuda.synchronize()
        check_forward(out3, x3, f"{k.metadata.kernel_name} batched")


@pytest.mark.gpu
def test_fresh_data_each_call_and_streams():
    """Same compiled artifact, new random data every call, on a side stream: results follow the data."""
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    args = SoftmaxArguments(x, out)
    for kernel in kernel_api.get_kernels(args):
        artifact = kernel.compile(args)
        stream = torch.cuda.Stream()
        for _ in range(3):
            x.normal_()
            out.fill_(float("nan"))
            stream.wait_stream(torch.cuda.current_stream())  # the new data is written on the current stream
            with torch.cuda.stream(stream):
                kernel.run(args, compiled_artifact=artifact, stream=stream, assume_supported_args=True)
            stream.synchronize()
            check_forward(out, x, kernel.metadata.kernel_name)


@pytest.mark.gpu
def test_empty_rows_are_a_no_op():
    x = torch.empty(0, 128, device="cuda")
    args = SoftmaxArguments(x, torch.empty_like(x))
    for kernel in kernel_api.get_kernels(args, providers="cuda_src"):
        kernel.run(args)
    torch.cuda.synchronize()


# Sentinel buffers for kernel outputs and inputs at any alignment (the split and smem tests).
SENTINEL_MARGIN = 64  # elements of poisoned buffer before and after each output (a multiple of 16 bytes)


def poisoned(rows: int, cols: int, dtype: torch.dtype, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-filled flat buffer and a contiguous (rows, cols) view into it ``offset`` elements
    past a margin (so the view starts at any alignment)."""
    buf = torch.full((rows * cols + 2 * SENTINEL_MARGIN + offset,), float("nan"), device="cuda", dtype=dtype)
    start = SENTINEL_MARGIN + offset
    return buf, buf[start:start + rows * cols].view(rows, cols)


def margins_untouched(buf: torch.Tensor, rows: int, cols: int, offset: int, what: str) -> None:
    start = SENTINEL_MARGIN + offset
    assert bool(buf[:start].isnan().all()) and bool(buf[start + rows * cols:].isnan().all()), \
        f"{what}: wrote outside its output"


def input_at(rows: int, cols: int, dtype: torch.dtype, offset: int) -> torch.Tensor:
    """Fresh random rows (with the hard rows of make_rows) at ``offset`` elements past a 256-byte boundary."""
    flat = torch.empty(rows * cols + offset + 64, device="cuda", dtype=dtype)
    x = flat[offset:offset + rows * cols].view(rows, cols)
    x.copy_(make_rows(rows, cols, dtype))
    return x
