"""Files that readers never see half-written, and JSON files read with one-line errors."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path`` for writing; on a clean exit it is renamed over
    ``path`` (one atomic step), on an exception it is removed and ``path`` is left as it was.

    An `OSError` of the file's own (creating, writing or renaming it) names ``path``, never the
    temporary file; a missing folder raises `FileNotFoundError` saying that the destination
    folder does not exist.
    """
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=folder)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"the destination folder {folder} does not exist", str(target)) from None
    except OSError as exc:
        raise _naming(exc, target, None) from None
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, target)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise _naming(exc, target, tmp) from None
        raise


def _naming(exc: OSError, target: Path, tmp: str | None) -> OSError:
    """``exc`` naming ``target`` when it named the temporary file ``tmp`` or no file at all
    (a write's ENOSPC or EIO); an error about another file, or without an errno, is kept."""
    if exc.errno is None or exc.filename not in (None, tmp):
        return exc
    return OSError(exc.errno, exc.strerror, str(target))  # the subclass that matches the errno


def writable(path: str | os.PathLike) -> bool:
    """Whether this process may change the file ``path``: write to it when it exists, and
    create and rename files in its folder (a database's journal, an atomic replacement).

    Args:
        path: a file, existing or not.

    Returns:
        False on a read-only file system (even for root) or without write permission.
    """
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    return not os.path.exists(path) or os.access(path, os.W_OK)


def read_json(path: str | os.PathLike, source: str, error: type[Exception]) -> Any:
    """The JSON document in ``path``; an unreadable or invalid file raises ``error`` with a
    message that starts with ``source`` (what the file is, e.g. "shapes file x.json")."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except OSError as exc:
        raise error(f"{source}: cannot read it ({exc.strerror or exc})") from None
    except RecursionError:
        raise error(f"{source}: nested too deeply to read") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{source}: not valid JSON ({exc})") from None
