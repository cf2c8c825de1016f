"""CuTe DSL softmax kernels (interfaces here, implementations under implementations/)."""
