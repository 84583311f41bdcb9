#!/usr/bin/env python
"""Speed, peak-memory and FLOPs benchmark for XCiT backbones and the usual alternatives.

Models (``--models``, see ``--list-models``):

* ``xcit_<arch>_p<8|16>``            ``XCiTBackbone.forward``: trunk + dense adapter (4 maps).
* ``xcit_<arch>_p<8|16>_trunk``      ``XCiTBackbone.forward_trunk``: trunk only (paper layers).
* ``mmpretrain_xcit_<arch>_p<8|16>`` mmpretrain's port of the same trunk
  (``mmpretrain.models.backbones.xcit.XCiT`` with ``cls_attn_layers=0``, ``out_type='featmap'``,
  ``final_norm=False``, ``out_indices`` = the paper layers), i.e. the same work as ``*_trunk``.
* ``resnet50``  mmdet ``ResNet`` depth 50; ``swin_t`` mmdet ``SwinTransformer`` (embed 96, depths
  2,2,6,2, window 7); ``vit_s16`` mmseg ``VisionTransformer`` (DeiT-S: embed 384, depth 12, 6 heads,
  img_size 224, position embedding interpolated to the input size on the fly).
* Suffix ``+cp`` builds the model with ``with_cp=True`` (gradient checkpointing; only changes the
  train-step numbers).
* Suffix ``+compile`` times the model through ``torch.compile(forward, dynamic=False)``
  (inductor; the compilation is an extra untimed first call per resolution, reported as
  ``compile_s``); ``--compile both`` times every model eager and compiled, interleaved, and prints
  the compiled / eager ratios.

Every model is built untrained, all parameters trainable, drop-path 0, BatchNorm (no SyncBN).

Figures per (model, resolution) point:

* time: median ms/image over ``--repeats`` timed calls after ``--warmup`` calls.  The repeats are
  *interleaved* across models (round r runs every model once, in an order rotated by r), so slow
  drifts of a shared machine hit all models alike; ``--compare`` also reports the median of the
  per-round (paired) time ratios.
* peak memory: measured in a FRESH PROCESS per point.  CPU: growth of the peak resident set
  (``VmHWM`` of ``/proc/self/status``, reset through ``/proc/self/clear_refs``) over the resident
  set after the model build, a 64 px warm-up call (it faults in code pages, creates thread pools),
  the input creation and ``malloc_trim(0)`` (so freed warm-up pages cannot hide reuse); the
  worker runs with ``MALLOC_MMAP_THRESHOLD_=65536`` so that the RSS peak follows the live tensors
  (``--cpu-mem-mode process`` keeps glibc's defaults: the RSS a plain process shows).  CUDA:
  ``torch.cuda.max_memory_allocated()`` growth over ``torch.cuda.memory_allocated()`` at the same
  moment.  So it is the memory the forward (or train
  step, incl. the parameter gradients) needs on top of the weights and the input.
* FLOPs: counted with ``torch.utils.flop_counter.FlopCounterMode`` (aten-level: mm/addmm/bmm,
  convolutions incl. depthwise and transposed, SDPA; matmul/einsum decompose into bmm, so the XCA
  ``q @ k^T`` and ``attn @ v`` products are counted; norms, softmax and element-wise ops are not,
  as in fvcore).  ``gmacs`` = forward multiply-accumulates per image, the unit the XCiT/Swin/DeiT
  papers call "GFLOPs".  ``achieved_gflop_s`` uses 2 FLOPs per MAC of everything executed
  (forward, plus backward and checkpoint recomputation in train mode) and ``matmul_frac`` divides it
  by the rate of a float32 1024x1024 ``torch.mm`` timed as an extra step of every interleaved
  round (so it sees the same machine load as the models).

The default models and resolutions, the goals of ``--goals`` and paper Table 1 of
``--flops-report`` are data: ``docs/benchmark/goals_spec.json`` (``--spec``).  The measuring code
is the library ``xcit_benchmark``; this file only parses the command line, shows the
progress bar and prints.

Examples::

    python benchmarks/benchmark.py                     # default table, CPU inference
    python benchmarks/benchmark.py --models xcit_s12_p8 --resolutions 384 --compare \\
        --repeats 20
    python benchmarks/benchmark.py --mode train --with-cp both --models xcit_s12_p16 \\
        --resolutions 1024
    python benchmarks/benchmark.py --goals --threads 1 # the project's goals, PASS/FAIL
    python benchmarks/get_flops.py                     # Table 1 check of the trunk FLOPs
    python benchmarks/benchmark.py --markdown docs/benchmark/goals.json  # docs tables
    python benchmarks/benchmark.py --models xcit_s12_p16 --resolutions 512 \\
        --compile both --no-mem --threads 1 --repeats 10   # torch.compile vs eager
    python benchmarks/benchmark.py --onnx configs/sem_fpn_xcit_s12_p16_80k_ade20k.py \\
        --resolutions 512 --threads 1 --repeats 10          # ONNX Runtime vs PyTorch eager
    python benchmarks/benchmark.py --whole-model \\
        configs/mask_rcnn_xcit_s12_p16_3x_coco.py \\
        mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py --mode train --shape 800 1216 \\
        --rounds 3    # whole detectors, medians of 3 interleaved rounds, XCiT / Swin-T ratios

This tool never imports torchvision.  mmpretrain's XCiT module is loaded without executing the
``mmpretrain.models`` package ``__init__`` (see ``xcit_benchmark.load_mmpretrain_xcit``).
"""
import argparse
import json
import os
import sys
import warnings
from typing import List, Optional, Sequence, Tuple

