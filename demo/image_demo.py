# Copyright (c) xcit_mm contributors. All rights reserved.
"""Draw the predictions of an XCiT detector or segmentor on images.

Usage::

    python demo/image_demo.py IMAGE [IMAGE ...] CONFIG CHECKPOINT --out-dir DIR \
        [--device cpu] [--score-thr 0.3] [--opacity A] [--recursive] [--cfg-options K=V ...]

``IMAGE`` is any number of image files and/or folders (a folder contributes the image files
directly inside it, sorted by name; ``--recursive`` walks sub-folders). The last two positional
arguments are always the config and the checkpoint. One PNG with the size of its input image is
written per image into ``--out-dir`` (``<name>.png``; a name already taken gets ``_1``, ``_2``,
... appended).

The work is done by the package: :func:`xcit_mm.apis.init_model` (config, checkpoint read by
the one safe reader and loaded strictly, class names), :func:`xcit_mm.apis.inference_model` and
:mod:`xcit_mm.visualization` (upstream ``DetLocalVisualizer`` / ``SegLocalVisualizer``).

Exit status: 0 when every image was drawn; 1 when some inputs could not be decoded (each is
reported, the others are still drawn, a summary lists them); 2, with one ``error: ...`` line,
for bad arguments, a missing input path or config, and a checkpoint that is missing, truncated,
not a checkpoint (e.g. an HTML page saved as ``.pth``) or holds pickled code (all found before
any model is built), or that does not fit the config's model (found when loading it).
"""
import argparse
import os
import os.path as osp
import sys
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

if __name__ == '__main__':
    # setuptools >= 80 warns about pkg_resources on every mmengine import: keep the
    # command's stderr for its own messages (one `error: ...` line on failure).
    warnings.filterwarnings('ignore', message='pkg_resources is deprecated',
                            category=UserWarning)

# Run from a checkout without installing: make `import xcit_mm` find the repository.
_REPO_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp', '.tif', '.tiff', '.webp', '.ppm', '.pgm')


def collect_images(inputs: Sequence[str], recursive: bool = False) -> Tuple[List[str], int]:
    """Expand image files and folders into a list of image paths.

    Files given explicitly are kept whatever their extension (a non-image file is reported when
    it fails to decode). In folders only files with an image extension (:data:`IMAGE_EXTENSIONS`,
    case-insensitive) are taken.

    Returns:
        The image paths (folders expanded in sorted order, duplicates removed) and the number of
        non-image files skipped inside folders.

    Raises:
        FileNotFoundError: If an input path does not exist.
        ValueError: If no input is given or the inputs contain no image at all.
    """
    if not inputs:
        raise ValueError('no IMAGE given: pass image files and/or folders before CONFIG '
                         'and CHECKPOINT')
    paths: List[str] = []
    skipped = 0
    for item in inputs:
        if osp.isdir(item):
            if recursive:
                found = []
                for root, dirs, files in os.walk(item):
                    dirs.sort()
                    found += [osp.join(root, f) for f in sorted(files)]
            else:
                found = [osp.join(item, f) for f in sorted(os.listdir(item))
                         if osp.isfile(osp.join(item, f))]
            images = [f for f in found if f.lower().endswith(IMAGE_EXTENSIONS)]
            skipped += len(found) - len(images)
            paths += images
        elif osp.isfile(item):
            paths.append(item)
        else:
            raise FileNotFoundError(f'IMAGE input not found: {item!r} (neither a file nor a '
                                    'folder)')
    seen, unique = set(), []
    for p in paths:
        if osp.abspath(p) not in seen:
            seen.add(osp.abspath(p))
            unique.append(p)
    if not unique:
        raise ValueError(f'no image files found in {list(inputs)} (looked for '
                         f'{", ".join(IMAGE_EXTENSIONS)})')
    return unique, skipped


def read_image(path: str) -> np.ndarray:
    """Read an image as an (H, W, 3) BGR uint8 array, as mmcv's loaders do.

    Raises:
        ValueError: If the file cannot be decoded as an image; the message names the file.
    """
    import mmcv
    try:
        img = mmcv.imread(path, flag='color')
    except Exception as exc:  # mmcv raises various errors for unreadable files
        raise ValueError(f'cannot read image {path!r}: {exc}') from exc
    if img is None or img.size == 0:
        raise ValueError(f'cannot read image {path!r}: not a decodable image file')
    return img


def output_names(paths: Sequence[str]) -> List[str]:
    """A unique ``<stem>.png`` per input; a stem seen before gets ``_1``, ``_2``, ..."""
    used, names = set(), []
    for p in paths:
        stem = osp.splitext(osp.basename(p))[0] or 'image'
        name, n = stem, 0
        while name in used:
            n += 1
            name = f'{stem}_{n}'
        used.add(name)
        names.append(name + '.png')
    return names


