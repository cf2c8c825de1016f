"""A tiny CUDA C++ test kernel that needs a workspace (shared by the integration tests)."""

from __future__ import annotations

import torch

from kernel_api import SoftmaxArguments, SoftmaxOperandsMetadata, TensorAttributes
from kernel_api.providers.cuda_src.kernel import CudaSourceKernel

SOURCE = r"""
__global__ void ws_twice_plus_one(const float* x, float* ws, float* y, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) {
    ws[i] = 2.0f * x[i];                       // stage through the workspace...
    y[i] = ((volatile float*)ws)[i] + 1.0f;    // ...and read it back from memory
  }
}
"""


class WorkspaceTestKernel(CudaSourceKernel):
    """``out = 2 * x + 1`` staged through a workspace of ``4 * numel`` bytes; keeps the last
    workspace it was given so tests can inspect it."""

    source = SOURCE
    kernel_name = "ws_twice_plus_one"
    supported_args_type = SoftmaxArguments
    operands = SoftmaxOperandsMetadata(TensorAttributes(torch.float32, (0, 1), 1),
                                       TensorAttributes(torch.float32, (0, 1), 1))
    last_workspace = None

    def get_workspace_size(self, args: SoftmaxArguments) -> int:
        return 4 * args.x.numel()

    def launch_config(self, args: SoftmaxArguments) -> tuple:
        return (args.x.numel() + 255) // 256, 256

    def kernel_arguments(self, args: SoftmaxArguments) -> tuple:
        return args.x, self._workspace, args.out, args.x.numel()

    def _run(self, args, artifact, stream, workspace=None):
        if workspace is None or workspace.numel() < self.get_workspace_size(args):
            raise ValueError("WorkspaceTestKernel: operand workspace is missing or too small")
        self._workspace = workspace
        type(self).last_workspace = workspace
        super()._run(args, artifact, stream, workspace)


def workspace_kernel() -> WorkspaceTestKernel:
    return WorkspaceTestKernel.generate_kernels(None)[0]
