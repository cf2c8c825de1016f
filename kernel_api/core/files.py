"""Files that readers never see half-written, and JSON files read with one-line errors."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path`` for writing; on a clean exit it is renamed over
    ``path`` (one atomic step), on an exception it is removed and ``path`` is left as it was."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent if str(target.parent) else ".")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_json(path: str | os.PathLike, source: str, error: type[Exception]) -> Any:
    """The JSON document in ``path``; an unreadable or invalid file raises ``error`` with a
    message that starts with ``source`` (what the file is, e.g. "shapes file x.json")."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except OSError as exc:
        raise error(f"{source}: cannot read it ({exc.strerror or exc})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{source}: not valid JSON ({exc})") from None
