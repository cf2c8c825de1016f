"""A metadata-only kernel family for testing discovery without any toolchain.

`ToyGemm` instances cover dtypes x layouts x tiles; their `_run` computes with torch so the
shared `Kernel.run` machinery (checks, artifact cache, workspace) can be exercised on CPU
tensors by tests that call `_run` paths directly.
"""

from __future__ import annotations

import itertools

import torch

import kernel_api
from kernel_api import (BLASDesignMetadata, CompiledArtifact, GemmArguments, GemmOperandsMetadata, KernelMetadata,
                        Status, TensorAttributes)
from kernel_api.metadata import EpilogueMetadata
from kernel_api.utils import strides_to_layout_string

ROW, COL = (0, 0, 1), (0, 1, 0)


class ToyProvider(kernel_api.Provider):
    name = "toy"


class ToyGemm(kernel_api.Kernel):
    supported_args_type = GemmArguments
    compiles = 0
    dtypes = ("f16", "bf16", "f32")
    tiles = ((128, 128, 64), (64, 64, 32))
    divisibilities = (8, 1)
    max_k = None
    workspace_bytes = 0

    def compile(self, args, cc=None):
        type(self).compiles += 1
        return CompiledArtifact(("toy", self.metadata.kernel_name), self)

    def _run(self, args, artifact, stream, workspace=None):
        self.last_workspace = workspace
        torch.matmul(args.A, args.B, out=args.out)

    @staticmethod
    def generate_kernels(metadata_filter, epilogue_args=None, cc=None):
        kernels = []
        for dt, tile, div, (sa, sb, so) in itertools.product(
                ToyGemm.dtypes, ToyGemm.tiles, ToyGemm.divisibilities, itertools.product((ROW, COL), repeat=3)):
            layout = strides_to_layout_string(sa, sb, so)
            name = f"ToyGemm_{dt}_{layout}_tile{tile[0]}x{tile[1]}x{tile[2]}_align{div}"
            md = KernelMetadata(
                name, ToyGemm,
                GemmOperandsMetadata(TensorAttributes(dt, sa, div), TensorAttributes(dt, sb, div),
                                     TensorAttributes(dt, so, div), accumulator_type="f32"),
                design=BLASDesignMetadata(tile), min_cc=80,
                epilogue=EpilogueMetadata(activations=frozenset({"relu"})))
            if metadata_filter(md):
                kernels.append(ToyGemm(md))
        return kernels

    def _supports(self, args: GemmArguments) -> Status:
        if ToyGemm.max_k is not None and args.K > ToyGemm.max_k:
            return Status.fail(f"K={args.K} exceeds {ToyGemm.max_k}")
        return Status.success()

    def get_workspace_size(self, args):
        return ToyGemm.workspace_bytes
