"""CUDA C++ source provider: kernels compiled at run time with NVRTC (no build step).

To add a kernel family, subclass `CudaSourceKernel` (``kernel_api.providers.cuda_src.kernel``)
and decorate it with ``@CudaSourceProvider.register``; cuda.core is imported only when a kernel
compiles (a cache miss); a cached cubin loads and launches through the driver API. The base class implements the `kernel_api.kernel` contract from class
attributes, so a subclass sets:

- ``source`` (CUDA C++ text) or ``source_file`` (a path, relative to the subclass's module);
- ``kernel_name``: the ``__global__`` function, or a name expression such as
  ``"softmax<float, {N}>"`` whose ``{fields}`` each entry of ``variants`` fills;
- ``operands``: an `OperandsMetadata` (or override ``operands_for(params)``);
- ``supported_args_type`` (e.g. ``SoftmaxArguments``), or annotate an own
  ``_supports(self, args: SoftmaxArguments)``;
- ``launch_config(self, args)``: ``(grid, block)`` or ``(grid, block, shared_memory_bytes)``.

and may override the defaults of the contract's methods: ``generate_kernels`` (one instance per
entry of ``variants``: dicts, optionally computed by ``variant_params()``), ``_supports`` (what
the metadata accepts), ``compile`` (NVRTC for the requested ``cc`` or the GPU's, cubin cached on
disk), ``_run`` (launches ``kernel_arguments(args)``, by default the operands' pointers, on the
caller's stream) and ``get_workspace_size`` (0). Further class attributes: ``design``,
``min_cc``/``max_cc``, ``defines``, ``include_dirs``, ``compile_options``.

``run`` and ``supports`` are final. The optional hooks, as for every kernel
(`kernel_api.kernel.OPTIONAL_HOOKS`): ``_launcher(self, args, artifact) -> Launcher | None`` (a
`kernel_api.launcher.Launcher` whose ``function(*tensors, *tail, stream)`` launches for
operands with ``args``' raw metadata, e.g. a ``kernel_api.native.cuda_launch`` function; the
default None launches every call through ``_run``), ``compile_key(self, args, cc)`` (default:
the name expression, the defines and cc) and ``estimated_cost(self, args, sm_count)``.
``workspace_free`` and ``performance_hint`` are class attributes with defaults, not hooks;
`CudaSourceKernel` sets ``compiles_from_cache_only``.

A compiled kernel is loaded and launched by `kernel_api.nvrtc.CudaLauncher`; cubins are cached
on disk (namespace ``cubin``). ``register_kernels`` lists the built-in families' modules per
arguments type; discovery imports (and so registers) those of the type it is asked for.
"""

from ...registry import Provider, register_provider


@register_provider
class CudaSourceProvider(Provider):
    """Kernels written as CUDA C++ source and compiled with NVRTC."""

    name = "cuda_src"


__all__ = ["CudaSourceProvider"]
