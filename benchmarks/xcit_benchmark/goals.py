"""``--goals``: measure the points the spec's goal runs list, then evaluate its checks (the goals
are data: the ``goals`` section of the spec, :mod:`.spec`)."""
from typing import Callable, List, Sequence, Tuple

from .compare import median_paired_ratio
from .models import parse_model
from .report import fmt
from .runner import RunOptions, log_stderr, run_points

DEFAULT_DETAILS = {
    'peak_mem_mb': '{a} MB / {b} MB',
    'ms_per_img': '{a} ms / {b} ms, paired median ratio {paired}, {repeats} interleaved repeats'}


def evaluate_goals(records: Sequence[dict], checks: Sequence[dict], repeats: int) -> List[dict]:
    """Evaluate the spec's goal checks on measured records (the first record of a point)."""
    index, goals = {}, []
    for r in records:
        index.setdefault((r['model'], r['resolution'], r['mode']), r)
    for check in checks:
        a_rec = index.get((*check['a'], check['mode']), {})
        b_rec = index.get((*check['b'], check['mode']), {})
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
