"""The benchmark library behind ``benchmarks/benchmark.py`` and ``benchmarks/peak_memory.py``
(docs/benchmark.md); not imported by ``import xcit_mm``."""
from .runner import compile_variants
from .flops import count_flops
from .models import parse_model

__all__ = ['compile_variants', 'count_flops', 'parse_model']
