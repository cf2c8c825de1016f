"""The CuTe DSL code of the vector add family (imported only when a kernel compiles)."""
