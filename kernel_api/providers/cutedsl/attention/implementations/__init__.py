"""CuTe DSL attention kernels (implementation objects compiled by the attention interfaces)."""
