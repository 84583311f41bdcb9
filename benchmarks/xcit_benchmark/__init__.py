"""The benchmark library behind ``benchmarks/benchmark.py`` and ``benchmarks/peak_memory.py``
(docs/benchmark.md); not imported by ``import xcit_mm``."""
from .flops import count_flops
from .models import parse_model
from .runner import variants

__all__ = ['count_flops', 'parse_model', 'variants']
