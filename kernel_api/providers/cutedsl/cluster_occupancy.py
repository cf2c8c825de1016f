"""How many thread-block clusters fit on a GPU at once, asked of the driver without the DSL.

``cutlass.utils.HardwareInfo(device).get_max_active_clusters(size)`` answers with a dummy
kernel that it compiles with the DSL: on a warm cache, the first launch of a cluster kernel in a
new process then imports ``cutlass`` and runs ``cute.compile``. The driver's count depends on
the kernel only through the resources it uses, so an empty kernel written in PTX (which the
driver's JIT loads in about a millisecond), asked with the same launch configuration (128
threads, all the dynamic shared memory a block may take, one cluster of ``size`` CTAs, non-portable
sizes allowed), is answered alike.
"""

from __future__ import annotations

from typing import Any

_ENTRY = b"kernel_api_cluster_probe"
#: The first PTX ISA version of each target; others take the newest listed.
_PTX_VERSIONS = {90: "7.8", 100: "8.6", 101: "8.6", 103: "8.8", 110: "9.0", 120: "8.7", 121: "8.8"}
_THREADS = 128


def _ptx(cc: int) -> bytes:
    version = _PTX_VERSIONS.get(cc, max(_PTX_VERSIONS.values(), key=lambda v: tuple(map(int, v.split(".")))))
    return (f".version {version}\n.target sm_{cc}\n.address_size 64\n\n"
            f".visible .entry {_ENTRY.decode()}()\n{{\n\tret;\n}}\n").encode() + b"\0"


def _check(result: tuple) -> Any:
    """The value of a ``cuda.bindings`` call (status first), or RuntimeError naming the status."""
    status, *values = result
    if int(getattr(status, "value", status)):
        from cuda.bindings import driver

        _, name = driver.cuGetErrorName(status)
        raise RuntimeError(f"CUDA driver error {int(status)} ({name.decode() if isinstance(name, bytes) else name})")
    return values[0] if len(values) == 1 else (tuple(values) or None)


def max_active_clusters(device_index: int, cluster_size: int) -> int:
    """The number of clusters of ``cluster_size`` CTAs (one CTA per SM) resident at once on
    CUDA device ``device_index``, as the driver's occupancy calculator answers.

    Args:
        device_index: a CUDA device ordinal.
        cluster_size: CTAs per cluster, 1 to 32.

    Returns:
        The count (0 when no cluster of that size fits).

    Raises:
        ValueError: ``cluster_size`` outside 1..32.
        RuntimeError: a driver call failed (no such device, a driver without the calls).
    """
    if not 1 <= cluster_size <= 32:
        raise ValueError(f"cluster_size must be between 1 and 32, got {cluster_size}")
    from cuda.bindings import driver

    _check(driver.cuInit(0))
    device = _check(driver.cuDeviceGet(device_index))
    attribute = driver.CUdevice_attribute
    major = _check(driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device))
    minor = _check(driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device))
    # The device's primary context (torch's), current for this call only.
    context = _check(driver.cuDevicePrimaryCtxRetain(device))
    try:
        _check(driver.cuCtxPushCurrent(context))
        library = None
        try:
            library = _check(driver.cuLibraryLoadData(_ptx(major * 10 + minor), None, None, 0, None, None, 0))
            function = _check(driver.cuKernelGetFunction(_check(driver.cuLibraryGetKernel(library, _ENTRY))))
            return _clusters(driver, device, function, cluster_size)
        finally:
            if library is not None:
                driver.cuLibraryUnload(library)
            driver.cuCtxPopCurrent()
    finally:
        driver.cuDevicePrimaryCtxRelease(device)


def _clusters(driver: Any, device: Any, function: Any, cluster_size: int) -> int:
    attribute = driver.CUfunction_attribute
    optin = _check(driver.cuDeviceGetAttribute(
        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device))
    _check(driver.cuFuncSetAttribute(function, attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, optin))
    smem = _check(driver.cuOccupancyAvailableDynamicSMemPerBlock(function, 1, 1))
    blocks = _check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, 1, smem))
    _check(driver.cuFuncSetAttribute(function, attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
    config = driver.CUlaunchConfig()
    config.blockDimX, config.blockDimY, config.blockDimZ = _THREADS, 1, 1
    config.sharedMemBytes = smem
    cluster = driver.CUlaunchAttribute()
    cluster.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    value = driver.CUlaunchAttributeValue()
    value.clusterDim.x, value.clusterDim.y, value.clusterDim.z = cluster_size, 1, 1
    cluster.value = value
    config.numAttrs = 1
    config.attrs = [cluster]
    config.gridDimX, config.gridDimY, config.gridDimZ = cluster_size, blocks, 1
    return int(_check(driver.cuOccupancyMaxActiveClusters(function, config)))
