"""CuTe DSL attention kernels (interface modules; implementations under ``implementations/``)."""
