"""Choosing kernels: policies (`PickAny`, `PickBest` and its shape `buckets`), the scoped
`settings`, tuning records (SQLite), timing, float64 references, the compile workers PickBest
starts, and tuning many problems on every GPU of a host (`scale.tune_shapes`, with its
`tune_worker`) or on the ranks of a torch.distributed job (`distributed`).

Importing this package imports nothing; import the module you need (``kernel_api.tuning.policies``).
"""
