"""Pieces the CUDA-source GEMM families' launchers share (`Kernel._launcher`): the raw stream of
a launcher's stream argument, and a workspace allocated per launch on the launch stream.

A `kernel_api.launcher.Launcher` function is called with a ``cuda.bindings`` CUstream by the
Python paths (`Kernel.run`'s bound launch, `kernel_api.ops`' fast dictionary); cubin launches
(`kernel_api.nvrtc.CudaLauncher.launch`) take the raw handle.
"""

from __future__ import annotations

from typing import Any

import torch

from ....core.streams import current_raw_stream, stream_handle


def raw_stream(stream: Any, device: int) -> int:
    """The raw ``cudaStream_t`` of a launcher's stream argument (a CUstream or an int; anything
    else `stream_handle` accepts, None being ``device``'s current stream)."""
    try:
        return int(stream)
    except TypeError:
        return stream_handle(stream, device)


def launch_workspace(size: int, device: int, stream: int) -> torch.Tensor:
    """``size`` bytes from torch's caching allocator for one launch on the raw ``stream`` of
    ``device``, owned by that stream: freed when the caller drops it, the block is reused only
    by work queued on the same stream after this launch."""
    if current_raw_stream is not None and current_raw_stream(device) == stream:
        return torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", device))
    with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=torch.device("cuda", device))):
        return torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", device))
