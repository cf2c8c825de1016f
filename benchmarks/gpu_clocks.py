"""The GPU's SM clock and power draw while a block of benchmark code runs, sampled by
``nvidia-smi`` in the background (a benchmark helper: library code starts no processes).

    with ClockSampler() as clocks:
        with clocks.window("coop"):
            ...GPU work, waited for...
    clocks.summary()  # {"coop": {"sm_mhz": median, "watts": median, "samples": n}, ...}

Samples arrive every ``period_ms`` (nvidia-smi's own loop); a window holds the samples whose host
arrival time falls inside it, so windows shorter than a few periods hold few or none.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
import threading
import time

import torch


class ClockSampler:
    """Background ``nvidia-smi --query-gpu=clocks.sm,power.draw -lms period_ms`` for the current
    device; `window` names a span of host time, `summary` gives each span's medians. Without
    nvidia-smi it records nothing (`available` is False)."""

    def __init__(self, period_ms: int = 10) -> None:
        self.period_ms = period_ms
        self.samples: list[tuple[float, float, float]] = []  # (host time, SM MHz, W)
        self.windows: dict[str, list[tuple[float, float]]] = {}
        self.available = shutil.which("nvidia-smi") is not None
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> "ClockSampler":
        if self.available:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
            self._proc = subprocess.Popen(
                ["nvidia-smi", "-i", str(index), "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                 f"-lms={self.period_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
            time.sleep(0.3)  # nvidia-smi's start-up before the first window
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                self.samples.append((time.monotonic(), float(parts[0]), float(parts[1])))
            except (ValueError, IndexError):
                continue

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)

    @contextlib.contextmanager
    def window(self, name: str):
        """Host-time span ``name`` (repeat a name to add spans to it); wait for the GPU inside it."""
        began = time.monotonic()
        try:
            yield
        finally:
            self.windows.setdefault(name, []).append((began, time.monotonic()))

    def summary(self) -> dict[str, dict]:
        out = {}
        for name, spans in self.windows.items():
            inside = [(mhz, w) for t, mhz, w in self.samples if any(a <= t <= b for a, b in spans)]
            out[name] = {"samples": len(inside),
                         "sm_mhz": statistics.median(m for m, _ in inside) if inside else None,
                         "watts": statistics.median(w for _, w in inside) if inside else None}
        return out
