"""benchmarks/gpu_clocks.py: the SM clock and power sampled while benchmark code runs, here from a
stand-in nvidia-smi that prints fixed readings."""

from __future__ import annotations

import os
import stat
import time

from benchmark_modules import load


def _module():
    return load("gpu_clocks")


def _fake_smi(folder, mhz: str, watts: str) -> None:
    path = folder / "nvidia-smi"
    path.write_text(f"#!/bin/sh\nwhile true; do echo '{mhz}, {watts}'; echo 'garbage line'; sleep 0.01; done\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_windows_hold_the_samples_that_arrived_inside_them(tmp_path, monkeypatch):
    _fake_smi(tmp_path, "1755", "612.5")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    clocks = _module().ClockSampler(period_ms=10)
    assert clocks.available
    with clocks:
        with clocks.window("busy"):
            time.sleep(0.3)
        with clocks.window("instant"):
            pass
    summary = clocks.summary()
    assert summary["busy"]["samples"] >= 5
    assert (summary["busy"]["sm_mhz"], summary["busy"]["watts"]) == (1755.0, 612.5)
    assert summary["instant"] == {"samples": 0, "sm_mhz": None, "watts": None}
    assert clocks._proc.poll() is not None  # the sampler stopped with the block


def test_without_nvidia_smi_nothing_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nvidia-smi
    clocks = _module().ClockSampler()
    assert not clocks.available
    with clocks:
        with clocks.window("busy"):
            pass
    assert clocks.summary() == {"busy": {"samples": 0, "sm_mhz": None, "watts": None}}
