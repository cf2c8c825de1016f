"""``kernel-api bench`` on operations beyond GEMM and softmax: every candidate and the torch
provider's kernel (the baseline) compile, verify and time on the GPU."""

import json

import pytest
import torch

from kernel_api.cli.commands import main

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("argv", [
    ["rms_norm", "--rows", "1000", "--cols", "4096"],
    ["gated_activation", "--rows", "999", "--cols", "1408", "--activation", "gelu_tanh"],
    ["cross_entropy", "--rows", "333", "--classes", "32000"],
    ["rope", "--batch", "2", "--seq", "129", "--heads", "8", "--kv-heads", "2", "--head-dim", "128"],
    ["attention", "--batch", "4", "--heads", "8", "--kv-heads", "2", "--seqlen-q", "1", "--seqlen-k", "300",
     "--head-dim", "128"],
])
def test_bench_times_every_candidate_against_the_torch_kernel(argv, tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(["bench", *argv, "--limit", "3", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "vs torch" in out and "best per provider" in out
    rows = json.loads(path.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    timed = [r for r in rows if r["median_ms"] is not None]
    assert any(r["kernel"] == "torch" for r in timed) and len(timed) >= 2, rows
    assert all(r["failure"] is None for r in timed), rows  # (timed only after its result was verified)
