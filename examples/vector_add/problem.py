"""The vector add on the ``kernel-api`` command line (`list`, `explain`, `bench`, `tune`, and the
shapes files of `precompile`, `tune --shapes` and `bundle create`). A package holding this example
declares it in its ``pyproject.toml``:

    [project.entry-points."kernel_api.problems"]
    vector_add = "vector_add.problem:PROBLEM"

after which ``kernel-api list vector_add --n 4096 --dtype bf16 --cc 90`` lists its kernels and a
shapes file takes ``{"op": "vector_add", "n": 4096, "dtype": "bf16"}``.
"""

from __future__ import annotations

import torch

from kernel_api.cli.problems import Field, Problem
from kernel_api.core.dtypes import to_dtype

from .arguments import VectorAddArguments


def _arguments(n: int, dtype: str, device: str) -> VectorAddArguments:
    t = to_dtype(dtype, "--dtype").to_torch()
    x, y, out = (torch.empty(n, dtype=t, device=device) for _ in range(3))
    return VectorAddArguments(x, y, out)


#: ``out = x + y`` over ``n`` elements of one type.
PROBLEM = Problem("vector_add", "out = x + y, 1-D tensors of n elements",
                  (Field("n", int, help="elements"),
                   Field("dtype", "dtype", "f16", "tensor type: f16, bf16, f32, f64")),
                  _arguments)
