"""Bundles are executable code: installing takes an act of trust (``--trust``, or a signature by a
listed key) and is recorded; no member lands outside the cache; members are streamed and never
read past their size; an install is all or nothing, and staged leftovers are cleaned up."""

import dataclasses
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
import tracemalloc

import pytest

from kernel_api.cli.commands import main
from kernel_api.core.cache import DiskCache, encode_entry
from kernel_api.core.cache import UntrustedCacheError
from kernel_api.tuning.bundle import (BundleError, BundleNotTrustedError, create_bundle, install_bundle,
                                   installed_bundles)
from kernel_api.tuning.records import TuningRecord, TuningRecords

KEY_A, KEY_B, KEY_C = "a" * 64, "b" * 64, "c" * 64
# What an attacker ships: an "object file" whose code runs in the process that loads it.
PAYLOAD = b"\x7fELF... void __attribute__((constructor)) run(void) { system(\"id > /tmp/pwned\"); }"


def _record(cc=90):
    return TuningRecord("NVIDIA H200", cc, "GemmSignature(...)", "s1", "K1", 0.5, {}, {"torch": "2.13"},
                        "2026-01-01T00:00:00+00:00", "kernel_api 0.1.0; nvidia-cutlass-dsl 4.8.1 cu12")


def _pack(path, members, *, sign=None, manifest_change=None, compress=False, claims=None):
    """A bundle of ``members`` ((name, bytes) or (name, reader, size)) with a manifest whose
    hashes match them, as `create_bundle` would write it (``claims`` overrides a file's
    manifest entry; ``manifest_change`` edits the manifest before it is signed)."""
    from kernel_api.tuning import bundle as module

    files = {}
    for item in members:
        name, data = item[0], item[1]
        if isinstance(data, bytes):
            files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    files.update(claims or {})
    manifest = {"format": "kernel_api.bundle", "version": 1, "toolchain": module._toolchain(), "files": files,
                "created": "2026-01-01T00:00:00+00:00"}
    if manifest_change:
        manifest_change(manifest)
    manifest_bytes = json.dumps(manifest).encode()
    head = [("manifest.json", manifest_bytes)]
    if sign is not None:
        from kernel_api.core.trust import sign_manifest

        head.append(("manifest.sig", json.dumps(sign_manifest(manifest_bytes, sign)).encode()))
    with tarfile.open(path, "w:gz" if compress else "w", **({"compresslevel": 1} if compress else {})) as tar:
        for item in head + list(members):
            name, data = item[0], item[1]
            info = tarfile.TarInfo(name)
            if isinstance(data, bytes):
                info.size = len(data)
                data = io.BytesIO(data)
            else:
                info.size = item[2]
            tar.addfile(info, data)
    return path


def _records_json(records):
    from kernel_api.tuning.records import records_to_json

    document = records_to_json(records)
    return json.dumps(document).encode()


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


@pytest.fixture
def evil(tmp_path):
    """A bundle that passes every hash check and carries code: what a 10-line C file gives."""
    return _pack(tmp_path / "evil.tar", [(f"cutedsl/{KEY_A}.bin", encode_entry(PAYLOAD)),
                                         ("records.json", _records_json([]))])


@pytest.fixture
def keys(tmp_path, monkeypatch):
    """An Ed25519 key pair in OpenSSH form, and an empty trusted-keys folder."""
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    monkeypatch.setenv("KERNEL_API_CONFIG_DIR", str(tmp_path / "config"))
    key = Ed25519PrivateKey.generate()
    private, public = tmp_path / "signer", tmp_path / "signer.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH) + b" ci@builder\n")
    return private, public


# ---- 1. installing takes an act of trust, and is recorded --------------------------------------

