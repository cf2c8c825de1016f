"""Bundles: compiled artifacts and tuning records carried to other machines in one tar file.

``create_bundle`` packs the disk cache's entries (every namespace: CuTe DSL objects, NVRTC
cubins) and the tuning records (as `records_to_json` writes them) with a manifest
(``manifest.json``, the first member) holding the toolchain the artifacts were built with
(`kernel_api.core.toolchain.artifact_toolchain`) and each file's SHA-256 and size. With a
signing key, a detached signature of the manifest follows it (``manifest.sig``,
`kernel_api.core.trust.sign_manifest`); the manifest's hashes extend it to every file.

A bundle is executable code: its CuTe DSL objects are linked into the process that loads them.
``install_bundle`` therefore installs only what the user vouches for: ``trusted=True`` (the
command line's ``--trust``), or a signature by a key the user listed (``kernel-api trust add``).
It refuses, naming the reason and installing nothing:
- a bundle neither vouched for nor signed by a trusted key (`BundleNotTrustedError`);
- a bundle whose toolchain differs from this process's (another kernel_api, CuTe DSL build or
  CUDA variant, TVM-FFI or Python): its artifacts would never be looked up here, or would not load;
- a file whose SHA-256 or size differs from the manifest's, a file missing or not listed, and
  any name other than ``records.json`` or ``<namespace>/<key>.bin`` where neither part is empty,
  ``.``, ``..`` or hidden (so nothing lands outside the cache folder);
- records the tuning store would not take (checked by merging them into a scratch store);
- a cache folder another user could write (`kernel_api.core.cache.untrusted_folders`), checked
  before anything is written, records included, and for each namespace folder an entry goes to.

Members are streamed in 1 MiB chunks and never read past the manifest's size (+1 byte, to see
an excess), so a small compressed bundle cannot claim a little and inflate to gigabytes.

Installing is validate, stage, commit. Every file is checked while it is copied to a staged
file (``.tmp-*.part``) in its final folder; only when all passed are they renamed over their
names, then the records merged (one transaction); an error in that step takes back what it
did. A process killed during the renames leaves some complete, checked entries of the bundle
and its staged files; later installs and cache writes remove staged files over an hour old
(`kernel_api.core.cache.remove_stale_parts`: by age, since a staged file's writer lives in
another process). Each install records its provenance (the bundle's SHA-256, file name, time,
toolchain and who vouched for it) under ``<cache>/bundles/``; ``kernel-api cache info`` lists it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import os
import re
import sqlite3
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..core.cache import (UntrustedCacheError, cache_dir, decode_entry, entry_file_ok, folder_problem,
                          remove_stale_parts, untrusted_folders)
from ..core.errors import KernelApiError
from ..core.files import atomic_file
from ..core.toolchain import artifact_toolchain
from ..core.trust import TrustError, sign_manifest, verify_manifest
from .records import MergeCounts, RecordsFileError, TuningRecords, records_from_json, records_to_json

_FORMAT = "kernel_api.bundle"
_VERSION = 1
_MANIFEST = "manifest.json"
_SIGNATURE = "manifest.sig"
_RECORDS = "records.json"
PROVENANCE = "bundles"  # the cache sub-folder of install records
_COMPONENT = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,119}$")  # never '', '.', '..' or hidden
_MAX_MANIFEST = 16 << 20
_MAX_SIGNATURE = 64 << 10
_MAX_RECORDS = 256 << 20
_CHUNK = 1 << 20


class BundleError(KernelApiError, ValueError):
    """A bundle that cannot be made or installed; the message names the bundle and the reason."""


class BundleNotTrustedError(KernelApiError):
    """A bundle refused because no one vouches for it: neither ``trusted=True`` (``--trust``) nor
    a valid signature by a key in `kernel_api.core.trust.trusted_keys`. Not a ValueError: the
    bundle may be intact; what is missing is the user's act of trust (the command line exits 1).
    The message names the bundle and why."""


@dataclass(frozen=True)
class InstallCounts:
    """What `install_bundle` did: cache files written, cache files already present (the same
    key: the same artifact), and the records merge."""

    files_added: int
    files_present: int
    records: MergeCounts


def _toolchain() -> dict[str, str]:
    return dict(artifact_toolchain())


def entry_name_ok(name: str) -> bool:
    """Whether ``name`` is ``<namespace>/<key>.bin`` with two plain components: neither empty,
    ``.``, ``..`` nor hidden (a leading dot), of letters, digits, ``.``, ``_`` and ``-``.

    Args:
        name: a bundle member's name.

    Returns:
        True when the name may be installed under the cache folder.
    """
    parts = name.split("/")
    return len(parts) == 2 and all(_COMPONENT.match(p) for p in parts) and parts[1].endswith(".bin") \
        and len(parts[1]) > len(".bin")


def _cache_entries(root: Path) -> list[tuple[str, Path]]:
    """(bundle name, path) of every entry file under the cache folder ``root``."""
    found = []
    if not root.is_dir():
        return found
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        for path in sorted(sub.glob("*.bin")):
            name = f"{sub.name}/{path.name}"
            if entry_name_ok(name):
                found.append((name, path))
    return found


def create_bundle(path: str | os.PathLike, cache_root: str | os.PathLike | None = None,
                  records: TuningRecords | None = None, sign_with: str | os.PathLike | None = None) -> dict:
    """Write a bundle of the disk cache's entries and the tuning records to the tar file ``path``
    (replaced atomically); returns its manifest.

    Args:
        path: the tar file to write.
        cache_root: the cache folder whose entries to pack (default: `cache_dir`).
        records: the tuning records to pack (default: ``cache_root``'s ``tuning.sqlite``).
        sign_with: an Ed25519 private key file: sign the manifest with it (needs ``cryptography``).

    Returns:
        The manifest written.

    Entries that fail their own checksum (damaged) are left out.
    """
    root = Path(cache_root) if cache_root is not None else cache_dir()
    store = records if records is not None else TuningRecords(root / "tuning.sqlite")
    files: dict[str, dict[str, Any]] = {}
    payloads: list[tuple[str, bytes]] = []
    for name, entry in _cache_entries(root):
        try:
            data = entry.read_bytes()
        except OSError:
            continue  # removed meanwhile (a cache clear, a corrupt entry dropped by a reader)
        if decode_entry(data) is None:
            continue
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        payloads.append((name, data))
    record_bytes = json.dumps(records_to_json(store.all()), indent=1, sort_keys=True).encode()
    files[_RECORDS] = {"sha256": hashlib.sha256(record_bytes).hexdigest(), "size": len(record_bytes)}
    payloads.append((_RECORDS, record_bytes))
    manifest = {"format": _FORMAT, "version": _VERSION, "toolchain": _toolchain(), "files": files,
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True).encode()
    head = [(_MANIFEST, manifest_bytes)]
    if sign_with is not None:
        head.append((_SIGNATURE, json.dumps(sign_manifest(manifest_bytes, sign_with)).encode()))
    with atomic_file(path) as f, tarfile.open(fileobj=f, mode="w") as tar:
        for name, data in head + payloads:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return manifest


def _read_small(tar: tarfile.TarFile, member: tarfile.TarInfo, limit: int, source: str) -> bytes:
    """A member of at most ``limit`` bytes, read whole."""
    if not member.isfile() or member.size > limit:
        raise BundleError(f"{source}: {member.name} is not a regular file of at most {limit} bytes")
    return tar.extractfile(member).read(member.size)


def _read_manifest(tar: tarfile.TarFile, source: str) -> tuple[bytes, dict]:
    """The manifest's bytes and its checked contents: the bundle's first member."""
    member = tar.next()
    if member is None or member.name != _MANIFEST:
        raise BundleError(f"{source}: not a kernel_api bundle (its first file is not {_MANIFEST})")
    data = _read_small(tar, member, _MAX_MANIFEST, source)
    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BundleError(f"{source}: {_MANIFEST} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise BundleError(f"{source}: not a kernel_api bundle ({_MANIFEST} has no \"format\": \"{_FORMAT}\")")
    if manifest.get("version") != _VERSION:
        raise BundleError(f"{source}: bundle format version {manifest.get('version')!r} is not supported "
                          f"(this kernel_api reads version {_VERSION})")
    files = manifest.get("files")
    if not isinstance(files, dict) or not isinstance(manifest.get("toolchain"), dict) or not all(
            isinstance(v, dict) and isinstance(v.get("sha256"), str) and type(v.get("size")) is int
            and v["size"] >= 0 for v in files.values()):
        raise BundleError(f"{source}: {_MANIFEST} is malformed (needs \"toolchain\" and \"files\" with a sha256 "
                          f"and a size per file)")
    for name in files:
        if name != _RECORDS and not entry_name_ok(name):
            raise BundleError(f"{source}: refusing file {name!r}: a bundle holds only {_RECORDS} and "
                              f"<namespace>/<key>.bin, each part a plain name (not empty, '.', '..' or hidden)")
    if files.get(_RECORDS, {}).get("size", 0) > _MAX_RECORDS:
        raise BundleError(f"{source}: {_RECORDS} claims {files[_RECORDS]['size']} bytes, over the "
                          f"{_MAX_RECORDS}-byte limit")
    return data, manifest


def check_toolchain(manifest: dict, source: str) -> None:
    """Raise `BundleError` naming every version in which the bundle's toolchain differs from
    this process's.

    Args:
        manifest: a bundle's manifest.
        source: the bundle, for messages.
    """
    here = _toolchain()
    theirs = manifest["toolchain"]
    differences = [f"{name} {theirs.get(name, 'absent')!s} (here: {version})" for name, version in here.items()
                   if theirs.get(name) != version]
    if differences:
        raise BundleError(f"{source}: made with another toolchain, refusing it: {'; '.join(differences)}")


def _vouch(manifest_bytes: bytes, signature: bytes | None, trusted: bool, source: str) -> str:
    """Who vouches for the bundle ("--trust", or the trusted key that signed it).

    Args:
        manifest_bytes: the manifest as stored in the bundle.
        signature: the ``manifest.sig`` member's bytes, or None when the bundle has none.
        trusted: the caller vouches for the bundle.
        source: the bundle, for messages.

    Returns:
        A description of who vouched, for the provenance record.

    Raises:
        BundleNotTrustedError: not vouched for, unsigned, or a signature that does not verify
            against a trusted key (or cannot be checked).
    """
    if trusted:
        return "trusted by the user (--trust)"
    if signature is None:
        raise BundleNotTrustedError(f"{source}: not installed: a bundle is executable code and this one is not signed "
                          f"by a trusted key; pass --trust (trusted=True) if you trust its source "
                          f"(docs/security.md)")
    try:
        document = json.loads(signature)
    except (ValueError, UnicodeDecodeError):
        document = None
    try:
        key = verify_manifest(manifest_bytes, document, source)
    except TrustError as exc:
        raise BundleNotTrustedError(str(exc)) from None
    return f"signed by {key.fingerprint} ({' '.join(key.line.split()[2:]) or 'no comment'})"


def _copy_checked(reader: IO[bytes], out: IO[bytes] | None, expected: dict, name: str, source: str) -> bytes:
    """Copy a member to ``out`` (or into the returned bytes when ``out`` is None), reading at
    most its expected size + 1 byte, and check its size and SHA-256."""
    h = hashlib.sha256()
    size, limit = 0, expected["size"]
    kept = io.BytesIO() if out is None else out
    while size <= limit:
        chunk = reader.read(min(_CHUNK, limit + 1 - size))
        if not chunk:
            break
        size += len(chunk)
        h.update(chunk)
        kept.write(chunk)
    if size != limit or h.hexdigest() != expected["sha256"]:
        detail = f"over the {limit} bytes its manifest gives; " if size > limit else ""
        raise BundleError(f"{source}: file {name!r} fails its SHA-256 check ({detail}damaged or tampered with); "
                          f"nothing was installed")
    return kept.getvalue() if out is None else b""


def _sha256_stream(f: IO[bytes]) -> str:
    h = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        h.update(chunk)
    return h.hexdigest()


def _sha256_of(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return _sha256_stream(f)
    except OSError:
        return None


def _check_records(record_bytes: bytes | None, source: str) -> list:
    """The bundle's records, checked by merging them into a scratch store (what the real merge
    would refuse, it refuses now, before anything is installed)."""
    if record_bytes is None:
        return []
    try:
        incoming = records_from_json(json.loads(record_bytes), f"{source}: {_RECORDS}")
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        text = str(exc) if isinstance(exc, RecordsFileError) else f"{source}: {_RECORDS}: {exc}"
        raise BundleError(text) from None
    with tempfile.TemporaryDirectory(prefix="kernel_api-records-") as scratch:
        store = TuningRecords(Path(scratch) / "check.sqlite")
        try:
            store.merge(incoming)
        except (OverflowError, ValueError, TypeError, sqlite3.Error) as exc:
            raise BundleError(f"{source}: {_RECORDS} holds a record the tuning store cannot take ({exc}); "
                              f"nothing was installed") from None
        finally:
            store.close()
    return incoming


def install_bundle(path: str | os.PathLike, cache_root: str | os.PathLike | None = None,
                   records: TuningRecords | None = None, *, trusted: bool = False) -> InstallCounts:
    """Check a bundle written by `create_bundle` and install it: its cache files into the cache
    folder, its records merged into the tuning records (the newer record wins per key).

    Args:
        path: the bundle (tar file).
        cache_root: the cache folder to install into (default: `cache_dir`).
        records: the tuning records to merge into (default: ``cache_root``'s ``tuning.sqlite``).
        trusted: the caller vouches for the bundle's source (it holds code this process and later
            ones will run); without it the bundle must be signed by a key in `trusted_keys`.

    Returns:
        What was added, already present, and merged.

    Raises:
        BundleNotTrustedError: not vouched for nor signed by a trusted key.
        UntrustedCacheError: the cache folder, or a namespace folder an entry would go to, fails
            the permission rule (`kernel_api.core.cache.untrusted_folders`).
        BundleError: not a bundle, another toolchain, a file that fails its check or is missing
            or not listed, records the store cannot take (the message names it).

    Nothing is installed when any of these is raised.
    """
    source = f"bundle {os.fspath(path)}"
    root = Path(cache_root) if cache_root is not None else cache_dir()
    staged: list[tuple[str, Path]] = []  # (staged file, final path), renamed once all passed
    present = 0
    try:
        with open(path, "rb") as raw:
            bundle_sha256 = _sha256_stream(raw)
            raw.seek(0)
            try:
                tar = tarfile.open(fileobj=raw, mode="r:*")
            except tarfile.TarError as exc:
                raise BundleError(f"{source}: cannot read it as a tar file ({exc})") from None
            with tar:
                manifest_bytes, manifest = _read_manifest(tar, source)
                member = tar.next()
                signature = None
                if member is not None and member.name == _SIGNATURE:
                    signature = _read_small(tar, member, _MAX_SIGNATURE, source)
                    member = tar.next()
                vouched = _vouch(manifest_bytes, signature, trusted, source)
                check_toolchain(manifest, source)
                # The install writes into the cache folder whatever the bundle holds: its provenance
                # record, and the records (tuning.sqlite) even when it has no entry.
                problem = next(iter(untrusted_folders(root).values()), None)
                if problem is not None:
                    raise UntrustedCacheError(f"{source}: not installed into an unsafe cache folder: {problem}")
                files = manifest["files"]
                seen: set[str] = set()
                record_bytes = None
                swept: set[Path] = set()
                while member is not None:
                    name = member.name
                    if name not in files:
                        raise BundleError(f"{source}: file {name!r} is not in its manifest, refusing the bundle")
                    if not member.isfile() or name in seen:
                        raise BundleError(f"{source}: file {name!r} is not a regular file or appears twice")
                    seen.add(name)
                    expected = files[name]
                    reader = tar.extractfile(member)
                    if name == _RECORDS:
                        record_bytes = _copy_checked(reader, None, expected, name, source)
                        member = tar.next()
                        continue
                    final = root / name
                    problem = folder_problem(final.parent)
                    if problem is not None:
                        raise UntrustedCacheError(f"{source}: not installed into an unsafe cache folder: {problem}")
                    if _sha256_of(final) == expected["sha256"]:
                        present += 1
                        member = tar.next()
                        continue
                    final.parent.mkdir(parents=True, exist_ok=True)
                    if final.parent not in swept:
                        swept.add(final.parent)
                        remove_stale_parts(final.parent)
                    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".part", dir=final.parent)
                    staged.append((tmp, final))
                    with os.fdopen(fd, "wb") as out:
                        _copy_checked(reader, out, expected, name, source)
                    if not entry_file_ok(tmp):  # a valid sha256 but a broken entry: made that way
                        raise BundleError(f"{source}: file {name!r} is not a valid cache entry; nothing was installed")
                    member = tar.next()
                missing = sorted(set(files) - seen)
                if missing:
                    raise BundleError(f"{source}: file {missing[0]!r} is listed in its manifest but missing "
                                      f"({len(missing)} missing); nothing was installed")
        incoming = _check_records(record_bytes, source)
        store = records if records is not None else TuningRecords(root / "tuning.sqlite")
        provenance = {"file": os.path.basename(os.fspath(path)), "path": os.path.abspath(path),
                      "sha256": bundle_sha256, "installed": _dt.datetime.now(_dt.timezone.utc).isoformat(
                          timespec="seconds"), "created": manifest.get("created"),
                      "toolchain": manifest["toolchain"], "vouched": vouched,
                      "entries": sorted(n for n in files if n != _RECORDS), "records": len(incoming)}
        merged = _commit(staged, store, incoming, root, provenance, source)
        staged = []
    except (OSError, tarfile.TarError) as exc:
        raise BundleError(f"{source}: cannot install it ({exc})") from exc
    finally:
        for tmp, _ in staged:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return InstallCounts(len(seen) - present - (1 if record_bytes is not None else 0), present, merged)


def _commit(staged: list[tuple[str, Path]], store: TuningRecords, incoming: list, root: Path,
            provenance: dict, source: str) -> MergeCounts:
    """Install what was checked: the provenance record, then the staged files renamed over their
    names, then the records merged; an error takes back what this step did."""
    folder = root / PROVENANCE
    folder.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    record = folder / f"{stamp}-{provenance['sha256'][:16]}.json"
    with atomic_file(record, "w") as f:
        json.dump(provenance, f, indent=1, sort_keys=True)
    done: list[Path] = []
    try:
        for tmp, final in staged:
            os.replace(tmp, final)
            done.append(final)
        try:
            return store.merge(incoming)
        except (OverflowError, ValueError, TypeError, sqlite3.Error) as exc:
            raise BundleError(f"{source}: its records could not be merged ({exc}); nothing was installed") from None
    except BaseException:
        for item in done + [record]:
            try:
                os.unlink(item)
            except OSError:
                pass
        raise


def installed_bundles(cache_root: str | os.PathLike | None = None) -> list[dict]:
    """The provenance of every bundle installed into the cache folder, oldest first.

    Args:
        cache_root: the cache folder (default: `cache_dir`).

    Returns:
        One dict per install: ``file``, ``path``, ``sha256`` (of the bundle file), ``installed``
        and ``created`` (times), ``toolchain``, ``vouched`` (``--trust`` or the signing key),
        ``entries`` (the cache files it held) and ``records`` (how many). Unreadable records are
        skipped.
    """
    folder = (Path(cache_root) if cache_root is not None else cache_dir()) / PROVENANCE
    found = []
    for item in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            document = json.loads(item.read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if isinstance(document, dict):
            found.append(document)
    return found
