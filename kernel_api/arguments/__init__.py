"""Arguments objects: the user's tensors for one operation, validated and summarised.

Construction is on the hot path (a few microseconds): it checks ranks, shapes, devices and
dtypes, and records per operand a `TensorAttributes` (dtype, stride pattern, alignment) plus
a hashable ``signature`` that discovery caches on. No DSL objects, no device sync.
"""

from .gemm import (Arguments, EpilogueArguments, GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments,
                   byte_extent)

__all__ = ["Arguments", "EpilogueArguments", "GemmArguments", "SoftmaxArguments", "SoftmaxBackwardArguments",
           "byte_extent"]
