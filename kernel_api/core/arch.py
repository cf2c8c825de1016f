"""Compute capability: parsing user input, and reading the current device's."""

from __future__ import annotations

import functools
import re
from typing import Any

import torch

_CC_PATTERN = re.compile(r"^(?:sm_?|compute_)?(\d{2,3})[af]?$")


def normalize_cc(cc: Any, what: str = "cc") -> int | None:
    """Return ``cc`` as an int such as 90, or None if ``cc`` is None.

    Accepts 90, "90", "sm_90", "sm_90a", (9, 0). Raises ``ValueError`` for anything that is
    not a plausible NVIDIA compute capability and ``TypeError`` for other kinds of value.
    """
    if cc is None:
        return None
    if isinstance(cc, bool):
        raise TypeError(f"{what}: expected an int such as 90, got bool {cc!r}")
    if isinstance(cc, tuple) and len(cc) == 2 and all(isinstance(x, int) for x in cc):
        value = cc[0] * 10 + cc[1]
    elif isinstance(cc, int):
        value = cc
    elif isinstance(cc, str):
        m = _CC_PATTERN.match(cc.strip().lower())
        if m is None:
            raise ValueError(f"{what}: {cc!r} is not a compute capability (expected e.g. 90 or 'sm_90a')")
        value = int(m.group(1))
    else:
        raise TypeError(f"{what}: expected an int such as 90, got {type(cc).__name__} {cc!r}")
    if not 30 <= value <= 199 or value % 10 > 9:
        raise ValueError(f"{what}: {cc!r} is not a compute capability NVIDIA GPUs have (expected 30..199, e.g. 80, 90, 100)")
    return value


def gpu_available() -> bool:
    """True when torch sees at least one CUDA device."""
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def device_cc(device_index: int | None = None) -> int:
    """Compute capability of a CUDA device (current device if None), e.g. 90."""
    if not torch.cuda.is_available():
        from .errors import DeviceError

        raise DeviceError("no CUDA GPU is available; pass cc explicitly (e.g. cc=90) to compile without one")
    major, minor = torch.cuda.get_device_capability(device_index)
    return major * 10 + minor


#: SMs assumed when planning without a GPU (an H100/H200 SXM, the machines we target).
DEFAULT_SM_COUNT = 132


@functools.lru_cache(maxsize=None)
def _device_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device | None = None) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (its index, else the current one), looked
    up once per device; `DEFAULT_SM_COUNT` for a device that is not CUDA (meta and CPU tensors
    when planning without a GPU) or for None without a GPU."""
    if device is None:
        if not torch.cuda.is_available():
            return DEFAULT_SM_COUNT
        return _device_sms(torch.cuda.current_device())
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return _device_sms(device.index if device.index is not None else torch.cuda.current_device())


def planning_sm_count(device: torch.device | None) -> int:
    """SMs to plan a launch for: ``device``'s (`sm_count`), or `DEFAULT_SM_COUNT` when there is
    no device (the machines we target, not whichever GPU is current)."""
    return sm_count(device) if device is not None else DEFAULT_SM_COUNT


def resolve_cc(cc: Any = None, device: torch.device | None = None) -> int | None:
    """An explicit ``cc`` always wins; else the cc of ``device`` (if CUDA) or of the current GPU.

    Returns None when there is neither an explicit cc nor a GPU: discovery then does not
    filter by architecture.
    """
    value = normalize_cc(cc)
    if value is not None:
        return value
    if device is not None and device.type == "cuda":
        return device_cc(device.index)
    if torch.cuda.is_available():
        return device_cc(None)
    return None


def arch_string(cc: int) -> str:
    """Target name for compilers: sm_90a for Hopper (wgmma/setmaxnreg need the 'a'), else sm_XY."""
    if cc in (90, 100, 101, 103, 110, 120, 121):
        return f"sm_{cc}a"
    return f"sm_{cc}"
