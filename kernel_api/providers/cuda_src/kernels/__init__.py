"""The cuda_src provider's own kernels: ``*.cu`` implementations with a ``*.py`` interface each."""
