"""Tuning records under trouble: a read-only cache, records dated in the future, damaged rows,
a locked database, and record files with values too large or nested too deeply."""

import datetime as dt
import gc
import json
import logging
import os
import sqlite3
import subprocess

import pytest

from kernel_api.cli.commands import main
from kernel_api.tuning import records as records_module
from kernel_api.tuning.records import (RecordsNotWritableError, TuningRecord, TuningRecords, import_records,
                                       records_to_json)

KEY = "kernel_api 1; dsl 4.8.1 cu12"


def _record(shape="s", kernel="K", created="2026-01-01T00:00:00+00:00", cc=90, median_ms=0.5,
            toolchain_key=KEY) -> TuningRecord:
    return TuningRecord("NVIDIA H200", cc, "GemmSignature(...)", shape, kernel, median_ms, {"other": 0.7},
                        {"torch": "2.13.0"}, created, toolchain_key)


def _write(path, *items) -> None:
    path.write_text(json.dumps(records_to_json(items)))


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kernel-api: error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


# --- a read-only cache ------------------------------------------------------------------------

def _stored(folder) -> TuningRecords:
    """A closed database in ``folder`` holding one record of this toolchain, as an image build leaves it."""
    folder.mkdir(parents=True, exist_ok=True)
    store = TuningRecords(folder / "tuning.sqlite")
    store.record("NVIDIA H200", 90, "op", "s", "baked-winner", 1.0, {}, {})
    store.close()
    assert not (folder / "tuning.sqlite-wal").exists()  # the last connection checkpointed and removed it
    return store


def _read_only(monkeypatch, folder) -> None:
    """Simulate a read-only mount of ``folder`` (root may write anywhere, so chmod cannot)."""
    real = records_module.writable
    monkeypatch.setattr(records_module, "writable",
                        lambda path: False if os.path.dirname(os.path.abspath(path)) == str(folder) else real(path))


def test_a_read_only_cache_serves_its_records_and_writes_nothing(tmp_path, monkeypatch):
    folder = tmp_path / "image-cache"
    _stored(folder)
    _read_only(monkeypatch, folder)
    before = (folder / "tuning.sqlite").read_bytes()
    store = TuningRecords(folder / "tuning.sqlite")
    found = store.lookup("NVIDIA H200", 90, "op", "s")
    assert found is not None and found.kernel_name == "baked-winner"
    assert store.why_not_saved == "its folder is read-only"
    with pytest.warns(RuntimeWarning, match="could not save the tuning record"):
        store.record("NVIDIA H200", 90, "op", "t", "new", 1.0, {}, {})
    assert store.lookup("NVIDIA H200", 90, "op", "t").kernel_name == "new"  # kept for this process
    # A merge (the end of `tune --shapes`) keeps its winners in the process, and writes nothing.
    with pytest.warns(RuntimeWarning, match="cannot save 1 tuning record"):
        counts = store.merge([_record("u", toolchain_key=store.toolchain_key)])
    assert counts.added == 1 and store.lookup("NVIDIA H200", 90, "GemmSignature(...)", "u") is not None
    store.close()
    assert (folder / "tuning.sqlite").read_bytes() == before
    assert not (folder / "tuning.sqlite-wal").exists() or (folder / "tuning.sqlite-wal").stat().st_size == 0


def test_importing_into_a_read_only_cache_fails_in_one_line(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "image-cache"
    _stored(folder)
    _read_only(monkeypatch, folder)
    _write(tmp_path / "r.json", _record())
    with pytest.raises(RecordsNotWritableError, match=r"\(its folder is read-only\); nothing was imported"):
        import_records(tmp_path / "r.json", TuningRecords(folder / "tuning.sqlite"))
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(folder))
    assert main(["records", "import", str(tmp_path / "r.json")]) == 1
    line = _one_line_error(capsys)
    assert str(folder / "tuning.sqlite") in line and "nothing was imported" in line
    assert [r.shape for r in TuningRecords(folder / "tuning.sqlite").all()] == ["s"]  # the baked record only


