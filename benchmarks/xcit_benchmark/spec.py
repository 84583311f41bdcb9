"""The benchmark's data (docs/benchmark/goals_spec.json, checked by :func:`load_spec`): default
models and resolutions, the project's goals, paper Table 1; and ``--goals``, which measures the
goal runs' points and evaluates the checks: ``a / b`` ("ratio") or ``1 - a / b`` ("saving")."""
import json
import os
from typing import Callable, List, Optional, Sequence, Tuple

from .fresh_points import REPO
from .models import XCIT_ARCHS, parse_model
from .report import fmt
from .runner import RunOptions, log_stderr, median_paired_ratio, run_points

DEFAULT_SPEC_PATH = os.path.join(REPO, 'docs', 'benchmark', 'goals_spec.json')

CHECK_VALUES = dict(metric=('peak_mem_mb', 'ms_per_img'), mode=('inference', 'train'),
                    value=('ratio', 'saving'), op=('<=', '>='))  # of a goal check's keys


class SpecError(ValueError):
    """The spec file is missing a key or names something unknown."""


def validate_spec(spec: dict, path: str = '<spec>') -> dict:
    """Check the layout of goals_spec.json (an error names the entry); return ``spec``."""
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

    check(isinstance(spec, dict), 'the top level must be an object')
    for key in ('default_models', 'default_resolutions', 'goals', 'flops_report'):
        check(key in spec, f'missing key {key!r}')
    for key in ('batch', 'precision', 'warmup', 'repeats', 'runs', 'checks'):
        check(key in spec['goals'], f'missing key goals.{key}')
    for name in spec['default_models']:
        check_model(name, 'default_models')
    check(all(isinstance(r, int) and r >= 32 for r in spec['default_resolutions']),
          'default_resolutions must be integers >= 32')
    measured = set()  # (model, resolution, mode, timed) of every run's points
    for i, run in enumerate(spec['goals']['runs']):
        modes = CHECK_VALUES['mode']
        check(run.get('mode') in modes, f'goals.runs[{i}].mode must be one of {modes}')
        check(isinstance(run.get('time'), bool), f'goals.runs[{i}].time must be true or false')
        for point in run.get('points', []):
            check_point(point, f'goals.runs[{i}].points')
            measured.add((point[0], point[1], run['mode'], run['time']))
    for i, goal in enumerate(spec['goals']['checks']):
        where = f'goals.checks[{i}]'
        for key, allowed in CHECK_VALUES.items():
            check(goal.get(key) in allowed, f'{where}.{key} must be one of {allowed}')
        check(isinstance(goal.get('goal'), str), f'{where}.goal must be a string')
        check(isinstance(goal.get('threshold'), (int, float)),
              f'{where}.threshold must be a number')
        timed = goal['metric'] == 'ms_per_img'
        for side in ('a', 'b'):
            check_point(goal.get(side), f'{where}.{side}')
            name, res = goal[side]
            check((name, res, goal['mode'], True) in measured
                  or not timed and (name, res, goal['mode'], False) in measured,
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
    return validate_spec(spec, path)


DEFAULT_DETAILS = {
    'peak_mem_mb': '{a} MB / {b} MB',
    'ms_per_img': '{a} ms / {b} ms, paired median ratio {paired}, {repeats} interleaved repeats'}


def evaluate_goals(records: Sequence[dict], checks: Sequence[dict], repeats: int) -> List[dict]:
    """Evaluate the spec's goal checks on measured records (the first record of a point)."""
    index, goals = {}, []
    for r in records:
        index.setdefault((r['model'], r['resolution'], r['mode']), r)
    for check in checks:
        a_rec, b_rec = (index.get((*check[side], check['mode']), {}) for side in 'ab')
        a, b = a_rec.get(check['metric']), b_rec.get(check['metric'])
        value = (a / b if check['value'] == 'ratio' else 1 - a / b) if a and b else None
        threshold, op = check['threshold'], check['op']
        target = f'{op} {threshold:.0%}' if check['value'] == 'saving' else f'{op} {threshold}'
        detail = check.get('detail', DEFAULT_DETAILS[check['metric']]).format(
            a=fmt(a), b=fmt(b), repeats=repeats, paired=fmt(median_paired_ratio(a_rec, b_rec), 3))
        ok = None if value is None else (value <= threshold if op == '<=' else value >= threshold)
        goals.append(dict(goal=check['goal'], target=target, value=value, detail=detail, ok=ok))
    return goals


def run_goals(opts: RunOptions, goals_spec: dict,
              log: Callable[[str], None] = log_stderr) -> Tuple[List[dict], List[dict], dict]:
    """(goals, records, meta): every run of the spec, one :func:`run_points` call each (with the
    spec's batch and precision; not timed where ``"time": false``), then its checks."""
    records, meta = [], None
    for run in goals_spec['runs']:
        log(run['label'])
        run_opts = RunOptions(**dict(vars(opts), batch=goals_spec['batch'], mode=run['mode'],
                                     precision=goals_spec['precision'],
                                     do_time=opts.do_time and run['time']))
        recs, run_meta = run_points([(parse_model(n), r) for n, r in run['points']], run_opts,
                                    log)
        records += recs
        meta = meta or run_meta
    goals = evaluate_goals(records, goals_spec['checks'], opts.repeats)
    return goals, records, meta
