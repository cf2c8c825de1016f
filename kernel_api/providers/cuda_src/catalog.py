"""Imports the interface modules of the cuda_src provider's own kernels (registering them)."""
