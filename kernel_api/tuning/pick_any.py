"""`Policy`, what chooses one kernel among the candidates, and `PickAny`, the choice that runs
nothing: the candidates ranked by their estimated run time (`kernel_api.cost.estimated_cost`).

Below `policies` (`PickBest`) and `scope`, which holds a `PickAny` as the default policy.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..arguments import GemmArguments
from ..core.arch import planning_sm_count
from ..core.errors import NoKernelFoundError
from ..cost import estimated_cost

if TYPE_CHECKING:
    from ..kernel import Kernel

_log = logging.getLogger(__name__)


def describe_problem(args: Any) -> str:
    """A short description of a problem for log records (GEMM MxNxK, else rows x cols, else the
    arguments' repr)."""
    if isinstance(args, GemmArguments):
        return f"GEMM M={args.M} N={args.N} K={args.K}" + (f" L={args.L}" if args.L != 1 else "")
    if hasattr(args, "rows") and hasattr(args, "cols"):
        return f"{type(args).__name__} {args.rows}x{args.cols}"
    return repr(args)


def rank_candidates(kernels: list[Kernel], args: Any, sm_count: int | None = None) -> list[Kernel]:
    """Candidates ordered by the analytic heuristic (cheapest first, generation order on ties),
    for ``sm_count`` SMs (default: the arguments' device's, else an H100/H200's)."""
    sm = planning_sm_count(getattr(args, "device", None)) if sm_count is None else sm_count
    return [k for _, _, k in sorted((estimated_cost(k, args, sm), i, k) for i, k in enumerate(kernels))]


class Policy:
    """Chooses one kernel for an arguments object."""

    def choose(self, args: Any, candidates: list[Kernel]) -> Kernel:
        raise NotImplementedError


class PickAny(Policy):
    """The best-ranked supported kernel by the analytic heuristic; runs nothing."""

    def choose(self, args: Any, candidates: list[Kernel]) -> Kernel:
        if not candidates:
            raise NoKernelFoundError(f"PickAny.choose: no candidates given for {args!r} (pass "
                                     f"kernel_api.get_kernels(args); kernel_api.explain(args) says why it is empty)")
        chosen = rank_candidates(candidates, args)[0]
        _log.debug("PickAny chose %s (best ranked of %d candidates) for %s", chosen.metadata.kernel_name,
                   len(candidates), describe_problem(args))
        return chosen
