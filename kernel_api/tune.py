"""Tuning a shapes file across hosts, one rank per GPU, with torch.distributed:

    torchrun --nnodes N --nproc-per-node G -m kernel_api.tune --shapes FILE [--export FILE]

Each rank tunes its shard of the problems on its local GPU (``LOCAL_RANK``), the winners are
all-gathered so every rank's tuning records end with all of them, and rank 0 writes them to
``--export`` (JSON, for ``kernel-api records import``) and prints the report. See
`kernel_api.tuning.distributed`. The shapes file is ``kernel-api precompile --shapes``' format.
On one host, ``kernel-api tune --shapes FILE`` does the same without torchrun.
"""

from __future__ import annotations

import sys

from .cli.torchrun import main, make_parser

__all__ = ["main", "make_parser"]

if __name__ == "__main__":
    sys.exit(main())
