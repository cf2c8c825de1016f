"""benchmarks/results_io.py: where the benchmark scripts write their JSON."""

from __future__ import annotations

import json

import pytest

from benchmark_modules import load


def _module():
    return load("results_io")


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


def test_text_beside_every_json(tmp_path, monkeypatch):
    rio = _module()
    monkeypatch.setattr(rio, "RESULTS", str(tmp_path / "results"))
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    paths = rio.write_result_with_text("c.json", {"z": 3}, ["line 1", "line 2"])
    assert paths == [str(tmp_path / "results" / "c.json"), str(out / "c.json")]
    for folder in (tmp_path / "results", out):
        assert (folder / "c.txt").read_text() == "line 1\nline 2\n"


def test_document_head(monkeypatch):
    rio = _module()
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    doc = rio.result_doc(cases=[])
    assert doc["device"] == "NVIDIA H200" and doc["torch"] == torch.__version__ and doc["cases"] == []
    assert isinstance(doc["argv"], list)


def test_gzip_result_replaces_the_json_and_load_reads_both(tmp_path):
    """Sweeps whose files would crowd the tree are stored gzipped: `gzip_result` packs a JSON
    file in place (the same bytes for the same content: no timestamp inside) and `load` reads
    either form; what is not JSON is refused and left alone."""
    rio = _module()
    doc = {"results": [{"shape": [2, 2048], "ms": 0.0043}]}
    plain = tmp_path / "a.json"
    plain.write_text(json.dumps(doc))
    assert rio.load(str(plain)) == doc
    packed = rio.gzip_result(str(plain))
    assert packed == str(plain) + ".gz" and not plain.exists()
    assert rio.load(packed) == doc
    again = tmp_path / "b.json"
    again.write_text(json.dumps(doc))
    assert open(rio.gzip_result(str(again)), "rb").read() == open(packed, "rb").read()
    bad = tmp_path / "c.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError):
        rio.gzip_result(str(bad))
    assert bad.exists() and not (tmp_path / "c.json.gz").exists()
