"""kernel_api: find, compile, tune and call GPU kernels through one interface.

    args = kernel_api.GemmArguments(A, B, out, accumulator_type=torch.float32)
    kernels = kernel_api.get_kernels(args)
    kernels[0].run(args)

Logging goes to the ``kernel_api`` logger (silent until configured; ``KERNEL_API_LOG_LEVEL=DEBUG``
attaches a stderr handler): see `kernel_api.core.logs`.
"""

from .core.logs import configure_from_environment as _configure_logging

_configure_logging()  # first: records logged while the package imports go to its handler

from . import arguments, artifact, dtypes, errors, metadata, status, utils
from .arguments import (Arguments, EpilogueArguments, GemmArguments, SoftmaxArguments,
                        SoftmaxBackwardArguments)
from .arguments import LayerNormArguments, LayerNormBackwardArguments, RMSNormArguments, RMSNormBackwardArguments
from .arguments import AttentionArguments, AttentionBackwardArguments
from .arguments import (CrossEntropyArguments, CrossEntropyBackwardArguments, GatedActivationArguments,
                        GatedActivationBackwardArguments, LinearCrossEntropyArguments, RopeArguments,
                        RopeBackwardArguments)
from .arguments import CrossEntropyReducedArguments
from .core.artifact import CompiledArtifact
from .core.dtypes import DataType
from .core.errors import (CompilationError, DeviceError, KernelApiError, KernelLaunchError, NoKernelFoundError,
                          RegistrationError, UnsupportedArgumentsError)
from .kernel import Kernel
from .metadata import (BLASDesignMetadata, EpilogueMetadata, GemmOperandsMetadata, KernelMetadata,
                       RowReductionDesignMetadata, SoftmaxBackwardOperandsMetadata, SoftmaxOperandsMetadata,
                       TensorAttributes)
from .registry import (Provider, available_providers, explain, get_kernels, plugin_errors, register_provider)
from .core.status import Reason, Status
from . import registry, kernel, providers  # noqa: E402  (providers register themselves)
from .tuning.policies import PickAny, PickBest, Policy  # noqa: E402
from .tuning.settings import settings  # noqa: E402
from . import ops  # noqa: E402
from . import nn  # noqa: E402  (torch modules through ops)

__version__ = "0.1.0"

__all__ = [
    "Arguments", "BLASDesignMetadata", "CompilationError", "CompiledArtifact", "DataType", "DeviceError",
    "EpilogueArguments", "EpilogueMetadata", "GemmArguments", "GemmOperandsMetadata", "Kernel",
    "KernelApiError", "KernelLaunchError", "KernelMetadata", "NoKernelFoundError", "Provider", "Reason",
    "RegistrationError", "RowReductionDesignMetadata", "SoftmaxArguments", "SoftmaxBackwardArguments",
    "SoftmaxBackwardOperandsMetadata", "SoftmaxOperandsMetadata", "Status", "TensorAttributes",
    "UnsupportedArgumentsError", "available_providers", "explain", "get_kernels", "plugin_errors",
    "register_provider", "PickAny", "PickBest", "Policy", "settings", "tune_shapes", "ops", "nn",
]
__all__ += ["LayerNormArguments", "LayerNormBackwardArguments", "RMSNormArguments", "RMSNormBackwardArguments"]
__all__ += ["AttentionArguments", "AttentionBackwardArguments"]
__all__ += ["CrossEntropyArguments", "CrossEntropyBackwardArguments", "GatedActivationArguments",
            "GatedActivationBackwardArguments", "LinearCrossEntropyArguments", "RopeArguments",
            "RopeBackwardArguments"]
__all__ += ["CrossEntropyReducedArguments"]


def __getattr__(name: str):
    # tune_shapes (multi-GPU tuning: worker processes, sharding) is imported on first use, not
    # with every `import kernel_api` (about 10 ms of module set-up that most programs never need).
    if name == "tune_shapes":
        from .tuning.scale import tune_shapes

        globals()["tune_shapes"] = tune_shapes
        return tune_shapes
    raise AttributeError(f"module 'kernel_api' has no attribute {name!r}")
