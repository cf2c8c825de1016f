"""kernel-api-flash-attn: FlashAttention-4's CuTe DSL attention as a kernel_api candidate.

Importing it (kernel_api does, through the ``kernel_api.providers`` entry point) registers the
``flash_attn`` provider, `FlashAttnForward` (`AttentionArguments`: dense and variable-length,
causal or full, GQA, f16/bf16, sm_90+; it writes the row log-sum-exp when asked) and
`FlashAttnBackward` (`AttentionBackwardArguments`, the same layouts). FA4 compiles with its
own JIT for the GPU it runs on. flash-attn-4 outside `library.SUPPORTED` (or absent) raises
ImportError here, which kernel_api reports in ``plugin_errors()``.
"""

from .library import PLUGIN_VERSION as __version__
from .provider import FlashAttnProvider
from .attention import FlashAttnForward
from .attention_backward import FlashAttnBackward

__all__ = ["FlashAttnBackward", "FlashAttnForward", "FlashAttnProvider", "__version__"]
