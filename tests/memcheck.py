"""Running a test's script under compute-sanitizer memcheck, as the kernel families' memcheck
tests do: the caching allocator off (each tensor its own allocation, so an overrun is caught),
API errors not reported (they are not memory errors, and the launcher probes a user kernel's
parameter sizes that way, cuKernelGetParamInfo past the last one), this checkout first on PYTHONPATH."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: A clean summary line: memcheck's and synccheck's "ERROR SUMMARY: 0 errors", racecheck's
#: "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)".
CLEAN_SUMMARY = re.compile(r"ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards displayed \(0 errors, 0 warnings\)")

#: The start of a softmax family's sanitized script: the argument types, a seed, and ``at``,
#: fresh rows in their own allocation ``offset`` elements in (rows at any alignment).
SOFTMAX_PREAMBLE = r"""
import torch
from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments
torch.manual_seed(0)
def at(rows, cols, dtype, offset):  # its own allocation, offset elements in: rows at any alignment
    return torch.randn(rows * cols + offset, device="cuda").to(dtype)[offset:].view(rows, cols)
n = 0
def launch(k, backward, rows, cols, dtype, offset):  # one run of k on operands from `at`, counted in n
    global n
    x, out, gi = (at(rows, cols, dtype, offset) for _ in range(3))
    k.run(SoftmaxBackwardArguments(x, out, gi) if backward else SoftmaxArguments(x, out)); n += 1
"""


def run_memcheck(code: str, timeout: int = 900, tool: str = "memcheck") -> str:
    """Run ``python -c code`` under compute-sanitizer's ``tool`` (memcheck; racecheck for shared
    memory hazards, synccheck for barriers; the test skips without compute-sanitizer); assert a
    clean exit and a clean error summary; return its stdout. The messages carry the tail of what
    it printed."""
    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer not installed")
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(["compute-sanitizer", "--tool", tool, "--report-api-errors", "no",
                           "--error-exitcode", "3", sys.executable, "-c", code],
                          env=env, capture_output=True, text=True, timeout=timeout)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    assert CLEAN_SUMMARY.search(proc.stdout + proc.stderr), tail
    return proc.stdout