def test_a_read_only_cache_without_records_keeps_them_in_memory(tmp_path, monkeypatch, capsys):
    """No database and a folder that cannot take one: records live in the process; an import fails."""
    folder = tmp_path / "not-a-folder"
    folder.write_text("a file")
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(folder / "cache"))
    _write(tmp_path / "r.json", _record())
    with pytest.warns(RuntimeWarning, match="keeping them in memory"):
        assert main(["records", "import", str(tmp_path / "r.json")]) == 1
    assert "nothing was imported" in _one_line_error(capsys)


def _mount_read_only(source, target) -> bool:
    for command in (["mount", "--bind", str(source), str(target)],
                    ["mount", "-o", "remount,bind,ro", str(target)]):
        try:
            done = subprocess.run(command, capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return False
        if done.returncode != 0:
            if command[1] != "--bind":
                subprocess.run(["umount", str(target)], capture_output=True, timeout=30)
            return False
    return True


def test_a_read_only_bind_mount_serves_its_records(tmp_path, monkeypatch, capsys):
    """The real thing where this machine allows it (root, mount permitted)."""
    source, target = tmp_path / "built", tmp_path / "mounted"
    _stored(source)
    target.mkdir()
    if os.geteuid() != 0 or not _mount_read_only(source, target):
        pytest.skip("cannot make a read-only bind mount here")
    try:
        assert not records_module.writable(target / "tuning.sqlite")
        store = TuningRecords(target / "tuning.sqlite")
        assert store.lookup("NVIDIA H200", 90, "op", "s").kernel_name == "baked-winner"
        store.close()
        _write(tmp_path / "r.json", _record())
        monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(target))
        assert main(["records", "import", str(tmp_path / "r.json")]) == 1
        assert "nothing was imported" in _one_line_error(capsys)
    finally:
        gc.collect()  # close the connections of stores no longer referenced, so the mount is not busy
        if subprocess.run(["umount", str(target)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30)


# --- records dated in the future --------------------------------------------------------------

def test_a_record_from_the_future_is_dated_at_its_import(tmp_path, caplog):
    store = TuningRecords(tmp_path / "t.sqlite", toolchain_key=KEY)
    _write(tmp_path / "r.json", _record(kernel="from-9999", created="9999-12-31T23:59:59+00:00"))
    start = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    with caplog.at_level(logging.WARNING, logger="kernel_api.tuning.records"):
        assert import_records(tmp_path / "r.json", store).added == 1
    assert "in the future" in caplog.text
    (stored,) = store.all()
    created = dt.datetime.fromisoformat(stored.created)
    assert start <= created <= dt.datetime.now(dt.timezone.utc)


def test_a_stored_record_from_the_future_loses_to_any_import(tmp_path):
    """A record an older kernel_api stored with its future date does not win forever."""
    path = tmp_path / "t.sqlite"
    store = TuningRecords(path, toolchain_key=KEY)
    store.merge([_record(kernel="stored")])
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE tuning_records SET created='9999-01-01T00:00:00+00:00'")
    conn.close()
    counts = store.merge([_record(kernel="measured-yesterday",
                                  created=(dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=1)).isoformat())])
    assert counts.replaced == 1 and store.all()[0].kernel_name == "measured-yesterday"


# --- damaged rows -----------------------------------------------------------------------------

@pytest.mark.parametrize("column, value", [("runners_up", "{not json"), ("toolchain", "[1, 2"),
                                           ("runners_up", "[]")])
def test_a_damaged_row_counts_as_missing_with_a_warning(tmp_path, caplog, column, value):
    path = tmp_path / "t.sqlite"
    store = TuningRecords(path, toolchain_key=KEY)
    store.merge([_record("damaged"), _record("intact")])
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(f"UPDATE tuning_records SET {column}=? WHERE shape='damaged'", (value,))
    conn.close()
    with caplog.at_level(logging.WARNING, logger="kernel_api.tuning.records"):
        assert store.lookup("NVIDIA H200", 90, "GemmSignature(...)", "damaged") is None
        assert [r.shape for r in store.all()] == ["intact"]
    assert "damaged" in caplog.text and "counts as missing" in caplog.text
    assert store.lookup("NVIDIA H200", 90, "GemmSignature(...)", "intact").kernel_name == "K"
    # A new measurement replaces the damaged row.
    store.merge([_record("damaged", kernel="remeasured", created="2026-02-01T00:00:00+00:00")])
    assert store.lookup("NVIDIA H200", 90, "GemmSignature(...)", "damaged").kernel_name == "remeasured"


