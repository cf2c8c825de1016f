"""CuTe DSL GEMM kernels: interfaces here, DSL implementations in ``implementations/``."""
