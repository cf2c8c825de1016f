"""benchmarks/results_io.py: where the benchmark scripts write their JSON."""

from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    spec = importlib.util.spec_from_file_location("results_io", os.path.join(ROOT, "benchmarks", "results_io.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_names_carry_device_and_tag():
    rio = _module()
    assert rio.result_name("gemm_shapes", "NVIDIA H200", "s25") == "gemm_shapes-NVIDIA_H200-s25.json"
    assert rio.result_name("softmax-rowgroup-trace", "NVIDIA H200") == "softmax-rowgroup-trace-NVIDIA_H200.json"


def test_writes_results_and_a_copy_in_out_only_when_it_is_a_folder(tmp_path, monkeypatch):
    rio = _module()
    monkeypatch.setattr(rio, "RESULTS", str(tmp_path / "results"))
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))  # not created yet: no copy
    paths = rio.write_result("a.json", {"x": 1})
    assert paths == [str(tmp_path / "results" / "a.json")]
    out.mkdir()
    paths = rio.write_result("b.json", {"y": (1, 2)})
    assert paths == [str(tmp_path / "results" / "b.json"), str(out / "b.json")]
    assert json.loads((out / "b.json").read_text()) == {"y": [1, 2]}
