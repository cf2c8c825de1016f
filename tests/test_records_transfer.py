"""Tuning records move between machines: export to JSON, import merges (the newer record wins)."""

import json
import os

import pytest

from kernel_api.cli.commands import main
from kernel_api.tuning.records import (MergeCounts, RecordsFileError, TuningRecord, TuningRecords, export_records,
                                       import_records)

OLD, NEW = "2026-01-01T00:00:00+00:00", "2026-06-01T00:00:00+00:00"


def _record(shape: str, kernel: str, created: str, toolchain_key: str = "kernel_api 1; dsl 4.8.1 cu12",
            device: str = "NVIDIA H200") -> TuningRecord:
    return TuningRecord(device, 90, "GemmSignature(...)", shape, kernel, 0.5, {"other": 0.7},
                        {"torch": "2.13.0", "nvidia-cutlass-dsl": "4.8.1"}, created, toolchain_key)


def test_export_then_import_into_an_empty_store_round_trips(tmp_path):
    source = TuningRecords(tmp_path / "a.sqlite")
    source.merge([_record("64x64x64x1", "K1", OLD), _record("128x128x64x1", "K2", NEW, toolchain_key="other")])
    assert export_records(tmp_path / "r.json", source) == 2
    target = TuningRecords(tmp_path / "b.sqlite")
    assert import_records(tmp_path / "r.json", target) == MergeCounts(added=2, replaced=0, kept=0)
    assert sorted(target.all(), key=lambda r: r.shape) == sorted(source.all(), key=lambda r: r.shape)
    # The toolchain travels with each record (what it was measured with and the key it matches).
    got = {r.shape: r for r in target.all()}
    assert got["128x128x64x1"].toolchain_key == "other"
    assert got["64x64x64x1"].toolchain == {"torch": "2.13.0", "nvidia-cutlass-dsl": "4.8.1"}


def test_import_keeps_a_newer_local_record_and_replaces_an_older_one(tmp_path):
    exported = TuningRecords(tmp_path / "a.sqlite")
    exported.merge([_record("s1", "remote-new", NEW), _record("s2", "remote-old", OLD), _record("s3", "remote", OLD),
                    _record("s4", "remote-same-time", OLD)])
    export_records(tmp_path / "r.json", exported)
    local = TuningRecords(tmp_path / "b.sqlite")
    local.merge([_record("s1", "local-old", OLD), _record("s2", "local-new", NEW), _record("s4", "local", OLD)])
    counts = import_records(tmp_path / "r.json", local)
    assert counts == MergeCounts(added=1, replaced=1, kept=2)
    winners = {r.shape: r.kernel_name for r in local.all()}
    assert winners == {"s1": "remote-new", "s2": "local-new", "s3": "remote", "s4": "local"}


def test_records_of_another_toolchain_are_separate_keys(tmp_path):
    local = TuningRecords(tmp_path / "b.sqlite", toolchain_key="mine")
    local.record("NVIDIA H200", 90, "GemmSignature(...)", "s1", "mine-kernel", 0.1, {}, {})
    path = tmp_path / "r.json"
    export_records(path, TuningRecords(tmp_path / "empty.sqlite"))
    doc = json.loads(path.read_text())
    doc["records"].append(json.loads(json.dumps(_record("s1", "theirs", NEW, toolchain_key="theirs").__dict__)))
    path.write_text(json.dumps(doc))
    assert import_records(path, local) == MergeCounts(1, 0, 0)
    assert local.lookup("NVIDIA H200", 90, "GemmSignature(...)", "s1").kernel_name == "mine-kernel"


@pytest.mark.parametrize("mutate, message", [
    (lambda d: "not json{", "not valid JSON"),
    (lambda d: [], "not a kernel_api tuning-records file"),
    (lambda d: {**d, "version": 99}, "format version 99 is not supported"),
    (lambda d: {**d, "records": {}}, '"records" must be a list'),
    (lambda d: {**d, "records": [3]}, "record 0 must be an object"),
    (lambda d: {**d, "records": [{k: v for k, v in d["records"][0].items() if k != "cc"}]}, "record 0 has no field 'cc'"),
    (lambda d: {**d, "records": [{**d["records"][0], "cc": "ninety"}]}, "record 0: field 'cc' must be an integer"),
    (lambda d: {**d, "records": [{**d["records"][0], "median_ms": -1}]}, "field 'median_ms' must be a finite time"),
    (lambda d: {**d, "records": [{**d["records"][0], "created": "yesterday"}]}, "field 'created' must be an ISO"),
    (lambda d: {**d, "records": [{**d["records"][0], "color": 1}]}, "unknown field(s) 'color'"),
])
def test_a_malformed_file_names_the_problem_and_merges_nothing(tmp_path, mutate, message):
    source = TuningRecords(tmp_path / "a.sqlite")
    source.merge([_record("s1", "K", OLD)])
    path = tmp_path / "r.json"
    export_records(path, source)
    bad = mutate(json.loads(path.read_text()))
    path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    target = TuningRecords(tmp_path / "b.sqlite")
    with pytest.raises(RecordsFileError, match="r.json") as caught:
        import_records(path, target)
    assert message in str(caught.value)
    assert target.all() == []


def test_cli_export_and_import(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path / "a"))
    TuningRecords().merge([_record("s1", "K1", OLD), _record("s2", "K2", NEW)])
    assert main(["records", "export", str(tmp_path / "r.json")]) == 0
    assert "exported 2 tuning record(s)" in capsys.readouterr().out
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path / "b"))
    TuningRecords().merge([_record("s2", "local", NEW)])
    assert main(["records", "import", str(tmp_path / "r.json")]) == 0
    assert "1 added, 0 replaced, 1 kept" in capsys.readouterr().out
    assert {r.shape: r.kernel_name for r in TuningRecords().all()} == {"s1": "K1", "s2": "local"}


def test_cli_import_of_a_bad_file_is_one_line(tmp_path, capsys):
    (tmp_path / "r.json").write_text('{"format": "kernel_api.tuning_records", "version": 1, "records": [1]}')
    assert main(["records", "import", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "record 0 must be an object" in err and "Traceback" not in err
    assert main(["records", "import", str(tmp_path / "missing.json")]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_export_writes_atomically(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    path.write_text("previous")
    monkeypatch.setattr(json, "dump", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        export_records(path, TuningRecords(tmp_path / "a.sqlite"))
    assert path.read_text() == "previous"
    assert [p for p in os.listdir(tmp_path) if p.endswith(".part")] == []


def test_toolchain_versions_are_read_once_and_handed_out_as_new_dicts():
    from kernel_api.tuning import records

    first = records.toolchain_versions()
    first["torch"] = "changed by a caller"
    assert records.toolchain_versions()["torch"] != "changed by a caller"
    assert records._toolchain_versions.cache_info().currsize == 1
