"""PyTorch modules through kernel_api: `Linear`, and `patch`/`unpatch` for whole models.

    model = kernel_api.nn.patch(model)         # nn.Linear / GPT-2 Conv1D -> ops.gemm, bias and activation fused;
                                               # Llama-family RMSNorm, MLP, attention, RoPE, loss -> their ops
    y = model(x)                               # training, torch.compile and CUDA graphs work too
    model = kernel_api.nn.unpatch(model)       # the original modules and settings back
    kernel_api.nn.set_compile_lowering(model, "aten")   # under torch.compile: plain aten (default "auto": nn.lowering)
"""

from .linear import Conv1DLinear, Linear
from .lowering import set_compile_lowering
from .patching import FusedActivation, patch, patched_modules, unpatch

__all__ = ["Conv1DLinear", "FusedActivation", "Linear", "patch", "patched_modules", "set_compile_lowering", "unpatch"]
