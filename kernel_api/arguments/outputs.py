"""The memory check of operations with several operands: no output shares memory with an input
(but one it may overwrite in place) or with another output, and an output's elements are
distinct (`elements_distinct`). Each operand's byte range is computed once (a pairwise test would
compute it once per pair: 9 pairs for RoPE's six operands), with `base`'s rule: overlapping
ranges of dense tensors share elements; strided tensors with gaps, empty ones and tensors
without memory are not judged."""

from __future__ import annotations

from typing import Any

import torch

from .base import STORAGELESS_TYPES


def _range(t: torch.Tensor) -> tuple[int, int] | None:
    """[first byte, end) of a dense tensor with memory; None when not judged."""
    if type(t) is not torch.Tensor and isinstance(t, STORAGELESS_TYPES):
        return None
    n = t.numel()
    if not n:
        return None
    size = t.element_size()
    extent = 1
    for length, stride in zip(t.shape, t.stride()):
        extent += (length - 1) * stride
    if extent != n:
        return None
    ptr = t.data_ptr()
    return (ptr, ptr + n * size) if ptr else None


def check_outputs_disjoint(tensors: dict[str, torch.Tensor], outputs: tuple[str, ...],
                           in_place: tuple[tuple[str, str], ...] = ()) -> None:
    """Raise ValueError naming the first output that overlaps an input or another output.

    Args:
        tensors: operand name -> tensor (every operand of the arguments).
        outputs: the names of the outputs among them.
        in_place: (output, input) pairs where the output may be that input itself (the same view:
            kernels read each element before they write it), though no other part of it.
    """
    ranges: dict[str, Any] = {name: _range(t) for name, t in tensors.items()}
    for i, name in enumerate(outputs):
        mine = ranges[name]
        if mine is None:
            continue
        for other, theirs in ranges.items():
            if other == name or theirs is None or (other in outputs and outputs.index(other) < i):
                continue
            if mine[0] < theirs[1] and theirs[0] < mine[1]:
                if (name, other) not in in_place:
                    raise ValueError(f"operand {name}: overlaps {other} in memory; give {name} its own memory")
                if mine != theirs or tensors[name].stride() != tensors[other].stride():
                    raise ValueError(f"operand {name}: overlaps {other} in memory but is not {other} itself; give "
                                     f"{name} its own memory (or pass {other}, to write in place)")


def elements_distinct(t: torch.Tensor) -> bool:
    """Whether no two indices of ``t`` address one element, by a sufficient test: ordered by
    stride, each dim of more than one element steps past everything the smaller-strided dims
    span (every layout torch makes passes; an interleaving it cannot tell is taken as overlapping)."""
    if not t.numel():
        return True
    span = 0  # elements past the first that the dims so far reach
    for stride, length in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride <= span:
            return False
        span += (length - 1) * stride
    return True
