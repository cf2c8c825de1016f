"""Imports the interface modules of the CuTe DSL provider's own kernels (registering them)."""
