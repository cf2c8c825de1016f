"""The native module's C++ sources and their digest.

setup.py builds the digest into each module; kernel_api.native compares it with the sources
beside the module, which tells a module built from other sources (a source tree edited since
its last install) from a current one. Standard library only: setup.py runs this file without
importing kernel_api.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

NAMES = ("launch_table.h", "launch_table.cc", "python_entry.cc", "torch_reads.h")
#: The torch-linked module's (``_torch_reads``).
TORCH_READS_NAMES = ("torch_reads.h", "torch_reads.cc")
#: The front doors' module's (``_front_door``).
FRONT_DOOR_NAMES = ("front_door.cc",)


def digest(folder: Path | str = Path(__file__).parent, names: tuple[str, ...] = NAMES) -> str | None:
    """A digest of the sources ``names`` in ``folder``, or None when some are missing (nothing to compare)."""
    hasher = hashlib.sha256()
    for name in names:
        try:
            hasher.update(name.encode() + b"\0" + (Path(folder) / name).read_bytes())
        except FileNotFoundError:
            return None
    return hasher.hexdigest()[:16]
