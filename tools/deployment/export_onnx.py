#!/usr/bin/env python
# Copyright (c) xcit_mm contributors. All rights reserved.
"""Export an XCiT segmentor (image -> per-class logits) or detector (backbone + neck) to ONNX.

Usage::

    python tools/deployment/export_onnx.py CONFIG [CHECKPOINT] --out FILE.onnx --shape H W \\
        [--dynamic] [--verify] [--verify-shape H W] [--opset 17] [--cfg-options K=V ...]

* An mmseg ``EncoderDecoder`` config (Semantic FPN, UperNet): input ``image`` (B, 3, H, W), output
  ``logits`` (B, num_classes, H, W) at the input size.
* An mmdet config (Mask R-CNN): backbone + neck, outputs ``feat0`` ... (Mask R-CNN: 5 FPN maps).

The input is the normalised image (the config's data_preprocessor mean / std, channel order as
trained; written into the file's metadata). Without CHECKPOINT the weights are the random
initialisation (nothing is downloaded). ``--dynamic`` makes batch, height and width dynamic.
``--verify`` runs the file with ONNX Runtime and compares it with PyTorch at the export size and,
for a dynamic file, at a second size (``--verify-shape``; default 32 px more rows, 16 px fewer
columns): max abs and relative (max |diff| / max |PyTorch|) difference per output.

The work is done by :mod:`xcit_mm.deployment.onnx`; this file parses the command line and prints.

Exit status: 0 exported (and verified); 1 the verification found a relative difference above
``--tolerance`` (default 1e-4) or a wrong output shape; 2, with one ``error: ...`` line, for bad
arguments, a missing config, a config this exporter does not take, a missing / unreadable /
unsafe checkpoint or one of another model, and missing onnx / onnxruntime packages.
"""
import argparse
import os.path as osp
import sys
import time
import warnings
from typing import Optional, Sequence

if __name__ == '__main__':
    # setuptools >= 80 warns about pkg_resources on every mmengine import: keep the
    # command's stderr for its own messages (one `error: ...` line on failure).
    warnings.filterwarnings('ignore', message='pkg_resources is deprecated',
                            category=UserWarning)

# Run from a checkout without installing: make `import xcit_mm` find the repository.
_REPO_ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    from mmengine.config import DictAction
    p = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        epilog=__doc__.split('\n\n', 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('config', help='mmseg EncoderDecoder or mmdet detector config')
    p.add_argument('checkpoint', nargs='?', default=None,
                   help='weights (local path or URL); omitted: random initialisation')
    p.add_argument('--out', required=True, metavar='FILE.onnx', help='the ONNX file to write')
    p.add_argument('--shape', nargs=2, type=int, required=True, metavar=('H', 'W'),
                   help='export size (each side >= 32)')
    p.add_argument('--dynamic', action='store_true',
                   help='dynamic batch, height and width (default: the file takes exactly '
                   '1 x 3 x H x W)')
    p.add_argument('--verify', action='store_true',
                   help='compare ONNX Runtime with PyTorch at the export size and, with '
                   '--dynamic, at a second size; exit 1 on a mismatch')
    p.add_argument('--verify-shape', nargs=2, type=int, default=None, metavar=('H', 'W'),
                   help='the second size of --verify (default: H+32, W-16)')
    p.add_argument('--tolerance', type=float, default=1e-4,
                   help='largest accepted relative difference max|onnx-torch|/max|torch| '
                   '(default: %(default)g)')
    p.add_argument('--opset', type=int, default=17, help='ONNX opset (default: %(default)s)')
    p.add_argument('--cfg-options', nargs='+', action=DictAction, default=None,
                   help='override config settings, as in tools/train.py')
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    from xcit_mm.apis import error_line
    from xcit_mm.deployment import (ExportError, build_export_model, check_onnx_runtime,
                                    check_shape, export_onnx, verify_onnx)
    from xcit_mm.models.utils.checkpoint_io import CheckpointError
    try:
        check_onnx_runtime(need_runtime=args.verify)
        check_shape(args.shape)
        if args.verify_shape:
            check_shape(args.verify_shape, '--verify-shape')
        if args.verify_shape and not args.dynamic:
            raise ExportError('--verify-shape needs --dynamic (a static file takes only '
                              'the export size)')
        t0 = time.perf_counter()
        model = build_export_model(args.config, args.checkpoint, args.cfg_options)
        export_onnx(model, args.out, args.shape, dynamic=args.dynamic, opset=args.opset)
    except (FileNotFoundError, ValueError, TypeError, CheckpointError,
            ImportError) as e:
        print(error_line(e), file=sys.stderr)
        return 2
    what = 'segmentor: image -> logits' if model.task == 'seg' else \
        f'detector backbone + neck: image -> {len(model.output_names)} feature maps'
    print(f'wrote {args.out} ({what}; export size {args.shape[0]}x{args.shape[1]}, '
          f'{"dynamic" if args.dynamic else "static"} axes, opset {args.opset}, '
          f'{osp.getsize(args.out) / 2 ** 20:.1f} MB, {time.perf_counter() - t0:.1f} s)')
    if not args.verify:
        return 0
    shapes = [tuple(args.shape)]
    if args.dynamic:
        # by default 32 px more rows, 16 px fewer columns (16 more under 64): the backbone's
        # padded path runs
        h, w = args.shape
        shapes.append(tuple(args.verify_shape or (h + 32, w - 16 if w - 16 >= 64 else w + 16)))
    else:
        print('verify: static file, checked at the export size only (export with --dynamic '
              'to check another size)')
    results = verify_onnx(model, args.out, shapes, tolerance=args.tolerance)
    for r in results:
        verdict = 'OK' if r['ok'] else 'MISMATCH'
        print(f'verify {r["shape"][0]}x{r["shape"][1]}: {verdict} max abs diff '
              f'{r["max_abs"]:.3e}, max rel diff {r["max_rel"]:.3e} (tolerance '
              f'{args.tolerance:g})')
        for o in r['outputs']:
            extra = f' (PyTorch: {o["want_shape"]})' if 'want_shape' in o else ''
            print(f'    {o["name"]:<8} {"x".join(map(str, o["shape"]))}{extra}: abs '
                  f'{o["max_abs"]:.3e} rel {o["max_rel"]:.3e}')
    if all(r['ok'] for r in results):
        print('verify: ONNX Runtime matches PyTorch')
        return 0
    print('error: ONNX Runtime differs from PyTorch above the tolerance', file=sys.stderr)
    return 1


if __name__ == '__main__':
    sys.exit(main())
