"""The units of the analytic run-time estimates.

A GEMM's estimate is in `gemm_cost` units (`kernel_api.cost.gemm`): a tile model's work, which
`GEMM_COST_UNITS_PER_SECOND` converts to and from seconds, so a kernel family that models its
time in seconds (split-K, memory-bound or launch-bound kernels) reports seconds times that rate.
A row-wise (softmax) problem's estimate is in `row_cost` units (`kernel_api.cost.rows`):
multiples of the time to move the problem's bytes once at full bandwidth. The two never meet:
PickAny ranks the candidates of one problem against each other.
"""

#: gemm_cost's units per second: the rate the Sm90 family's cost showed on the H200 at
#: 64x8192x8192 (43.8 us for 114.3M units of its 64x128 tile, benchmarks/gemm_shapes.py).
GEMM_COST_UNITS_PER_SECOND = 2.61e12
