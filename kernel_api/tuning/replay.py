"""Replaying PickAny's choice against recorded measurements, without a GPU.

A measured case is a problem and the times (ms) that kernels took on it on a GPU. Replaying it
ranks today's candidates with today's cost model (`policies.rank_candidates`) on meta tensors,
for an H100 / H200 (cc 90, 132 SMs) unless told otherwise, and looks the choice up in the
case's times. That is the check that the cost model chooses within 10 % of the measured best:
``benchmarks/gemm_replay.py`` and ``benchmarks/softmax.py --replay`` print it for result files,
and the selection-replay tests assert it on the measured cases kept under ``tests/data``.
Discovery and ranking need no GPU and import no CuTe DSL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from .. import registry
from ..arguments import EpilogueArguments, GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments
from .policies import rank_candidates

#: The SM count a replay ranks for when the measurement does not say: an H100 / H200's.
REPLAY_SMS = 132
#: The architecture a replay discovers candidates for.
REPLAY_CC = 90
#: A choice "within 10 %" takes at most this many times the measured best's time.
WITHIN = 1.1

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "f64": torch.float64,
          "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class GemmProblem:
    """A GEMM as a benchmark measured it: ``out[M, N] = A[M, K] @ B[K, N]`` (``L`` batches).

    ``layouts`` gives A, B and out each as ``t`` (row-major) or ``n`` (column-major). ``tf32``:
    torch allowed TF32 matmuls, so tf32 / 3xTF32 kernels were candidates (as for ``ops.gemm``).
    ``bias`` adds a row bias of N elements, ``activation`` an epilogue activation; ``out_ld``
    is a row-major output's leading dimension where rows are padded (None: N).
    """

    M: int
    N: int
    K: int
    dtype: str = "bf16"
    layouts: str = "ttt"
    L: int | None = None
    tf32: bool = False
    bias: bool = False
    activation: str | None = None
    out_ld: int | None = None

    def arguments(self, device: str | torch.device = "meta") -> GemmArguments:
        """The problem's `GemmArguments` (on the meta device: shapes, strides and dtypes only).

        Args:
            device: where the tensors live; ``"meta"`` allocates nothing.

        Returns:
            GemmArguments; f64 accumulates in f64, every other dtype in f32.
        """
        dt = DTYPES[self.dtype]
        lead = () if self.L is None else (self.L,)

        def operand(rows: int, cols: int, layout: str) -> torch.Tensor:
            if layout == "n":
                return torch.empty(*lead, cols, rows, dtype=dt, device=device).transpose(-1, -2)
            return torch.empty(*lead, rows, cols, dtype=dt, device=device)

        if self.out_ld is not None:
            out = torch.empty(*lead, self.M, self.out_ld, dtype=dt, device=device)[..., :self.N]
        else:
            out = operand(self.M, self.N, self.layouts[2])
        epilogue = None
        if self.bias or self.activation:
            bias = torch.empty(self.N, dtype=dt, device=device) if self.bias else None
            epilogue = EpilogueArguments(bias=bias, activation=self.activation)
        return GemmArguments(operand(self.M, self.K, self.layouts[0]), operand(self.K, self.N, self.layouts[1]), out,
                             accumulator_type=torch.float64 if dt == torch.float64 else torch.float32,
                             epilogue=epilogue)


@dataclass(frozen=True)
class SoftmaxProblem:
    """A row softmax as a benchmark measured it: ``rows`` x ``cols`` of ``dtype``, ``op``
    ``"fwd"`` (forward) or ``"bwd"`` (backward), over the last dimension."""

    rows: int
    cols: int
    dtype: str
    op: str = "fwd"

    def arguments(self, device: str | torch.device = "meta") -> SoftmaxArguments | SoftmaxBackwardArguments:
        """The problem's arguments (on the meta device: shapes, strides and dtypes only).

        Args:
            device: where the tensors live; ``"meta"`` allocates nothing.

        Returns:
            SoftmaxArguments, or SoftmaxBackwardArguments for ``op="bwd"``.
        """
        x = torch.empty(self.rows, self.cols, dtype=DTYPES[self.dtype], device=device)
        if self.op == "bwd":
            return SoftmaxBackwardArguments(x, torch.empty_like(x), torch.empty_like(x))
        return SoftmaxArguments(x, torch.empty_like(x))


@dataclass(frozen=True)
class Replayed:
    """One measured case, replayed.

    ``top`` is the cost model's first choice now; ``choice`` the kernel the replay judges: ``top``,
    or with ``stand_in`` the best-ranked kernel that the case measured. ``best`` is the fastest
    measured candidate. ``skipped`` names measured kernels that are not candidates now (another
    name, or no longer offered for the problem); they count for nothing.
    """

    top: str | None
    choice: str | None
    choice_ms: float | None
    best: str | None
    best_ms: float | None
    skipped: tuple[str, ...] = ()

    @property
    def ratio(self) -> float | None:
        """best ms / choice ms (1.0: the choice was the fastest measured); None if untimed."""
        if self.choice_ms is None or self.best_ms is None:
            return None
        return self.best_ms / self.choice_ms

    @property
    def within(self) -> bool | None:
        """Whether the choice took at most `WITHIN` times the best's time; None if untimed."""
        if self.choice_ms is None or self.best_ms is None:
            return None
        return self.choice_ms <= WITHIN * self.best_ms

    @property
    def top_unmeasured(self) -> bool:
        """Whether the case did not measure the cost model's first choice."""
        return self.choice is not None and self.choice != self.top


