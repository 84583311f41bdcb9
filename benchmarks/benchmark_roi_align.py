#!/usr/bin/env python
"""CPU speed of GatherRoIAlign against mmcv's RoIAlign, forward and forward + backward.

Each case: a seeded RoI-pooling call of Mask R-CNN on its stride-4 level (shapes', COCO's), both
on the same inputs (largest difference recorded), interleaved rounds. docs/benchmark_shapes.md.

Examples::

    python benchmarks/benchmark_roi_align.py      # all cases -> docs/benchmark/
    python benchmarks/benchmark_roi_align.py --cases shapes_bbox --repeats 3 --out-dir /tmp/rb
    python benchmarks/benchmark_roi_align.py --markdown docs/benchmark/roi_align_cpu.json
"""
import argparse
import json
import math
import os
import statistics
import sys
from typing import Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # xcit_mm

from training_extras.roi_heads import GatherRoIAlign  # noqa: E402
from xcit_benchmark.fresh_points import run_metadata, write_artifact  # noqa: E402
from xcit_benchmark.report import md_table  # noqa: E402
from xcit_benchmark.timing import set_threads, time_interleaved  # noqa: E402

CASES = tuple(dict(name=name, map=m, stride=4, rois=rois, output=out, sampling_ratio=ratio)
              for name, m, rois, out, ratio in (
                  ('shapes_bbox', (4, 64, 40, 40), 128, 7, 2),
                  ('shapes_mask', (4, 64, 40, 40), 32, 14, 2),
                  ('coco_bbox', (2, 256, 200, 304), 1024, 7, 0),
                  ('coco_mask', (2, 256, 200, 304), 128, 14, 0)))
BOX_PX = (8.0, 112.0)  # box sides (image pixels) that mmdet's RoI extractor maps to stride 4
COLUMNS = ('case', 'map', 'RoIs', 'output', 'sampling ratio', 'mmcv fwd ms', 'gather fwd ms',
           'speedup', 'mmcv fwd+bwd ms', 'gather fwd+bwd ms', 'speedup', 'max diff')


def make_inputs(case: dict, seed: int = 0):
    """Feature map, (R, 5) RoIs in image pixels and output weighting ``w`` of a case."""
    gen = torch.Generator().manual_seed(seed)
    (n, c, h, w), num = case['map'], case['rois']
    image = torch.tensor([w * case['stride'], h * case['stride']], dtype=torch.float32)
    feat = torch.randn(n, c, h, w, generator=gen)
    lo, hi = math.log(BOX_PX[0]), math.log(BOX_PX[1])
    size = torch.minimum(torch.exp(lo + (hi - lo) * torch.rand(num, 2, generator=gen)), image)
    corner = torch.rand(num, 2, generator=gen) * (image - size)
    index = (torch.arange(num) % n).to(feat.dtype)[:, None]
    rois = torch.cat([index, corner, corner + size], 1)
    weight = torch.randn(num, c, case['output'], case['output'], generator=gen)
    return feat, rois, weight


def _run(op, feat, rois, weight, backward: bool):
    if not backward:
        with torch.no_grad():
            return op(feat, rois), None
    feat = feat.detach().requires_grad_()
    out = op(feat, rois)
    (out * weight).sum().backward()
    return out.detach(), feat.grad


def measure(case: dict, repeats: int = 10, warmup: int = 2) -> dict:
    """Check agreement and time both implementations (``aligned=True``) on one case."""
    from mmcv.ops import RoIAlign
    feat, rois, weight = make_inputs(case)
    args = (case['output'], 1.0 / case['stride'], case['sampling_ratio'], 'avg', True)
    ops = dict(mmcv=RoIAlign(*args), gather=GatherRoIAlign(*args))
    (ref_out, ref_grad), (out, grad) = (_run(op, feat, rois, weight, True) for op in ops.values())
    steps = {f'{impl}_{kind}_ms': (lambda op=op, backward=kind == 'fwd_bwd':
                                   _run(op, feat, rois, weight, backward))
             for impl, op in ops.items() for kind in ('fwd', 'fwd_bwd')}
    times = {key: [t * 1e3 for t in values]
             for key, values in time_interleaved(steps, warmup, repeats, 'cpu').items()}
    rec = dict(case=case['name'], map=list(case['map']),
               **{key: case[key] for key in ('stride', 'rois', 'output', 'sampling_ratio')})
    for kind in ('fwd', 'fwd_bwd'):
        mmcv, gather = (statistics.median(times[f'{impl}_{kind}_ms']) for impl in ops)
        rec.update({f'mmcv_{kind}_ms': mmcv, f'gather_{kind}_ms': gather,
                    f'{kind}_speedup': mmcv / gather})
    rec.update(max_diff_out=(out - ref_out).abs().max().item(),
               max_diff_grad=(grad - ref_grad).abs().max().item())
    return dict(rec, max_diff=max(rec['max_diff_out'], rec['max_diff_grad']), repeats=repeats,
                warmup=warmup, times=times)


def markdown_table(records: Sequence[dict]) -> str:
    return md_table(COLUMNS, [[
        r['case'], 'x'.join(map(str, r['map'])), str(r['rois']), f"{r['output']}x{r['output']}",
        str(r['sampling_ratio']), f"{r['mmcv_fwd_ms']:.2f}", f"{r['gather_fwd_ms']:.2f}",
        f"{r['fwd_speedup']:.1f}x", f"{r['mmcv_fwd_bwd_ms']:.2f}", f"{r['gather_fwd_bwd_ms']:.2f}",
        f"{r['fwd_bwd_speedup']:.1f}x", f"{r['max_diff']:.1e}"] for r in records], 'l' * 12)


def main(argv: Optional[Sequence[str]] = None, cases: Sequence[dict] = CASES) -> int:
    """Entry point; ``cases`` is the table ``--cases`` chooses from. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    names = [c['name'] for c in cases]
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                epilog=__doc__.split('\n\n', 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--cases', nargs='+', choices=names, default=names, metavar='NAME')
    p.add_argument('--repeats', type=int, default=10, help='timed rounds')
    p.add_argument('--warmup', type=int, default=2, help='untimed calls')
    p.add_argument('--threads', type=int, help='torch.set_num_threads')
    p.add_argument('--out-dir', default='docs/benchmark')
    p.add_argument('--name', default='roi_align_cpu', help='file stem')
    p.add_argument('--quiet', action='store_true', help='no progress lines')
    p.add_argument('--markdown', metavar='JSON', help='print the Markdown table the docs quote')
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or (args.threads is not None and args.threads < 1):
        p.error('need --repeats >= 1, --warmup >= 0 and --threads >= 1')
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown_table(json.load(f)['records']))
        return 0
    set_threads(args.threads)
    records = []
    for case in (c for name in dict.fromkeys(args.cases) for c in cases if c['name'] == name):
        if not args.quiet:
            print(f"measuring {case['name']}", file=sys.stderr)
        records.append(measure(case, args.repeats, args.warmup))
    print(markdown_table(records))
    import mmcv
    meta = dict(run_metadata(), command=' '.join(['benchmarks/benchmark_roi_align.py', *argv]),
                mmcv=mmcv.__version__, threads=torch.get_num_threads())
    paths = write_artifact(os.path.join(args.out_dir, args.name), meta, records,
                           [k for k in records[0] if k != 'times'] if records else [], 'records',
                           [{**r, 'map': 'x'.join(map(str, r['map']))} for r in records])
    print('wrote ' + ', '.join(paths))
    return 0


if __name__ == '__main__':
    sys.exit(main())
