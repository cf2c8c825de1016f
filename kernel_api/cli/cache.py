"""``kernel-api cache clear``: what kernel_api writes under the cache folder, and deleting only that.

The cache folder may be shared: with ``KERNEL_API_CACHE_DIR=~/.cache`` it also holds pip's and
Hugging Face's caches. So nothing is deleted by folder, only kernel_api's own files:

- the disk caches' entries (``*.bin``) and staged files (``.*.part``) in their namespace folders
  (`NAMESPACES`), and the entries that installed bundles listed in other namespaces;
- the bundles' provenance records (``bundles/*.json``, `kernel_api.tuning.bundle.PROVENANCE`);
- the tuning records (``tuning.sqlite``, its journal files and the copies set aside as damaged).

A namespace folder left empty is removed; the cache folder itself stays.
"""

from __future__ import annotations

import errno
import re
import sys
from pathlib import Path
from typing import Any, Callable

from ..core.cache import NAMESPACES, staged_name

# tuning.sqlite, its journal files, and the copies set aside as damaged (tuning/records.py).
_RECORDS = re.compile(r"^tuning\.sqlite(\.corrupt-\d{8}T\d{12}Z)?(-wal|-shm|-journal)?$")


def _files(folder: Path, keep: Callable[[str], bool]) -> list[Path]:
    """The files in ``folder`` (not below it, never through a link to a folder) whose names pass ``keep``."""
    if folder.is_symlink() or not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if keep(p.name) and (p.is_symlink() or p.is_file()))


def owned_files(root: Path) -> list[Path]:
    """The files kernel_api wrote under the cache folder ``root`` (see the module docstring).

    Args:
        root: the cache folder.

    Returns:
        Their paths, grouped by folder; empty when ``root`` does not exist.

    Raises:
        NotADirectoryError: ``root`` is a file.
    """
    if not root.exists():
        return []
    if not root.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "the cache folder is a file, not a folder "
                                                "(KERNEL_API_CACHE_DIR names the folder)", str(root))
    from ..tuning.bundle import PROVENANCE, entry_name_ok, installed_bundles

    found = []
    for namespace in NAMESPACES:
        found += _files(root / namespace, lambda name: name.endswith(".bin") or staged_name(name))
    listed = {name for bundle in installed_bundles(root) for name in bundle.get("entries", ())
              if isinstance(name, str) and entry_name_ok(name) and name.split("/")[0] not in NAMESPACES}
    found += sorted(root / name for name in listed if (root / name).is_file())
    found += _files(root / PROVENANCE, lambda name: name.endswith(".json") or staged_name(name))
    found += _files(root, lambda name: _RECORDS.match(name) is not None)
    return found


def namespace_folders(root: Path) -> list[Path]:
    """The disk caches' namespace folders under the cache folder ``root`` that exist: `NAMESPACES`
    and those installed bundles wrote entries into.

    Raises:
        NotADirectoryError: ``root`` is a file.
    """
    names = {path.relative_to(root).parts[0] for path in owned_files(root) if len(path.relative_to(root).parts) == 2}
    from ..tuning.bundle import PROVENANCE

    names |= set(NAMESPACES)
    names.discard(PROVENANCE)
    return [root / name for name in sorted(names) if (root / name).is_dir() and not (root / name).is_symlink()]


def _summary(root: Path, files: list[Path]) -> str:
    """What ``files`` are, per top folder: "cutedsl: 3 file(s), tuning records: 2 file(s)"."""
    groups: dict[str, int] = {}
    for path in files:
        top = path.relative_to(root).parts
        name = "tuning records" if len(top) == 1 else top[0]
        groups[name] = groups.get(name, 0) + 1
    return ", ".join(f"{name}: {count} file(s)" for name, count in groups.items())


def run_cache_clear(assume_yes: bool, root: Path | None = None, show: Callable[..., Any] = print,
                    ask: Callable[[str], str] = input) -> int:
    """``cache clear``: delete kernel_api's files in the cache folder, after asking on a terminal.

    Args:
        assume_yes: delete without asking (``--yes``).
        root: the cache folder (default: `kernel_api.core.cache.cache_dir`).
        show: prints a line.
        ask: asks a question on the terminal and returns the answer.

    Returns:
        The exit status: 0 when cleared (or nothing to clear), 1 when the user said no.

    Raises:
        ValueError: confirmation is needed and there is no terminal to ask on.
        NotADirectoryError: the cache folder is a file.
    """
    from ..core.cache import cache_dir

    root = cache_dir() if root is None else root
    files = owned_files(root)
    if not files:
        show(f"nothing of kernel_api's to clear in {root}")
        return 0
    summary = _summary(root, files)
    if not assume_yes:
        if not sys.stdin.isatty():
            raise ValueError(f"cache clear: would delete {summary} in {root}; no terminal to confirm on, "
                             f"add --yes to delete them")
        try:
            answer = ask(f"delete {summary} in {root}? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            show("nothing deleted")
            return 1
    folders = {path.parent for path in files} - {root}
    for path in files:
        path.unlink(missing_ok=True)
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        try:
            folder.rmdir()
        except OSError:  # not empty: it holds files that are not kernel_api's
            pass
    show(f"cleared {root}: deleted {summary}")
    return 0
