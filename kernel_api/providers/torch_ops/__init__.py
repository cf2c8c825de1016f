"""The ``torch`` provider: PyTorch's own operators (cuBLAS/cuBLASLt GEMMs, torch's softmax) as
kernels beside ours, so discovery lists them and PickBest measures them too.

`TorchGemm` runs ``torch.matmul`` (``torch._addmm_activation`` for a row bias with relu or
gelu, cuBLASLt's fused epilogues; ``torch.addmm`` for a row bias alone), any layout and
alignment of f16, bf16, f32 and f64; `TorchSoftmax` and `TorchSoftmaxBackward` run
``torch._softmax`` and ``torch._softmax_backward_data``. Nothing is compiled: ``compile``
returns an artifact holding nothing. PickAny models cuBLAS as a tensor-core library without
wave quantisation (it splits K), slowed down by unaligned operands, so it takes cuBLAS where
our tiles would leave SMs idle and ours elsewhere (`TorchGemm.estimated_cost`, fitted to
H100 and H200 measurements: docs/performance.md, "Choosing"). The package is named
``torch_ops`` so that ``import torch`` inside it means PyTorch.
"""

import torch

from ...core.toolchain import kernel_api_version
from ...registry import Provider, register_provider


@register_provider
class TorchProvider(Provider):
    """PyTorch's own operators, as kernels."""

    name = "torch"
    #: torch's version with kernel_api's: another torch (another cuBLAS) re-tunes its records
    version = f"{kernel_api_version()}+torch-{torch.__version__}"


__all__ = ["TorchProvider"]
