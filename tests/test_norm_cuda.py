"""The CUDA C++ row norms (cuda_src: norm.py / norm.cu / norm_plan.py) without a GPU: discovery
and names, metadata, the row mapping, compiles for sm_90a through NVRTC, compile keys, and the
one-line refusals. The GPU half is tests/test_norm_cuda_gpu.py."""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api.arguments.norm import (LayerNormArguments, LayerNormBackwardArguments, RMSNormArguments,
                                       RMSNormBackwardArguments)
from kernel_api.providers.cuda_src.kernels import norm_plan
from kernel_api.providers.cuda_src.kernels.norm import (CudaLayerNorm, CudaLayerNormBackward, CudaRMSNorm,
                                                        CudaRMSNormBackward)
from kernel_api.tuning.pick_any import rank_candidates


def _meta(shape, dtype, offset=0):
    """A meta tensor of ``shape`` (``offset`` elements into its storage: misaligned when odd)."""
    n = 1
    for s in shape:
        n *= s
    return torch.empty(n + offset, dtype=dtype, device="meta")[offset:].view(shape)


def _rms(shape, dtype=torch.bfloat16, wtype=None, residual=False, offset=0):
    x = _meta(shape, dtype, offset)
    w = _meta((shape[-1],), wtype or dtype)
    extra = dict(residual=_meta(shape, dtype), residual_out=_meta(shape, dtype)) if residual else {}
    return RMSNormArguments(x, w, _meta(shape, dtype), **extra)


def _layer_bwd(shape, dtype=torch.bfloat16, wtype=None):
    x = _meta(shape, dtype)
    w = _meta((shape[-1],), wtype or dtype)
    return LayerNormBackwardArguments(_meta(shape, dtype), x, w, _meta(shape, dtype), torch.empty_like(w),
                                      torch.empty_like(w))


def _by_name(cls, name):
    return next(k for k in cls.generate_kernels(None, cc=90) if k.metadata.kernel_name == name)


def _ours(args):
    return [k.metadata.kernel_name for k in kernel_api.get_kernels(args, cc=90, providers="cuda_src")]


def test_every_family_generates_named_instances():
    for cls in (CudaRMSNorm, CudaLayerNorm, CudaRMSNormBackward, CudaLayerNormBackward):
        names = [k.metadata.kernel_name for k in cls.generate_kernels(None, cc=90)]
        assert len(names) == len(set(names)) == 5 * 2 * 3
        assert all(n.startswith(cls.__name__ + "_") for n in names)
    assert _by_name(CudaRMSNorm, "CudaRMSNorm_bf16_wf32_block_a8").weight_type.name == "f32"
    assert CudaRMSNorm.generate_kernels(None, cc=75) == []


def test_discovery_by_row_length_and_alignment():
    assert _ours(_rms((64, 512))) == ["CudaRMSNorm_bf16_warp_a8", "CudaRMSNorm_bf16_block_a8",
                                      "CudaRMSNorm_bf16_looped_a8", "CudaRMSNorm_bf16_warp_a1",
                                      "CudaRMSNorm_bf16_block_a1", "CudaRMSNorm_bf16_looped_a1"]
    assert _ours(_rms((4, 4097))) == ["CudaRMSNorm_bf16_block_a1", "CudaRMSNorm_bf16_looped_a1"]
    assert _ours(_rms((4, 40000))) == ["CudaRMSNorm_bf16_looped_a8", "CudaRMSNorm_bf16_looped_a1"]
    assert _ours(_rms((4, 4096), offset=1)) == ["CudaRMSNorm_bf16_block_a1", "CudaRMSNorm_bf16_looped_a1"]
    assert _ours(_rms((2, 3, 1024), torch.float16, torch.float32, residual=True))[0] == "CudaRMSNorm_f16_wf32_warp_a8"
    assert _ours(_layer_bwd((4, 8192)))[0] == "CudaLayerNormBackward_bf16_block_a8"
    assert _ours(_layer_bwd((4, 8200))) == ["CudaLayerNormBackward_bf16_looped_a8",
                                            "CudaLayerNormBackward_bf16_looped_a1"]


