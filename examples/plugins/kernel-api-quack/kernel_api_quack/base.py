"""`QuackKernel`: what the QuACK kernels share. QuACK compiles with its own JIT (cached in memory
and on disk by QuACK) for the GPU it runs on, and its compiled functions launch on torch's
current stream (TVM-FFI's environment stream).

So ``compile`` builds (or loads) QuACK's function for the arguments' types and row length, which
is the warm-up of its first call; it refuses a target other than the present GPU, since QuACK
chooses the architecture itself and its cache key does not hold it. ``_run`` and the
`Launcher` make the requested stream torch's current one around the call when it is another.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kernel_api import CompilationError, CompiledArtifact, Kernel, Status
from kernel_api.core.status import Reason
from kernel_api.core.streams import stream_context
from kernel_api.launcher import Launcher


#: QuACK's row kernels copy 16 bytes at a time where the row allows, and never less than 4 bytes
#: (cp.async takes 4, 8 or 16): a 2-byte type with an odd row length cannot be compiled
_VECTOR_BYTES = 16
_MIN_COPY_BYTES = 4


def aligned_rows(args: Any, names: tuple[str, ...], vector_elements: int | None = None,
                 whole_vectors: bool = False) -> Status:
    """Whether QuACK can compile its row copies for the named operands.

    Each operand is copied in pieces of ``gcd(N, vector)`` elements (``vector``: 16 bytes of its
    type, or ``vector_elements`` where the kernel shares one width among operands of several
    types); a piece must hold at least 4 bytes, and the operand's pointer and row stride must be
    aligned to it. ``whole_vectors`` asks for rows that are whole 16-byte vectors (QuACK's softmax
    asserts it).

    Args:
        args: row-kernel arguments with ``cols`` and ``tensor_attributes``.
        names: the operands to check (absent ones are skipped).
        vector_elements: the shared piece width in elements, or None for each operand's own.
        whole_vectors: whether N must be a multiple of the 16-byte vector.

    Returns:
        Success, or a failure naming the first operand QuACK cannot copy.
    """
    for name in names:
        attrs = args.tensor_attributes.get(name)
        if attrs is None:
            continue
        vector = vector_elements or _VECTOR_BYTES // attrs.dtype.bytes
        if whole_vectors and args.cols % vector:
            return Status.fail(f"operand {name}: rows of {args.cols} elements, QuACK takes rows of whole 16-byte "
                               f"vectors ({vector} elements)", kind=Reason.SHAPE, operand=name, actual=args.cols,
                               required=vector)
        need = math.gcd(vector, args.cols)
        if need * attrs.dtype.bytes < _MIN_COPY_BYTES:
            return Status.fail(f"operand {name}: rows of {args.cols} {attrs.dtype.name} elements copy in "
                               f"{need * attrs.dtype.bytes}-byte pieces, QuACK's copies take {_MIN_COPY_BYTES} "
                               f"bytes or more", kind=Reason.SHAPE, operand=name, actual=args.cols,
                               required=_MIN_COPY_BYTES // attrs.dtype.bytes)
        if attrs.divisibility < need:
            return Status.fail(f"operand {name}: QuACK assumes rows and pointer aligned to {need} elements, got "
                               f"{attrs.divisibility}", kind=Reason.ALIGNMENT, operand=name,
                               actual=attrs.divisibility, required=need)
    return Status.success()


class QuackKernel(Kernel):
    """Base of the QuACK kernels. Subclasses give ``generate_kernels``, ``build(args)`` (QuACK's
    compiled function for the arguments, or None when the first call compiles) and
    ``call(function, args)`` / ``caller(function, args)`` (a launch, and a launch function of
    the operand tensors for repeated calls)."""

    workspace_free = True
    # compile runs in this process even while tuning asks for cached artifacts only: QuACK keeps
    # what it compiled in this process (and its own disk cache), so a compile worker's is lost
    compiles_from_cache_only = True
    min_cc = 90  # QuACK's kernels target sm_90 and later
    # the row kernels' rank beside ours (0.5 too): one pass over rows held in registers; PickBest
    # measures them
    performance_hint = 0.5

    def build(self, args: Any) -> Any:
        """QuACK's compiled function for ``args``.

        Args:
            args: the arguments (their types and row length select the function).

        Returns:
            The function, or None where QuACK compiles at its first call.
        """
        return None

    def call(self, function: Any, args: Any) -> None:
        """Launch for ``args`` on torch's current stream.

        Args:
            function: what `build` returned.
            args: the arguments.
        """
        raise NotImplementedError

    def caller(self, function: Any, args: Any) -> Any:
        """A launch for any operands with ``args``' shapes, strides and types.

        Args:
            function: what `build` returned.
            args: the arguments whose raw metadata the launch is for.

        Returns:
            ``launch(*operands)`` (the operands in ``args.tensor_attributes`` order, on torch's
            current stream), or None when there is none.
        """
        return None

    def compile(self, args: Any, cc: int | None = None) -> CompiledArtifact:
        """QuACK's function for ``args`` (compiled, or loaded from QuACK's caches); only for the
        present GPU's architecture (CompilationError otherwise)."""
        present = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        present = None if present is None else present[0] * 10 + present[1]
        if present is None or (cc is not None and cc != present):
            where = "no GPU is present" if present is None else f"the GPU is sm_{present}"
            raise CompilationError(f"{self.metadata.kernel_name}: QuACK compiles for the GPU it runs on and "
                                   f"{where}; it cannot target sm_{cc}")
        try:
            function = self.build(args)
        except Exception as exc:  # noqa: BLE001 - a QuACK compile failure, said in one line
            raise CompilationError(f"{self.metadata.kernel_name}: QuACK's compile failed: "
                                   f"{type(exc).__name__}: {exc}") from exc
        return CompiledArtifact(function, self)

    def get_workspace_size(self, args: Any) -> int:
        return 0

    def _supports(self, args: Any) -> Status:
        return Status.success()

    def _run(self, args: Any, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        with stream_context(args.device, stream):
            self.call(artifact.compiled_obj, args)

    def _launcher(self, args: Any, artifact: CompiledArtifact) -> Launcher | None:
        launch_operands = self.caller(artifact.compiled_obj, args)
        if launch_operands is None:
            return None
        device = args.device

        def launch(*call: Any) -> None:
            with stream_context(device, call[-1]):
                launch_operands(*call[:-1])

        launch.__name__ = f"launch_{self.metadata.kernel_name}"
        return Launcher(launch)
