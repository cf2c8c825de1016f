"""Choosing kernels: policies (`PickAny`, `PickBest`), the scoped `settings`, tuning records
(SQLite), timing, float64 references and the compile workers PickBest starts.

Importing this package imports nothing; import the module you need (``kernel_api.tuning.policies``).
"""
