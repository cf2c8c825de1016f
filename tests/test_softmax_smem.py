"""Softmax with the row staged in shared memory (CudaSoftmaxSmem*), and the block kernels'
warp-granular CTAs.

CPU: discovery, limits and refusals, NVRTC compiles for sm_90a with their register use read
from the cubin (no local memory), PickAny's choices. GPU (@pytest.mark.gpu): float64
references on fresh random rows (with -inf rows and huge magnitudes), outputs inside
NaN-filled buffers whose margins must stay untouched, for odd row lengths at the family's
limits (the longest row, the longest with two CTAs per SM and one past it), misaligned base
pointers and strided rows, forward and backward, all three dtypes."""

from __future__ import annotations

import struct

import pytest
import torch

import kernel_api
from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments
from kernel_api.errors import UnsupportedArgumentsError
from kernel_api.providers.cuda_src.kernels import softmax_smem
from kernel_api.providers.cuda_src.kernels.softmax import CudaSoftmaxBackward, CudaSoftmaxForward
from kernel_api.providers.cuda_src.kernels.softmax_smem import (CudaSoftmaxSmemBackward, CudaSoftmaxSmemForward,
                                                              CudaSoftmaxSmemYBackward)
from kernel_api.tuning.policies import rank_candidates

from test_softmax import check_backward, check_forward, make_rows
from test_softmax import input_at as _input_at, margins_untouched as _margins_untouched, poisoned as _poisoned

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CLASSES = (CudaSoftmaxSmemForward, CudaSoftmaxSmemBackward, CudaSoftmaxSmemYBackward)


def _args(cls, x: torch.Tensor):
    if cls.backward:
        return SoftmaxBackwardArguments(x, x, torch.empty_like(x))
    return SoftmaxArguments(x, torch.empty_like(x))


def _kernel(cls, dtype: torch.dtype):
    return next(k for k in cls.generate_kernels(None, cc=90) if k.dtype.to_torch() == dtype)


def _two_per_sm_cols(kernel) -> int:
    """The longest row whose buffers still let two CTAs share an SM."""
    return softmax_smem.TWO_PER_SM_BYTES // (16 * kernel.staged_rows) * kernel.vec + kernel.vec - 1


