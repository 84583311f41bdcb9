#!/usr/bin/env python
"""FLOPs (multiply-accumulates) and parameters of XCiT backbones and the benchmark's baselines.

Without ``--models``: the paper Table 1 check (what ``benchmark.py --flops-report`` does).  For
every XCiT arch at 224/p16 and 384/p8 it counts XCiTBackbone's trunk, adds what the ImageNet
classifier puts on top (2 class-attention layers, norm, head; mmpretrain's modules), compares
with the paper (tolerance and paper figures: ``flops_report`` of ``docs/benchmark/goals_spec.json``)
and writes ``<out-dir>/<name>.csv`` and ``.json``; exit status 3 if an arch is off by more than
the tolerance.

With ``--models`` (names as in ``benchmark.py --list-models``): the forward GMACs, the executed
GFLOPs of ``--mode`` and the parameters of each model at each ``--resolutions`` (one image).

Counted with ``torch.utils.flop_counter.FlopCounterMode`` on fake tensors (no compute, any size
is cheap): mm/addmm/bmm/baddbmm, convolutions (grouped and depthwise exactly, also in the
backward), SDPA; XCA's products included; norms, softmax and element-wise ops not.  GMACs are what
the XCiT, Swin and DeiT papers call "GFLOPs".  The library is ``xcit_benchmark``; this file only
parses the command line and prints.

For a config's whole detector or segmentor, count with mmengine as upstream does: mmdet's
``benchmarks/get_flops.py CONFIG``, or ``mmengine.analysis.get_model_complexity_info``
(mmseg 1.2.2's script passes ``input_shape`` with ``inputs``, which mmengine 0.10 refuses).
``import xcit_mm`` (the configs' ``custom_imports``) makes that counter count XCA's fused
projection; it then reports these multiply-adds plus what it counts for norms (5 FLOPs per
LayerNorm, 2 per eval BatchNorm element), upsampling and pooling (tests/test_flops.py).

Examples::

    python benchmarks/get_flops.py --out-dir docs/benchmark
    python benchmarks/get_flops.py --models xcit_s12_p16 swin_t --resolutions 512 1024
    python benchmarks/get_flops.py --models xcit_s12_p16 xcit_s12_p16+cp --mode train
"""
import argparse
import os
import sys
import warnings
from typing import Optional, Sequence

# Run from a checkout without installing: make `import xcit_mm` find the repository.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from xcit_benchmark import (SpecError, flops_report, format_flops_report,  # noqa: E402
                                     format_model_flops, list_models, load_spec,
                                     parse_models, point_flops,
                                     run_metadata, write_rows)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check the command line (an unknown model name is an argparse error, exit 2)."""
    p = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        epilog=__doc__.split('\n\n', 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--models', nargs='+', default=None, metavar='NAME',
                   help='count these models instead of the paper Table 1 check; see '
                   '--list-models')
    p.add_argument('--resolutions', nargs='+', type=int, default=[224], metavar='PX',
                   help='square input sides for --models (default: %(default)s)')
    p.add_argument('--mode', choices=['inference', 'train'], default='inference',
                   help='for --models: also count a train step (forward + backward) in '
                   'gflop_exec (default: inference)')
    p.add_argument('--spec', default=None, metavar='JSON',
                   help='paper Table 1 and tolerance (default: docs/benchmark/goals_spec.json)')
    p.add_argument('--out-dir', default='work_dirs/benchmark',
                   help='where the CSV/JSON go (default: %(default)s)')
    p.add_argument('--name', default=None,
                   help='file name stem (default: flops; with --models: model_flops)')
    p.add_argument('--list-models', action='store_true', help='list model names and exit')
    args = p.parse_args(argv)
    if any(r < 32 for r in args.resolutions):
        p.error('--resolutions must be >= 32 (the stride-32 level of the dense backbones)')
    try:
        args.model_specs = parse_models(args.models or [])
    except ValueError as e:
        p.error(f'argument --models: {e}')
    try:
        args.spec_data = load_spec(args.spec)
    except SpecError as e:
        p.error(str(e))
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit status."""
    args = parse_args(argv)
    # mmcv's ConvModule warns about mmpretrain's LPI conv (bias before a norm): not our concern
    warnings.filterwarnings('ignore', message='Unnecessary conv bias before batch/instance norm')
    if args.list_models:
        print(list_models())
        return 0
    if args.models:
        cache = {}
        rows = []
        for name, spec in zip(args.models, args.model_specs):
            for res in args.resolutions:
                rows.append(dict(model=name, resolution=res, mode=args.mode,
                                 **point_flops(spec, res, args.mode, cache)))
        print(format_model_flops(rows))
        name = args.name or 'model_flops'
    else:
        cfg = args.spec_data['flops_report']
        rows = flops_report(cfg['paper_table1'], cfg['tolerance'])
        print(format_flops_report(rows))
        name = args.name or 'flops'
    write_rows(rows, run_metadata(), args.out_dir, name)
    print(f'wrote {args.out_dir}/{name}.csv and .json')
    if args.models:
        return 0
    return 0 if all(r['ok'] for r in rows) else 3


if __name__ == '__main__':
    sys.exit(main())
