"""The cache folder holds executable code, so entries load only from folders and files that only
this user can write: a folder or entry others can write, or another user owns, is a miss, with
one logged warning; the rebuilt entry is kept in memory. (These tests run as root: ``os.chown``
to another uid stands for "owned by another user".)"""

import logging
import os

import pytest

from kernel_api.core import cache as kcache
from kernel_api.core import trust
from kernel_api.core.cache import DiskCache

OTHER_UID = 54321  # no such user here: "another user"
LOGGER = "kernel_api.core.cache"


@pytest.fixture
def planted(tmp_path):
    """A cache folder with one valid entry, as another process would have written it."""
    root = tmp_path / "cache"
    DiskCache("cutedsl", root).put("k", b"compiled code")
    return root, root / "cutedsl", DiskCache("cutedsl", root).path("k")


def _load(root, caplog):
    """A fresh DiskCache's read of "k" (no memory of earlier writes), and the warnings logged."""
    kcache._memory.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cache = DiskCache("cutedsl", root)
        data = cache.get("k")
    return data, cache, [r for r in caplog.records if r.levelno == logging.WARNING]


def _setup(kind, root, folder, entry):
    if kind == "root writable by others":
        os.chmod(root, 0o777)
    elif kind == "folder writable by others":
        os.chmod(folder, 0o777)
    elif kind == "folder writable by a shared group":
        os.chown(folder, -1, OTHER_UID)  # a group of no one in particular: not the owner's private group
        os.chmod(folder, 0o775)
    elif kind == "root owned by another user":
        os.chown(root, OTHER_UID, -1)
    elif kind == "folder owned by another user":
        os.chown(folder, OTHER_UID, -1)
    elif kind == "entry writable by others":
        os.chmod(entry, 0o666)
    elif kind == "entry owned by another user":
        os.chown(entry, OTHER_UID, -1)


FOLDER_CASES = ["root writable by others", "folder writable by others", "folder writable by a shared group",
                "root owned by another user", "folder owned by another user"]
ENTRY_CASES = ["entry writable by others", "entry owned by another user"]


@pytest.mark.parametrize("kind", FOLDER_CASES + ENTRY_CASES)
def test_an_untrusted_folder_or_entry_is_not_loaded(planted, caplog, capsys, kind):
    root, folder, entry = planted
    assert _load(root, caplog)[0] == b"compiled code"  # trusted as written
    _setup(kind, root, folder, entry)
    data, cache, warned = _load(root, caplog)
    assert data is None and cache.stats["untrusted"] == 1
    assert len(warned) == 1
    message = warned[0].getMessage()
    assert "not loading compiled artifacts" in message and "compiling in memory instead" in message
    expected = "is owned by uid 54321" if "owned" in kind else "is writable by"
    assert expected in message and str(entry if "entry" in kind else root if "root" in kind else folder) in message
    # Warned once: the next miss is silent.
    assert _load(root, caplog)[2] == []
    assert capsys.readouterr() == ("", "")  # logging only, never print


@pytest.mark.parametrize("kind", FOLDER_CASES)
def test_in_an_untrusted_folder_the_rebuilt_entry_stays_in_memory(planted, caplog, kind):
    root, folder, entry = planted
    before = entry.read_bytes()
    _setup(kind, root, folder, entry)
    data, cache, _ = _load(root, caplog)
    assert data is None
    assert cache.put("k", b"rebuilt here") is False  # not written where another user could replace it
    assert cache.get("k") == b"rebuilt here"
    assert entry.read_bytes() == before


@pytest.mark.parametrize("kind", ENTRY_CASES)
def test_an_untrusted_entry_in_a_trusted_folder_is_replaced_by_the_rebuild(planted, caplog, kind):
    root, folder, entry = planted
    _setup(kind, root, folder, entry)
    data, cache, _ = _load(root, caplog)
    assert data is None
    assert cache.put("k", b"rebuilt here") is True
    assert trust.stat_problem(os.stat(entry)) is None
    assert _load(root, caplog)[0] == b"rebuilt here"


def test_a_sticky_folder_others_can_write_is_trusted_for_our_own_entries(planted, caplog):
    root, folder, entry = planted
    os.chmod(root, 0o1777)  # as /tmp: others may add files but not replace ours
    os.chmod(folder, 0o1777)
    assert _load(root, caplog)[0] == b"compiled code"
    os.chown(entry, OTHER_UID, -1)  # what another user adds there is theirs: refused
    assert _load(root, caplog)[0] is None


