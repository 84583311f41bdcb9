"""Box and mask AP of one trained Mask R-CNN run whole, streamed and in tiles (``LeanMaskRCNN``).

    python tools/train.py configs/shapes/mask_rcnn_xcit_shapes_coco.py \
        --work-dir work_dirs/shapes_det
    python benchmarks/tiled_detection_accuracy.py configs/shapes/mask_rcnn_xcit_shapes_coco.py \
        work_dirs/shapes_det/iter_1200.pth --out docs/results/shapes_mask_rcnn_tiles

Each variant is the config's own test (``Runner.test``, its peak resident-set growth measured,
the first variant's after one run unmeasured) with ``model.test_cfg`` updated: whole,
the stream with cores of each ``--stream SIZE:MARGIN`` (``feature_margin``; ``--band-mb`` its
bands of rows), tiles of each ``--tiles SIZE:OVERLAP`` (network pixels). ``--figure PNG``: the
first test image with each variant's masks. ``--larger-than PX``: box and mask AP again over the
objects whose box is wider or taller than PX (the tile), the others made ignore regions. (The
bands variant, band_mb with the whole path, went into the stream with the path itself.)
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
           'coco/segm_mAP_50', 'time_s', 'peak_growth_mb']


def variants(band_mb, tiles: list, streams: list = ()) -> list:
    """(name, ``model.test_cfg`` update) of every variant, whole first; ``band_mb`` (or None):
    the stream variants' band size."""
    bands = {} if band_mb is None else dict(band_mb=band_mb)
    return ([('whole', {})]
            + [(f'stream {size}/{margin}',
                dict(mode='stream', tile_size=size, feature_margin=margin, **bands))
               for size, margin in streams]
            + [(f'tiles {size}/{overlap}', dict(mode='tiles', tile_size=size, tile_overlap=overlap))
               for size, overlap in tiles])


def tile(value: str) -> tuple:
    """A ``--tiles`` value: (size, overlap) of tiles that advance."""
    size, sep, overlap = value.partition(':')
    if not (sep and size.isdigit() and overlap.isdigit() and int(overlap) < int(size)):
        raise argparse.ArgumentTypeError(
            f'{value!r}: expected SIZE:OVERLAP with 0 <= OVERLAP < SIZE')
    return int(size), int(overlap)


def stream(value: str) -> tuple:
    """A ``--stream`` value: (core size, feature margin), the margin a multiple of 64."""
    size, sep, margin = value.partition(':')
    if not (sep and size.isdigit() and margin.isdigit() and int(margin) % 64 == 0):
        raise argparse.ArgumentTypeError(
            f'{value!r}: expected SIZE:MARGIN, MARGIN a multiple of 64')
    return int(size), int(margin)


def larger_objects_ap(ann_file: str, result_prefix: str, size: int) -> dict:
    """Box and mask AP over the objects whose box is wider or taller than ``size`` px.

    pycocotools' ``COCOeval`` on the test's own detections (CocoMetric's result files), with every
    other object made an ignore region (``iscrowd``), as COCO treats crowds: a detection that
    matches one of them counts neither as right nor as wrong, so the AP is that of the large
    objects alone.
    """
    from mmdet.datasets.api_wrappers import COCO, COCOeval
    with open(ann_file) as f:
        dataset = json.load(f)
    larger = 0
    for ann in dataset['annotations']:
        if max(ann['bbox'][2:]) > size:
            larger += 1
        else:
            ann['iscrowd'] = 1
    if not larger:
        raise SystemExit(f'--larger-than {size}: no object of {ann_file} is larger than that')
    truth = COCO()
    truth.dataset = dataset
    truth.createIndex()
    row = {f'larger_{size}/objects': larger}
    for kind in ('bbox', 'segm'):
        evaluation = COCOeval(truth, truth.loadRes(f'{result_prefix}.{kind}.json'), kind)
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
        row[f'larger_{size}/{kind}_mAP'] = round(float(evaluation.stats[0]), 4)
        row[f'larger_{size}/{kind}_mAP_50'] = round(float(evaluation.stats[1]), 4)
    return row


