"""Tuning records: which kernel won for a (device, cc, operation signature, problem shape).

Stored in SQLite (``tuning.sqlite`` in the cache folder, WAL mode, a busy timeout) so any
later process picks the recorded winner without benchmarking again. Each record is keyed on
the toolchain that measured it too (kernel_api's version, the CuTe DSL's version and CUDA
variant), and its operation field (`record_key`) on the versions of the providers whose
kernels may be candidates: after an upgrade the old winners count as missing. The records are an
optimisation, so trouble never costs the caller a choice: a damaged database (a bad header,
or damaged pages found by any query) is set aside as ``tuning.sqlite.corrupt-<time>`` and
recreated with a warning; a damaged row counts as missing, with a logged warning; a write
that fails (locked past the busy timeout, disk full...) warns and the winner is kept for
the rest of the process. A database in a folder this process cannot write (a cache baked into
a container image and mounted read-only) is opened read-only, so its records still serve; with
no database there, records are kept in memory. ``KERNEL_API_RECORDS_TIMEOUT`` sets the busy
timeout in seconds (default 30); a command that still finds the database locked raises
`RecordsLockedError`.

Records move between machines as JSON (`export_records`, `import_records`; the command line's
``kernel-api records export/import``): each record keeps its toolchain, and a merge keeps, per
key (device, cc, operation, shape, toolchain key), the newer record, so an import never
overwrites a newer local winner. A record dated in the future is dated at its merge instead,
and a stored one dated in the future loses to any incoming record, so a wrong clock cannot
make a record win forever.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import json
import logging
import math
import os
import sqlite3
import threading
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, TypeVar

from ..core.arch import normalize_cc
from ..core.cache import cache_dir
from ..core.errors import KernelApiError
from ..core.files import atomic_file, read_json, writable
from ..core.toolchain import tuning_toolchain

# The first schema's table, "records", had no toolchain key; its rows count as missing (an old
# kernel_api may still be using them, so they are left alone).
_TABLE = "tuning_records"
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {_TABLE} (
    device TEXT NOT NULL,
    cc INTEGER NOT NULL,
    operation TEXT NOT NULL,
    shape TEXT NOT NULL,
    toolchain_key TEXT NOT NULL,
    kernel_name TEXT NOT NULL,
    median_ms REAL NOT NULL,
    runners_up TEXT NOT NULL,
    toolchain TEXT NOT NULL,
    created TEXT NOT NULL,
    PRIMARY KEY (device, cc, operation, shape, toolchain_key)
)
"""
_COLUMNS = "device, cc, operation, shape, kernel_name, median_ms, runners_up, toolchain, created, toolchain_key"
_CORRUPT_CODES = (11, 26)  # SQLITE_CORRUPT ("disk image is malformed"), SQLITE_NOTADB
_BUSY_CODES = (5, 6)  # SQLITE_BUSY, SQLITE_LOCKED
_UNWRITABLE_CODES = (8, 14)  # SQLITE_READONLY, SQLITE_CANTOPEN ("unable to open database file")
ENV_TIMEOUT = "KERNEL_API_RECORDS_TIMEOUT"
DEFAULT_TIMEOUT_S = 30.0
_T = TypeVar("_T")
_log = logging.getLogger(__name__)


class RecordsLockedError(KernelApiError, sqlite3.OperationalError):
    """The tuning records stayed locked by another process for the whole busy timeout."""


class RecordsNotWritableError(KernelApiError):
    """The tuning records cannot be written here (a read-only folder); nothing was changed."""


@dataclass(frozen=True)
class TuningRecord:
    """One recorded winner; ``runners_up`` maps kernel names to their median ms, ``toolchain``
    holds the versions it was measured with and ``toolchain_key`` the part a lookup matches."""

    device: str
    cc: int
    operation: str
    shape: str
    kernel_name: str
    median_ms: float
    runners_up: dict
    toolchain: dict
    created: str
    toolchain_key: str = ""


