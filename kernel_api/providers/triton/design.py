"""`TritonDesignMetadata`: what one Triton configuration is, as plain data (no triton import)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TritonDesignMetadata:
    """The design of one instance of a Triton kernel family: one ``triton.Config`` and the
    pointer alignment the compiled code assumes.

    ``constexprs``: the configuration's meta-parameters (block sizes...), as sorted
    ``(name, value)`` pairs; ``num_warps``, ``num_stages``, ``num_ctas`` and ``maxnreg`` as
    ``triton.Config`` has them; ``alignment``: the bytes every tensor operand's pointer is
    assumed aligned to (16: compiled with ``tt.divisibility = 16`` on those pointers, as
    Triton's JIT specialises aligned pointers; 1: no assumption).
    """

    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int = 4
    num_stages: int = 3
    num_ctas: int = 1
    maxnreg: int | None = None
    alignment: int = 16

    @property
    def block_sizes(self) -> dict[str, Any]:
        """The configuration's meta-parameters as a dict (e.g. ``{"BLOCK_SIZE": 1024}``)."""
        return dict(self.constexprs)

    @property
    def threads(self) -> int:
        """Threads per program (CTA): ``num_warps`` warps of 32."""
        return 32 * self.num_warps

    def options(self) -> dict[str, Any]:
        """The ``triton.compile`` options of this configuration.

        Returns:
            ``num_warps``, ``num_stages``, ``num_ctas`` and, when set, ``maxnreg``.
        """
        found = {"num_warps": self.num_warps, "num_stages": self.num_stages, "num_ctas": self.num_ctas}
        if self.maxnreg is not None:
            found["maxnreg"] = self.maxnreg
        return found