def test_a_group_writable_folder_of_a_private_group_is_trusted(planted, caplog, monkeypatch):
    root, folder, _ = planted
    os.chmod(folder, 0o775)  # umask 002 under a user-private group
    monkeypatch.setattr(trust, "_private_group", lambda gid, owner: True)
    assert _load(root, caplog)[0] == b"compiled code"
    monkeypatch.setattr(trust, "_private_group", lambda gid, owner: False)
    assert _load(root, caplog)[0] is None


def test_the_nvrtc_loader_goes_through_the_check(tmp_path, monkeypatch, caplog):
    """NVRTC's cubins are read through `DiskCache.get`: a cubin in a folder others can write is
    not loaded; it is compiled again."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from kernel_api.nvrtc import compile_cuda, compiler

    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path / "cache"))
    source = 'extern "C" __global__ void one(float* y) { y[threadIdx.x] = 1.f; }'
    compiler.clear_memory_cache()
    first = compile_cuda(source, cc=90, name_expressions=["one"])
    compiler.clear_memory_cache()
    assert compile_cuda(source, cc=90, name_expressions=["one"]).cache_hit
    os.chmod(tmp_path / "cache", 0o777)
    compiler.clear_memory_cache()
    kcache._memory.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        again = compile_cuda(source, cc=90, name_expressions=["one"])
    compiler.clear_memory_cache()
    assert not again.cache_hit and again.cubin == first.cubin
    assert any("is writable by others (mode 0o777)" in r.getMessage() for r in caplog.records)


def test_the_cutedsl_loader_reads_through_the_disk_cache():
    """The CuTe DSL provider's artifacts are a `DiskCache`: every load passes `DiskCache.get`."""
    pytest.importorskip("cutlass")
    from kernel_api.providers.cutedsl import kernel

    assert isinstance(kernel._artifacts, DiskCache)


def test_stat_problem_rules():
    uid = os.geteuid()

    class St:
        def __init__(self, mode, owner=uid, gid=OTHER_UID):
            self.st_mode, self.st_uid, self.st_gid = mode, owner, gid
    assert trust.stat_problem(St(0o100600)) is None
    assert trust.stat_problem(St(0o100600, owner=0), uid=1000) is None  # root's files: root can do anything
    assert "owned by uid 1000" in trust.stat_problem(St(0o100600, owner=1000), uid=2000)
    assert "writable by others (mode 0o602)" in trust.stat_problem(St(0o100602))
    assert "writable by its group" in trust.stat_problem(St(0o100620))
    assert trust.stat_problem(St(0o041777)) is None  # a sticky folder
    assert "writable by others" in trust.stat_problem(St(0o040777))


def test_cache_info_reports_each_untrusted_namespace_folder_in_one_line(planted, tmp_path, monkeypatch, capsys):
    """A namespace folder that fails the rule is named with its reason, one line each, though the
    cache folder above it passes; so is an entry that fails it."""
    from kernel_api.cli.commands import main

    root, folder, entry = planted
    DiskCache("cubin", root).put("k", b"cubin")
    DiskCache("cutedsl-compiles", root).put("k", b"names an artifact")
    os.chmod(folder, 0o777)
    os.chown(root / "cubin", OTHER_UID, -1)
    os.chown(DiskCache("cutedsl-compiles", root).path("k"), OTHER_UID, -1)
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(root))
    assert main(["cache", "info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    refused = [line for line in lines if "NOT LOADED" in line]
    assert refused == [
        f"  NOT LOADED: cubin: {root / 'cubin'} is owned by uid {OTHER_UID}, not by this user (uid {os.geteuid()}); "
        f"its entries are compiled in memory instead (docs/security.md)",
        f"  NOT LOADED: cutedsl: {folder} is writable by others (mode 0o777); "
        f"its entries are compiled in memory instead (docs/security.md)"]
    assert "  cutedsl-compiles: 1 entries, 0.0 MB (1 fail the permission rule, not loaded)" in lines
    assert "  cutedsl: 1 entries, 0.0 MB" in lines  # the folder is refused above; its entry itself passes