def test_an_unsigned_bundle_is_refused_unless_trusted(evil, tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_API_CONFIG_DIR", str(tmp_path / "config"))
    target = tmp_path / "cache"
    with pytest.raises(BundleNotTrustedError, match=r"not installed: a bundle is executable code and this one is not "
                                          r"signed by a trusted key; pass --trust"):
        install_bundle(evil, cache_root=target)
    assert not target.exists() or _files(target) == []
    counts = install_bundle(evil, cache_root=target, trusted=True)
    assert counts.files_added == 1
    assert DiskCache("cutedsl", target).get(KEY_A) == PAYLOAD


def test_cli_refuses_in_one_line_and_installs_with_trust(evil, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KERNEL_API_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["bundle", "install", str(evil)]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not signed by a trusted key; pass --trust" in err
    assert not (tmp_path / "cache" / "cutedsl").exists()
    assert main(["bundle", "install", str(evil), "--trust"]) == 0
    assert "1 cache file(s) added" in capsys.readouterr().out


def test_a_bundle_no_one_vouches_for_is_a_failure_not_bad_values(evil, tmp_path, monkeypatch, capsys):
    """Exit 1 (a failure kernel_api reports), by the error's type: the bundle may be intact; what
    is missing is the act of trust. A damaged bundle is still bad values (2)."""
    monkeypatch.setenv("KERNEL_API_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(BundleNotTrustedError) as refused:
        install_bundle(evil)
    assert not isinstance(refused.value, ValueError)
    assert main(["bundle", "install", str(evil)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not signed by a trusted key; pass --trust" in err
    damaged = _pack(tmp_path / "damaged.tar", [(f"cutedsl/{KEY_A}.bin", encode_entry(PAYLOAD))],
                    claims={f"cutedsl/{KEY_A}.bin": {"sha256": "0" * 64, "size": len(encode_entry(PAYLOAD))}})
    assert main(["bundle", "install", str(damaged), "--trust"]) == 2
    assert "fails its SHA-256 check" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["writable by others", "owned by uid 54321"])
def test_records_are_not_merged_into_an_untrusted_cache_folder(tmp_path, monkeypatch, capsys, kind):
    """A bundle of records only writes no entry, and still checks the cache folder first."""
    target = tmp_path / "cache"
    target.mkdir()
    TuningRecords(target / "tuning.sqlite").close()
    if kind == "writable by others":
        os.chmod(target, 0o777)
    else:
        os.chown(target, 54321, -1)
    before = _files(target)
    bundle = _pack(tmp_path / "r.tar", [("records.json", _records_json([_record()]))])
    with pytest.raises(UntrustedCacheError, match=rf"not installed into an unsafe cache folder: {target} is {kind}"):
        install_bundle(bundle, cache_root=target, trusted=True)
    assert _files(target) == before and TuningRecords(target / "tuning.sqlite").all() == []
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(target))
    assert main(["bundle", "install", str(bundle), "--trust"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{target} is {kind}" in err
    os.chmod(target, 0o755)
    os.chown(target, os.geteuid(), -1)
    assert install_bundle(bundle, cache_root=target, trusted=True).records.added == 1


def test_provenance_is_recorded_and_listed_by_cache_info(evil, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path / "cache"))
    install_bundle(evil, trusted=True)
    [found] = installed_bundles()
    assert found["sha256"] == hashlib.sha256(evil.read_bytes()).hexdigest()
    assert found["file"] == "evil.tar" and found["entries"] == [f"cutedsl/{KEY_A}.bin"]
    assert found["vouched"] == "trusted by the user (--trust)"
    assert set(found["toolchain"]) == {"kernel_api", "nvidia-cutlass-dsl", "apache-tvm-ffi", "python"}
    assert found["installed"][:2] == "20"
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "bundles installed: 1" in out and f"evil.tar sha256 {found['sha256']}" in out
    assert "trusted by the user (--trust)" in out and "bundles:" not in out.replace("bundles installed", "")


def test_a_bundle_signed_by_a_listed_key_installs_without_trust(keys, tmp_path, monkeypatch, capsys):
    private, public = keys
    source = tmp_path / "source"
    DiskCache("cutedsl", source).put(KEY_A, b"object file")
    bundle = tmp_path / "signed.tar"
    create_bundle(bundle, cache_root=source, sign_with=private)
    target = tmp_path / "target"
    with pytest.raises(BundleNotTrustedError, match=r"signed by key SHA256:\S+, which is not trusted here"):
        install_bundle(bundle, cache_root=target)
    assert main(["trust", "add", str(public)]) == 0
    fingerprint = capsys.readouterr().out.split()[1]
    assert fingerprint.startswith("SHA256:")
    counts = install_bundle(bundle, cache_root=target)
    assert counts.files_added == 1
    assert installed_bundles(target)[0]["vouched"] == f"signed by {fingerprint} (ci@builder)"
    assert main(["trust", "list"]) == 0
    assert fingerprint in capsys.readouterr().out
    assert main(["trust", "remove", fingerprint]) == 0
    with pytest.raises(BundleNotTrustedError, match="which is not trusted here"):
        install_bundle(bundle, cache_root=tmp_path / "again")


def test_a_signed_bundle_changed_after_signing_is_refused(keys, tmp_path):
    private, public = keys
    from kernel_api.core.trust import add_trusted_key

    add_trusted_key(public)
    bundle = _pack(tmp_path / "b.tar", [(f"cutedsl/{KEY_A}.bin", encode_entry(b"good"))], sign=private)
    with tarfile.open(bundle) as tar:
        signature = tar.extractfile("manifest.sig").read()
    # The same signature on a manifest re-hashed for other code.
    forged = _pack(tmp_path / "forged.tar", [(f"cutedsl/{KEY_A}.bin", encode_entry(PAYLOAD))])
    with tarfile.open(forged) as tar:
        manifest = tar.extractfile("manifest.json").read()
        body = tar.extractfile(f"cutedsl/{KEY_A}.bin").read()
    with tarfile.open(forged, "w") as tar:
        for name, data in (("manifest.json", manifest), ("manifest.sig", signature), (f"cutedsl/{KEY_A}.bin", body)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(BundleNotTrustedError, match=r"its signature by SHA256:\S+ does not match its manifest"):
        install_bundle(forged, cache_root=tmp_path / "target")
    assert install_bundle(bundle, cache_root=tmp_path / "target").files_added == 1


def test_a_trusted_keys_file_others_can_write_is_not_used(keys, tmp_path):
    private, public = keys
    from kernel_api.core.trust import add_trusted_key

    add_trusted_key(public)
    bundle = _pack(tmp_path / "b.tar", [(f"cutedsl/{KEY_A}.bin", encode_entry(b"good"))], sign=private)
    os.chmod(tmp_path / "config" / "trusted_keys", 0o666)
    with pytest.raises(BundleNotTrustedError, match=r"trusted_keys is writable by others \(mode 0o666\); not using it"):
        install_bundle(bundle, cache_root=tmp_path / "target")


def test_signatures_without_cryptography_fail_in_one_line(evil, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KERNEL_API_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setitem(sys.modules, "cryptography", None)  # import cryptography raises ImportError
    key = tmp_path / "key"
    key.write_text("whatever")
    assert main(["bundle", "create", str(tmp_path / "x.tar"), "--sign", str(key)]) == 1
    err = capsys.readouterr().err
    assert err == ("kernel-api: error: signing a bundle needs the cryptography package, which is not installed: "
                   "pip install 'kernel_api[sign]' (or pip install cryptography)\n")
    signed = _pack(tmp_path / "s.tar", [("records.json", _records_json([]))])
    with tarfile.open(signed) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
    members.insert(1, ("manifest.sig", json.dumps({"algorithm": "ed25519", "key": "SHA256:x",
                                                   "signature": "AA=="}).encode()))
    with tarfile.open(signed, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(BundleNotTrustedError, match=r"checking its signature needs the cryptography package.*"
                                          r"pip install 'kernel_api\[sign\]'"):
        install_bundle(signed, cache_root=tmp_path / "target")
    assert install_bundle(signed, cache_root=tmp_path / "target", trusted=True).files_added == 0


# ---- 3. no member lands outside the cache folder -------------------------------------------------

@pytest.mark.parametrize("name", ["../weights.bin", "./x.bin", ".hidden/x.bin", "cutedsl/.x.bin", "cutedsl/..bin",
                                  "/x.bin", "cutedsl//x.bin", "cutedsl/../x.bin", "../cutedsl.bin/x.bin"])
def test_a_path_component_that_is_dot_dotdot_empty_or_hidden_is_refused(tmp_path, name):
    root = tmp_path / "cache"
    root.mkdir()
    bundle = _pack(tmp_path / "b.tar", [(name, encode_entry(PAYLOAD))])
    with pytest.raises(BundleError, match=r"refusing file .*each part a plain name"):
        install_bundle(bundle, cache_root=root, trusted=True)
    assert _files(tmp_path) == ["b.tar"]  # nothing beside the cache, nothing in it


# ---- 4. members are streamed, never read past their size -------------------------------------------

class _Zeros(io.RawIOBase):
    """``size`` zero bytes, made as they are read (the bomb is never in the test's memory)."""

    def __init__(self, size):
        self.left = size

    def readable(self):
        return True

    def readinto(self, buffer):
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


def test_a_member_larger_than_claimed_is_not_read_whole(tmp_path):
    big = 96 << 20
    one = bytes(1)
    bundle = _pack(tmp_path / "bomb.tar.gz", [(f"cutedsl/{KEY_A}.bin", io.BufferedReader(_Zeros(big)), big)],
                   compress=True, claims={f"cutedsl/{KEY_A}.bin": {"sha256": hashlib.sha256(one).hexdigest(),
                                                                   "size": 1}})
    assert bundle.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(BundleError) as refused:
            install_bundle(bundle, cache_root=tmp_path / "cache", trusted=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak  # the member is 96 MiB: reading it whole would hold all of it
    assert "fails its SHA-256 check (over the 1 bytes its manifest gives" in str(refused.value)
    assert _files(tmp_path / "cache") == []


def test_an_oversized_records_claim_is_refused_before_reading(tmp_path):
    bundle = _pack(tmp_path / "b.tar", [("records.json", b"{}")],
                   claims={"records.json": {"sha256": "0" * 64, "size": 1 << 40}})
    with pytest.raises(BundleError, match=r"records.json claims 1099511627776 bytes, over the"):
        install_bundle(bundle, cache_root=tmp_path / "cache", trusted=True)


# ---- 6. an install is all or nothing; staged leftovers are removed ---------------------------------

@pytest.mark.parametrize("bad", [{"cc": 2**70}, {"device": "\ud800"}], ids=["cc-2**70", "lone-surrogate"])
def test_records_the_store_cannot_take_install_nothing(tmp_path, bad):
    target = tmp_path / "cache"
    record = dataclasses.replace(_record(), **bad)
    bundle = _pack(tmp_path / "b.tar", [(f"cubin/{KEY_A}.bin", encode_entry(b"one")),
                                        (f"cutedsl/{KEY_B}.bin", encode_entry(b"two")),
                                        ("records.json", _records_json([record]))])
    with pytest.raises(BundleError, match=r"records\.json"):
        install_bundle(bundle, cache_root=target, trusted=True)
    assert [f for f in _files(target) if not f.startswith("tuning.sqlite")] == []  # no entry, .part or provenance
    assert TuningRecords(target / "tuning.sqlite").all() == []


def test_a_failed_rename_takes_back_the_entries_already_renamed(tmp_path, monkeypatch):
    target = tmp_path / "cache"
    names = [f"cubin/{KEY_A}.bin", f"cutedsl/{KEY_B}.bin", f"cutedsl/{KEY_C}.bin"]
    bundle = _pack(tmp_path / "b.tar", [(n, encode_entry(n.encode())) for n in names]
                   + [("records.json", _records_json([_record()]))])
    real = os.replace

    def failing(src, dst, *args, **kwargs):
        if str(dst).endswith(KEY_C + ".bin"):
            raise OSError(28, "No space left on device")
        return real(src, dst, *args, **kwargs)
    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(BundleError, match="No space left on device"):
        install_bundle(bundle, cache_root=target, trusted=True)
    monkeypatch.setattr(os, "replace", real)
    assert [f for f in _files(target) if not f.startswith("tuning.sqlite")] == []
    assert TuningRecords(target / "tuning.sqlite").all() == []
    assert install_bundle(bundle, cache_root=target, trusted=True).files_added == 3


def test_stale_staged_files_are_removed_by_later_runs(tmp_path):
    target = tmp_path / "cache"
    folder = target / "cutedsl"
    folder.mkdir(parents=True)
    old, fresh, old_atomic = folder / ".tmp-killed.part", folder / ".tmp-live.part", folder / f".{KEY_C}.bin.x.part"
    for path in (old, fresh, old_atomic):
        path.write_bytes(b"half")
    hours_ago = time.time() - 2 * 3600
    os.utime(old, (hours_ago, hours_ago))
    os.utime(old_atomic, (hours_ago, hours_ago))
    bundle = _pack(tmp_path / "b.tar", [(f"cutedsl/{KEY_A}.bin", encode_entry(b"x"))])
    install_bundle(bundle, cache_root=target, trusted=True)
    assert sorted(p.name for p in folder.iterdir()) == [".tmp-live.part", f"{KEY_A}.bin"]
    # A compile's cache write in a later process sweeps its folder once too.
    other = target / "cubin"
    other.mkdir()
    (other / ".tmp-killed.part").write_bytes(b"half")
    os.utime(other / ".tmp-killed.part", (hours_ago, hours_ago))
    DiskCache("cubin", target).put(KEY_B, b"y")
    assert sorted(p.name for p in other.iterdir()) == [f"{KEY_B}.bin"]


def test_cache_info_counts_only_the_entries_a_killed_install_put_in_place(tmp_path, monkeypatch, capsys):
    """The provenance record is written before any entry (every entry that lands has one); a
    process killed during the renames leaves a record listing more than was installed, and
    ``cache info`` says how many of its entries are present."""
    target = tmp_path / "cache"
    names = [f"cubin/{KEY_A}.bin", f"cutedsl/{KEY_B}.bin", f"cutedsl/{KEY_C}.bin"]
    bundle = _pack(tmp_path / "b.tar", [(n, encode_entry(n.encode())) for n in names])
    killed = (f"import os, sys\n"
              f"real = os.replace\n"
              f"def replace(src, dst, *args, **kwargs):\n"
              f"    if str(dst).endswith({KEY_B + '.bin'!r}):\n"
              f"        os._exit(9)\n"
              f"    return real(src, dst, *args, **kwargs)\n"
              f"os.replace = replace\n"
              f"from kernel_api.tuning.bundle import install_bundle\n"
              f"install_bundle(sys.argv[1], cache_root=sys.argv[2], trusted=True)\n")
    done = subprocess.run([sys.executable, "-c", killed, str(bundle), str(target)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 9, done.stderr
    [record] = installed_bundles(target)
    assert record["entries"] == sorted(names)
    assert [n for n in names if (target / n).is_file()] == [names[0]]
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(target))
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "b.tar sha256" in out and ": 1 of 3 entries present, 0 records;" in out
    install_bundle(bundle, cache_root=target, trusted=True)  # installed again: the second record is whole
    assert main(["cache", "info"]) == 0
    assert ": 3 entries, 0 records;" in capsys.readouterr().out
