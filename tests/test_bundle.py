"""Bundles carry compiled kernels and tuning records to another machine: integrity and toolchain
checks, atomic cache writes, newer local records kept, and a warm compile after install."""

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

from kernel_api.cli.commands import main
from kernel_api.core.cache import DiskCache
from kernel_api.tuning.bundle import BundleError, create_bundle, install_bundle
from kernel_api.tuning.records import TuningRecord, TuningRecords

from test_precompile import _NEW_PROCESS, OURS, SHAPES, assert_warm

OLD, NEW = "2026-01-01T00:00:00+00:00", "2026-06-01T00:00:00+00:00"


def _record(shape, kernel, created):
    return TuningRecord("NVIDIA H200", 90, "GemmSignature(...)", shape, kernel, 0.5, {}, {"torch": "2.13"}, created,
                        "kernel_api 0.1.0; nvidia-cutlass-dsl 4.8.1 cu12")


@pytest.fixture
def source(tmp_path):
    """A source cache folder with two entries and two records, and its bundle."""
    root = tmp_path / "source"
    DiskCache("cutedsl", root).put("a" * 64, b"object file")
    DiskCache("cubin", root).put("b" * 64, b"cubin")
    TuningRecords(root / "tuning.sqlite").merge([_record("s1", "K1", NEW), _record("s2", "K2", OLD)])
    bundle = tmp_path / "b.tar"
    create_bundle(bundle, cache_root=root)
    return root, bundle


def _rewrite(bundle, change):
    """The bundle with ``change(name, data) -> (name, data) or None (dropped)`` applied per member."""
    with tarfile.open(bundle) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(bundle, "w") as tar:
        for name, data in members:
            changed = change(name, data)
            if changed is None:
                continue
            info = tarfile.TarInfo(changed[0])
            info.size = len(changed[1])
            tar.addfile(info, io.BytesIO(changed[1]))


def _cache_files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                  if not f.startswith("tuning.sqlite"))


def test_install_copies_the_entries_and_merges_the_records(source, tmp_path):
    root, bundle = source
    target = tmp_path / "target"
    TuningRecords(target / "tuning.sqlite").merge([_record("s2", "local-newer", NEW)])
    counts = install_bundle(bundle, cache_root=target, trusted=True)
    assert (counts.files_added, counts.files_present) == (2, 0)
    assert tuple(counts.records) == (1, 0, 1)
    assert DiskCache("cutedsl", target).get("a" * 64) == b"object file"
    assert DiskCache("cubin", target).get("b" * 64) == b"cubin"
    assert {r.shape: r.kernel_name for r in TuningRecords(target / "tuning.sqlite").all()} == \
        {"s1": "K1", "s2": "local-newer"}  # the newer local record is never overwritten
    again = install_bundle(bundle, cache_root=target, trusted=True)
    assert (again.files_added, again.files_present) == (0, 2)
    assert [f for f in _cache_files(target) if f.endswith(".part")] == []


def test_a_tampered_file_is_named_and_nothing_is_installed(source, tmp_path):
    _, bundle = source
    # The last entry is the damaged one: the one before it was staged already, and is withdrawn.
    _rewrite(bundle, lambda name, data: (name, data[:-1] + b"X") if name.startswith("cutedsl/") else (name, data))
    target = tmp_path / "target"
    with pytest.raises(BundleError, match=r"file 'cutedsl/a{64}\.bin' fails its SHA-256 check"):
        install_bundle(bundle, cache_root=target, trusted=True)
    assert (target / "cubin").is_dir()  # staged there, then removed
    assert _cache_files(target) == []  # no entry, and no half-written file
    assert not (target / "tuning.sqlite").exists() or TuningRecords(target / "tuning.sqlite").all() == []


