"""The command line under trouble: `cache clear` in a shared folder, precompiling into a folder
that keeps nothing, and system errors (missing folders, failing disks, a closed pipe) reported
in one line instead of a traceback."""

import errno
import io
import json
import os
import sqlite3
import subprocess
import sys

import pytest

from kernel_api.cli import commands
from kernel_api.cli.commands import main
from kernel_api.core.cache import DiskCache
from kernel_api.tuning.records import TuningRecords


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kernel-api: error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


# --- cache clear and cache info in a shared folder --------------------------------------------

def _shared_cache(root):
    """``~/.cache`` as kernel_api shares it: pip's and Hugging Face's caches beside its own."""
    (root / "pip" / "http").mkdir(parents=True)
    (root / "pip" / "http" / "blob").write_text("pip")
    (root / "huggingface" / "hub").mkdir(parents=True)
    (root / "huggingface" / "hub" / "model.bin").write_text("weights")
    (root / "cubin").mkdir()
    (root / "cubin" / "notes.txt").write_text("someone else's file in a folder named like ours")
    (root / "tuning.sqlite.notes").write_text("a file named like the records, but not theirs")
    DiskCache("cutedsl", root).put("k1", b"x" * 100)
    DiskCache("cubin", root).put("k2", b"y" * 100)
    (root / "cutedsl" / ".k3.bin.abc.part").write_text("staged")
    records = TuningRecords(root / "tuning.sqlite")
    records.record("dev", 90, "op", "s", "winner", 1.0, {}, {})
    records.close()
    (root / "bundles").mkdir()
    (root / "bundles" / "20260101T000000Z-abc.json").write_text(json.dumps({"entries": ["cutedsl/k1.bin"]}))


def _tree(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


def test_cache_clear_deletes_only_what_kernel_api_wrote(tmp_path, monkeypatch, capsys):
    root = tmp_path / ".cache"
    _shared_cache(root)
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(root))
    assert main(["cache", "clear", "--yes"]) == 0
    assert f"cleared {root}" in capsys.readouterr().out
    assert _tree(root) == ["cubin/notes.txt", "huggingface/hub/model.bin", "pip/http/blob", "tuning.sqlite.notes"]


def test_cache_info_lists_only_its_own_sections(tmp_path, monkeypatch, capsys):
    root = tmp_path / ".cache"
    _shared_cache(root)
    (root / "pip" / "entry.bin").write_text("a .bin file of pip's")
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(root))
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "cutedsl: 1 entries" in out and "cubin: 1 entries" in out
    assert "pip" not in out and "huggingface" not in out and "  bundles: " not in out


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_cache_clear_asks_on_a_terminal(tmp_path, monkeypatch, capsys):
    root = tmp_path / ".cache"
    _shared_cache(root)
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(root))
    before = _tree(root)
    monkeypatch.setattr(sys, "stdin", _Terminal("n\n"))
    assert main(["cache", "clear"]) == 1
    out = capsys.readouterr().out
    assert f"in {root}? [y/N]" in out and "cutedsl: 2 file(s)" in out and "nothing deleted" in out
    assert _tree(root) == before
    monkeypatch.setattr(sys, "stdin", _Terminal("y\n"))
    assert main(["cache", "clear"]) == 0
    assert _tree(root) == ["cubin/notes.txt", "huggingface/hub/model.bin", "pip/http/blob", "tuning.sqlite.notes"]


def test_cache_clear_without_a_terminal_needs_yes(tmp_path, monkeypatch, capsys):
    root = tmp_path / ".cache"
    _shared_cache(root)
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(root))
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # piped input is not a confirmation
    before = _tree(root)
    assert main(["cache", "clear"]) == 2
    line = _one_line_error(capsys)
    assert "no terminal to confirm on, add --yes" in line and str(root) in line
    assert _tree(root) == before


@pytest.mark.parametrize("action", [["clear", "--yes"], ["info"]])
def test_a_cache_folder_that_is_a_file_is_one_line(tmp_path, monkeypatch, capsys, action):
    root = tmp_path / "cache"
    root.write_text("not a folder")
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(root))
    assert main(["cache", *action]) == 1
    line = _one_line_error(capsys)
    assert str(root) in line and "the cache folder is a file, not a folder" in line
    assert root.read_text() == "not a folder"


# --- precompile into a cache that keeps nothing -----------------------------------------------

SOFTMAX = [{"op": "softmax", "rows": 64, "cols": 1000, "dtype": "bf16"}]