def draw_figure(path: str, image_path: str, masks: dict) -> None:
    """The image, then each variant's masks over it (one colour an instance)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    import mmcv
    import numpy as np
    image = mmcv.imread(image_path, channel_order='rgb')
    fig, axes = plt.subplots(1, len(masks) + 1, figsize=(4 * (len(masks) + 1), 4.4))
    axes[0].imshow(image)
    axes[0].set_title('held-out scene')
    colours = np.random.default_rng(0).uniform(0, 1, (4096, 3))
    for ax, (name, (instance_masks, count)) in zip(axes[1:], masks.items()):
        overlay = image / 255.0 * 0.45
        for i, mask in enumerate(instance_masks):
            overlay[mask] = 0.45 * overlay[mask] + 0.55 * colours[i % len(colours)]
        ax.imshow(overlay)
        ax.set_title(f'{name}: {count} instances')
    for ax in axes:
        ax.axis('off')
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('config', help='a Mask R-CNN config whose model is LeanMaskRCNN')
    parser.add_argument('checkpoint', help='its trained weights')
    parser.add_argument('--band-mb', type=float,
                        help="the stream variants' bands of rows (MB; test_cfg.band_mb)")
    parser.add_argument('--tiles', nargs='+', type=tile, default=['96:32', '112:64'],
                        help='SIZE:OVERLAP of each tiles variant (network pixels)')
    parser.add_argument('--stream', nargs='*', type=stream, default=[],
                        help='SIZE:MARGIN of each stream variant (cores, feature_margin)')
    parser.add_argument('--larger-than', type=int, metavar='PX',
                        help='also AP over the objects whose box is wider or taller than PX')
    parser.add_argument('--figure', help='PNG: the first test image with each variant\'s masks')
    parser.add_argument('--out', help='artifact path without extension (.json, .csv)')
    args = parser.parse_args(argv)
    if args.larger_than is not None and args.larger_than <= 0:
        parser.error(f'--larger-than must be a positive size in pixels, got {args.larger_than}')
    if args.band_mb is not None and not args.stream:
        parser.error("--band-mb sets the stream's bands (band_mb is read by mode='stream' "
                     'alone): give --stream SIZE:MARGIN too')
    for path in (args.config, args.checkpoint):
        if not osp.isfile(path):
            parser.error(f'no such file: {path}')
    from mmengine.config import Config
    from mmengine.runner import Runner

    from xcit_mm.models.utils.memory_budget import measure_peak_growth_mb
    rows = []
    with tempfile.TemporaryDirectory() as work_dir:
        figure = {}
        for index, (name, update) in enumerate(variants(args.band_mb, args.tiles, args.stream)):
            start = time.perf_counter()
            cfg = Config.fromfile(args.config)  # the config's own test, test_cfg updated
            cfg.model.test_cfg.update(update)
            result_prefix = osp.join(work_dir, f'variant{index}')
            cfg.test_evaluator.outfile_prefix = result_prefix  # kept for --larger-than
            cfg.update(load_from=args.checkpoint, work_dir=work_dir, resume=False)
            runner = Runner.from_cfg(cfg)
            if index == 0:  # once unmeasured: generates a missing world, sets up what stays
                runner.test()
                start = time.perf_counter()
            metrics = {}
            growth_mb = measure_peak_growth_mb(lambda: metrics.update(runner.test()))
            if args.figure:  # the first test image through the same model, as the test ran it
                from mmengine.dataset import pseudo_collate
                sample = runner.test_dataloader.dataset[0]
                image_path = sample['data_samples'].img_path
                dets = runner.model.test_step(pseudo_collate([sample]))[0].pred_instances
                dets = dets[dets.scores >= 0.5]
                figure[name] = (dets.masks.cpu().numpy(), len(dets))
            row = dict(variant=name, test_cfg=json.dumps(update),
                       time_s=round(time.perf_counter() - start, 1),
                       peak_growth_mb=round(growth_mb),
                       **{k: round(float(v), 4) for k, v in metrics.items()})
            if args.larger_than:
                row.update(larger_objects_ap(cfg.test_evaluator.ann_file, result_prefix,
                                             args.larger_than))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.figure:
        draw_figure(args.figure, image_path, figure)
    if args.out:
        write_artifact(args.out, dict(run_metadata(), config=args.config,
                                      checkpoint=args.checkpoint), rows,
                       COLUMNS + [k for k in rows[0] if k.startswith('larger_')])


if __name__ == '__main__':
    main()