def test_pick_any_ranks_the_register_rows_first():
    for shape, first in (((16384, 4096), "CudaRMSNorm_bf16_block_a8"), ((4096, 2048), "CudaRMSNorm_bf16_block_a8"),
                         ((65536, 512), "CudaRMSNorm_bf16_warp_a8"), ((8, 100000), "CudaRMSNorm_bf16_looped_a8")):
        args = _rms(shape)
        ranked = rank_candidates(kernel_api.get_kernels(args, cc=90), args, 132)
        assert ranked[0].metadata.kernel_name == first


def test_refusals_are_one_line_and_name_the_operand():
    # a misaligned residual: the 16-byte instance declines, naming it
    x, w = _meta((4, 1024), torch.bfloat16), _meta((1024,), torch.bfloat16)
    args = RMSNormArguments(x, w, _meta((4, 1024), torch.bfloat16), residual=_meta((4, 1024), torch.bfloat16, 1),
                            residual_out=_meta((4, 1024), torch.bfloat16))
    status = _by_name(CudaRMSNorm, "CudaRMSNorm_bf16_block_a8").supports(args, 90)
    assert not status and "operand residual" in status.error and "\n" not in status.error
    # rows too long for the registers
    status = _by_name(CudaRMSNorm, "CudaRMSNorm_bf16_block_a8").supports(_rms((2, 40000)), 90)
    assert not status and "40000" in status.error and "\n" not in status.error
    # CPU tensors: the torch provider takes them
    cpu = torch.randn(2, 64, dtype=torch.bfloat16)
    status = _by_name(CudaRMSNorm, "CudaRMSNorm_bf16_block_a8").supports(
        RMSNormArguments(cpu, torch.randn(64, dtype=torch.bfloat16), torch.empty_like(cpu)), 90)
    assert not status and "operand x" in status.error and "CPU" in status.error
    # f64 rows: no instance of ours, the explanation says why in one line per class
    text = kernel_api.explain(_rms((2, 64), torch.float64)).all()
    assert "cuda_src/CudaRMSNorm" in text and "operand x" in text