def candidates(args: Any, *, tf32: bool = True, cc: int = REPLAY_CC) -> list:
    """The kernels ``ops`` weighs for ``args`` on architecture ``cc``.

    Args:
        args: GemmArguments or softmax arguments (meta tensors are enough).
        tf32: whether torch allows TF32 matmuls; without, tf32 / 3xTF32 math is left out.
        cc: the compute capability to discover for.

    Returns:
        The candidate kernels, in generation order.
    """
    from ..ops.dispatch import allowed_math  # the f32 precision rule of ops (a layer above)

    found = registry.get_kernels(args, cc=cc)
    return allowed_math(found, tf32) if isinstance(args, GemmArguments) else found


def ranked_names(args: Any, *, tf32: bool = True, sm_count: int = REPLAY_SMS, cc: int = REPLAY_CC) -> list[str]:
    """The candidates' kernel names, cheapest first by today's cost model (see `candidates`)."""
    return [k.metadata.kernel_name for k in rank_candidates(candidates(args, tf32=tf32, cc=cc), args, sm_count)]


def replay_ranking(ranked: Sequence[str], times_ms: Mapping[str, float], *, stand_in: bool = False) -> Replayed:
    """Judge a ranking against measured times.

    Args:
        ranked: candidate kernel names, the cost model's first choice first.
        times_ms: measured time per kernel name; names not in ``ranked`` are skipped.
        stand_in: judge the best-ranked measured kernel when the first choice was not
            measured (else that case is untimed: ``choice_ms`` None).

    Returns:
        The `Replayed` case.
    """
    known = set(ranked)
    usable = {n: ms for n, ms in times_ms.items() if n in known}
    skipped = tuple(sorted(n for n in times_ms if n not in known))
    top = ranked[0] if ranked else None
    best = min(usable, key=usable.get) if usable else None
    choice = next((n for n in ranked if n in usable), None) if stand_in else top
    return Replayed(top=top, choice=choice, choice_ms=usable.get(choice), best=best,
                    best_ms=usable[best] if best is not None else None, skipped=skipped)


def replay_gemm(problem: GemmProblem, times_ms: Mapping[str, float], *, sm_count: int = REPLAY_SMS) -> Replayed:
    """PickAny's GEMM choice now for a measured problem; untimed when the case did not time it."""
    return replay_ranking(ranked_names(problem.arguments(), tf32=problem.tf32, sm_count=sm_count), times_ms)


def replay_softmax(problem: SoftmaxProblem, times_ms: Mapping[str, float], *,
                   sm_count: int = REPLAY_SMS) -> Replayed:
    """PickAny's softmax choice now for a measured problem: the best-ranked measured candidate."""
    return replay_ranking(ranked_names(problem.arguments(), sm_count=sm_count), times_ms, stand_in=True)
