"""The benchmark library behind ``benchmarks/benchmark.py`` and ``benchmarks/peak_memory.py``
(docs/benchmark.md); not imported by ``import xcit_mm``.

models (names, factory), flops (the counter, Table 1), timing (interleaved rounds), fresh_points
(what every fresh-process measurement shares), runner (the points, the memory process, compare),
spec (and goals), report / plot, whole_model.
"""
from .runner import compile_variants
from .flops import count_flops
from .models import parse_model

__all__ = ['compile_variants', 'count_flops', 'parse_model']
