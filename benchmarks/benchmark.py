#!/usr/bin/env python
"""Speed, peak memory and FLOPs of XCiT backbones and the usual alternatives, or of whole configs.

Method, figures and the committed runs: docs/benchmark.md, docs/benchmark_whole_model.md,
docs/flops.md; defaults, goals and paper Table 1: docs/benchmark/goals_spec.json.

Examples::

    python benchmarks/benchmark.py                          # default table, CPU inference
    python benchmarks/benchmark.py --models xcit_s12_p8 --resolutions 384 --compare
    python benchmarks/benchmark.py --goals --threads 1      # the project's goals, PASS/FAIL
    python benchmarks/benchmark.py --flops-report           # paper Table 1 check of the FLOPs
    python benchmarks/benchmark.py --whole-model CONFIG [BASELINE ...] --shape 800 1216
"""
import argparse
import json
import os
import sys
from typing import List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # xcit_mm

from xcit_benchmark import report, runner  # noqa: E402
from xcit_benchmark.flops import flops_report  # noqa: E402
from xcit_benchmark.fresh_points import run_metadata, write_artifact  # noqa: E402
from xcit_benchmark.models import list_models, parse_model  # noqa: E402
from xcit_benchmark.runner import RunOptions, log_stderr, mem_available_bytes  # noqa: E402
from xcit_benchmark.spec import SpecError, load_spec, run_goals  # noqa: E402
from xcit_benchmark.timing import set_threads  # noqa: E402
from xcit_benchmark.whole_model import (WholeModelError, check_config_path,  # noqa: E402
                                        run_whole_models, whole_model_ratios, work_settings,
                                        write_whole_outputs)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check the command line (a bad one is a usage error, exit 2)."""
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                epilog=__doc__.split('\n\n', 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add('--models', nargs='+', metavar='NAME',
        help="models to measure (default: the spec's default_models); see --list-models")
    add('--resolutions', nargs='+', type=int, metavar='PX',
        help="square input sides (default: the spec's default_resolutions)")
    add('--batch-size', type=int, default=1, help='images per call')
    add('--mode', choices=['inference', 'train'], default='inference')
    add('--precision', choices=['fp32', 'amp'], default='fp32', help='amp: bf16 CPU, fp16 CUDA')
    add('--device', choices=['cpu', 'cuda'], default='cpu')
    add('--threads', type=int, help='torch threads (and OMP/MKL threads of the memory workers)')
    add('--warmup', type=int, help="untimed calls per model and size (1; --goals: the spec's)")
    add('--repeats', type=int, help="timed interleaved rounds (5; --goals: the spec's; "
        '--whole-model: 3 steps per process)')
    add('--with-cp', choices=['off', 'on', 'both'], default='off', help='both: with ratios')
    add('--compile', choices=['off', 'on', 'both'], default='off', help='both: with ratios')
    add('--onnx', metavar='CONFIG', help="CONFIG's model in ONNX Runtime against eager (CPU)")
    add('--whole-model', nargs='+', metavar='CONFIG',
        help='whole models on --shape images, by part; the first one the subject of the ratios')
    add('--detections', type=int, default=100, help='--whole-model: detections per image')
    add('--own-settings', action='store_true', help="--whole-model: each one's detector settings")
    add('--rounds', type=int, help='--whole-model: interleaved rounds (3)')
    add('--shape', nargs=2, type=int, metavar=('H', 'W'), help='--whole-model: input size')
    add('--mem-iters', type=int, default=2, help='calls measured in each memory process')
    add('--cpu-mem-mode', choices=['live', 'process'], default='live',
        help="live: MALLOC_MMAP_THRESHOLD_=65536; process: glibc's defaults")
    add('--mem-limit-gb', type=float, help='RSS limit of a memory process (80%% of MemAvailable)')
    add('--no-time', action='store_true', help='no timing')
    add('--no-mem', action='store_true', help='no memory processes')
    add('--compare', action='store_true', help="our XCiT trunk against mmpretrain's port")
    add('--goals', action='store_true', help='the goal checks of --spec, PASS/FAIL')
    add('--fail-on-goal-miss', action='store_true', help='--goals: exit 3 if a goal fails')
    add('--flops-report', action='store_true', help='GMACs against paper Table 1')
    add('--spec', metavar='JSON', help='default: docs/benchmark/goals_spec.json')
    add('--out-dir', default='work_dirs/benchmark', help='where CSV/JSON/PNG go')
    add('--name', help='file name stem')
    add('--no-plot', action='store_true', help='no PNG')
    add('--quiet', action='store_true', help='no progress lines')
    add('--list-models', action='store_true', help='list model names and exit')
    add('--markdown', metavar='JSON', help='the Markdown tables of a result')
    args = p.parse_args(argv)
    try:
        args.spec_data = spec = load_spec(args.spec)
    except SpecError as e:
        p.error(str(e))
    args.models = args.models or spec['default_models']
    args.resolutions = args.resolutions or spec['default_resolutions']
    for name, least in (('batch_size', 1), ('repeats', 1), ('mem_iters', 1), ('rounds', 1),
                        ('warmup', 0)):
        if getattr(args, name) is not None and getattr(args, name) < least:
            p.error(f'--{name.replace("_", "-")} must be >= {least}')
    if any(r < 32 for r in args.resolutions):
        p.error('--resolutions must be >= 32 (the stride-32 level of the dense backbones)')
    args.model_specs = specs = []
    for name in args.models:
        try:
            specs.append(parse_model(name))
        except ValueError as e:
            p.error(f'argument --models: invalid choice: {name!r} ({e}). Valid names:\n'
                    + list_models())
    if args.whole_model:
        if not args.shape or min(args.shape) < 32:
            p.error('--whole-model needs --shape H W (both >= 32)')
        for config in args.whole_model:
            try:
                check_config_path(config)
            except WholeModelError as e:
                p.error(f'argument --whole-model: {e}')
    elif args.rounds is not None:
        p.error('--rounds is for --whole-model (--repeats are already interleaved rounds)')
    if args.compare and not any(s.family in ('xcit', 'xcit_trunk') for s in specs):
        p.error('--compare needs at least one xcit_* model in --models')
    return args


def whole_models(args, limit: float) -> int:
    work = None if args.own_settings else work_settings(args.whole_model[0], args.detections)
    settings = dict(mode=args.mode, batch=args.batch_size, repeats=args.repeats or 3,
                    rounds=args.rounds or 3, cpu_mem_mode=args.cpu_mem_mode, work=work)
    records = run_whole_models(args.whole_model, height=args.shape[0], width=args.shape[1],
                               threads=args.threads, limit_bytes=limit,
                               log=None if args.quiet else log_stderr, **settings)
    meta = dict(run_metadata(), whole_model=dict(configs=args.whole_model, shape=args.shape,
                                                 **settings), ratios=whole_model_ratios(records))
    print(report.markdown_whole_model(dict(meta=meta, records=records)))
    for r in records:
        if r['status'] != 'ok':
            print(f"{r['model']}: {r['note']}")
    paths = write_whole_outputs(records, meta, args.out_dir, args.name or 'wholemodel')
    print('wrote ' + ', '.join(paths))
    return 0 if all(r.get('status') == 'ok' for r in records) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit status."""
    args = parse_args(argv)
    if args.list_models:
        print(list_models())
        return 0
    if args.markdown:
        with open(args.markdown) as f:
            print(report.markdown_result(json.load(f)))
        return 0
    spec, goals_spec = args.spec_data, args.spec_data['goals']
    limit = args.mem_limit_gb * 2 ** 30 if args.mem_limit_gb else 0.8 * mem_available_bytes()
    warmup = args.warmup if args.warmup is not None else (goals_spec['warmup'] if args.goals else 1)
    repeats = args.repeats or (goals_spec['repeats'] if args.goals else 5)
    opts = RunOptions(batch=args.batch_size, mode=args.mode, precision=args.precision,
                      device=args.device, threads=args.threads, warmup=warmup, repeats=repeats,
                      mem_iters=args.mem_iters, cpu_mem_mode=args.cpu_mem_mode,
                      mem_limit_bytes=int(limit), do_time=not args.no_time,
                      do_mem=not args.no_mem, quiet=args.quiet)
    set_threads(args.threads)
    if args.flops_report:
        rows = flops_report(spec['flops_report']['paper_table1'], spec['flops_report']['tolerance'])
        print(report.markdown_flops_report(rows))
        print('wrote ' + ', '.join(write_artifact(os.path.join(args.out_dir, args.name or 'flops'),
                                                  run_metadata(), rows)))
        return 0 if all(r['ok'] for r in rows) else 3
    if args.whole_model:
        return whole_models(args, limit)
    pairs: List[Tuple[str, str]] = []
    checks: List[str] = []
    if args.goals:
        goals, records, meta = run_goals(opts, goals_spec)
        meta['goals'] = goals
    elif args.onnx:
        records, meta = runner.run_onnx_points(args.onnx, args.resolutions, opts)
        pairs = [(records[1]['model'], records[0]['model'])]  # ONNX Runtime / eager
    else:
        specs = args.model_specs
        if args.compare:
            specs, pairs = runner.compare_pairs(specs)
        specs = runner.variants(specs, args.with_cp, pairs, '+cp')
        specs = runner.variants(specs, args.compile, pairs, '+compile')
        checks = [runner.check_same_trunk(s.arch, s.patch) for s in specs
                  if args.compare and s.family == 'xcit_trunk' and not s.with_cp]
        records, meta = runner.run_points([(s, r) for r in args.resolutions for s in specs], opts)
        meta['checks'] = checks
    print(report.format_table(records))
    if pairs:
        meta['ratios'] = runner.ratio_rows(records, pairs)
        print('\n' + report.format_ratios(meta['ratios']))
    if args.goals:
        print('\n' + report.markdown_goals(goals))
    for line in checks:
        print(line)
    name = args.name or ('goals' if args.goals else 'onnx' if args.onnx else
                         'compare' if args.compare else 'benchmark')
    plot = not (args.no_plot or args.goals or args.onnx)
    print('wrote ' + ', '.join(report.write_outputs(records, meta, args.out_dir, name, plot)))
    if args.goals and args.fail_on_goal_miss and any(g['ok'] is not True for g in goals):
        return 3
    return 0


if __name__ == '__main__':
    sys.exit(main())
