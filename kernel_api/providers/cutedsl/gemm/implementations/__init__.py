"""CuTe DSL implementations of the GEMM kernels (import cutlass; loaded lazily at compile)."""
