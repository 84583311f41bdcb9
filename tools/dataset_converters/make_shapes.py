#!/usr/bin/env python
# Copyright (c) xcit_mm contributors. All rights reserved.
"""Generate the built-in "shapes" world (COCO or ADE20k layout), with a progress bar.

Examples::

    # what a shapes config needs (reads its `shapes_world` dict)
    python tools/dataset_converters/make_shapes.py \
        --config configs/shapes/mask_rcnn_xcit_shapes_coco.py

    # explicit arguments
    python tools/dataset_converters/make_shapes.py data/shapes_coco --task coco \
        --num-train 800 --num-val 100 --image-size 160 --seed 0

    # a PNG mosaic of the first validation images and their masks
    python tools/dataset_converters/make_shapes.py data/shapes_coco --mosaic docs/shapes_samples.png

Command-line values override those of ``--config``. If the root already holds a world made
with the same arguments nothing is regenerated; other contents need ``--overwrite``.
"""
import argparse
import json
import os.path as osp
import sys

# Use this checkout's shapes_world even when it is not pip-installed.
_REPO_ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from shapes_world.shapes import TASKS  # noqa: E402


def parse_args(argv=None):
    """Parse the command line.

    Args:
        argv (list[str] | None): Arguments; ``sys.argv[1:]`` if None.

    Returns:
        argparse.Namespace: The parsed arguments.
    """
    parser = argparse.ArgumentParser(
        description='Generate the deterministic shapes world (COCO, ADE20k or Cityscapes '
        'layout).')
    parser.add_argument('root', nargs='?', help='output directory')
    parser.add_argument('--config', help='a config with a `shapes_world` dict (defaults for '
                        'every other option, including root)')
    parser.add_argument('--task', choices=TASKS, help='layout (default coco)')
    parser.add_argument('--num-train', type=int, help='training images (default 800)')
    parser.add_argument('--num-val', type=int, help='validation images (default 100)')
    parser.add_argument('--image-size', type=int, nargs='+',
                        help='side, or height width, in pixels (default 160)')
    parser.add_argument('--seed', type=int, help='world seed (default 0)')
    parser.add_argument('--overwrite', action='store_true',
                        help='replace an existing root with other contents')
    parser.add_argument('--mosaic', metavar='PNG',
                        help='also save a mosaic of validation images with their masks')
    parser.add_argument('--mosaic-num', type=int, default=8,
                        help='images in the mosaic (default 8)')
    return parser.parse_args(argv)


def main(argv=None):
    """Entry point: generate (or reuse) the world and print its summary.

    Args:
        argv (list[str] | None): Arguments; ``sys.argv[1:]`` if None.

    Returns:
        dict: The summary returned by :func:`shapes_world.generate_shapes`.
    """
    args = parse_args(argv)
    from shapes_world import generate_shapes, load_samples, make_mosaic
    from shapes_world.shapes import ShapesWorldExistsError

    kwargs = {}
    if args.config:
        from mmengine.config import Config
        cfg = Config.fromfile(args.config)
        if 'shapes_world' not in cfg:
            sys.exit(f'error: {args.config} has no `shapes_world` dict')
        kwargs.update(cfg.shapes_world.to_dict())
    overrides = dict(root=args.root, task=args.task, num_train=args.num_train,
                     num_val=args.num_val, seed=args.seed)
    if args.image_size is not None:
        if len(args.image_size) not in (1, 2):
            sys.exit('error: --image-size takes 1 or 2 values')
        overrides['image_size'] = (args.image_size[0] if len(args.image_size) == 1 else
                                   tuple(args.image_size))
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    if 'root' not in kwargs:
        sys.exit('error: give an output root or --config')
    try:
        summary = generate_shapes(**dict(kwargs, overwrite=args.overwrite, progress=True))
    except ShapesWorldExistsError as err:
        sys.exit(f'error: {err.message("remove it or pass --overwrite")}')
    except (ValueError, FileExistsError) as err:
        sys.exit(f'error: {err}')
    print(json.dumps(summary, indent=2))
    if args.mosaic:
        make_mosaic(load_samples(kwargs['root'], 'val', args.mosaic_num), args.mosaic)
        print(f'mosaic saved to {args.mosaic}')
    return summary


if __name__ == '__main__':
    main()