# Run from a checkout without installing: make `import xcit_mm` find the repository.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from xcit_benchmark import (RunOptions, SpecError, check_same_trunk,  # noqa: E402
                                     compare_pairs, compile_variants, flops_report,
                                     format_flops_report, format_goals, format_ratios,
                                     format_table, list_models, load_spec, markdown_result,
                                     parse_models, ratio_rows, run_goals,
                                     run_metadata, run_points, with_cp_variants, write_outputs,
                                     write_rows)
from xcit_benchmark.memory import mem_available_bytes  # noqa: E402
from xcit_benchmark.plot import default_title, plot_records  # noqa: E402
from xcit_benchmark.timing import set_threads  # noqa: E402


def build_parser(spec: Optional[dict]) -> argparse.ArgumentParser:
    """The command line; defaults of ``--models`` / ``--resolutions`` come from ``spec``."""
    p = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        epilog=__doc__.split('\n\n', 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--models', nargs='+', default=spec and spec['default_models'],
                   metavar='NAME',
                   help='models to measure (default: %(default)s, from --spec); see --list-models')
    p.add_argument('--resolutions', nargs='+', type=int,
                   default=spec and spec['default_resolutions'],
                   metavar='PX', help='square input sides (default: %(default)s, from --spec); '
                   'add 2048 where it fits: a point whose memory worker exceeds --mem-limit-gb is '
                   'reported as OOM and not timed')
    p.add_argument('--batch-size', type=int, default=1, help='images per call (default: 1)')
    p.add_argument('--mode', choices=['inference', 'train'], default='inference',
                   help='inference: eval() + no_grad forward; train: train() forward + backward '
                   'of sum(out.mean()) with fresh gradients (default: inference)')
    p.add_argument('--precision', choices=['fp32', 'amp'], default='fp32',
                   help='fp32, or amp = torch.autocast with bf16 on CPU / fp16 on CUDA')
    p.add_argument('--device', choices=['cpu', 'cuda'], default='cpu', help='(default: cpu)')
    p.add_argument('--threads', type=int, default=None,
                   help='torch.set_num_threads (and OMP/MKL threads of the memory workers); '
                   'default: torch\'s default')
    p.add_argument('--warmup', type=int, default=None,
                   help='untimed calls per model and resolution (default 1; --goals: the '
                   'spec\'s goals.warmup, 2)')
    p.add_argument('--repeats', type=int, default=None,
                   help='timed interleaved rounds; the median is reported (default 5; '
                   '--goals: the spec\'s goals.repeats, 10). Run-to-run noise of a shared CPU is '
                   '~10%%: use >= 10 for decisions')
    p.add_argument('--with-cp', choices=['off', 'on', 'both'], default='off',
                   help='gradient checkpointing for models that support it (all but the '
                   'mmpretrain port); both = each model with and without (the +cp suffix on a '
                   'model name does the same for one model)')
    p.add_argument('--compile', choices=['off', 'on', 'both'], default='off',
                   help='torch.compile (inductor, dynamic=False) the timed forward / train step; '
                   'both = each model eager and compiled, interleaved, with compiled/eager ratios '
                   '(the +compile suffix on a model name does the same for one model)')
    p.add_argument('--onnx', metavar='CONFIG', default=None,
                   help='instead of --models: export CONFIG\'s model (random init; segmentor: '
                   'image -> logits, detector: backbone + neck) to ONNX at each resolution and '
                   'time ONNX Runtime vs PyTorch eager, interleaved (CPU fp32 inference; needs '
                   'onnx / onnxruntime)')
    p.add_argument('--whole-model', nargs='+', metavar='CONFIG', default=None,
                   help='instead of --models: measure whole detectors / segmentors (a config '
                   'path or mmdet::/mmseg:: config; random init, SyncBN -> BN) on synthetic '
                   'images of --shape, one fresh process per config, --mode train (AdamW step) '
                   'or inference; time and peak RSS by part (trunk, adapter, neck, heads, '
                   'backward, optimizer). Default --repeats 3 (timed steps per process), '
                   '--rounds 3. With 2+ configs the first is the subject and every other one a '
                   'baseline: prints the median (min-max) of the per-round ratios subject / '
                   'baseline of step time and peak memory')
    p.add_argument('--detections', type=int, default=100,
                   help='--whole-model detectors: every config gets the first config\'s '
                   'train_cfg / test_cfg, and inference keeps exactly this many detections per '
                   'image (score_thr 0), so that both sides do the same RoI and mask-head work '
                   '(default: 100, the COCO max_per_img)')
    p.add_argument('--own-settings', action='store_true',
                   help='--whole-model: give each config its own detector train_cfg / test_cfg '
                   'and optimizer flags (to measure what a setting costs, e.g. a config against '
                   'one that reverts it) instead of the first config\'s for all')
    p.add_argument('--rounds', type=int, default=None,
                   help='--whole-model only: interleaved rounds; round r measures every config '
                   'once (a fresh process each) in an order rotated by r; the reported figures '
                   'are medians over the rounds (default: 3)')
    p.add_argument('--shape', nargs=2, type=int, metavar=('H', 'W'), default=None,
                   help='input height and width of --whole-model')
    p.add_argument('--mem-iters', type=int, default=2,
                   help='calls in each fresh memory process after the baseline (default: 2)')
    p.add_argument('--cpu-mem-mode', choices=['live', 'process'], default='live',
                   help='CPU peak memory: live = the memory workers run with '
                   'MALLOC_MMAP_THRESHOLD_=65536, so the RSS peak follows the live tensors '
                   '(reproducible to <1%%, comparable to CUDA max_memory_allocated); process = '
                   'glibc defaults, the RSS a plain process shows, incl. freed heap blocks glibc '
                   'keeps (up to 2x more, +-15%% run to run). Default: live')
    p.add_argument('--mem-limit-gb', type=float, default=None,
                   help='kill a memory worker above this RSS and report OOM (default: 80%% of '
                   'MemAvailable at start)')
    p.add_argument('--mem-timeout', type=float, default=1800., help='seconds per memory worker')
    p.add_argument('--no-time', action='store_true', help='skip the timing (memory/FLOPs only)')
    p.add_argument('--no-mem', action='store_true', help='skip the fresh-process memory workers')
    p.add_argument('--no-flops', action='store_true', help='skip FLOP counting')
    p.add_argument('--compare', action='store_true',
                   help='for every xcit_* model: XCiTBackbone.forward_trunk vs mmpretrain\'s port '
                   'of the same trunk (cls_attn_layers=0; same out_indices), interleaved; prints '
                   'median time ratio, paired ratio and memory ratio; also loads the port\'s '
                   'weights into XCiTBackbone and reports the max output difference')
    p.add_argument('--goals', action='store_true',
                   help='run exactly the goal checks of --spec (batch 1, fp32) and print '
                   'PASS/FAIL with the measured numbers')
    p.add_argument('--fail-on-goal-miss', action='store_true',
                   help='with --goals: exit with status 3 if a goal fails')
    p.add_argument('--flops-report', action='store_true',
                   help='GMACs of every XCiT arch at 224/p16 and 384/p8 vs paper Table 1 (no '
                   'device, no compute); the same as benchmarks/get_flops.py')
    p.add_argument('--spec', default=None, metavar='JSON',
                   help='default models/resolutions, goals and paper Table 1 (default: '
                   'docs/benchmark/goals_spec.json)')
    p.add_argument('--out-dir', default='work_dirs/benchmark',
                   help='where CSV/JSON/PNG go (default: %(default)s)')
    p.add_argument('--name', default=None,
                   help='file name stem (default: benchmark / compare / goals / flops)')
    p.add_argument('--no-plot', action='store_true', help='no PNG')
    p.add_argument('--quiet', action='store_true', help='no progress bar')
    p.add_argument('--list-models', action='store_true', help='list model names and exit')
    p.add_argument('--replot', metavar='JSON', default=None,
                   help='only redraw the PNG of an earlier run from its JSON (written next to it)')
    p.add_argument('--markdown', metavar='JSON', default=None,
                   help='only print the Markdown tables of an earlier run / goals run / FLOPs '
                   'report from its JSON (the tables docs/benchmark.md quotes)')
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check the command line; ``args.spec_data`` is the loaded spec.

    An unknown model name, an empty measurement or a bad spec is an argparse error (exit 2).
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument('--spec', default=None)
    spec, spec_error = None, None
    try:
        spec = load_spec(pre.parse_known_args(argv)[0].spec)
    except SpecError as e:
        spec_error = str(e)
    p = build_parser(spec)
    args = p.parse_args(argv)
    if spec_error:
        p.error(spec_error)
    args.spec_data = spec
    for name in ('batch_size', 'repeats', 'mem_iters', 'rounds'):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f'--{name.replace("_", "-")} must be >= 1')
    if args.warmup is not None and args.warmup < 0:
        p.error('--warmup must be >= 0')
    if any(r < 32 for r in args.resolutions):
        p.error('--resolutions must be >= 32 (the stride-32 level of the dense backbones)')
    if args.no_time and args.no_mem and args.no_flops and not (args.flops_report or args.goals):
        p.error('nothing to measure: --no-time, --no-mem and --no-flops all given')
    try:
        args.model_specs = specs = parse_models(args.models)
    except ValueError as e:
        p.error(f'argument --models: {e}')
    if args.whole_model:
        from xcit_benchmark.whole_model import WholeModelError, check_config_path
        if not args.shape or min(args.shape) < 32:
            p.error('--whole-model needs --shape H W (both >= 32)')
        for config in args.whole_model:
            try:
                check_config_path(config)
            except WholeModelError as e:
                p.error(f'argument --whole-model: {e}')
    elif args.rounds is not None:
        p.error('--rounds is for --whole-model (the backbone benchmark\'s --repeats are already '
                'interleaved rounds)')
    if args.compare and not any(s.family in ('xcit', 'xcit_trunk') for s in specs):
        p.error('--compare needs at least one xcit_* model in --models')
    return args