def _from_row(row: tuple) -> TuningRecord:
    """The record a row holds; ValueError when its JSON columns are damaged."""
    runners_up, toolchain = json.loads(row[6]), json.loads(row[7])
    if not isinstance(runners_up, dict) or not isinstance(toolchain, dict):
        raise ValueError("runners_up and toolchain must be JSON objects")
    return TuningRecord(*row[:6], runners_up, toolchain, row[8], row[9])


def _damaged(row: tuple, exc: Exception, path: Path) -> None:
    _log.warning("tuning records %s: the row for %s %s (device %s, cc %s) is damaged (%s); it counts as missing",
                 path, row[2], row[3], row[0], row[1], exc)


def _is_corrupt(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _CORRUPT_CODES
    text = str(exc)  # Python 3.10 does not expose the error code
    return "malformed" in text or "not a database" in text


def _is_unwritable(exc: sqlite3.Error) -> bool:
    """Whether SQLite could not open or write the database file (a read-only file or folder, a
    missing or unreadable path): the records then live in memory."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _UNWRITABLE_CODES
    text = str(exc)  # Python 3.10 does not expose the error code
    return "readonly" in text or "unable to open" in text


def _is_busy(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)  # absent before Python 3.11: then never
    return code is not None and code & 0xFF in _BUSY_CODES


def _default_timeout() -> float:
    text = os.environ.get(ENV_TIMEOUT, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{ENV_TIMEOUT}: expected seconds >= 0, got {text!r}")
    return value


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


class TuningRecords:
    """The SQLite store of tuning results (one connection per thread).

    ``toolchain_key`` is what lookups match and records carry (default: this process's
    kernel_api and DSL versions, `kernel_api.core.toolchain.tuning_toolchain`); ``timeout`` is
    SQLite's busy timeout in seconds (default: ``$KERNEL_API_RECORDS_TIMEOUT``, else 30).
    ``read_only``: `record` writes nothing and keeps the new record in this object (its `lookup`
    returns it): the tuning workers of `tune_shapes` read the store and hand their records to
    the parent, which merges them in one transaction.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, toolchain_key: str | None = None,
                 timeout: float | None = None, read_only: bool = False) -> None:
        self.path = Path(path) if path is not None else cache_dir() / "tuning.sqlite"
        self.timeout = _default_timeout() if timeout is None else timeout
        self.read_only = read_only
        self._toolchain_key = toolchain_key
        self._local = threading.local()
        self._memory_fallback = False
        self._opened_read_only = False  # the file's folder is not writable: the database is read, never written
        self._not_saved: str | None = None  # why records are not saved to the file (None: they are)
        self._unsaved: dict[tuple, TuningRecord] = {}  # winners whose write failed, kept for this process
        self._lock = threading.Lock()

    @property
    def toolchain_key(self) -> str:
        if self._toolchain_key is None:
            self._toolchain_key = tuning_toolchain()
        return self._toolchain_key

    def _connect(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        conn = self._open()
        self._local.conn = conn
        self._local.inode = None if self._memory_fallback else _inode(self.path)
        return conn

    @property
    def why_not_saved(self) -> str | None:
        """None when what this store records or merges is saved to its file; else why not (the
        file's folder is read-only, so it is opened read-only; or records are kept in memory)."""
        self._connect()
        return self._not_saved

    def _open(self) -> sqlite3.Connection:
        if self._memory_fallback:
            return self._init(sqlite3.connect(":memory:"))
        if self.path.exists() and not writable(self.path):
            return self._open_read_only()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return self._init(sqlite3.connect(str(self.path), timeout=self.timeout))
        except sqlite3.DatabaseError as exc:
            if _is_corrupt(exc):
                return self._recreate(exc)
            if isinstance(exc, sqlite3.OperationalError) and not _is_unwritable(exc):
                raise
            return self._fallback(exc)
        except OSError as exc:
            return self._fallback(exc)

    def _open_read_only(self) -> sqlite3.Connection:
        """The database opened read-only. A WAL database whose journal files are absent cannot
        be opened so in a folder nobody may write (SQLite would create them); then nobody
        writes it, and it is opened as immutable."""
        uri = self.path.absolute().as_uri()
        failure: Exception | None = None
        for query in ("mode=ro", "mode=ro&immutable=1"):
            conn = None
            try:
                conn = sqlite3.connect(f"{uri}?{query}", uri=True, timeout=self.timeout)
                found = conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?",
                                     (_TABLE,)).fetchone()
            except sqlite3.DatabaseError as exc:
                if conn is not None:
                    conn.close()
                failure = exc
                if _is_corrupt(exc):
                    break  # damaged, and it cannot be set aside here
                continue
            if found is None:  # no records of this schema to read
                conn.close()
                failure = OSError(f"the folder is read-only and the database has no {_TABLE} table")
                break
            _log.info("tuning records %s: the folder is not writable; reading them read-only (%s)", self.path,
                      query)
            self._opened_read_only = True
            self._not_saved = "its folder is read-only"
            return conn
        return self._fallback(failure)

    def _init(self, conn: sqlite3.Connection) -> sqlite3.Connection:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(_SCHEMA)
            conn.commit()
        except sqlite3.DatabaseError as exc:
            conn.close()
            if _is_corrupt(exc):
                return self._recreate(exc)
            if _is_unwritable(exc):
                return self._fallback(exc)
            raise
        return conn

    def _move_aside(self, exc: Exception) -> None:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        warnings.warn(f"kernel_api: tuning records {self.path} were unreadable ({exc}); moved to {aside.name} "
                      f"and starting afresh", RuntimeWarning, stacklevel=5)
        for suffix in ("", "-wal", "-shm"):
            try:
                os.replace(str(self.path) + suffix, str(aside) + suffix)
            except OSError:
                pass

    def _recreate(self, exc: Exception) -> sqlite3.Connection:
        self._move_aside(exc)
        return self._init(sqlite3.connect(str(self.path), timeout=self.timeout))

    def _fallback(self, exc: Exception) -> sqlite3.Connection:
        warnings.warn(f"kernel_api: cannot write tuning records at {self.path} ({exc}); keeping them in memory "
                      f"for this process", RuntimeWarning, stacklevel=4)
        self._memory_fallback = True
        self._not_saved = f"they are kept in memory: {exc}"
        return self._init(sqlite3.connect(":memory:"))

    def _execute(self, work: Callable[[sqlite3.Connection], _T]) -> _T:
        """``work(connection)``; when it finds the database damaged (a valid header but damaged
        pages is only noticed by the query that reads them), the file is set aside and ``work``
        runs once more on a fresh database. A database still locked by another process after
        the busy timeout raises `RecordsLockedError`."""
        try:
            try:
                return work(self._connect())
            except sqlite3.DatabaseError as exc:
                if not _is_corrupt(exc) or self._opened_read_only:
                    raise
                self.close()
                inode = getattr(self._local, "inode", None)
                with self._lock:
                    # Another thread or process may have replaced the file already: then only reconnect.
                    if inode is not None and _inode(self.path) == inode:
                        self._move_aside(exc)
            return work(self._connect())
        except sqlite3.OperationalError as exc:
            if not _is_busy(exc) or isinstance(exc, RecordsLockedError):
                raise
            raise RecordsLockedError(f"tuning records {self.path} are locked by another process (waited "
                                     f"{self.timeout:g} s; {ENV_TIMEOUT} sets how long)") from exc

    def lookup(self, device: str, cc: int, operation: str, shape: str) -> TuningRecord | None:
        """The winner recorded for this key with this toolchain, or None.

        A record measured with another kernel_api or DSL version counts as missing; so does
        one that cannot be read (the database locked past the busy timeout, say), with a warning.
        """
        unsaved = self._unsaved.get((device, cc, operation, shape))
        if unsaved is not None:
            return unsaved
        try:
            row = self._execute(lambda conn: conn.execute(
                f"SELECT {_COLUMNS} FROM {_TABLE} WHERE device=? AND cc=? AND operation=? AND shape=? "
                f"AND toolchain_key=?", (device, cc, operation, shape, self.toolchain_key)).fetchone())
        except (sqlite3.Error, OSError) as exc:
            warnings.warn(f"kernel_api: cannot read tuning records at {self.path} ({exc}); treating "
                          f"{operation} {shape} as not yet tuned", RuntimeWarning, stacklevel=2)
            return None
        if row is None:
            return None
        try:
            return _from_row(row)
        except (ValueError, TypeError) as exc:
            _damaged(row, exc, self.path)
            return None

    def record(self, device: str, cc: int, operation: str, shape: str, kernel_name: str, median_ms: float,
               runners_up: dict[str, float], toolchain: dict[str, str]) -> TuningRecord:
        """Store (replace) the winner for this key and toolchain, and return it (a read-only
        store only keeps it in this object).

        A failed write warns instead of raising, and the winner is still returned by this
        object's `lookup` for the rest of the process: the measurement is not lost.
        """
        created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        found = TuningRecord(device, cc, operation, shape, kernel_name, float(median_ms), runners_up, toolchain,
                             created, self.toolchain_key)
        row = (device, cc, operation, shape, kernel_name, float(median_ms), json.dumps(runners_up, sort_keys=True),
               json.dumps(toolchain, sort_keys=True), created, self.toolchain_key)

        def write(conn: sqlite3.Connection) -> None:
            with conn:
                conn.execute(f"INSERT OR REPLACE INTO {_TABLE} ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                             row)

        key = (device, cc, operation, shape)
        if self.read_only:
            self._unsaved[key] = found
            return found
        try:
            self._execute(write)
        except (sqlite3.Error, OSError) as exc:
            warnings.warn(f"kernel_api: could not save the tuning record for {operation} {shape} in {self.path} "
                          f"({exc}); this process keeps {kernel_name}, later ones will measure again",
                          RuntimeWarning, stacklevel=2)
            self._unsaved[key] = found
        else:
            self._unsaved.pop(key, None)
        return found

    def all(self) -> list[TuningRecord]:
        """Every stored record, of every toolchain, oldest first; damaged rows are left out
        (with a logged warning)."""
        rows = self._execute(lambda conn: conn.execute(
            f"SELECT {_COLUMNS} FROM {_TABLE} ORDER BY created").fetchall())
        found = []
        for row in rows:
            try:
                found.append(_from_row(row))
            except (ValueError, TypeError) as exc:
                _damaged(row, exc, self.path)
        return found

    def merge(self, incoming: Iterable[TuningRecord]) -> "MergeCounts":
        """Merge ``incoming`` records (of any toolchain) into the store, in one transaction.

        Per key (device, cc, operation, shape, toolchain key) the newer record by ``created``
        wins; on a tie the local one stays. An incoming record dated in the future is dated now
        instead, and a local one dated in the future (or unreadably) counts as older than any.
        A store that cannot save (`why_not_saved`) keeps the winners in this object for the
        rest of the process, with a warning.

        Returns:
            How many were added, replaced, and kept because the local record was as new or newer.
        """
        now = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)
        incoming = [_not_after(r, now) for r in incoming]
        winners: list[TuningRecord] = []

        def work(conn: sqlite3.Connection) -> MergeCounts:
            added = replaced = kept = 0
            winners.clear()
            with conn:
                for r in incoming:
                    found = conn.execute(
                        f"SELECT created FROM {_TABLE} WHERE device=? AND cc=? AND operation=? AND shape=? "
                        f"AND toolchain_key=?", (r.device, r.cc, r.operation, r.shape, r.toolchain_key)).fetchone()
                    if found is not None and _holds(found[0], r.created, now):
                        kept += 1
                        continue
                    winners.append(r)
                    if not self._opened_read_only:
                        conn.execute(f"INSERT OR REPLACE INTO {_TABLE} ({_COLUMNS}) VALUES "
                                     f"(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                     (r.device, r.cc, r.operation, r.shape, r.kernel_name, r.median_ms,
                                      json.dumps(r.runners_up, sort_keys=True),
                                      json.dumps(r.toolchain, sort_keys=True), r.created, r.toolchain_key))
                    if found is None:
                        added += 1
                    else:
                        replaced += 1
            return MergeCounts(added, replaced, kept)

        counts = self._execute(work)
        if self._opened_read_only:
            ours = [r for r in winners if r.toolchain_key == self.toolchain_key]
            for r in ours:
                self._unsaved[(r.device, r.cc, r.operation, r.shape)] = r
            if winners:
                warnings.warn(f"kernel_api: cannot save {len(winners)} tuning record(s) in {self.path} "
                              f"({self._not_saved}); this process keeps them, later ones will measure again",
                              RuntimeWarning, stacklevel=2)
        else:
            for r in incoming:  # a winner this process kept after a failed write is superseded by the store
                self._unsaved.pop((r.device, r.cc, r.operation, r.shape), None)
        return counts

    def clear(self) -> int:
        """Delete every stored record (those of the first schema's table too); returns how many."""
        def delete(conn: sqlite3.Connection) -> int:
            with conn:
                count = conn.execute(f"DELETE FROM {_TABLE}").rowcount
                if conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='records'").fetchone():
                    count += conn.execute("DELETE FROM records").rowcount
                return count

        self._unsaved.clear()
        return self._execute(delete)

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


