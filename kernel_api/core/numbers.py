"""The one test of a scalar argument's value that every layer shares."""

from __future__ import annotations

import math
from typing import Any


def is_finite_number(value: Any) -> bool:
    """Whether ``value`` is an int or float (a bool is neither) of finite value: an int too large
    for a float (``10**400``) is not, as float arithmetic would overflow on it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