def tqdm_progress(total: int, desc: str):
    """The progress bar of a run (on stderr)."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)


def log(message: str):
    """Progress messages and warnings go to stderr."""
    print(message, file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit status."""
    args = parse_args(argv)
    # mmcv's ConvModule warns about mmpretrain's LPI conv (bias before a norm): not our concern
    warnings.filterwarnings('ignore', message='Unnecessary conv bias before batch/instance norm')
    if args.list_models:
        print(list_models())
        return 0
    if args.replot:
        with open(args.replot) as f:
            data = json.load(f)
        png = os.path.splitext(args.replot)[0] + '.png'
        plot_records(data['records'], png, default_title(data['meta'], data['records']))
        print(f'wrote {png}')
        return 0
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown_result(json.load(f)))
        return 0
    spec = args.spec_data
    goals_spec = spec['goals']
    limit = args.mem_limit_gb * 2 ** 30 if args.mem_limit_gb else 0.8 * mem_available_bytes()
    warmup = args.warmup if args.warmup is not None else (
        goals_spec['warmup'] if args.goals else 1)
    repeats = args.repeats or (goals_spec['repeats'] if args.goals else 5)
    opts = RunOptions(batch=args.batch_size, mode=args.mode, precision=args.precision,
                      device=args.device, threads=args.threads, warmup=warmup, repeats=repeats,
                      mem_iters=args.mem_iters, cpu_mem_mode=args.cpu_mem_mode,
                      mem_limit_bytes=int(limit), mem_timeout_s=args.mem_timeout,
                      do_time=not args.no_time, do_mem=not args.no_mem,
                      do_flops=not args.no_flops, quiet=args.quiet)
    set_threads(args.threads)

    if args.flops_report:
        cfg = spec['flops_report']
        rows = flops_report(cfg['paper_table1'], cfg['tolerance'])
        print(format_flops_report(rows))
        name = args.name or 'flops'
        write_rows(rows, run_metadata(), args.out_dir, name)
        print(f'wrote {args.out_dir}/{name}.csv and .json')
        return 0 if all(r['ok'] for r in rows) else 3

    if args.goals:
        goals, records, meta = run_goals(opts, goals_spec, tqdm_progress, log)
        print(format_table(records))
        print()
        print(format_goals(goals))
        meta['goals'] = goals
        paths = write_outputs(records, meta, args.out_dir, args.name or 'goals', plot=False)
        print('wrote ' + ', '.join(paths))
        failed = any(g['ok'] is not True for g in goals)
        return 3 if failed and args.fail_on_goal_miss else 0

    if args.whole_model:
        from xcit_benchmark.whole_model import (format_whole_ratios, format_whole_table,
                                                run_whole_models, whole_model_ratios,
                                                work_settings, write_whole_outputs)
        repeats, rounds = args.repeats or 3, args.rounds or 3
        work = None if args.own_settings else work_settings(args.whole_model[0],
                                                            args.detections)
        records = run_whole_models(
            args.whole_model, args.mode, args.shape[0], args.shape[1], batch=args.batch_size,
            repeats=repeats, threads=args.threads, cpu_mem_mode=args.cpu_mem_mode,
            limit_bytes=limit, timeout_s=args.mem_timeout, log=None if args.quiet else log,
            rounds=rounds, work=work)
        print(format_whole_table(records))
        ratios = whole_model_ratios(records)
        if ratios:
            print()
            print(format_whole_ratios(ratios))
        meta = run_metadata()
        meta.update(whole_model=dict(configs=args.whole_model, mode=args.mode,
                                     shape=args.shape, batch=args.batch_size,
                                     repeats=repeats, rounds=rounds,
                                     cpu_mem_mode=args.cpu_mem_mode, work=work))
        meta['ratios'] = ratios
        paths = write_whole_outputs(records, meta, args.out_dir, args.name or 'wholemodel')
        print('wrote ' + ', '.join(paths))
        return 0 if all(r.get('status') == 'ok' for r in records) else 1

    if args.onnx:
        from xcit_benchmark.onnx_rt import onnx_model_names, run_onnx_points
        records, meta = run_onnx_points(args.onnx, args.resolutions, opts, log=log)
        print(format_table(records))
        rows = ratio_rows(records, [onnx_model_names(args.onnx)[::-1]])
        print()
        print(format_ratios(rows))
        meta['ratios'] = rows
        paths = write_outputs(records, meta, args.out_dir, args.name or 'onnx', plot=False)
        print('wrote ' + ', '.join(paths))
        return 0

    specs = args.model_specs
    pairs: List[Tuple[str, str]] = []
    if args.compare:
        specs, pairs = compare_pairs(specs)
    specs = with_cp_variants(specs, args.with_cp, pairs)
    specs = compile_variants(specs, args.compile, pairs)
    checks = []
    if args.compare:
        checks = [check_same_trunk(s.arch, s.patch) for s in specs
                  if s.family == 'xcit_trunk' and not s.with_cp]
    records, meta = run_points([(s, r) for r in args.resolutions for s in specs], opts,
                               tqdm_progress, log)
    print(format_table(records))
    if pairs:
        rows = ratio_rows(records, pairs)
        print()
        print(format_ratios(rows))
        meta['ratios'] = rows
    for line in checks:
        print(line)
    meta['checks'] = checks
    paths = write_outputs(records, meta, args.out_dir,
                          args.name or ('compare' if args.compare else 'benchmark'),
                          plot=not args.no_plot)
    print('wrote ' + ', '.join(paths))
    return 0


if __name__ == '__main__':
    sys.exit(main())