class MergeCounts(NamedTuple):
    """What a merge did: records added, local records replaced by newer ones, and incoming
    records dropped because the local one was as new or newer."""

    added: int
    replaced: int
    kept: int


class RecordsFileError(KernelApiError, ValueError):
    """A tuning-records file that cannot be read; the message names the file and the problem."""


_FILE_FORMAT = "kernel_api.tuning_records"
_FILE_VERSION = 1
# Field name -> (accepted types, description): what every record in a file must hold.
_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "device": ((str,), "a string"), "cc": ((int,), "an integer"), "operation": ((str,), "a string"),
    "shape": ((str,), "a string"), "kernel_name": ((str,), "a string"), "median_ms": ((int, float), "a number"),
    "runners_up": ((dict,), "an object"), "toolchain": ((dict,), "an object"), "created": ((str,), "a string"),
    "toolchain_key": ((str,), "a string"),
}


def _timestamp(created: str) -> _dt.datetime:
    """A record's creation time, comparable across records (naive times count as UTC)."""
    found = _dt.datetime.fromisoformat(created)
    return found if found.tzinfo is not None else found.replace(tzinfo=_dt.timezone.utc)


def _not_after(record: TuningRecord, now: _dt.datetime) -> TuningRecord:
    """``record``, dated ``now`` when it is dated later (a wrong clock where it was measured)."""
    if _timestamp(record.created) <= now:
        return record
    _log.warning("tuning record for %s %s (device %s) is dated %s, in the future: dated %s instead",
                 record.operation, record.shape, record.device, record.created, now.isoformat())
    return dataclasses.replace(record, created=now.isoformat())


