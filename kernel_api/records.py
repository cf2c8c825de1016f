"""Tuning records: which kernel won for a (device, cc, operation signature, problem shape).

Stored in SQLite (``tuning.sqlite`` in the cache folder, WAL mode) so any later process picks
the recorded winner without benchmarking again. A corrupt database is set aside and
recreated with a warning; an unwritable folder falls back to an in-memory database.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sqlite3
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cache import cache_dir

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    device TEXT NOT NULL,
    cc INTEGER NOT NULL,
    operation TEXT NOT NULL,
    shape TEXT NOT NULL,
    kernel_name TEXT NOT NULL,
    median_ms REAL NOT NULL,
    runners_up TEXT NOT NULL,
    toolchain TEXT NOT NULL,
    created TEXT NOT NULL,
    PRIMARY KEY (device, cc, operation, shape)
)
"""


@dataclass(frozen=True)
class TuningRecord:
    """One recorded winner; ``runners_up`` maps kernel names to their median ms."""

    device: str
    cc: int
    operation: str
    shape: str
    kernel_name: str
    median_ms: float
    runners_up: dict
    toolchain: dict
    created: str


class TuningRecords:
    """The SQLite store of tuning results (one connection per thread)."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else cache_dir() / "tuning.sqlite"
        self._local = threading.local()
        self._memory_fallback = False

    def _connect(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        conn = self._open()
        self._local.conn = conn
        return conn

    def _open(self) -> sqlite3.Connection:
        if self._memory_fallback:
            return self._init(sqlite3.connect(":memory:"))
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return self._init(sqlite3.connect(str(self.path), timeout=30))
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError) and "unable to open" not in str(exc) \
                    and "readonly" not in str(exc):
                raise
            if "file is not a database" in str(exc) or "malformed" in str(exc):
                return self._recreate(exc)
            return self._fallback(exc)
        except OSError as exc:
            return self._fallback(exc)

    def _init(self, conn: sqlite3.Connection) -> sqlite3.Connection:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(_SCHEMA)
            conn.commit()
        except sqlite3.DatabaseError as exc:
            conn.close()
            if "not a database" in str(exc) or "malformed" in str(exc):
                return self._recreate(exc)
            if "readonly" in str(exc) or "unable to open" in str(exc):
                return self._fallback(exc)
            raise
        return conn

    def _recreate(self, exc: Exception) -> sqlite3.Connection:
        aside = self.path.with_name(self.path.name + ".corrupt")
        warnings.warn(f"kernel_api: tuning records {self.path} were unreadable ({exc}); moved to {aside.name} "
                      f"and starting afresh", RuntimeWarning, stacklevel=4)
        for suffix in ("", "-wal", "-shm"):
            try:
                os.replace(str(self.path) + suffix, str(aside) + suffix)
            except OSError:
                pass
        return self._init(sqlite3.connect(str(self.path), timeout=30))

    def _fallback(self, exc: Exception) -> sqlite3.Connection:
        warnings.warn(f"kernel_api: cannot write tuning records at {self.path} ({exc}); keeping them in memory "
                      f"for this process", RuntimeWarning, stacklevel=4)
        self._memory_fallback = True
        return self._init(sqlite3.connect(":memory:"))

    def lookup(self, device: str, cc: int, operation: str, shape: str) -> TuningRecord | None:
        """The recorded winner for this key, or None."""
        row = self._connect().execute(
            "SELECT device, cc, operation, shape, kernel_name, median_ms, runners_up, toolchain, created "
            "FROM records WHERE device=? AND cc=? AND operation=? AND shape=?",
            (device, cc, operation, shape)).fetchone()
        if row is None:
            return None
        return TuningRecord(*row[:6], json.loads(row[6]), json.loads(row[7]), row[8])

    def record(self, device: str, cc: int, operation: str, shape: str, kernel_name: str, median_ms: float,
               runners_up: dict[str, float], toolchain: dict[str, str]) -> TuningRecord:
        """Store (replace) the winner for this key."""
        created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        conn = self._connect()
        with conn:
            conn.execute("INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         (device, cc, operation, shape, kernel_name, float(median_ms),
                          json.dumps(runners_up, sort_keys=True), json.dumps(toolchain, sort_keys=True), created))
        return TuningRecord(device, cc, operation, shape, kernel_name, float(median_ms), runners_up, toolchain, created)

    def all(self) -> list[TuningRecord]:
        rows = self._connect().execute(
            "SELECT device, cc, operation, shape, kernel_name, median_ms, runners_up, toolchain, created FROM records "
            "ORDER BY created").fetchall()
        return [TuningRecord(*r[:6], json.loads(r[6]), json.loads(r[7]), r[8]) for r in rows]

    def clear(self) -> int:
        conn = self._connect()
        with conn:
            return conn.execute("DELETE FROM records").rowcount

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


def toolchain_versions() -> dict[str, str]:
    """Versions that a recorded timing depends on."""
    from importlib.metadata import version

    import torch

    found = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi", "cuda-python", "kernel-api"):
        try:
            found[dist] = version(dist)
        except Exception:
            pass
    return found


def operation_key(args: Any) -> tuple[str, str]:
    """(operation signature, problem shape) strings for an arguments object."""
    signature = repr(args.signature)
    if hasattr(args, "problem_shape"):
        shape = "x".join(map(str, args.problem_shape))
    else:
        shape = f"{getattr(args, 'rows', '?')}x{getattr(args, 'cols', '?')}"
    return signature, shape