def test_a_missing_or_an_unlisted_file_is_refused(source, tmp_path):
    _, bundle = source
    original = bundle.read_bytes()
    _rewrite(bundle, lambda name, data: None if name.startswith("cutedsl/") else (name, data))
    with pytest.raises(BundleError, match=r"file 'cutedsl/a{64}\.bin' is listed in its manifest but missing"):
        install_bundle(bundle, cache_root=tmp_path / "t1", trusted=True)
    bundle.write_bytes(original)
    _rewrite(bundle, lambda name, data: ("../evil.bin", data) if name.startswith("cutedsl/") else (name, data))
    with pytest.raises(BundleError, match=r"file '../evil.bin' is not in its manifest"):
        install_bundle(bundle, cache_root=tmp_path / "t2", trusted=True)
    assert not (tmp_path / "evil.bin").exists()
    assert not (tmp_path / "t2").exists() or _cache_files(tmp_path / "t2") == []


def test_another_toolchain_is_refused_naming_the_versions(source, tmp_path):
    _, bundle = source

    def older(name, data):
        if name != "manifest.json":
            return name, data
        manifest = json.loads(data)
        manifest["toolchain"]["nvidia-cutlass-dsl"] = "4.7.0 cu13"
        return name, json.dumps(manifest).encode()
    _rewrite(bundle, older)
    with pytest.raises(BundleError, match=r"another toolchain, refusing it: nvidia-cutlass-dsl 4\.7\.0 cu13 \(here: "):
        install_bundle(bundle, cache_root=tmp_path / "target", trusted=True)
    assert not (tmp_path / "target").exists() or _cache_files(tmp_path / "target") == []


def test_not_a_bundle(tmp_path):
    (tmp_path / "x.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(BundleError, match="cannot read it as a tar file"):
        install_bundle(tmp_path / "x.tar", cache_root=tmp_path / "t", trusted=True)
    with tarfile.open(tmp_path / "y.tar", "w") as tar:
        info = tarfile.TarInfo("hello.txt")
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(BundleError, match="not a kernel_api bundle"):
        install_bundle(tmp_path / "y.tar", cache_root=tmp_path / "t", trusted=True)


def test_the_manifest_records_toolchain_and_hashes(source):
    root, bundle = source
    with tarfile.open(bundle) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())
        for name, meta in manifest["files"].items():
            assert hashlib.sha256(tar.extractfile(name).read()).hexdigest() == meta["sha256"]
    assert set(manifest["toolchain"]) == {"kernel_api", "nvidia-cutlass-dsl", "apache-tvm-ffi", "python"}
    assert sorted(manifest["files"]) == ["cubin/" + "b" * 64 + ".bin", "cutedsl/" + "a" * 64 + ".bin", "records.json"]


def test_cli_errors_are_one_line(source, tmp_path, capsys):
    _, bundle = source
    _rewrite(bundle, lambda name, data: (name, data + b"!") if name == "records.json" else (name, data))
    assert main(["bundle", "install", str(bundle), "--trust"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "file 'records.json' fails its SHA-256 check" in err


def test_bundle_of_shapes_then_install_gives_a_warm_compile_in_a_new_process(tmp_path, monkeypatch, capsys):
    """The whole path on a CPU machine: compile two shapes for cc 90 into a bundle, install it
    into an empty cache, and a new process's compile of both kernels is a disk-cache hit."""
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps(SHAPES))
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path / "source"))
    TuningRecords().merge([_record("s1", "K1", NEW)])
    bundle = tmp_path / "b.tar"
    assert main(["bundle", "create", str(bundle), "--shapes", str(shapes), "--cc", "90", *OURS]) == 0
    assert "2 compiled kernel(s)" in capsys.readouterr().out
    assert _cache_files(tmp_path / "source") == []  # the shapes were compiled into a scratch folder
    target = tmp_path / "target"
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(target))
    assert main(["bundle", "install", str(bundle), "--trust"]) == 0
    assert "3 cache file(s) added" in capsys.readouterr().out  # two kernels and the GEMM's remembered compile
    assert [r.kernel_name for r in TuningRecords().all()] == ["K1"]
    done = subprocess.run([sys.executable, "-c", _NEW_PROCESS], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "KERNEL_API_CACHE_DIR": str(target)})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert_warm(report)
    assert report["seconds"] < 10, report  # loose: loaded, not compiled
