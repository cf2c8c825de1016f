"""QuACK's RMSNorm and LayerNorm forward (``quack.rmsnorm``, one kernel for both), with the fused
residual add: a row per CTA or cluster, statistics in f32.

QuACK compiles one function per set of operand types and row length N, assuming every operand
aligned to ``gcd(N, 16 bytes of each type)`` elements, copied in pieces of 4 bytes or more
(`_supports` checks it). QuACK's LayerNorm
takes f32 weight and bias only; its RMSNorm takes weights of x's type or f32.
"""

from __future__ import annotations

import math
from typing import Any

from quack.rmsnorm import _compile_rmsnorm_fwd

from kernel_api import (DataType, KernelMetadata, LayerNormArguments, RMSNormArguments, RowReductionDesignMetadata,
                        Status, TensorAttributes)
from kernel_api.metadata.norm import LayerNormOperandsMetadata, RMSNormOperandsMetadata

from .base import QuackKernel, aligned_rows
from .provider import QuackProvider

#: The longest row offered
MAX_COLS = 65536


def _aligned(args: Any) -> Status:
    """Success when every operand is aligned to the elements QuACK's compile assumes: one piece
    width for all of them, ``gcd(N, 16 bytes of each type)``."""
    attrs = args.tensor_attributes
    width = math.gcd(*(16 // a.dtype.bytes for a in attrs.values()))
    return aligned_rows(args, tuple(attrs), vector_elements=width)


class _QuackNorm(QuackKernel):
    """One instance per (x's type, weight's type) of ``types``."""

    types: tuple = ()
    operands_type: Any = None
    is_layernorm = False

    @classmethod
    def generate_kernels(cls, metadata_filter: Any, epilogue_args: Any = None, cc: int | None = None) -> list:
        if epilogue_args is not None or (cc is not None and cc < cls.min_cc):
            return []
        found = []
        for x_type, w_type in cls.types:
            rows, vector = TensorAttributes(x_type, (0, 1), 1), TensorAttributes(w_type, (1,), 1)
            operands = cls.operands_type(rows, vector, rows, max_cols=MAX_COLS, residual=True)
            name = f"{cls.__name__}_{x_type}" + (f"_w{w_type}" if w_type is not x_type else "")
            metadata = KernelMetadata(name, cls, operands, min_cc=cls.min_cc,
                                      design=RowReductionDesignMetadata("block", 128, 16, 1, MAX_COLS))
            if metadata_filter is None or metadata_filter(metadata):
                found.append(cls(metadata))
        return found

    def _supports(self, args: Any) -> Status:
        return _aligned(args)

    def build(self, args: Any) -> Any:
        attrs = args.tensor_attributes
        x = attrs["x"].dtype.to_cutlass()
        weight = attrs["weight"].dtype.to_cutlass()
        bias = attrs["bias"].dtype.to_cutlass() if "bias" in attrs else None
        residual = x if args.residual is not None else None
        # (positional, as QuACK's own call passes them: the same key in QuACK's caches)
        return _compile_rmsnorm_fwd(x, x, residual, weight, bias, residual, args.cols, False, False,
                                    self.is_layernorm, False, 0.0)

    def call(self, function: Any, args: Any) -> None:
        if args.rows:
            self.caller(function, args)(*args.tensors().values())

    def caller(self, function: Any, args: Any) -> Any:
        if not args.rows:
            return None
        shape, eps = (args.rows, args.cols), args.eps
        names = list(args.tensor_attributes)
        has_bias, has_residual = "bias" in names, "residual" in names

        def launch(*tensors: Any) -> None:
            t = dict(zip(names, tensors))
            residual = t["residual"].view(shape) if has_residual else None
            residual_out = t["residual_out"].view(shape) if has_residual else None
            function(t["x"].view(shape), t["weight"], t["bias"] if has_bias else None, residual, t["out"].view(shape),
                     residual_out, None, None, eps)

        return launch


@QuackProvider.register
class QuackRMSNorm(_QuackNorm):
    """``quack.rmsnorm.RMSNorm``: RMSNorm, optionally fused with the residual add."""

    supported_args_type = RMSNormArguments
    operands_type = RMSNormOperandsMetadata
    types = ((DataType.f32, DataType.f32), (DataType.f16, DataType.f16), (DataType.bf16, DataType.bf16),
             (DataType.f16, DataType.f32), (DataType.bf16, DataType.f32))


@QuackProvider.register
class QuackLayerNorm(_QuackNorm):
    """``quack.rmsnorm.RMSNorm`` in LayerNorm mode (f32 weight and bias), optionally fused with the residual add."""

    supported_args_type = LayerNormArguments
    operands_type = LayerNormOperandsMetadata
    is_layernorm = True
    types = ((DataType.f32, DataType.f32), (DataType.f16, DataType.f32), (DataType.bf16, DataType.f32))
