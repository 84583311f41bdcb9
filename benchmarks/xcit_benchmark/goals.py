"""``--goals``: measure the points the spec's goal runs list, then evaluate its checks.

The goals themselves (points, metrics, thresholds) are data: the ``goals`` section of the spec
(:mod:`.spec`, ``docs/benchmark/goals_spec.json``).
"""
from typing import Callable, List, Optional, Sequence, Tuple

from .compare import median_paired_ratio
from .models import parse_model
from .report import fmt
from .runner import RunOptions, log_stderr, run_points

DEFAULT_DETAILS = {
    'peak_mem_mb': '{a} MB / {b} MB',
    'ms_per_img': '{a} ms / {b} ms, paired median ratio {paired}, {repeats} interleaved repeats'}


def _find(records: Sequence[dict], point: Sequence, mode: str) -> Optional[dict]:
    name, res = point
    for r in records:
        if (r['model'], r['resolution'], r['mode']) == (name, res, mode):
            return r
    return None


def evaluate_goals(records: Sequence[dict], checks: Sequence[dict], repeats: int) -> List[dict]:
    """Evaluate the spec's goal checks on measured records."""
    goals = []
    for check in checks:
        a_rec = _find(records, check['a'], check['mode']) or {}
        b_rec = _find(records, check['b'], check['mode']) or {}
        a, b = a_rec.get(check['metric']), b_rec.get(check['metric'])
        value = None
        if a and b:
            value = a / b if check['value'] == 'ratio' else 1 - a / b
        threshold = check['threshold']
        target = f'{check["op"]} {threshold:.0%}' if check['value'] == 'saving' else \
            f'{check["op"]} {threshold}'
        template = check.get('detail', DEFAULT_DETAILS[check['metric']])
        detail = template.format(a=fmt(a), b=fmt(b), repeats=repeats,
                                 paired=fmt(median_paired_ratio(a_rec, b_rec), 3))
        ok = None
        if value is not None:
            ok = value <= threshold if check['op'] == '<=' else value >= threshold
        goals.append(dict(goal=check['goal'], target=target, value=value, detail=detail, ok=ok))
    return goals


def run_goals(opts: RunOptions, goals_spec: dict,
              log: Callable[[str], None] = log_stderr) -> Tuple[List[dict], List[dict], dict]:
    """(goals, records, meta): every run of the spec, one :func:`run_points` call each (with the
    spec's batch and precision; not timed where ``"time": false``), then its checks."""
    records: List[dict] = []
    meta = None
    for run in goals_spec['runs']:
        overrides = dict(batch=goals_spec['batch'], precision=goals_spec['precision'],
                         mode=run['mode'])
        if not run['time']:
            overrides['do_time'] = False
        log(run['label'])
        recs, run_meta = run_points([(parse_model(n), r) for n, r in run['points']],
                                    RunOptions(**{**vars(opts), **overrides}), log)
        records += recs
        meta = run_meta if meta is None else meta
    goals = evaluate_goals(records, goals_spec['checks'], opts.repeats)
    return goals, records, meta
