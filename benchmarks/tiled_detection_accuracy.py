"""Box and mask AP of one trained Mask R-CNN run whole, in bands and in tiles (``LeanMaskRCNN``).

    python tools/train.py configs/shapes/mask_rcnn_xcit_shapes_coco.py \
        --work-dir work_dirs/shapes_det
    python benchmarks/tiled_detection_accuracy.py configs/shapes/mask_rcnn_xcit_shapes_coco.py \
        work_dirs/shapes_det/iter_1200.pth --out docs/results/shapes_mask_rcnn_tiles

Each variant is the config's own test (``Runner.test``) with ``model.test_cfg`` updated: whole,
bands, tiles of each ``--tiles SIZE:OVERLAP`` (network pixels).
"""
import argparse
import json
import os.path as osp
import sys
import tempfile
import time

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path[:0] = [ROOT, osp.join(ROOT, 'benchmarks')]  # xcit_mm of this checkout; xcit_benchmark
from xcit_benchmark.fresh_points import run_metadata, write_artifact  # noqa: E402

COLUMNS = ['variant', 'test_cfg', 'coco/bbox_mAP', 'coco/bbox_mAP_50', 'coco/segm_mAP',
           'coco/segm_mAP_50', 'time_s']


def variants(band_mb, tiles: list) -> list:
    """(name, ``model.test_cfg`` update) of every variant, whole first."""
    return ([('whole', {})] + ([('bands', dict(band_mb=band_mb))] if band_mb else [])
            + [(f'tiles {size}/{overlap}', dict(mode='tiles', tile_size=size, tile_overlap=overlap))
               for size, overlap in tiles])


def tile(value: str) -> tuple:
    """A ``--tiles`` value: (size, overlap) of tiles that advance."""
    size, sep, overlap = value.partition(':')
    if not (sep and size.isdigit() and overlap.isdigit() and int(overlap) < int(size)):
        raise argparse.ArgumentTypeError(
            f'{value!r}: expected SIZE:OVERLAP with 0 <= OVERLAP < SIZE')
    return int(size), int(overlap)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('config', help='a Mask R-CNN config whose model is LeanMaskRCNN')
    parser.add_argument('checkpoint', help='its trained weights')
    parser.add_argument('--band-mb', type=float,
                        help='also a bands variant with this band size (needs an FPN without '
                        'GroupNorm: not the shapes config)')
    parser.add_argument('--tiles', nargs='+', type=tile, default=['96:32', '112:64'],
                        help='SIZE:OVERLAP of each tiles variant (network pixels)')
    parser.add_argument('--out', help='artifact path without extension (.json, .csv)')
    args = parser.parse_args(argv)
    for path in (args.config, args.checkpoint):
        if not osp.isfile(path):
            parser.error(f'no such file: {path}')
    from mmengine.config import Config
    from mmengine.runner import Runner
    rows = []
    with tempfile.TemporaryDirectory() as work_dir:
        for name, update in variants(args.band_mb, args.tiles):
            start = time.perf_counter()
            cfg = Config.fromfile(args.config)  # the config's own test, test_cfg updated
            cfg.model.test_cfg.update(update)
            cfg.update(load_from=args.checkpoint, work_dir=work_dir, resume=False)
            metrics = Runner.from_cfg(cfg).test()
            row = dict(variant=name, test_cfg=json.dumps(update),
                       time_s=round(time.perf_counter() - start, 1),
                       **{k: round(float(v), 4) for k, v in metrics.items()})
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        write_artifact(args.out, dict(run_metadata(), config=args.config,
                                      checkpoint=args.checkpoint), rows, COLUMNS)


if __name__ == '__main__':
    main()
