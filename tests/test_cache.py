"""kernel_api.core.cache: hits, misses, corruption, disabling, unwritable folders, concurrent writers."""

import multiprocessing as mp
import os

import pytest

from kernel_api.core import cache as kcache
from kernel_api.core.cache import DiskCache, decode_entry, encode_entry, make_key


def test_put_get_roundtrip_and_miss(tmp_path):
    c = DiskCache("unit", tmp_path)
    key = make_key("a", 1, b"\x00")
    assert c.get(key) is None
    assert c.put(key, b"payload")
    assert c.get(key) == b"payload"
    assert c.stats["hits"] == 1 and c.stats["misses"] == 1 and c.stats["writes"] == 1
    assert c.path(key).parent == tmp_path / "unit"
    # no temp files are left behind
    assert [p.name for p in (tmp_path / "unit").iterdir()] == [c.path(key).name]


def test_keys_differ_by_every_part():
    assert make_key("src", "sm_90a") != make_key("src", "sm_100a")
    assert make_key("ab", "c") != make_key("a", "bc")  # parts are length-prefixed
    assert make_key(b"x") == make_key(b"x")


def test_directory_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path / "here"))
    c = DiskCache("ns")
    c.put("k", b"1")
    assert (tmp_path / "here" / "ns" / "k.bin").exists()


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_corrupt_entry_is_detected_removed_and_rebuilt(tmp_path, damage):
    c = DiskCache("unit", tmp_path)
    c.put("k", b"0123456789" * 100)
    path = c.path("k")
    blob = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(blob[:-7])
    elif damage == "flip":
        path.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        path.write_bytes(os.urandom(len(blob)))
    assert c.get("k") is None
    assert c.stats["corrupt"] == 1
    assert not path.exists()
    c.put("k", b"rebuilt")
    assert c.get("k") == b"rebuilt"


def test_entry_format_checks_length_and_digest():
    blob = encode_entry(b"abc")
    assert decode_entry(blob) == b"abc"
    assert decode_entry(blob + b"x") is None
    assert decode_entry(blob[:10]) is None


def test_disabled_by_environment(monkeypatch, tmp_path):
    c = DiskCache("unit", tmp_path)
    monkeypatch.setenv("KERNEL_API_CACHE", "0")
    assert c.put("k", b"v") is False
    assert c.get("k") is None
    assert not (tmp_path / "unit").exists()
    monkeypatch.setenv("KERNEL_API_CACHE", "1")
    c.put("k", b"v")
    assert c.get("k") == b"v"


def test_unwritable_directory_falls_back_to_memory_with_a_warning(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    c = DiskCache("unit", blocker / "sub")  # mkdir fails even as root
    with pytest.warns(RuntimeWarning, match="not writable"):
        assert c.put("k", b"kept") is False
    assert c.get("k") == b"kept"


def test_unsafe_keys_are_hashed(tmp_path):
    c = DiskCache("unit", tmp_path)
    c.put("../../etc/x y", b"1")
    assert c.get("../../etc/x y") == b"1"
    assert c.path("../../etc/x y").parent == tmp_path / "unit"


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        DiskCache("a/b", tmp_path)
    with pytest.raises(TypeError):
        DiskCache("unit", tmp_path).put("k", "text")


def _writer(args):
    folder, worker, rounds = args
    c = DiskCache("race", folder)
    seen = 0
    for i in range(rounds):
        payload = bytes([worker]) * (1000 + 37 * worker + i)
        c.put("shared", payload)
        got = c.get("shared")
        # Whatever is read is some writer's complete payload, never a torn one.
        assert got is not None and len(set(got)) == 1 and len(got) >= 1000
        seen += 1
    return seen, c.stats["corrupt"]


def test_concurrent_processes_never_see_partial_entries(tmp_path):
    ctx = mp.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.map(_writer, [(str(tmp_path), w, 60) for w in range(4)])
    assert sum(r[0] for r in results) == 240
    assert all(r[1] == 0 for r in results)
    assert not [p for p in (tmp_path / "race").iterdir() if p.name.startswith(".tmp-")]


def test_default_dir_is_platform_user_cache(monkeypatch):
    monkeypatch.delenv("KERNEL_API_CACHE_DIR", raising=False)
    assert "kernel_api" in str(kcache.cache_dir())


def test_default_dir_follows_xdg_cache_home_changes(monkeypatch, tmp_path):
    """The platform folder is looked up once per environment value, not once per process."""
    monkeypatch.delenv("KERNEL_API_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a"))
    assert kcache.cache_dir() == tmp_path / "a" / "kernel_api"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert kcache.cache_dir() == tmp_path / "b" / "kernel_api"
