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


def _check(cond: bool, path: str, message: str):
    if not cond:
        raise SpecError(f'{path}: {message}')


def _check_model(name, path: str, where: str):
    try:
        parse_model(name)
    except (ValueError, AttributeError, TypeError) as e:
        raise SpecError(f'{path}: {where}: {e}') from None


def _check_point(point, path: str, where: str):
    _check(isinstance(point, list) and len(point) == 2 and isinstance(point[1], int),
           path, f'{where} must be [model name, resolution], got {point!r}')
    _check_model(point[0], path, where)


def validate_spec(spec: dict, path: str = '<spec>') -> dict:
    """Check the layout described in the module docstring; return ``spec``."""
    for key in ('default_models', 'default_resolutions', 'goals', 'flops_report'):
        _check(key in spec, path, f'missing key {key!r}')
    for name in spec['default_models']:
        _check_model(name, path, 'default_models')
    _check(all(isinstance(r, int) and r >= 32 for r in spec['default_resolutions']), path,
           'default_resolutions must be integers >= 32')
    goals = spec['goals']
    for key in ('batch', 'precision', 'warmup', 'repeats', 'runs', 'checks'):
        _check(key in goals, path, f'missing key goals.{key}')
    measured = set()
    for i, run in enumerate(goals['runs']):
        where = f'goals.runs[{i}]'
        _check(run.get('mode') in MODES, path, f'{where}.mode must be one of {MODES}')
        _check(isinstance(run.get('time'), bool), path, f'{where}.time must be true or false')
        for point in run.get('points', []):
            _check_point(point, path, f'{where}.points')
            measured.add((point[0], point[1], run['mode'], run['time']))
    for i, check in enumerate(goals['checks']):
        where = f'goals.checks[{i}]'
        for key, allowed in (('metric', METRICS), ('mode', MODES), ('value', VALUE_KINDS),
                             ('op', OPS)):
            _check(check.get(key) in allowed, path, f'{where}.{key} must be one of {allowed}')
        _check(isinstance(check.get('goal'), str), path, f'{where}.goal must be a string')
        _check(isinstance(check.get('threshold'), (int, float)), path,
               f'{where}.threshold must be a number')
        for side in ('a', 'b'):
            _check_point(check.get(side), path, f'{where}.{side}')
            name, res = check[side]
            timed = check['metric'] == 'ms_per_img'
            _check(any(m[:3] == (name, res, check['mode']) and (m[3] or not timed)
                       for m in measured), path,
                   f'{where}.{side}: {name}@{res} ({check["mode"]}) is measured by no run of '
                   f'goals.runs' + (' with "time": true' if timed else ''))
    table = spec['flops_report'].get('paper_table1', {})
    _check(isinstance(spec['flops_report'].get('tolerance'), (int, float)), path,
           'flops_report.tolerance must be a number')
    for arch, row in table.items():
        _check(arch in XCIT_ARCHS, path, f'flops_report.paper_table1: unknown arch {arch!r}')
        for key in ('params_m', 'gmacs_224_p16', 'gmacs_384_p8'):
            _check(key in row, path, f'flops_report.paper_table1.{arch}: missing {key!r}')
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
    _check(isinstance(spec, dict), path, 'the top level must be an object')
    return validate_spec(spec, path)
