"""CuTe DSL provider: kernels written in NVIDIA's CuTe DSL, compiled with ``cute.compile``.

To add a kernel family, subclass `CuteDslKernel` (``kernel_api.providers.cutedsl.kernel``) and
decorate it with ``@CuTeDSLProvider.register``. Keep two files: an interface file with the
subclass (metadata, generation, checks, compile and launch) and an implementation file with the
``@cute.jit``/``@cute.kernel`` code, imported inside ``compile`` (cutlass is imported only when
a kernel compiles); e.g. ``gemm/sm80_tensorop.py`` and ``gemm/implementations/sm80_tensorop_impl.py``.

What the subclass implements (the contract is `kernel_api.kernel`'s):

- ``supported_args_type``: the arguments class it accepts (e.g. ``GemmArguments``), or annotate
  ``_supports(self, args: GemmArguments)``;
- ``generate_kernels(metadata_filter, epilogue_args=None, cc=None)``, a static or class method:
  every instance whose `KernelMetadata` passes ``metadata_filter``, none for an epilogue it
  cannot fuse or a ``cc`` outside the metadata's range. Its ``__init__`` (if any) calls
  ``super().__init__(metadata)``;
- ``_supports(self, args) -> Status``: what metadata cannot express (shapes, limits...);
- ``compile(self, args, cc=None) -> CompiledArtifact``: typically
  ``CompiledArtifact(self.cute_compile(impl, *operands, make_fake_stream()), self)``.
  `cute_compile` compiles for the requested ``cc`` (no GPU needed) or the GPU's, turns torch
  tensors into fake tensors with dynamic shapes (`fake_tensor_like` keeps the metadata's
  alignment) and caches the compiled function on disk, keyed on the code the class and the
  implementation run (`kernel_api.core.fingerprint`: notebook cells and helper modules included);
- ``_run(self, args, artifact, stream, workspace=None)``: typically
  ``self.cute_run(artifact.compiled_obj, *tensors, *constants, to_cuda_stream(stream))``;
- ``get_workspace_size(self, args) -> int``: bytes of workspace ``_run`` needs (0: none).

``run`` and ``supports`` are final; kernel_api wraps ``compile`` (the arguments' type and the
cc checked against the metadata, ``artifact.cc`` filled in).

Optional hooks (`kernel_api.kernel.OPTIONAL_HOOKS`), one per concern:

- ``_launcher(self, args, artifact) -> Launcher | None`` (the fast path): return
  ``Launcher(artifact, tail)`` (``kernel_api.launcher``) when every launch for operands with
  ``args``' dtypes, shapes, strides, alignment and device is ``compiled(*tensors, *tail,
  stream)``. That one hook turns on ``run``'s one-call repeats, `kernel_api.ops`' dispatch
  without building arguments and its native replay. None (the default): launches that need
  per-call work (a workspace, an epilogue's operands) always go through ``_run``;
- ``compile_key(self, args, cc)`` (artifact reuse): when an artifact depends on more than
  ``args.signature`` (e.g. the epilogue's shape, or problem sizes a kernel specialises on);
- ``estimated_cost(self, args, sm_count)`` (ranking): the family's own run-time estimate for
  `PickAny`, in `kernel_api.cost`'s units (None: the generic model).

Class attributes with defaults (not hooks): ``workspace_free = True`` when
``get_workspace_size`` is always 0 (``run`` skips asking); ``performance_hint``, the relative
peak speed the generic cost model ranks by (tensor-core families about 1.0, SIMT about 0.05);
``compiles_from_cache_only = True``, set in the class that defines ``compile``, when that
compile's work is its ``cute_compile`` calls (which honour `kernel_api.kernel.cache_only`), as
in the built-in families. `CuteDslKernel`'s own knobs are
``enable_tvm_ffi``, ``keep_gil_during_launch`` and ``warm_load_skips_compile`` (see there).

Compiled functions are cached on disk (namespace ``cutedsl``) as shared libraries that
``tvm_ffi`` loads without importing cutlass (`artifact_loader`); a compile whose whole result
is one cached function is remembered in ``cutedsl-compiles``, so a warm process skips running
``compile``. ``register_kernels`` lists the built-in families' modules per arguments type;
discovery imports (and so registers) those of the type it is asked for.
"""

from ...registry import Provider, register_provider
from . import kernel


@register_provider
class CuTeDSLProvider(Provider):
    """Kernels authored in CuTe DSL."""

    name = "cutedsl"


__all__ = ["CuTeDSLProvider", "kernel"]
