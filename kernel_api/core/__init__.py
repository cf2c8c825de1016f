"""The bottom layer: element types, statuses, errors, architectures, artifacts, operand
attributes (`TensorAttributes`, stride patterns), the disk cache and toolchain versions.
Modules here import nothing above them and no DSL at import time.

This package's ``__init__`` re-exports nothing on purpose: importing one core module must not
pull in the others (upper layers import the module they need).
"""