# --- a locked database ------------------------------------------------------------------------

def test_an_import_into_a_locked_database_is_one_line_after_the_configured_timeout(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KERNEL_API_RECORDS_TIMEOUT", "0.2")
    TuningRecords().merge([_record("warm-up")])
    _write(tmp_path / "r.json", _record())
    holder = sqlite3.connect(tmp_path / "cache" / "tuning.sqlite", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process in the middle of a long write
    try:
        assert main(["records", "import", str(tmp_path / "r.json")]) == 1
    finally:
        holder.rollback()
        holder.close()
    line = _one_line_error(capsys)
    assert "locked by another process" in line and "0.2 s" in line and "tuning.sqlite" in line


def test_the_records_timeout_is_checked(monkeypatch):
    monkeypatch.setenv("KERNEL_API_RECORDS_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="KERNEL_API_RECORDS_TIMEOUT: expected seconds >= 0, got 'soon'"):
        TuningRecords()
    monkeypatch.setenv("KERNEL_API_RECORDS_TIMEOUT", "2.5")
    assert TuningRecords().timeout == 2.5


# --- values too large or nested too deeply ----------------------------------------------------

@pytest.mark.parametrize("field, value, message", [
    ("cc", 2 ** 70, "field 'cc' must be a compute capability such as 90, got 1180591620717411303424"),
    ("cc", 10 ** 400, "field 'cc' must be a compute capability such as 90, got an integer of 1329 bits"),
    ("median_ms", 10 ** 400, "field 'median_ms' must be a finite time >= 0, got an integer of 1329 bits"),
    ("runners_up", {"other": 10 ** 400}, "field 'runners_up' must hold kernel names mapped to times in ms"),
    ("runners_up", {"other": [[[]]]}, "field 'runners_up' must hold kernel names mapped to times in ms"),
    ("toolchain", {"torch": {"a": 1}}, "field 'toolchain' must hold names mapped to version strings"),
], ids=["cc-2**70", "cc-10**400", "median-10**400", "runner-10**400", "runner-nested", "toolchain-object"])
def test_record_values_out_of_range_are_one_line(tmp_path, capsys, field, value, message):
    item = dict(records_to_json([_record()])["records"][0], **{field: value})
    (tmp_path / "r.json").write_text(json.dumps({"format": "kernel_api.tuning_records", "version": 1,
                                                 "records": [item]}))
    assert main(["records", "import", str(tmp_path / "r.json")]) == 2
    assert f"record 0: {message}" in _one_line_error(capsys)
    assert TuningRecords().all() == []


def test_a_deeply_nested_records_file_is_one_line(tmp_path, capsys):
    (tmp_path / "r.json").write_text("[" * 200_000 + "]" * 200_000)
    assert main(["records", "import", str(tmp_path / "r.json")]) == 2
    assert "nested too deeply to read" in _one_line_error(capsys)


def test_unwritable_databases_are_told_by_sqlite_error_code_not_message():
    """SQLITE_READONLY and SQLITE_CANTOPEN send the records to memory whatever the message says;
    a busy database is not one of them."""
    import sqlite3

    from kernel_api.tuning import records as records_module

    def error(code: int, message: str) -> sqlite3.OperationalError:
        exc = sqlite3.OperationalError(message)
        exc.sqlite_errorcode = code
        return exc

    assert records_module._is_unwritable(error(8, "attempt to write a readonly database"))
    assert records_module._is_unwritable(error(8 | (1 << 8), "extended readonly code, other words"))
    assert records_module._is_unwritable(error(14, "cannot open"))
    assert not records_module._is_unwritable(error(5, "database is locked (readonly mentioned)"))