# ----------------------------------------------------------------------------- cubin report
def _nv_info(cubin: bytes) -> dict[str, dict[int, int]]:
    """Per kernel symbol, the 32-bit attributes of the cubin's ``.nv.info`` section
    (0x2f: registers per thread, 0x11: local-memory frame bytes, 0x12: minimum stack)."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]

    def cstr(offset: int) -> str:
        return cubin[offset:cubin.index(b"\0", offset)].decode()

    secs = {cstr(hdrs[shstrndx][4] + h[0]): h for h in hdrs}
    symtab, strtab, info = secs[".symtab"], secs[".strtab"], secs[".nv.info"]
    data = cubin[info[4]:info[4] + info[5]]
    found: dict[str, dict[int, int]] = {}
    i = 0
    while i < len(data):
        fmt, attr = data[i], data[i + 1]
        if fmt == 4:  # a sized value: (symbol, value) pairs for the per-kernel attributes
            size, = struct.unpack_from("<H", data, i + 2)
            if size == 8:
                sym, value = struct.unpack_from("<II", data, i + 4)
                name_off, = struct.unpack_from("<I", cubin, symtab[4] + sym * 24)
                found.setdefault(cstr(strtab[4] + name_off), {})[attr] = value
            i += 4 + size
        else:
            i += {3: 4, 2: 3}.get(fmt, 2)
    return found


def _resources(artifact) -> dict[int, int]:
    compiled = artifact.compiled_obj.compiled
    lowered = compiled.symbols[artifact.compiled_obj.name_expression]
    return _nv_info(compiled.cubin)[lowered]


# ----------------------------------------------------------------------------------- CPU
def test_instances_names_and_limits():
    fwd = {k.metadata.kernel_name: k for k in CudaSoftmaxSmemForward.generate_kernels(None, cc=90)}
    bwd = {k.metadata.kernel_name: k for k in CudaSoftmaxSmemBackward.generate_kernels(None, cc=90)}
    ybwd = {k.metadata.kernel_name: k for k in CudaSoftmaxSmemYBackward.generate_kernels(None, cc=90)}
    assert sorted(fwd) == ["CudaSoftmaxSmemForward_bf16_smem_peel8", "CudaSoftmaxSmemForward_f16_smem_peel8",
                           "CudaSoftmaxSmemForward_f32_smem_peel4"]
    assert len(bwd) == 3
    k = fwd["CudaSoftmaxSmemForward_bf16_smem_peel8"]
    assert k.metadata.design.strategy == "smem" and k.metadata.design.max_cols == k.max_cols
    # the longest row's vectors fill the shared memory a CTA may have, one more vector does not
    for kernel in list(fwd.values()) + list(bwd.values()) + list(ybwd.values()):
        assert softmax_smem.row_smem_bytes(kernel.max_cols, kernel.dtype, kernel.staged_rows) <= \
            softmax_smem.MAX_SMEM_BYTES < softmax_smem.row_smem_bytes(kernel.max_cols + 1, kernel.dtype,
                                                                      kernel.staged_rows)
    assert (fwd["CudaSoftmaxSmemForward_f32_smem_peel4"].max_cols - 3) * 2 + 7 == k.max_cols == 116103
    assert bwd["CudaSoftmaxSmemBackward_bf16_smem_peel8"].max_cols == 58055
    # the y-staged backward holds one row, as the forward does: f32 rows of GPT-2's 50257
    assert ybwd["CudaSoftmaxSmemYBackward_f32_smemy_peel4"].max_cols == 58051
    assert ybwd["CudaSoftmaxSmemYBackward_bf16_smemy_peel8"].max_cols == 116103
    assert ybwd["CudaSoftmaxSmemYBackward_f32_smemy_peel4"].metadata.design.strategy == "smemy"
    # two commit groups for the y-staged backward (its sweep), four for the others
    assert {k.stages for k in ybwd.values()} == {2} and {k.stages for k in bwd.values()} == {softmax_smem.STAGES}
    assert not CudaSoftmaxSmemForward.generate_kernels(None, cc=80)  # 227 KB of shared memory: sm_90, sm_100
    assert not CudaSoftmaxSmemForward.generate_kernels(None, cc=120)


def test_refusals_say_why():
    k = _kernel(CudaSoftmaxSmemBackward, torch.float32)
    x = torch.empty(2, 50257)
    status = k.supports(_args(CudaSoftmaxSmemBackward, x), 90)
    assert not status and "402,048 bytes of shared memory" in status.error and "rows of up to 29,027" in status.error
    # the y-staged backward takes that row (one 201 KB buffer) and refuses one past its own limit
    ky = _kernel(CudaSoftmaxSmemYBackward, torch.float32)
    assert ky.supports(_args(CudaSoftmaxSmemYBackward, x), 90)
    status = ky.supports(_args(CudaSoftmaxSmemYBackward, torch.empty(2, ky.max_cols + 1)), 90)
    assert not status and "rows of up to 58,051" in status.error and "shared memory" in status.error
    # operands whose rows start at different offsets from a 16-byte boundary: no one peel
    xb = torch.randn(4 * 40000 + 8, dtype=torch.bfloat16)
    x = xb[1:1 + 4 * 40000].view(4, 40000)
    args = SoftmaxArguments(x, torch.empty(4, 40000, dtype=torch.bfloat16))
    status = _kernel(CudaSoftmaxSmemForward, torch.bfloat16).supports(args, 90)
    assert not status and "different offsets from a 16-byte boundary" in status.error
    # one phase (x and out one element past a boundary): taken
    out = torch.empty(4 * 40000 + 8, dtype=torch.bfloat16)[1:1 + 4 * 40000].view(4, 40000)
    assert _kernel(CudaSoftmaxSmemForward, torch.bfloat16).supports(SoftmaxArguments(x, out), 90)


def test_artifact_for_shorter_rows_refuses_longer():
    k = _kernel(CudaSoftmaxSmemForward, torch.bfloat16)
    artifact = k.compile(_args(CudaSoftmaxSmemForward, torch.empty(2, 1000, dtype=torch.bfloat16)), cc=90)
    assert artifact.extra.capacity == k.max_cols
    x = torch.empty(2, k.max_cols + 1, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedArgumentsError, match=f"rows of up to {k.max_cols} elements"):
        k._run(_args(CudaSoftmaxSmemForward, x), artifact, None)


@pytest.mark.parametrize("cls", _CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiles_for_sm90a_without_spills(cls, dtype):
    """Both thread counts compile for sm_90a; the cubin's report: no local memory, registers
    that let a CTA of 1024 threads (and two of 512) launch."""
    k = _kernel(cls, dtype)
    for cols in (1000, min(50257, k.max_cols), k.max_cols):
        args = _args(cls, torch.empty(3, cols, dtype=dtype))
        assert k.supports(args, 90), (cols, k.supports(args, 90).error)
        grid, threads, smem = k.launch_config(args)
        assert grid == 3 and smem == softmax_smem.row_smem_bytes(cols, k.dtype, cls.staged_rows) <= softmax_smem.MAX_SMEM_BYTES
        assert threads == (softmax_smem.THREADS_SHARED if smem <= softmax_smem.TWO_PER_SM_BYTES
                           else softmax_smem.THREADS_ALONE)
        artifact = k.compile(args, cc=90)
        assert artifact.compiled_obj.compiled.arch == "sm_90a"
        assert artifact.compiled_obj.name_expression.endswith(f", {threads}, {k.default_stages}>")
        res = _resources(artifact)
        assert res.get(0x11, 0) == 0 and res.get(0x12, 0) == 0, f"{k.metadata.kernel_name} cols={cols}: local memory {res}"
        assert 0 < res[0x2f] <= 64, res


def test_block_ctas_are_warp_multiples_for_rows_past_a_power_of_two():
    """8192x4097 bf16: 513 vectors at 4 per thread need 129 threads, so a CTA of 160 (not 256,
    which would hold 2 vectors per thread); its block reductions take 5 warps."""
    k = next(k for k in CudaSoftmaxForward.generate_kernels(None, cc=90)
             if k.metadata.kernel_name == "CudaSoftmaxForward_bf16_block_ept32_peel8")
    x = torch.empty(8, 4097, dtype=torch.bfloat16)
    args = SoftmaxArguments(x, torch.empty_like(x))
    assert k.name_expression(args).endswith("<ka_softmax::BF16, 8, 4, 160, true>")
    assert k.launch_config(args) == (8, 160)
    artifact = k.compile(args, cc=90)
    assert artifact.extra.capacity == 160 * 32 >= 4097
    res = _resources(artifact)
    assert res.get(0x11, 0) == 0 and 0 < res[0x2f] <= 255
    kb = next(k for k in CudaSoftmaxBackward.generate_kernels(None, cc=90)
              if k.metadata.kernel_name == "CudaSoftmaxBackward_f32_block_ept16_peel4")
    y = torch.empty(8, 4097)
    assert kb.launch_config(SoftmaxBackwardArguments(y, y, torch.empty_like(y))) == (8, 288)  # 1025 / 4 -> 257
    # a power of two stays one: 4096 bf16 at 4 vectors per thread is 128 threads
    x = torch.empty(8, 4096, dtype=torch.bfloat16)
    assert k.launch_config(SoftmaxArguments(x, torch.empty_like(x))) == (8, 128)


def test_cutedsl_buckets_stay_powers_of_two():
    from kernel_api.providers import softmax_config

    assert softmax_config.register_bucket("block", 8, 32, 4097, False).threads_per_row == 256
    assert softmax_config.register_bucket("block", 8, 32, 4097, False, warp_granular=True).threads_per_row == 160
    assert softmax_config.register_bucket("block", 8, 32, 40000, False, warp_granular=True).threads_per_row == 1024


@pytest.mark.parametrize("dtype", DTYPES)
def test_pick_any_stages_rows_in_shared_memory_past_the_registers(dtype):
    """The register kernels keep the rows they hold; rows past them that one CTA's shared
    memory holds go to the smem family instead of the looped kernels (two reads)."""
    def first(rows, cols, backward=False):
        x = torch.empty(rows, cols, dtype=dtype)
        args = SoftmaxBackwardArguments(x, x, torch.empty_like(x)) if backward else SoftmaxArguments(x, torch.empty_like(x))
        return rank_candidates(kernel_api.get_kernels(args, cc=90), args)[0].metadata.kernel_name

    assert "_smem_" in first(4096, 50257)
    # (f32's backward holds two rows of 201 KB: past a CTA's shared memory)
    assert ("_smem_" in first(4096, 50257, True)) == (dtype != torch.float32)
    for backward in (False, True):
        assert "_block_" in first(8192, 4097, backward)
        assert "_block_" in first(16384, 16384, backward)
        assert "_smem_" not in first(8, 2**20, backward)


# ----------------------------------------------------------------------------------- GPU
def _gpu_cols(kernel) -> list[int]:
    """Row lengths at the family's edges: short and odd, 4096x50257's, the longest with two
    CTAs per SM and one past it, the longest row."""
    two = _two_per_sm_cols(kernel)
    cols = [1, 7, 4099, 50257, two, two + 1, kernel.max_cols - 5, kernel.max_cols]
    return sorted({c for c in cols if c <= kernel.max_cols})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 3])
def test_forward_at_the_limits(dtype, offset):
    k = _kernel(CudaSoftmaxSmemForward, dtype)
    torch.manual_seed(offset * 7 + len(str(dtype)))
    for cols in _gpu_cols(k):
        rows = 6
        x = _input_at(rows, cols, dtype, offset)
        buf, out = _poisoned(rows, cols, dtype, offset)
        args = SoftmaxArguments(x, out)
        assert k.supports(args), (cols, k.supports(args).error)
        k.run(args)
        torch.cuda.synchronize()
        what = f"{k.metadata.kernel_name} {rows}x{cols}+{offset}"
        check_forward(out, x, what)
        _margins_untouched(buf, rows, cols, offset, what)


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [CudaSoftmaxSmemBackward, CudaSoftmaxSmemYBackward])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 5])
def test_backward_at_the_limits(cls, dtype, offset):
    k = _kernel(cls, dtype)
    torch.manual_seed(offset * 11 + len(str(dtype)))
    for cols in _gpu_cols(k):
        rows = 5
        g = _input_at(rows, cols, dtype, offset)
        g.copy_(torch.randn(rows, cols, device="cuda") * 4)
        y = _input_at(rows, cols, dtype, offset)
        y.copy_(torch.softmax(torch.randn(rows, cols, device="cuda") * 2, -1))
        buf, grad_in = _poisoned(rows, cols, dtype, offset)
        args = SoftmaxBackwardArguments(g, y, grad_in)
        assert k.supports(args), (cols, k.supports(args).error)
        k.run(args)
        torch.cuda.synchronize()
        what = f"{k.metadata.kernel_name} {rows}x{cols}+{offset}"
        check_backward(grad_in, g, y, what)
        _margins_untouched(buf, rows, cols, offset, what)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_fresh_data_per_call(dtype):
    """x rows of a wider buffer (row stride cols + 16, three elements past a 16-byte boundary)
    into a poisoned out at the same phase, one artifact over new data each call on a side
    stream; an x whose rows' phases differ from out's is refused."""
    rows, cols, offset = 8, 40001, 3
    k = _kernel(CudaSoftmaxSmemForward, dtype)
    flat = torch.empty(rows * (cols + 16) + offset, device="cuda", dtype=dtype)
    x = flat[offset:].as_strided((rows, cols), (cols + 16, 1))
    buf, out = _poisoned(rows, cols, dtype, offset)
    args = SoftmaxArguments(x, out)
    assert k.supports(args), k.supports(args).error
    other = flat[offset:].as_strided((rows, cols), (cols + 5, 1))  # row r at another phase than out's
    refused = k.supports(SoftmaxArguments(other, out))
    assert not refused and "different offsets" in refused.error
    artifact = k.compile(args)
    stream = torch.cuda.Stream()
    for _ in range(3):
        x.copy_(make_rows(rows, cols, dtype))
        out.fill_(float("nan"))
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            k.run(args, compiled_artifact=artifact, stream=stream, assume_supported_args=True)
        stream.synchronize()
        check_forward(out, x, f"{k.metadata.kernel_name} strided rows")
        _margins_untouched(buf, rows, cols, offset, f"{k.metadata.kernel_name} strided rows")


@pytest.mark.gpu
def test_many_rows_through_ops_pick_any():
    """ops.softmax and its backward on 4096x50257-like rows (PickAny: the smem family)."""
    x = make_rows(300, 50257, torch.bfloat16)
    y = kernel_api.ops.softmax(x)
    check_forward(y, x, "ops.softmax 300x50257")
    # The backward of finite probabilities (make_rows' all -inf row has a NaN softmax, whose
    # gradient is NaN too, and check_backward takes any NaN for an unwritten element).
    y = kernel_api.ops.softmax((torch.randn(300, 50257, device="cuda") * 2).to(torch.bfloat16))
    g = torch.randn_like(x)
    gi = kernel_api.ops.softmax_backward(g, y, -1)
    check_backward(gi, g, y, "ops.softmax_backward 300x50257")
