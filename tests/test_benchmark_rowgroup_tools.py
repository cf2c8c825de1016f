"""benchmarks/softmax_rowgroup_ab.py's builds (another source, added defines: their own artifacts)
and benchmarks/ncu_sass_regions.py's summary of an Nsight Compute source page, without a GPU."""

from __future__ import annotations

import csv
import gzip
import hashlib
import os

import pytest
import torch

from benchmark_modules import load
from kernel_api import SoftmaxArguments
from kernel_api.providers.cuda_src.kernels import softmax_rowgroup as rg


def _forward(ctas_per_sm: int = 1):
    return next(k for k in rg.CudaSoftmaxRowGroupForward.generate_kernels(None, cc=90)
                if k.dtype.to_torch() == torch.bfloat16 and k.ctas_per_sm == ctas_per_sm)


def _cubin(kernel, args) -> str:
    return hashlib.sha1(kernel.compile(args, cc=90).compiled_obj.compiled.cubin).hexdigest()


def test_ab_builds_compile_their_own_source_and_defines():
    ab = load("softmax_rowgroup_ab")
    kernel = _forward()
    x = torch.empty(4, 2**20, dtype=torch.bfloat16)
    args = SoftmaxArguments(x, torch.empty_like(x))
    own = _cubin(kernel, args)
    assert _cubin(ab.build(kernel), args) == own  # no text, no defines: the same build
    with open(os.path.join(ab.ROOT, ab.SOURCE)) as f:
        own_text = f.read()
    text = own_text.replace("#define RG_STORES_IN_FLIGHT 4", "#define RG_STORES_IN_FLIGHT 2")
    assert text != own_text
    shared = rg.CudaSoftmaxRowGroupForward.get_source()[: -len(own_text)]
    assert _cubin(ab.build(kernel, shared + own_text), args) == own
    other = ab.build(kernel, shared + text)
    assert _cubin(other, args) != own
    knob = ab.build(kernel, None, {"RG_BATCH_OUT_BF16": 2})
    assert knob.defines_for(args) == {**kernel.defines_for(args), "RG_BATCH_OUT_BF16": 2}
    assert _cubin(knob, args) != own
    assert type(kernel) is rg.CudaSoftmaxRowGroupForward and kernel.defines_for(args).get("RG_BATCH_OUT_BF16") is None


def test_ab_base_source_joins_the_shared_helpers(tmp_path):
    import argparse

    ab = load("softmax_rowgroup_ab")
    (tmp_path / "own.cu").write_text("// own\n")
    (tmp_path / "shared.cu").write_text("// shared\n")
    opts = argparse.Namespace(base_source=str(tmp_path / "own.cu"), base_rev=None, base_shared_source=None)
    working = ab.sm.CudaSoftmaxForward.get_source()
    assert ab.base_source(opts) == working + "\n// own\n"
    opts.base_shared_source = str(tmp_path / "shared.cu")
    assert ab.base_source(opts) == "// shared\n\n// own\n"


def test_ab_parse_defines():
    ab = load("softmax_rowgroup_ab")
    assert ab.parse_defines("") == {}
    assert ab.parse_defines("RG_BATCH_BWD=0,RG_BATCH_OUT_FLOAT=-1") == {"RG_BATCH_BWD": 0, "RG_BATCH_OUT_FLOAT": -1}
    with pytest.raises(ValueError):
        ab.parse_defines("RG_BATCH_BWD=two")


def _source_page(path, rows) -> None:
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait",
              "stall_barrier", "stall_wait (Not Issued)"]
    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])
        w.writerow(header)
        for n, (source, samples, executed, wait, barrier) in enumerate(rows):
            w.writerow([hex(n * 16), source, samples, executed, wait, barrier, 0])


def test_sass_regions_split_by_execution_count(tmp_path, capsys, monkeypatch):
    regions = load("ncu_sass_regions")
    path = str(tmp_path / "page.csv.gz")
    _source_page(path, [("LDC R1, c[0x0][0x28]", 2, 100, 2, 0),
                        ("ISETP.GE.AND P0, PT, R1, RZ, PT", 0, 101, 0, 0),
                        ("LDS.128 R4, [R2]", 10, 800, 6, 0),
                        ("@!P0 MUFU.EX2 R5, R5", 20, 800, 20, 0),
                        ("BAR.SYNC 0x1, 0x200", 68, 100, 0, 68)])
    header, rows = regions.read_rows(path)
    total, reasons, found = regions.regions(header, rows)
    assert total == 100 and reasons == {"wait": 28, "barrier": 68}
    assert [(g["first"], g["last"], g["samples"]) for g in found] == [(0, 1, 2), (2, 3, 30), (4, 4, 68)]
    assert found[1]["ops"] == {"LDS": 1, "MUFU": 1} and found[1]["executed"] == 1600
    monkeypatch.setattr("sys.argv", ["ncu_sass_regions.py", path, "--min-share", "10"])
    regions.main()
    out = capsys.readouterr().out
    assert "100 samples over 5 instructions" in out and "barrier 68.0" in out
    assert "68.0%" in out and "30.0%" in out and "  2.0%" not in out
