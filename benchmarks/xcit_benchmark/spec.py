"""The benchmark's data: default models and resolutions, the project's goals and paper Table 1.

They live in a JSON file (:data:`DEFAULT_SPEC_PATH`), not in the code; :func:`load_spec` reads
and checks it. Layout::

    {"default_models": [NAME, ...], "default_resolutions": [PX, ...],
     "goals": {"batch": 1, "precision": "fp32", "warmup": W, "repeats": R,
               "runs": [{"label": STR, "mode": "inference"|"train", "time": BOOL,
                         "points": [[NAME, PX], ...]}, ...],
               "checks": [{"goal": STR, "metric": "peak_mem_mb"|"ms_per_img",
                           "mode": "inference"|"train", "value": "ratio"|"saving",
                           "a": [NAME, PX], "b": [NAME, PX], "op": "<="|">=",
                           "threshold": X, "detail": OPTIONAL FORMAT}, ...]},
     "flops_report": {"tolerance": X, "paper_table1": {ARCH: {"params_m": X,
                      "gmacs_224_p16": X, "gmacs_384_p8": X}, ...}}}

A check's value is ``a / b`` ("ratio") or ``1 - a / b`` ("saving") of the metric of the two
points measured in ``mode``; every point a check names must be measured by a run of that mode.
"""
import json
import os
from typing import Optional

from .models import XCIT_ARCHS, parse_model

# the repository root (benchmarks/xcit_benchmark/spec.py)
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_SPEC_PATH = os.path.join(_PACKAGE_PARENT, 'docs', 'benchmark', 'goals_spec.json')

METRICS = ('peak_mem_mb', 'ms_per_img')
MODES = ('inference', 'train')
VALUE_KINDS = ('ratio', 'saving')
OPS = ('<=', '>=')


class SpecError(ValueError):
    """The spec file is missing a key or names something unknown."""


def validate_spec(spec: dict, path: str = '<spec>') -> dict:
    """Check the layout described in the module docstring; return ``spec``."""
    def check(cond: bool, message: str):
        if not cond:
            raise SpecError(f'{path}: {message}')

    def check_model(name, where: str):
        try:
            parse_model(name)
        except (ValueError, AttributeError, TypeError) as e:
            raise SpecError(f'{path}: {where}: {e}') from None

    def check_point(point, where: str):
        check(isinstance(point, list) and len(point) == 2 and isinstance(point[1], int),
              f'{where} must be [model name, resolution], got {point!r}')
        check_model(point[0], where)

    for key in ('default_models', 'default_resolutions', 'goals', 'flops_report'):
        check(key in spec, f'missing key {key!r}')
    for name in spec['default_models']:
        check_model(name, 'default_models')
    check(all(isinstance(r, int) and r >= 32 for r in spec['default_resolutions']),
          'default_resolutions must be integers >= 32')
    goals = spec['goals']
    for key in ('batch', 'precision', 'warmup', 'repeats', 'runs', 'checks'):
        check(key in goals, f'missing key goals.{key}')
    measured = set()
    for i, run in enumerate(goals['runs']):
        where = f'goals.runs[{i}]'
        check(run.get('mode') in MODES, f'{where}.mode must be one of {MODES}')
        check(isinstance(run.get('time'), bool), f'{where}.time must be true or false')
        for point in run.get('points', []):
            check_point(point, f'{where}.points')
            measured.add((point[0], point[1], run['mode'], run['time']))
    for i, goal in enumerate(goals['checks']):
        where = f'goals.checks[{i}]'
        for key, allowed in (('metric', METRICS), ('mode', MODES), ('value', VALUE_KINDS),
                             ('op', OPS)):
            check(goal.get(key) in allowed, f'{where}.{key} must be one of {allowed}')
        check(isinstance(goal.get('goal'), str), f'{where}.goal must be a string')
        check(isinstance(goal.get('threshold'), (int, float)),
              f'{where}.threshold must be a number')
        for side in ('a', 'b'):
            check_point(goal.get(side), f'{where}.{side}')
            (name, res), timed = goal[side], goal['metric'] == 'ms_per_img'
            check(any(m[:3] == (name, res, goal['mode']) and (m[3] or not timed)
                      for m in measured),
                  f'{where}.{side}: {name}@{res} ({goal["mode"]}) is measured by no run of '
                  'goals.runs' + (' with "time": true' if timed else ''))
    check(isinstance(spec['flops_report'].get('tolerance'), (int, float)),
          'flops_report.tolerance must be a number')
    for arch, row in spec['flops_report'].get('paper_table1', {}).items():
        check(arch in XCIT_ARCHS, f'flops_report.paper_table1: unknown arch {arch!r}')
        for key in ('params_m', 'gmacs_224_p16', 'gmacs_384_p8'):
            check(key in row, f'flops_report.paper_table1.{arch}: missing {key!r}')
    return spec


def load_spec(path: Optional[str] = None) -> dict:
    """Read and check a spec file (default: :data:`DEFAULT_SPEC_PATH`)."""
    path = path or DEFAULT_SPEC_PATH
    try:
        with open(path) as f:
            spec = json.load(f)
    except FileNotFoundError:
        raise SpecError(f'benchmark spec {path} not found (it is part of the repository '
                        'checkout; pass its path with --spec)') from None
    except json.JSONDecodeError as e:
        raise SpecError(f'{path}: not valid JSON: {e}') from None
    if not isinstance(spec, dict):
        raise SpecError(f'{path}: the top level must be an object')
    return validate_spec(spec, path)
