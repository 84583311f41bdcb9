"""The benchmark library behind ``benchmarks/benchmark.py`` and ``get_flops.py``.

Speed, fresh-process peak memory and FLOPs of XCiT backbones and the usual alternatives (mmdet
ResNet-50 and Swin-T, mmseg ViT-S/16, mmpretrain's XCiT port); see docs/benchmark.md.

- :mod:`.models`: model names (``parse_model``, ``list_models``) and the factory (``build_model``;
  ``load_mmpretrain_xcit`` imports mmpretrain's XCiT without torchvision).
- :mod:`.flops`: the exact FLOP counter (``count_flops``), the trunk formula, per-point FLOPs and
  the paper Table 1 report.
- :mod:`.timing`: inference / train steps and interleaved timing.
- :mod:`.memory`: the fresh-process peak-memory workers (entry point: :mod:`.worker`).
- :mod:`.runner`: ``RunOptions`` and ``run_points`` (all three measurements per point).
- :mod:`.compare`, :mod:`.goals`: ``--compare`` ratios and the spec-driven ``--goals``.
- :mod:`.spec`: the data (default models, goals, paper Table 1) in docs/benchmark/goals_spec.json.
- :mod:`.report`, :mod:`.plot`: text and Markdown tables, CSV/JSON/PNG files.

Not imported by ``import xcit_mm``: import ``xcit_benchmark`` explicitly.
"""
from .compare import (check_same_trunk, compare_pairs, compile_variants, ratio_rows,
                      with_cp_variants)
from .flops import analytic_trunk_macs, count_flops, flops_report, point_flops
from .goals import evaluate_goals, run_goals
from .memory import run_memory_worker, worker_main
from .models import (BASELINES, XCIT_ARCHS, ModelSpec, build_model, compile_forward, count_params,
                     list_models, load_mmpretrain_xcit, model_name_patterns, parse_model,
                     parse_models)
from .report import (CSV_FIELDS, format_flops_report, format_goals, format_model_flops,
                     format_ratios, format_table, markdown_result, write_outputs, write_rows)
from .runner import RunOptions, run_metadata, run_points
from .spec import DEFAULT_SPEC_PATH, SpecError, load_spec

__all__ = [
    'BASELINES', 'CSV_FIELDS', 'DEFAULT_SPEC_PATH', 'ModelSpec', 'RunOptions', 'SpecError',
    'XCIT_ARCHS', 'analytic_trunk_macs', 'build_model', 'check_same_trunk', 'compare_pairs',
    'compile_forward', 'compile_variants', 'count_flops', 'count_params', 'evaluate_goals',
    'flops_report', 'format_flops_report',
    'format_goals', 'format_model_flops', 'format_ratios', 'format_table', 'list_models',
    'load_mmpretrain_xcit', 'load_spec', 'markdown_result', 'model_name_patterns',
    'parse_model', 'parse_models', 'point_flops', 'ratio_rows', 'run_goals', 'run_metadata',
    'run_memory_worker', 'run_points', 'with_cp_variants', 'worker_main', 'write_outputs',
    'write_rows'
]
