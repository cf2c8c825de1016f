"""Progress bars (tqdm) for the commands that compile and time many kernels."""

from __future__ import annotations

import sys
from typing import Any, Callable


class TqdmProgress:
    """A ``progress(done, total, label)`` callback (what `PickBest` and the compile workers call)
    drawing a tqdm bar on stderr. A count that starts again (the compile phase, then the timing
    phase) starts a new bar; a bar closes when its count reaches its total.

    ``disable=None`` lets tqdm hide the bar where stderr is not a terminal (logs, CI).
    """

    def __init__(self, desc: str, file: Any = None, disable: bool | None = None) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm
        self.desc = desc
        self.file = file if file is not None else sys.stderr
        self.disable = disable
        self._bar: Any = None
        self._done = 0

    def __call__(self, done: int, total: int, label: str) -> None:
        if self._bar is None or done < self._done or total != self._bar.total:
            self.close()
            self._bar = self._tqdm(total=total, desc=self.desc, unit="kernel", file=self.file,
                                   disable=self.disable, dynamic_ncols=True, leave=True)
        self._bar.set_postfix_str(label[:60], refresh=False)
        self._bar.update(done - self._done)
        self._done = done
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._bar = None
        self._done = 0


def progress(desc: str) -> Callable[[int, int, str], None] | None:
    """A tqdm progress callback, or None (no progress shown) where tqdm is not installed: it is a
    dependency, but an environment not reinstalled since it became one still runs the command."""
    try:
        return TqdmProgress(desc)
    except ImportError:
        return None
