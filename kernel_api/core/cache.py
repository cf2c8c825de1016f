"""A small on-disk cache of byte blobs, shared by every kind of compiled artifact.

    cache = DiskCache("cubin")
    data = cache.get(key)          # bytes, or None on a miss (or a corrupt entry)
    if data is None:
        data = build()
        cache.put(key, data)

Where: ``$KERNEL_API_CACHE_DIR`` if set, else the user cache directory (platformdirs), one
sub-folder per namespace. ``KERNEL_API_CACHE=0`` turns the disk cache off (``get`` always
misses, ``put`` does nothing). Entries are written to a temporary file in the same folder
and renamed over the final name, so concurrent processes never see half an entry; every entry
carries a SHA-256 of its payload, so a truncated or corrupt file is detected, deleted and
reported as a miss (the caller rebuilds it). When the folder cannot be written, the cache
warns once and keeps entries in memory for the rest of the process.

Entries are executable code, so they are loaded only from folders and files that only this
user can write (`kernel_api.core.trust`'s rule: owned by this user or root, not writable by
others). `DiskCache.get` is the one place every loader (CuTe DSL objects, NVRTC cubins) reads an
entry through: it checks the cache folder and the namespace folder, then the opened entry
itself. An untrusted folder or entry is a miss, logged once as a warning; the caller compiles,
and its entry is kept in memory for the process (an untrusted entry in a trusted folder is
replaced by the rebuilt one). Staged files left by a killed writer (``.*.part``) are removed once
they are an hour old (`remove_stale_parts`).

``tree_digest(folder, suffixes)`` hashes the contents of a source tree (a provider package,
an include folder), for keys that must change whenever a file the artifact was built from does.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import struct
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterable

from .errors import KernelApiError
from .files import atomic_file
from .trust import path_problem, stat_problem

ENV_DIR = "KERNEL_API_CACHE_DIR"
ENV_ENABLE = "KERNEL_API_CACHE"

_MAGIC = b"KAPICH1\n"  # 8 bytes: format of an entry file
_HEADER = struct.Struct("<8s32sQ")  # magic, sha256(payload), payload length
_SAFE_KEY = re.compile(r"^[A-Za-z0-9._-]{1,120}$")
_NAMESPACE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,119}$")  # no '.', '..' or hidden folder
_CHUNK = 1 << 20
# The namespaces kernel_api's own disk caches use: compiled kernels (providers/cutedsl/kernel.py's
# artifacts, nvrtc/compiler.py's cubins, providers/triton's cubins and metadata), and the CuTe DSL
# provider's remembered compiles (small entries naming an artifact).
KERNEL_NAMESPACES = ("cutedsl", "cubin", "triton")
NAMESPACES = KERNEL_NAMESPACES + ("cutedsl-compiles",)
STALE_PART_SECONDS = 3600  # a staged file this old has no writer left: a bundle stages in seconds to minutes

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_memory: dict[tuple[str, str, str], bytes] = {}  # fallback store for unwritable folders
_warned: set[str] = set()
_untrusted_warned: set[str] = set()
_swept: set[str] = set()  # folders whose stale staged files this process removed already
_file_digests: dict[str, tuple[int, int, bytes]] = {}  # path -> (mtime_ns, size, sha256 of contents)


def cache_enabled() -> bool:
    """False when ``KERNEL_API_CACHE`` is 0/false/no/off."""
    return os.environ.get(ENV_ENABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """The root cache folder: ``$KERNEL_API_CACHE_DIR``, else the platform's user cache dir."""
    explicit = os.environ.get(ENV_DIR)
    if explicit:
        return Path(explicit).expanduser()
    return _platform_cache_dir(os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"))


@functools.lru_cache(maxsize=8)
def _platform_cache_dir(xdg_cache_home: str | None, home: str | None) -> Path:
    """The platform's user cache folder for kernel_api, for the environment values it reads
    (looked up once per value: every cache read asks for the folder)."""
    try:
        import platformdirs
    except ImportError:  # a bare machine without platformdirs: follow the XDG convention
        base = xdg_cache_home or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "kernel_api"
    return Path(platformdirs.user_cache_dir("kernel_api", appauthor=False))


def make_key(*parts: Any) -> str:
    """A filename-safe key (hex SHA-256) for any parts with a stable ``repr``."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, (bytes, bytearray)):
            data = bytes(part)
        else:
            data = repr(part).encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def tree_digest(folder: str | os.PathLike, suffixes: tuple[str, ...]) -> str:
    """SHA-256 (hex) of the relative paths and contents of the files under ``folder``.

    Only files whose name ends with one of ``suffixes`` count (``""`` in ``suffixes`` also
    takes names without a dot, such as libcu++'s headers); hidden folders and
    ``__pycache__`` are skipped, and a missing folder has a digest of its own. Every call
    walks the tree, but a file is read again only when its size or modification time
    changed since this process last hashed it, so a repeated call costs one ``stat`` per file.
    """
    root = os.path.abspath(os.fspath(folder))
    wanted = tuple(s for s in suffixes if s)
    bare = "" in suffixes
    files = []
    for parent, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        for name in names:
            if name.endswith(wanted) or (bare and "." not in name):
                files.append(os.path.join(parent, name))
    h = hashlib.sha256(b"tree" if os.path.isdir(root) else b"missing folder")
    for path in sorted(files):
        try:
            st = os.stat(path)
        except OSError:
            continue  # deleted while walking
        known = _file_digests.get(path)
        if known is not None and known[0] == st.st_mtime_ns and known[1] == st.st_size:
            digest = known[2]
        else:
            try:
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).digest()
            except OSError:
                continue  # unreadable: the compiler cannot read it either
            _file_digests[path] = (st.st_mtime_ns, st.st_size, digest)
        relative = os.path.relpath(path, root).encode()
        h.update(len(relative).to_bytes(8, "little") + relative + digest)
    return h.hexdigest()


def encode_entry(payload: bytes) -> bytes:
    """Payload framed with a magic, its length and its checksum (what an entry file holds)."""
    return _HEADER.pack(_MAGIC, hashlib.sha256(payload).digest(), len(payload)) + payload


def decode_entry(blob: bytes) -> bytes | None:
    """The payload of an entry file, or None when it is truncated or corrupt."""
    if len(blob) < _HEADER.size:
        return None
    magic, digest, length = _HEADER.unpack_from(blob)
    payload = blob[_HEADER.size:]
    if magic != _MAGIC or length != len(payload) or hashlib.sha256(payload).digest() != digest:
        return None
    return payload


def entry_file_ok(path: str | os.PathLike) -> bool:
    """Whether the file ``path`` holds a valid entry (what `decode_entry` checks), read in
    chunks so a large file is never held in memory whole."""
    try:
        with open(path, "rb") as f:
            header = f.read(_HEADER.size)
            if len(header) < _HEADER.size:
                return False
            magic, digest, length = _HEADER.unpack(header)
            h = hashlib.sha256()
            size = 0
            while chunk := f.read(_CHUNK):
                size += len(chunk)
                h.update(chunk)
    except OSError:
        return False
    return magic == _MAGIC and size == length and h.digest() == digest


class UntrustedCacheError(KernelApiError):
    """A cache folder or namespace folder another user could write: what kernel_api would put
    there would never be loaded; the message names the folder and why."""


def untrusted_folders(root: str | os.PathLike, namespaces: Iterable[str] = ()) -> dict[Path, str]:
    """The folders among the cache folder ``root`` and its namespace folders that fail the
    permission rule (`kernel_api.core.trust`): the one check behind every loader, ``cache info``,
    ``precompile`` and ``bundle install``.

    Args:
        root: the cache folder.
        namespaces: namespace names; ``root/<name>`` is checked for each (a missing one passes).

    Returns:
        Each failing folder with its problem (naming the folder), ``root`` first; empty when all pass.
    """
    root = Path(root)
    found = {}
    for folder in [root] + [root / name for name in namespaces]:
        problem = path_problem(folder)
        if problem is not None:
            found[folder] = problem
    return found


def folder_problem(folder: str | os.PathLike) -> str | None:
    """Why entries of the namespace folder ``folder`` must not be loaded (it, or the cache
    folder above it, may be written by another user), or None.

    Args:
        folder: a namespace folder, ``<cache dir>/<namespace>``.

    Returns:
        The problem, naming the folder (see `kernel_api.core.trust.stat_problem`), or None.
    """
    folder = Path(folder)
    return next(iter(untrusted_folders(folder.parent, [folder.name]).values()), None)


def staged_name(name: str) -> bool:
    """Whether ``name`` is a staged file's (``.*.part``: `atomic_file`'s and a bundle install's),
    which a writer renames over its final name once written."""
    return name.startswith(".") and name.endswith(".part")


def remove_stale_parts(folder: str | os.PathLike, max_age_s: float = STALE_PART_SECONDS) -> int:
    """Delete staged files (``.*.part``: `atomic_file`'s and a bundle install's) older than
    ``max_age_s`` in ``folder``: what a writer killed before its rename left behind. A live
    writer's staged file is younger: it is written and renamed within one install.

    Args:
        folder: a namespace folder.
        max_age_s: the age, from the last modification, past which a staged file is removed.

    Returns:
        How many files were removed.
    """
    removed = 0
    cutoff = time.time() - max_age_s
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    for entry in entries:
        if not staged_name(entry.name):
            continue
        try:
            if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                os.unlink(entry.path)
                removed += 1
        except OSError:
            continue  # renamed or removed meanwhile
    if removed:
        _log.debug("cache: removed %d stale staged file(s) in %s", removed, folder)
    return removed


def _warn_untrusted(subject: str, problem: str) -> None:
    """Log ``problem`` once per ``subject`` (a folder) as a warning."""
    with _lock:
        if subject in _untrusted_warned:
            return
        _untrusted_warned.add(subject)
    _log.warning("kernel_api: not loading compiled artifacts: %s; compiling in memory instead "
                 "(docs/security.md)", problem)


class DiskCache:
    """Byte blobs under ``<cache dir>/<namespace>/``, keyed by strings.

    ``directory`` fixes the root folder; by default it is read from the environment at each
    call (so tests and users may change ``KERNEL_API_CACHE_DIR`` at run time). ``stats``
    counts hits, misses, corrupt entries discarded, writes and untrusted folders or entries
    not loaded, for tests and reports.
    """

    def __init__(self, namespace: str, directory: str | os.PathLike | None = None) -> None:
        if not namespace or not _NAMESPACE.match(namespace):
            raise ValueError(f"DiskCache namespace {namespace!r}: use letters, digits, '.', '_' or '-', "
                             f"not starting with '.'")
        self.namespace = namespace
        self._directory = None if directory is None else Path(directory)
        self.stats = {"hits": 0, "misses": 0, "corrupt": 0, "writes": 0, "untrusted": 0}

    @property
    def directory(self) -> Path:
        return (self._directory if self._directory is not None else cache_dir()) / self.namespace

    def path(self, key: str) -> Path:
        """The file an entry lives in (keys that are not filename-safe are hashed)."""
        return self.directory / f"{_file_key(key)}.bin"

    def get(self, key: str) -> bytes | None:
        """The bytes stored under ``key``, or None (missing, disabled, or corrupt and removed)."""
        if not cache_enabled():
            self.stats["misses"] += 1
            _log.debug("%s cache miss (disabled by %s): %.16s", self.namespace, ENV_ENABLE, key)
            return None
        folder = self.directory
        memo = _memory.get((str(folder), self.namespace, key))
        if memo is not None:
            self.stats["hits"] += 1
            _log.debug("%s cache hit (in memory): %.16s", self.namespace, key)
            return memo
        path = folder / f"{_file_key(key)}.bin"
        problem = folder_problem(folder)
        if problem is None:
            try:
                with open(path, "rb") as f:
                    # The opened file itself is checked: nothing can swap it between check and read.
                    problem = stat_problem(os.fstat(f.fileno()))
                    problem = None if problem is None else f"cache entry {path} {problem}"
                    blob = f.read() if problem is None else b""
            except OSError:
                self.stats["misses"] += 1
                _log.debug("%s cache miss: %s", self.namespace, path)
                return None
        if problem is not None:
            self.stats["untrusted"] += 1
            self.stats["misses"] += 1
            _warn_untrusted(str(folder), problem)
            return None
        payload = decode_entry(blob)
        if payload is None:
            # Truncated or corrupt (a crash mid-write elsewhere, disk trouble, tampering):
            # never load it; drop it so the caller's rebuild replaces it.
            self.stats["corrupt"] += 1
            self.stats["misses"] += 1
            _log.debug("%s cache entry %s is corrupt or truncated (%d bytes): deleted, a miss", self.namespace,
                       path, len(blob))
            try:
                os.unlink(path)
            except OSError:
                pass
            return None
        self.stats["hits"] += 1
        _log.debug("%s cache hit: %s (%d bytes)", self.namespace, path, len(payload))
        return payload

    def put(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key`` atomically; False when it went to memory or nowhere."""
        if not cache_enabled():
            return False
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"DiskCache.put: data must be bytes, got {type(data).__name__}")
        data = bytes(data)
        folder = self.directory
        path = folder / f"{_file_key(key)}.bin"
        problem = folder_problem(folder)
        if problem is not None:  # another user could replace what we write: keep it to ourselves
            _warn_untrusted(str(folder), problem)
            with _lock:
                _memory[(str(folder), self.namespace, key)] = data
            return False
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with atomic_file(path) as f:
                f.write(encode_entry(data))
        except OSError as exc:
            _log.debug("%s cache: %s is not writable (%s); entry kept in memory", self.namespace, folder, exc)
            with _lock:
                _memory[(str(folder), self.namespace, key)] = data
                if str(folder) not in _warned:
                    _warned.add(str(folder))
                    warnings.warn(
                        f"kernel_api: cache folder {folder} is not writable ({exc}); keeping compiled "
                        f"artifacts in memory for this process (set {ENV_DIR} to a writable folder)",
                        RuntimeWarning, stacklevel=2)
            return False
        self.stats["writes"] += 1
        _log.debug("%s cache: stored %s (%d bytes)", self.namespace, path, len(data))
        if str(folder) not in _swept:
            _swept.add(str(folder))
            remove_stale_parts(folder)
        return True

    def delete(self, key: str) -> None:
        """Forget ``key`` (on disk and in the memory fallback)."""
        _memory.pop((str(self.directory), self.namespace, key), None)
        try:
            os.unlink(self.path(key))
        except OSError:
            pass

    def __repr__(self) -> str:
        return f"DiskCache({self.namespace!r}, directory={str(self.directory)!r})"


def _file_key(key: str) -> str:
    if not isinstance(key, str):
        raise TypeError(f"cache key must be a str, got {type(key).__name__}")
    return key if _SAFE_KEY.match(key) else hashlib.sha256(key.encode()).hexdigest()
