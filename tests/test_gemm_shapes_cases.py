"""benchmarks/gemm_shapes.py's cases on the CPU: every group's case has kernels of ours, with the
accumulator and math the front door would use."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import gemm_shapes  # noqa: E402
from kernel_api.core.dtypes import DataType  # noqa: E402

TF32_MATH = {DataType.tf32, DataType.tf32x3}


def _meta_args(case):
    dt = gemm_shapes.DTYPES[case.dtype]

    def operand(rows, cols, column_major):
        t = torch.empty(cols, rows, dtype=dt, device="meta").t() if column_major else torch.empty(rows, cols, dtype=dt,
                                                                                                   device="meta")
        return t

    return gemm_shapes.case_arguments(case, operand(case.M, case.K, case.layouts[0] == "n"),
                                      operand(case.K, case.N, case.layouts[1] == "n"),
                                      operand(case.M, case.N, case.layouts[2] == "n"))


@pytest.mark.parametrize("group", ["f32", "f64"])
def test_every_case_has_our_kernels_and_the_front_doors_math(group):
    for case in gemm_shapes.GROUPS[group]:
        candidates = gemm_shapes.case_candidates(case, _meta_args(case))
        ours = [k for k in candidates if k.metadata.provider != "torch"]
        assert ours, case.name  # (f64 with an f32 accumulator found none: the first f64 run)
        maths = {k.metadata.operands.math_type for k in candidates}
        assert bool(maths & TF32_MATH) == case.tf32, (case.name, maths)
