"""Bundles: compiled artifacts and tuning records carried to other machines in one tar file.

``create_bundle`` packs the disk cache's entries (every namespace: CuTe DSL objects, NVRTC
cubins) and the tuning records (as `records_to_json` writes them) with a manifest
(``manifest.json``) holding the toolchain the artifacts were built with
(`kernel_api.core.toolchain.artifact_toolchain`) and each file's SHA-256 and size.

``install_bundle`` refuses, naming the reason and installing nothing:
- a bundle whose toolchain differs from this process's (another kernel_api, CuTe DSL build or
  CUDA variant, TVM-FFI or Python): its artifacts would never be looked up here, or would not load;
- a file whose SHA-256 or size differs from the manifest's, a file missing or not listed, and
  any name other than ``records.json`` or ``<namespace>/<key>.bin``.

Cache files are written to temporary files in their final folder, checked, and renamed over
their names only once every file passed, so a cache never holds half a file. Records are
merged with `TuningRecords.merge`: a newer local record is never overwritten.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import os
import re
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.cache import cache_dir, decode_entry
from ..core.errors import KernelApiError
from ..core.files import atomic_file
from ..core.toolchain import artifact_toolchain
from .records import MergeCounts, RecordsFileError, TuningRecords, records_from_json, records_to_json

_FORMAT = "kernel_api.bundle"
_VERSION = 1
_MANIFEST = "manifest.json"
_RECORDS = "records.json"
_ENTRY = re.compile(r"^([A-Za-z0-9._-]{1,120})/([A-Za-z0-9._-]{1,120}\.bin)$")


class BundleError(KernelApiError, ValueError):
    """A bundle that cannot be made or installed; the message names the bundle and the reason."""


@dataclass(frozen=True)
class InstallCounts:
    """What `install_bundle` did: cache files written, cache files already present (the same
    key: the same artifact), and the records merge."""

    files_added: int
    files_present: int
    records: MergeCounts


def _toolchain() -> dict[str, str]:
    return dict(artifact_toolchain())


def _cache_entries(root: Path) -> list[tuple[str, Path]]:
    """(bundle name, path) of every valid entry file under the cache folder ``root``."""
    found = []
    if not root.is_dir():
        return found
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        for path in sorted(sub.glob("*.bin")):
            name = f"{sub.name}/{path.name}"
            if _ENTRY.match(name):
                found.append((name, path))
    return found


def create_bundle(path: str | os.PathLike, cache_root: str | os.PathLike | None = None,
                  records: TuningRecords | None = None) -> dict:
    """Write a bundle of the disk cache's entries and the tuning records to the tar file ``path``
    (replaced atomically); returns its manifest.

    Args:
        path: the tar file to write.
        cache_root: the cache folder whose entries to pack (default: `cache_dir`).
        records: the tuning records to pack (default: ``cache_root``'s ``tuning.sqlite``).

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
    with atomic_file(path) as f, tarfile.open(fileobj=f, mode="w") as tar:
        for name, data in [(_MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())] + payloads:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return manifest


def read_manifest(tar: tarfile.TarFile, source: str) -> dict:
    """The checked manifest of an open bundle."""
    try:
        member = tar.getmember(_MANIFEST)
        manifest = json.loads(tar.extractfile(member).read())
    except (KeyError, AttributeError):
        raise BundleError(f"{source}: not a kernel_api bundle (no {_MANIFEST})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BundleError(f"{source}: {_MANIFEST} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise BundleError(f"{source}: not a kernel_api bundle ({_MANIFEST} has no \"format\": \"{_FORMAT}\")")
    if manifest.get("version") != _VERSION:
        raise BundleError(f"{source}: bundle format version {manifest.get('version')!r} is not supported "
                          f"(this kernel_api reads version {_VERSION})")
    files = manifest.get("files")
    if not isinstance(files, dict) or not isinstance(manifest.get("toolchain"), dict) or not all(
            isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("size"), int)
            for v in files.values()):
        raise BundleError(f"{source}: {_MANIFEST} is malformed (needs \"toolchain\" and \"files\" with a sha256 "
                          f"and a size per file)")
    for name in files:
        if name != _RECORDS and not _ENTRY.match(name):
            raise BundleError(f"{source}: refusing file {name!r}: a bundle holds only {_RECORDS} and "
                              f"<namespace>/<key>.bin")
    return manifest


def check_toolchain(manifest: dict, source: str) -> None:
    """Raise `BundleError` naming every version in which the bundle's toolchain differs from
    this process's."""
    here = _toolchain()
    theirs = manifest["toolchain"]
    differences = [f"{name} {theirs.get(name, 'absent')!s} (here: {version})" for name, version in here.items()
                   if theirs.get(name) != version]
    if differences:
        raise BundleError(f"{source}: made with another toolchain, refusing it: {'; '.join(differences)}")


def install_bundle(path: str | os.PathLike, cache_root: str | os.PathLike | None = None,
                   records: TuningRecords | None = None) -> InstallCounts:
    """Check a bundle written by `create_bundle` and install it: its cache files into the cache
    folder, its records merged into the tuning records (the newer record wins per key).

    Args:
        path: the bundle (tar file).
        cache_root: the cache folder to install into (default: `cache_dir`).
        records: the tuning records to merge into (default: ``cache_root``'s ``tuning.sqlite``).

    Raises:
        BundleError: not a bundle, another toolchain, a file that fails its check or is missing
            or not listed (the message names it); nothing is installed then.
    """
    source = f"bundle {os.fspath(path)}"
    root = Path(cache_root) if cache_root is not None else cache_dir()
    try:
        tar = tarfile.open(path, mode="r:*")
    except (OSError, tarfile.TarError) as exc:
        raise BundleError(f"{source}: cannot read it as a tar file ({exc})") from None
    staged: list[tuple[str, Path]] = []  # (temporary file, final path), renamed once all passed
    present = 0
    try:
        with tar:
            manifest = read_manifest(tar, source)
            check_toolchain(manifest, source)
            files = manifest["files"]
            seen = set()
            record_bytes = None
            for member in tar.getmembers():
                name = member.name
                if name == _MANIFEST:
                    continue
                if name not in files:
                    raise BundleError(f"{source}: file {name!r} is not in its manifest, refusing the bundle")
                if not member.isfile() or name in seen:
                    raise BundleError(f"{source}: file {name!r} is not a regular file or appears twice")
                seen.add(name)
                data = tar.extractfile(member).read()
                expected = files[name]
                if len(data) != expected["size"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
                    raise BundleError(f"{source}: file {name!r} fails its SHA-256 check (damaged or tampered "
                                      f"with); nothing was installed")
                if name == _RECORDS:
                    record_bytes = data
                    continue
                if decode_entry(data) is None:  # a valid sha256 but a broken entry: made that way
                    raise BundleError(f"{source}: file {name!r} is not a valid cache entry; nothing was installed")
                final = root / name
                if final.exists() and final.read_bytes() == data:
                    present += 1
                    continue
                final.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".part", dir=final.parent)
                staged.append((tmp, final))
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            missing = sorted(set(files) - seen)
            if missing:
                raise BundleError(f"{source}: file {missing[0]!r} is listed in its manifest but missing "
                                  f"({len(missing)} missing); nothing was installed")
            incoming = []
            if record_bytes is not None:
                try:
                    incoming = records_from_json(json.loads(record_bytes), f"{source}: {_RECORDS}")
                except (ValueError, UnicodeDecodeError) as exc:
                    text = str(exc) if isinstance(exc, RecordsFileError) else f"{source}: {_RECORDS}: {exc}"
                    raise BundleError(text) from None
        for tmp, final in staged:
            os.replace(tmp, final)
        staged = []
    except (OSError, tarfile.TarError) as exc:
        raise BundleError(f"{source}: cannot install it ({exc})") from exc
    finally:
        for tmp, _ in staged:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    store = records if records is not None else TuningRecords(root / "tuning.sqlite")
    merged = store.merge(incoming)
    return InstallCounts(len(seen) - present - (1 if record_bytes is not None else 0), present, merged)