@pytest.mark.parametrize("env, message", [
    ({"KERNEL_API_CACHE_DIR": "/proc/x"}, "cache folder /proc/x is not writable"),
    ({"KERNEL_API_CACHE": "0"}, "the disk cache is off (KERNEL_API_CACHE=0)"),
])
def test_precompile_into_a_cache_that_keeps_nothing_fails(tmp_path, monkeypatch, capsys, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps(SOFTMAX))
    assert main(["precompile", "--shapes", str(shapes), "--cc", "90", "--provider", "cuda_src"]) == 1
    line = _one_line_error(capsys)
    assert message in line and "would not be saved" in line


@pytest.mark.parametrize("folder", ["", "cubin"], ids=["cache folder", "namespace folder"])
def test_precompile_into_an_untrusted_folder_fails_before_compiling(tmp_path, monkeypatch, capsys, folder):
    """Entries in a folder others can write are never loaded, so compiling into it is refused up
    front, naming the folder and why (the same check the loaders use)."""
    root = tmp_path / "cache"
    (root / folder).mkdir(parents=True, exist_ok=True)
    os.chmod(root / folder, 0o777)
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(root))
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps(SOFTMAX))
    assert main(["precompile", "--shapes", str(shapes), "--cc", "90", "--provider", "cuda_src"]) == 1
    line = _one_line_error(capsys)
    assert f"{root / folder if folder else root} is writable by others (mode 0o777)" in line
    assert "precompiled kernels would never be loaded from it" in line
    assert list(root.rglob("*.bin")) == []


def test_precompile_says_which_entries_were_already_cached(tmp_path, monkeypatch, capsys):
    from kernel_api import nvrtc

    nvrtc.clear_memory_cache()  # as in a new process: no cubin compiled by an earlier test
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path / "cache"))
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps(SOFTMAX))
    command = ["precompile", "--shapes", str(shapes), "--cc", "90", "--provider", "cuda_src"]
    assert main(command) == 0
    assert "1 compiled, 0 already cached" in capsys.readouterr().out
    entries = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*.bin")}
    assert len(entries) == 1
    assert main(command) == 0
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*.bin")} == entries
    out = capsys.readouterr().out
    assert "already cached" in out.splitlines()[0] and out.startswith("entry 0: ")
    assert "0 compiled, 1 already cached" in out


# --- one-line errors --------------------------------------------------------------------------

def test_exporting_into_a_missing_folder_names_the_folder(tmp_path, capsys):
    target = tmp_path / "missing" / "r.json"
    assert main(["records", "export", str(target)]) == 1
    line = _one_line_error(capsys)
    assert line == f"kernel-api: error: {target}: the destination folder {tmp_path / 'missing'} does not exist"


def test_a_bundle_into_a_missing_folder_names_the_folder(tmp_path, capsys):
    target = tmp_path / "missing" / "b.tar"
    assert main(["bundle", "create", str(target)]) == 1
    line = _one_line_error(capsys)
    assert ".part" not in line and f"the destination folder {tmp_path / 'missing'} does not exist" in line


def test_a_disk_error_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    def failing_dump(*args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(json, "dump", failing_dump)
    target = tmp_path / "r.json"
    assert main(["records", "export", str(target)]) == 1
    assert _one_line_error(capsys) == f"kernel-api: error: {target}: {os.strerror(errno.EIO)}"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("error, status, text", [
    (OverflowError("int too large to convert"), 2, "a number too large to handle (int too large to convert)"),
    (RecursionError("maximum recursion depth exceeded"), 2, "input nested too deeply to process"),
    (OSError(errno.EIO, "Input/output error", "/data/x"), 1, "/data/x: Input/output error"),
    (OSError(errno.ENOSPC, "No space left on device"), 1, "No space left on device"),
    (PermissionError(errno.EACCES, "Permission denied", "/a", None, "/b"), 1, "/a -> /b: Permission denied"),
    (sqlite3.OperationalError("disk I/O error"), 1, "tuning.sqlite: disk I/O error"),
])
def test_system_errors_are_one_line_by_type(monkeypatch, capsys, error, status, text):
    def command(ns):
        raise error

    monkeypatch.setitem(commands.COMMANDS, "env", command)
    assert main(["env"]) == status
    assert text in _one_line_error(capsys)


def test_a_closed_stdout_exits_quietly_in_process(monkeypatch, capsys):
    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["env"]) == 1
    assert capsys.readouterr().err == ""


def test_explain_all_into_a_closed_pipe_exits_quietly(tmp_path):
    """``kernel-api explain ... --all | head``: the reader is gone before the output is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "kernel_api", "explain", "gemm", "--m", "64", "--n", "64",
                               "--k", "64", "--all"], stdout=write_end, stderr=subprocess.PIPE, text=True,
                              timeout=300)
    finally:
        os.close(write_end)
    assert done.stderr == "" and done.returncode == 1