def test_plan_arithmetic():
    shape = norm_plan.template_shape("block", False, 4096, 8, 2)
    assert (shape.nv, norm_plan.cta_threads(shape, 4096, False)) == (4, 128)
    shape = norm_plan.template_shape("block", True, 8192, 8, 2)
    assert (shape.nv, norm_plan.cta_threads(shape, 8192, True)) == (2, 512)
    assert norm_plan.template_shape("block", True, 8200, 8, 2) is None
    assert norm_plan.template_shape("warp", False, 1025, 1, 2) is None
    launch = norm_plan.backward_launch(shape, 32768, 8192, 132)
    assert launch.units == launch.grid == 132 and norm_plan.workspace_bytes(launch, 8192, 2) == 2 * 4 * 132 * 8192
    empty = norm_plan.backward_launch(shape, 0, 8192, 132)
    assert empty.grid == 1  # an empty problem still writes zero gradients
    warp = norm_plan.template_shape("warp", True, 512, 8, 2)
    assert norm_plan.backward_launch(warp, 10 ** 6, 512, 132).units == 4 * 132 * (512 // 128)


@pytest.mark.parametrize("cls,args,expect", [
    (CudaRMSNorm, _rms((3, 4096)), "fwd_staged<ka_norm::BF16, ka_norm::BF16, 8, 2, false, false>"),
    (CudaRMSNorm, _rms((3, 512), residual=True), "fwd_reg<ka_norm::BF16, ka_norm::BF16, 8, 2, false, true, true>"),
    (CudaRMSNorm, _rms((3, 4097), torch.float32), "fwd_reg<ka_norm::F32, ka_norm::F32, 1, 16, false, false, false>"),
    (CudaRMSNorm, _rms((3, 40000), torch.float16, torch.float32), "fwd_looped<ka_norm::F16, ka_norm::F32, 8, false, false>"),
    (CudaLayerNormBackward, _layer_bwd((3, 8192), wtype=torch.float32),
     "bwd_reg<ka_norm::BF16, ka_norm::F32, 8, 2, true, false, 3>"),
    (CudaLayerNormBackward, _layer_bwd((3, 100)), "bwd_reg<ka_norm::BF16, ka_norm::BF16, 1, 4, true, true, 0>"),  # (no ring: _a1)
    (CudaLayerNormBackward, _layer_bwd((3, 20000)), "bwd_looped<ka_norm::BF16, ka_norm::BF16, 8, true>"),
])
def test_compiles_for_sm90a_without_a_gpu(cls, args, expect):
    kernel = next(k for k in kernel_api.get_kernels(args, cc=90, providers="cuda_src") if isinstance(k, cls))
    artifact = kernel.compile(args, cc=90)
    launcher = artifact.compiled_obj
    assert launcher.name_expression.endswith(expect)
    assert launcher.compiled.arch == "sm_90a" and launcher.compiled.cubin[:4] == b"\x7fELF"
    assert (artifact.extra.reduce is not None) == cls.backward


def test_compile_key_follows_the_template_and_the_residual():
    kernel = _by_name(CudaRMSNorm, "CudaRMSNorm_bf16_block_a8")
    keys = {cols: kernel.compile_key(_rms((2, cols)), 90) for cols in (256, 512, 4096, 8192)}
    assert keys[512] == keys[4096] == keys[8192] != keys[256]  # (staged) nv: 2, 2, 2, 1
    kernel.staged = False
    held = {cols: kernel.compile_key(_rms((2, cols)), 90) for cols in (256, 512, 4096, 8192)}
    assert held[4096] == held[8192] != held[512] != held[256]  # (registers) nv: 4, 4, 2, 1
    assert held[4096] != keys[4096]
    assert kernel.compile_key(_rms((2, 4096), residual=True), 90) != keys[4096]
    layer = _by_name(CudaLayerNorm, "CudaLayerNorm_bf16_block_a8")
    x = _meta((2, 4096), torch.bfloat16)
    w = _meta((4096,), torch.bfloat16)
    assert layer.compile_key(LayerNormArguments(x, w, w, _meta((2, 4096), torch.bfloat16)), 90) != keys[4096]


def test_backward_stages_compile_into_the_name_and_the_shared_memory():
    kernel = _by_name(CudaLayerNormBackward, "CudaLayerNormBackward_bf16_block_a8")
    args = _layer_bwd((64, 4096))
    kernel.stages = 3
    artifact = kernel.compile(args, cc=90)
    assert artifact.compiled_obj.name_expression.endswith("true, false, 3>") and artifact.extra.stages == 3
    assert norm_plan.ring_bytes(3, artifact.extra.shape, 256) == 3 * 2 * 2 * 16 * 256
    narrow = _by_name(CudaLayerNormBackward, "CudaLayerNormBackward_bf16_block_a1")
    narrow.stages = 3  # single elements: no ring
    assert narrow.compile(_layer_bwd((64, 4095)), cc=90).compiled_obj.name_expression.endswith(", 0>")


def test_backward_workspace_and_launch():
    kernel = _by_name(CudaRMSNormBackward, "CudaRMSNormBackward_bf16_block_a8")
    x = _meta((16384, 4096), torch.bfloat16)
    w = _meta((4096,), torch.bfloat16)
    args = RMSNormBackwardArguments(_meta((16384, 4096), torch.bfloat16), x, w, _meta((16384, 4096), torch.bfloat16),
                                    torch.empty_like(w))
    grid, threads = kernel.launch_config(args)
    assert threads == 256 and grid == 132 * 2
    assert kernel.get_workspace_size(args) == 4 * grid * 4096
    layer = _by_name(CudaLayerNormBackward, "CudaLayerNormBackward_bf16_block_a8")
    assert layer.get_workspace_size(_layer_bwd((16384, 4096))) == 2 * 4 * grid * 4096


def test_resident_launch_cuts_the_persistent_grid():
    shape = norm_plan.template_shape("block", True, 4096, 8, 2)
    launch = norm_plan.backward_launch(shape, 16384, 4096, 132, threads_per_sm=1024)
    assert (launch.grid, launch.threads) == (132 * 4, 256)
    assert norm_plan.resident_launch(launch, "block", 132 * 2) == norm_plan.Launch(264, 256, 264)
    assert norm_plan.resident_launch(launch, "block", 10 ** 6) is launch
    assert norm_plan.resident_launch(launch, "block", 0) is launch  # (no answer from the occupancy query)
    warp = norm_plan.template_shape("warp", True, 512, 8, 2)
    wide = norm_plan.backward_launch(warp, 10 ** 6, 512, 132)
    assert norm_plan.resident_launch(wide, "warp", 100).units == 4 * 100


def test_staged_forward_compiles_where_its_stage_fits():
    kernel = _by_name(CudaRMSNorm, "CudaRMSNorm_bf16_block_a8")
    kernel.staged = True
    kernel.bytes_per_thread = 64
    artifact = kernel.compile(_rms((3, 8192), residual=True), cc=90)
    assert artifact.compiled_obj.name_expression.endswith("fwd_staged<ka_norm::BF16, ka_norm::BF16, 8, 4, false, true>")
    assert artifact.extra.staged
    shape = artifact.extra.shape
    assert norm_plan.stage_bytes(shape, 256, True) == 4 * 16 * 256 * 2 <= norm_plan.STAGE_LIMIT
    kernel.bytes_per_thread = 128  # staged rows take up to 128 bytes a thread
    assert kernel.name_expression(_rms((3, 8192))).endswith("fwd_staged<ka_norm::BF16, ka_norm::BF16, 8, 8, "
                                                              "false, false>")
    kernel.bytes_per_thread = 64
    # a row whose stage (with the residual's) exceeds the limit takes the register rows
    long = _rms((3, 32768))
    assert norm_plan.stage_bytes(kernel.shape_for(32768), 1024, False) > norm_plan.STAGE_LIMIT
    assert "fwd_reg<" in kernel.name_expression(long)
    narrow = _by_name(CudaRMSNorm, "CudaRMSNorm_bf16_block_a1")
    narrow.staged = True  # single elements: never staged
    assert "fwd_reg<" in narrow.name_expression(_rms((3, 4095)))


def test_staged_rows_take_more_bytes_a_thread():
    # the backward: held in registers, 32 bytes of a row a thread at most; read back from the ring, 64
    # (the staged forward: 128)
    assert norm_plan.template_shape("block", False, 8192, 8, 2, 128, staged=True).nv == 8
    assert norm_plan.template_shape("block", True, 8192, 8, 2, 64).nv == 2
    ring = norm_plan.template_shape("block", True, 8192, 8, 2, 64, staged=True)
    assert (ring.nv, norm_plan.cta_threads(ring, 8192, True)) == (4, 256)
    assert norm_plan.template_shape("block", True, 4096, 4, 4, 64, staged=True).nv == 4  # f32: 16 elements
    assert norm_plan.template_shape("block", True, 4096, 1, 2, 64, staged=True).nv == 8  # (no ring for _a1)
    kernel = _by_name(CudaRMSNormBackward, "CudaRMSNormBackward_bf16_block_a8")
    kernel.stages, kernel.bytes_per_thread = 3, 64
    assert kernel.name_expression(_rms_bwd((4, 8192))).endswith("8, 4, false, false, 3>")
    kernel.stages = 0
    assert kernel.name_expression(_rms_bwd((4, 8192))).endswith("8, 2, false, false, 0>")


def _rms_bwd(shape):
    x = _meta(shape, torch.bfloat16)
    w = _meta((shape[-1],), torch.bfloat16)
    return RMSNormBackwardArguments(_meta(shape, torch.bfloat16), x, w, _meta(shape, torch.bfloat16),
                                    torch.empty_like(w))