def _holds(local: str, incoming: str, now: _dt.datetime) -> bool:
    """Whether a stored record created at ``local`` stays against one created at ``incoming``
    (not later than ``now``): it is as new or newer, and neither dated in the future nor
    unreadably."""
    try:
        when = _timestamp(local)
    except (ValueError, TypeError):
        return False
    return when <= now and when >= _timestamp(incoming)


def _is_time(value: Any) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and value >= 0
    except OverflowError:
        return False


def _short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters (a value in a file may be huge)."""
    if isinstance(value, int) and value.bit_length() > 200:  # repr of a huge int is slow, or refused
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def records_to_json(records: Iterable[TuningRecord]) -> dict:
    """The JSON document `export_records` writes (and `records_from_json` reads)."""
    return {"format": _FILE_FORMAT, "version": _FILE_VERSION, "records": [asdict(r) for r in records]}


def records_from_json(document: Any, source: str = "tuning records") -> list[TuningRecord]:
    """The records of a document written by `records_to_json`.

    Raises:
        RecordsFileError: naming ``source``, the record's index and the field at fault.
    """
    if not isinstance(document, dict) or document.get("format") != _FILE_FORMAT:
        raise RecordsFileError(f"{source}: not a kernel_api tuning-records file (expected an object with "
                               f"\"format\": \"{_FILE_FORMAT}\")")
    if document.get("version") != _FILE_VERSION:
        raise RecordsFileError(f"{source}: format version {document.get('version')!r} is not supported "
                               f"(this kernel_api reads version {_FILE_VERSION})")
    items = document.get("records")
    if not isinstance(items, list):
        raise RecordsFileError(f"{source}: \"records\" must be a list")
    names = [f.name for f in fields(TuningRecord)]
    found = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise RecordsFileError(f"{source}: record {i} must be an object, got {type(item).__name__}")
        for name in names:
            if name not in item:
                raise RecordsFileError(f"{source}: record {i} has no field {name!r}")
            types, what = _FIELD_TYPES[name]
            value = item[name]
            if not isinstance(value, types) or isinstance(value, bool):
                raise RecordsFileError(f"{source}: record {i}: field {name!r} must be {what}, got {value!r}")
        try:
            normalize_cc(item["cc"])
        except ValueError:
            raise RecordsFileError(f"{source}: record {i}: field 'cc' must be a compute capability such as 90, "
                                   f"got {_short(item['cc'])}") from None
        try:
            finite = math.isfinite(item["median_ms"])
        except OverflowError:  # an integer beyond any float
            finite = False
        if not finite or item["median_ms"] < 0:
            raise RecordsFileError(f"{source}: record {i}: field 'median_ms' must be a finite time >= 0, "
                                   f"got {_short(item['median_ms'])}")
        for name, check, what in (("runners_up", _is_time, "kernel names mapped to times in ms"),
                                  ("toolchain", lambda v: isinstance(v, str), "names mapped to version strings")):
            bad = next((k for k, v in item[name].items() if not check(v)), None)
            if bad is not None:
                raise RecordsFileError(f"{source}: record {i}: field {name!r} must hold {what}; "
                                       f"{bad!r} maps to {_short(item[name][bad])}")
        try:
            _timestamp(item["created"])
        except ValueError:
            raise RecordsFileError(f"{source}: record {i}: field 'created' must be an ISO 8601 time, "
                                   f"got {item['created']!r}") from None
        unknown = sorted(set(item) - set(names))
        if unknown:
            raise RecordsFileError(f"{source}: record {i} has unknown field(s) {', '.join(map(repr, unknown))}")
        found.append(TuningRecord(**{name: item[name] for name in names}))
    return found


def write_json_atomically(path: str | os.PathLike, document: Any) -> None:
    """Write ``document`` as JSON to ``path`` through a temporary file renamed over it, so a
    reader never sees half a file."""
    with atomic_file(path, "w") as f:
        json.dump(document, f, indent=1, sort_keys=True)


def export_records(path: str | os.PathLike, records: TuningRecords | None = None) -> int:
    """Write every tuning record (of every toolchain, each with its toolchain) to the JSON file
    ``path``; returns how many.

    Args:
        path: the file to write (replaced atomically).
        records: the store to read (default: the cache folder's ``tuning.sqlite``).
    """
    store = records if records is not None else TuningRecords()
    found = store.all()
    write_json_atomically(path, records_to_json(found))
    return len(found)


def import_records(path: str | os.PathLike, records: TuningRecords | None = None) -> MergeCounts:
    """Merge the records of a JSON file written by `export_records` into the store: per key the
    newer record wins, so a newer local record is never overwritten (`TuningRecords.merge`).

    Args:
        path: the file to read.
        records: the store to merge into (default: the cache folder's ``tuning.sqlite``).

    Returns:
        How many records were added, replaced, and kept (`MergeCounts`).

    Raises:
        RecordsFileError: the file cannot be read or is not a valid records file (the message
            names the file, and the record and field at fault); nothing is merged then.
        RecordsNotWritableError: the store cannot save what it merges (a read-only folder).
        RecordsLockedError: another process kept the store locked past its busy timeout.
    """
    document = read_json(path, f"tuning records {os.fspath(path)}", RecordsFileError)
    found = records_from_json(document, f"tuning records {os.fspath(path)}")
    store = records if records is not None else TuningRecords()
    why = store.why_not_saved
    if why is not None:
        raise RecordsNotWritableError(f"tuning records {store.path}: cannot save records there ({why}); "
                                      f"nothing was imported")
    return store.merge(found)


def toolchain_versions() -> dict[str, str]:
    """Versions that a recorded timing depends on (a new dict each call)."""
    return dict(_toolchain_versions())


@functools.lru_cache(maxsize=1)
def _toolchain_versions() -> tuple[tuple[str, str], ...]:
    # Read once per process: installed versions do not change under a running process, and
    # each look-up scans the installed distributions (milliseconds per tuned problem).
    from importlib.metadata import version

    import torch

    found = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi", "cuda-python", "kernel-api"):
        try:
            found[dist] = version(dist)
        except Exception:
            pass
    return tuple(found.items())


def operation_key(args: Any) -> tuple[str, str]:
    """(operation signature, problem shape) strings for an arguments object.

    The shape is ``problem_shape`` where the type has one (GEMM: MxNxK[xL]); else the values of
    its `Arguments.problem_key` besides the type and the signature, joined by ``x`` (softmax:
    rows x cols; attention: batch, sequence lengths, heads, scale), so two problems that the
    front door chooses for apart are recorded apart.
    """
    signature = repr(args.signature)
    if hasattr(args, "problem_shape"):
        shape = "x".join(map(str, args.problem_shape))
    elif not hasattr(args, "problem_key"):
        shape = f"{getattr(args, 'rows', '?')}x{getattr(args, 'cols', '?')}"
    else:
        parts = [v for v in args.problem_key() if not isinstance(v, type) and v is not args.signature]
        shape = "x".join(",".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in parts) or "-"
    return signature, shape


#: The format of the keys `record_key` builds, first in their operation field. Records stored
#: under an older format (the bare signature, which said nothing of the math allowed, the
#: providers or the timing; "k2", which said nothing of the providers' versions) are never
#: matched, so no winner is reused for a setting that its measurement did not cover.
RECORD_KEY_FORMAT = "k3"


class RecordContext(NamedTuple):
    """What decides a tuning's winner besides the problem: everything that changes the candidate
    set or how the candidates are ranked.

    ``math``: the math the candidates may use where a setting chooses it (for f32 GEMMs
    ``"tf32"`` while torch allows TF32 matmuls, else ``"f32"``: cuBLAS follows that flag and
    `kernel_api.ops` offers tf32 and 3xTF32 kernels only under it); ``"native"`` where no
    setting does. ``providers``: the provider names the candidates came from (sorted; None:
    every registered provider). ``timing``: the policy's measuring options that can rank kernels
    differently, e.g. ``"as_called/own"``. ``versions``: (name, version) of every provider whose
    kernels may be candidates (`kernel_api.registry.versions.provider_versions`, sorted by name),
    so that a new release of any of them, the winner's or a loser's that may now win, re-tunes.
    ``limit``: how many of the best-ranked candidates were measured, where that left some out
    (`PickBest`'s ``max_candidates``); None where every candidate was.
    """

    math: str = "native"
    providers: tuple[str, ...] | None = None
    timing: str = ""
    versions: tuple[tuple[str, str], ...] = ()
    limit: int | None = None


class RecordKey(NamedTuple):
    """The (operation, shape) fields of a tuning record, as `TuningRecords.lookup` and
    `TuningRecords.record` take them."""

    operation: str
    shape: str


def record_key(args: Any, context: RecordContext, bucket: str | None = None) -> RecordKey:
    """The key of ``args``' tuning record under ``context``. Lookups and stores build their keys
    here alone.

    Args:
        args: the problem's arguments.
        context: what else decides the winner (`RecordContext`).
        bucket: a shape-range label (see `kernel_api.tuning.buckets`) to key on instead of the
            exact shape.

    Returns:
        The `RecordKey`: its operation field holds `RECORD_KEY_FORMAT`, the operands' signature
        and every field of ``context`` (``versions`` as ``name:version`` pairs); its shape field
        the problem's shape (`operation_key`), or ``bucket``.
    """
    signature, shape = operation_key(args)
    providers = "all" if context.providers is None else ",".join(context.providers)
    versions = ",".join(f"{name}:{version}" for name, version in context.versions) or "-"
    limit = "" if context.limit is None else f"top={context.limit} "
    operation = (f"{RECORD_KEY_FORMAT} {signature} math={context.math} providers={providers} {limit}"
                 f"versions={versions} timing={context.timing or '-'}")
    return RecordKey(operation, shape if bucket is None else bucket)