def run_demo(images: Sequence[str], config: str, checkpoint: str, out_dir: str,
             device: str = 'cpu', score_thr: float = 0.3, opacity: Optional[float] = None,
             recursive: bool = False, cfg_options=None, progress: bool = True
             ) -> Tuple[List[str], Dict[str, str]]:
    """Draw the model's predictions for every image into ``out_dir``.

    Returns:
        The written PNG paths and a ``{input path: error message}`` dict of failed inputs.

    Raises:
        FileNotFoundError / ValueError / CheckpointError: bad inputs, config or checkpoint,
        before any drawing.
    """
    from tqdm import tqdm

    from xcit_mm.apis import build_test_pipeline, config_task, inference_model, init_model
    from xcit_mm.visualization import build_visualizer, draw_prediction

    if opacity is not None and not 0 < opacity <= 1:
        raise ValueError(f'--opacity must be in (0, 1], got {opacity}')
    paths, skipped = collect_images(images, recursive)
    if skipped:
        print(f'note: skipped {skipped} non-image file(s) inside the given folder(s)',
              file=sys.stderr)
    model = init_model(config, checkpoint, device, cfg_options)
    task = config_task(model.cfg)
    pipeline = build_test_pipeline(model)
    visualizer = build_visualizer(model, opacity)
    os.makedirs(out_dir, exist_ok=True)
    written, failed, undrawn = [], {}, []
    bar = tqdm(list(zip(paths, output_names(paths))), desc='demo', unit='img',
               disable=not progress or len(paths) < 2, file=sys.stderr)
    for path, name in bar:
        try:
            img = read_image(path)
        except ValueError as exc:
            failed[path] = str(exc)
            tqdm.write(f'error: {exc}', file=sys.stderr)
            continue
        out_file = osp.join(out_dir, name)
        try:
            result = inference_model(model, img, pipeline)
            draw_prediction(visualizer, img, result, out_file, score_thr)
        except Exception as exc:
            raise RuntimeError(f'inference failed on {path!r} (image {img.shape[0]}x'
                               f'{img.shape[1]} px, HxW): {exc}') from exc
        written.append(out_file)
        if task == 'det':
            scores = result.pred_instances.scores
            best = float(scores.max()) if len(scores) else None
            if best is None or best < score_thr:
                undrawn.append(best)
    if undrawn:
        known = [b for b in undrawn if b is not None]
        best = f' (best score {max(known):.3f})' if known else ''
        print(f'note: on {len(undrawn)} of {len(written)} image(s) no detection reached '
              f'--score-thr {score_thr}{best}; lower --score-thr to draw weaker detections',
              file=sys.stderr)
    return written, failed


def parse_args(argv=None):
    """Parse the command line; the last two positionals are CONFIG and CHECKPOINT."""
    import torch
    parser = argparse.ArgumentParser(
        description='Draw XCiT detector / segmentor predictions on images (one PNG each).',
        usage='%(prog)s IMAGE [IMAGE ...] CONFIG CHECKPOINT --out-dir DIR [options]')
    parser.add_argument('inputs', nargs='+', metavar='IMAGE... CONFIG CHECKPOINT',
                        help='image files and/or folders, then the config, then the checkpoint '
                             '(a local file or an http(s) URL)')
    parser.add_argument('--out-dir', required=True, help='folder for the drawn PNGs')
    parser.add_argument('--device', default='cuda:0' if torch.cuda.is_available() else 'cpu',
                        help='torch device (default: cuda:0 when available, else cpu)')
    parser.add_argument('--score-thr', type=float, default=0.3,
                        help='detections below this score are not drawn (default 0.3)')
    parser.add_argument('--opacity', type=float, default=None,
                        help='opacity in (0, 1] of masks / the label-map overlay (default: '
                             'upstream, 0.8 for masks and 0.5 for label maps)')
    parser.add_argument('--recursive', action='store_true',
                        help='also take images from sub-folders of folder inputs')
    parser.add_argument('--no-progress', action='store_true', help='no progress bar')
    parser.add_argument('--cfg-options', nargs='+', default=None, metavar='KEY=VALUE',
                        help='override config settings, e.g. model.test_cfg.rcnn.max_per_img=50')
    args = parser.parse_args(argv)
    if len(args.inputs) < 3:
        parser.error('expected IMAGE [IMAGE ...] CONFIG CHECKPOINT (at least 3 positional '
                     f'arguments), got {len(args.inputs)}: {args.inputs}')
    args.images, args.config, args.checkpoint = (args.inputs[:-2], args.inputs[-2],
                                                 args.inputs[-1])
    if not args.config.endswith('.py') and args.checkpoint.endswith('.py'):
        parser.error(f'CONFIG and CHECKPOINT look swapped ({args.config!r}, '
                     f'{args.checkpoint!r}): the order is IMAGE... CONFIG CHECKPOINT')
    if args.cfg_options:
        from mmengine.config import DictAction
        ns = argparse.Namespace()
        DictAction(option_strings=['--cfg-options'], dest='cfg_options')(
            parser, ns, args.cfg_options)
        args.cfg_options = ns.cfg_options
    return args


def main(argv=None) -> int:
    """Command-line entry point: 0 all drawn, 1 some inputs unreadable, 2 bad input (above)."""
    from xcit_mm.apis import error_line
    from xcit_mm.models.utils.checkpoint_io import CheckpointError
    args = parse_args(argv)
    try:
        written, failed = run_demo(args.images, args.config, args.checkpoint, args.out_dir,
                                   device=args.device, score_thr=args.score_thr,
                                   opacity=args.opacity, recursive=args.recursive,
                                   cfg_options=args.cfg_options,
                                   progress=not args.no_progress)
    except (FileNotFoundError, ValueError, CheckpointError) as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    print(f'wrote {len(written)} image(s) to {args.out_dir}')
    if failed:
        print(f'{len(failed)} input(s) could not be read and were not drawn:', file=sys.stderr)
        for msg in failed.values():
            print(f'  {msg}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
