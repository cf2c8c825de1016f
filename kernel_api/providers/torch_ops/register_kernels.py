"""Imports the torch provider's kernels (registering them)."""

from . import kernels  # noqa: F401  (registers TorchGemm, TorchSoftmax, TorchSoftmaxBackward)
