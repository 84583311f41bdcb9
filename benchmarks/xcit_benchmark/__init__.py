"""The benchmark library behind ``benchmarks/benchmark.py`` and ``benchmarks/peak_memory.py``
(docs/benchmark.md); not imported by ``import xcit_mm``."""
