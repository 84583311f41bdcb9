# Copyright (c) xcit_mm contributors. All rights reserved.
"""Draw the predictions of an XCiT detector or segmentor on images.

Usage::

    python tools/demo.py IMAGE [IMAGE ...] CONFIG CHECKPOINT --out-dir DIR \
        [--device cpu] [--score-thr 0.3] [--opacity A] [--recursive] [--cfg-options K=V ...]

``IMAGE`` is any number of image files and/or folders (a folder contributes the image files
directly inside it, sorted by name; add ``--recursive`` to walk sub-folders). The last two
positional arguments are always the config and the checkpoint.

The task is chosen by the config's ``default_scope``: ``mmdet`` runs the model with
:func:`mmdet.apis.inference_detector` and draws boxes, masks, class names and scores with
:class:`mmdet.visualization.DetLocalVisualizer`; ``mmseg`` runs
:func:`mmseg.apis.inference_model` and overlays the label map, with class names, with
:class:`mmseg.visualization.SegLocalVisualizer`. One PNG with the size of its input image is
written per image into ``--out-dir`` (``<name>.png``; a name already taken gets ``_1``,
``_2``, ... appended).

Unreadable files: every input is tried; a file that cannot be decoded as an image (or a
folder file that vanished) is reported by name, the others are still drawn, and at the end a
summary lists every failure and the command exits with status 1. A path that does not exist at
all is an error before the model is loaded (exit status 2).

Class names come from the checkpoint's ``meta['dataset_meta']`` (what mmengine's Runner
saves), else from the config's test dataset ``metainfo``; the palette from the config's test
dataset when it has one (as upstream ``init_detector`` does), else from the checkpoint.
"""
import argparse
import itertools
import os
import os.path as osp
import sys
import warnings
from copy import deepcopy
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

# Run from a checkout without installing: make `import xcit_mm` find the repository.
_REPO_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp', '.tif', '.tiff', '.webp', '.ppm', '.pgm')
TASK_BY_SCOPE = {'mmdet': 'det', 'mmseg': 'seg'}
_VIS_COUNTER = itertools.count()


# --------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------
def collect_images(inputs: Sequence[str], recursive: bool = False) -> Tuple[List[str], int]:
    """Expand image files and folders into a list of image paths.

    Files given explicitly are kept whatever their extension (a non-image file is reported
    when it fails to decode). In folders only files with an image extension
    (:data:`IMAGE_EXTENSIONS`, case-insensitive) are taken.

    Args:
        inputs: Image files and/or folders, in the order given.
        recursive: Also walk sub-folders of the given folders.

    Returns:
        The image paths (folders expanded in sorted order, duplicates removed) and the number
        of non-image files that were skipped inside folders.

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
    seen = set()
    unique = []
    for p in paths:
        key = osp.abspath(p)
        if key not in seen:
            seen.add(key)
            unique.append(p)
    if not unique:
        raise ValueError(f'no image files found in {list(inputs)} (looked for '
                         f'{", ".join(IMAGE_EXTENSIONS)})')
    return unique, skipped


def read_image(path: str) -> np.ndarray:
    """Read an image as a BGR uint8 array (the channel order of mmcv's loaders).

    Args:
        path: Image file.

    Returns:
        Array of shape (H, W, 3). Gray images are expanded to 3 channels, alpha is dropped.

    Raises:
        ValueError: If the file cannot be read or decoded as an image; the message names
            the file.
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
    """Give every input a unique ``<stem>.png`` output name.

    Args:
        paths: Input image paths.

    Returns:
        One file name per path; a stem seen before gets ``_1``, ``_2``, ... appended.
    """
    used = set()
    names = []
    for p in paths:
        stem = osp.splitext(osp.basename(p))[0] or 'image'
        name, n = stem, 0
        while name in used:
            n += 1
            name = f'{stem}_{n}'
        used.add(name)
        names.append(name + '.png')
    return names


# --------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------
def config_task(cfg) -> str:
    """Return ``'det'`` or ``'seg'`` from a config's ``default_scope``.

    Args:
        cfg (mmengine.Config): The config.

    Raises:
        ValueError: If the scope is neither ``mmdet`` nor ``mmseg``.
    """
    scope = cfg.get('default_scope', None)
    if scope not in TASK_BY_SCOPE:
        raise ValueError(f'config default_scope is {scope!r}; tools/demo.py runs mmdet '
                         "detectors (default_scope='mmdet') and mmseg segmentors "
                         "(default_scope='mmseg')")
    return TASK_BY_SCOPE[scope]


def _test_dataset_cfg(cfg):
    """The test dataset's config, unwrapped from dataset wrappers, or None."""
    loader = cfg.get('test_dataloader', None) or cfg.get('val_dataloader', None)
    if not loader or 'dataset' not in loader:
        return None
    ds = loader['dataset']
    # Unwrap RepeatDataset / ClassBalancedDataset (``dataset``) and ConcatDataset
    # (``datasets``, first member).
    while isinstance(ds, dict) and ('dataset' in ds or 'datasets' in ds):
        ds = ds['datasets'][0] if 'datasets' in ds else ds['dataset']
    return ds


def _config_metainfo(cfg) -> dict:
    """Metainfo (classes, palette) of the config's test dataset, without reading its data.

    The dataset is built with ``lazy_init=True`` as upstream ``init_detector`` does; if that
    fails (for example the dataset type is not importable) the class attribute ``METAINFO``
    updated by the config's ``metainfo`` is used.
    """
    from mmengine.registry import DATASETS
    ds = _test_dataset_cfg(cfg)
    if ds is None:
        return {}
    ds = deepcopy(ds)
    try:
        ds['lazy_init'] = True
        with warnings.catch_warnings():  # building the pipeline warns about GT loaders
            warnings.simplefilter('ignore')
            return dict(DATASETS.build(ds).metainfo)
    except Exception:  # fall back on the declared metainfo
        pass
    meta = {}
    try:
        cls = DATASETS.get(ds['type']) if isinstance(ds['type'], str) else ds['type']
        meta.update(deepcopy(getattr(cls, 'METAINFO', {})))
    except Exception:
        pass
    meta.update(ds.get('metainfo', None) or {})
    return meta


def _default_palette(num_classes: int) -> List[Tuple[int, int, int]]:
    """A fixed, distinct-enough palette for ``num_classes`` classes."""
    rng = np.random.RandomState(42)
    return [tuple(int(c) for c in rng.randint(0, 256, 3)) for _ in range(num_classes)]


def resolve_dataset_meta(ckpt_meta: dict, cfg, num_classes: Optional[int]) -> dict:
    """Decide the class names and palette used for drawing.

    Priority for classes: checkpoint ``meta['dataset_meta']`` (or old-style ``CLASSES``),
    then the config's test dataset metainfo, then ``class_0``, ``class_1``, ... Palette: the
    config's test dataset palette, then the checkpoint's, then a fixed random palette.

    Args:
        ckpt_meta: The checkpoint's ``meta`` dict (may be empty).
        cfg (mmengine.Config): The config.
        num_classes: Number of classes the model predicts, when known.

    Returns:
        dict with ``classes`` (tuple of str) and ``palette`` (list of RGB tuples).
    """
    meta = {}
    if 'dataset_meta' in ckpt_meta and ckpt_meta['dataset_meta']:
        meta = {k.lower(): v for k, v in ckpt_meta['dataset_meta'].items()}
    elif 'CLASSES' in ckpt_meta:
        meta = {'classes': ckpt_meta['CLASSES']}
        if 'PALETTE' in ckpt_meta:
            meta['palette'] = ckpt_meta['PALETTE']
    cfg_meta = _config_metainfo(cfg)
    if not meta.get('classes') and cfg_meta.get('classes'):
        meta['classes'] = cfg_meta['classes']
    if cfg_meta.get('palette') and len(cfg_meta['palette']) >= len(meta.get('classes', ())):
        meta['palette'] = cfg_meta['palette']
    if not meta.get('classes'):
        n = num_classes or 1
        warnings.warn('no class names in the checkpoint meta or the config; using class_0, '
                      'class_1, ...')
        meta['classes'] = tuple(f'class_{i}' for i in range(n))
    meta['classes'] = tuple(meta['classes'])
    n = max(len(meta['classes']), num_classes or 0)
    palette = meta.get('palette')
    if not isinstance(palette, (list, tuple)) or len(palette) < n:
        meta['palette'] = _default_palette(n)
    else:
        meta['palette'] = [tuple(int(c) for c in p) for p in palette]
    return meta


def _model_num_classes(model) -> Optional[int]:
    """Number of classes of a detector / segmentor, or None when it cannot be found."""
    head = getattr(model, 'decode_head', None)
    if head is not None and hasattr(head, 'num_classes'):
        return int(head.num_classes)
    roi_head = getattr(model, 'roi_head', None)
    if roi_head is not None:
        bbox_head = getattr(roi_head, 'bbox_head', None)
        if isinstance(bbox_head, (list, tuple)) or bbox_head.__class__.__name__ == 'ModuleList':
            bbox_head = bbox_head[-1]
        if bbox_head is not None and hasattr(bbox_head, 'num_classes'):
            return int(bbox_head.num_classes)
    bbox_head = getattr(model, 'bbox_head', None)
    if bbox_head is not None and hasattr(bbox_head, 'num_classes'):
        return int(bbox_head.num_classes)
    return None


def load_weights(model, checkpoint_path: str) -> dict:
    """Load a full detector / segmentor checkpoint into ``model``.

    Accepts mmengine Runner checkpoints (``state_dict`` + ``meta`` + optimizer/message hub,
    loadable under torch's ``weights_only=True`` through
    :func:`xcit_mm.utils.checkpoint_io.runner_checkpoint_globals`), bare state dicts and ``{'model': sd}``.
    Missing or unexpected keys are logged by mmengine; a checkpoint that shares no key with
    the model is an error (it belongs to another model).

    Args:
        model (torch.nn.Module): The model built from the config.
        checkpoint_path: Local path or URL understood by mmengine.

    Returns:
        The checkpoint's ``meta`` dict ({} when absent).

    Raises:
        FileNotFoundError: If a local checkpoint path does not exist.
        ValueError: If the file holds no state dict matching the model.
    """
    from mmengine.runner import load_state_dict

    from xcit_mm.utils.checkpoint_io import load_checkpoint_file
    if '://' not in checkpoint_path and not osp.isfile(checkpoint_path):
        raise FileNotFoundError(f'checkpoint not found: {checkpoint_path!r}')
    ckpt = load_checkpoint_file(checkpoint_path, 'checkpoint')
    if not isinstance(ckpt, dict):
        raise ValueError(f'checkpoint {checkpoint_path!r} holds a {type(ckpt).__name__}, '
                         'not a state dict')
    if 'state_dict' in ckpt:
        state_dict = ckpt['state_dict']
    elif 'model' in ckpt and isinstance(ckpt['model'], dict):
        state_dict = ckpt['model']
    else:
        state_dict = ckpt
    state_dict = {(k[len('module.'):] if k.startswith('module.') else k): v
                  for k, v in state_dict.items()}
    own = set(model.state_dict().keys())
    if not own & set(state_dict.keys()):
        sample = ', '.join(list(state_dict.keys())[:5])
        raise ValueError(f'checkpoint {checkpoint_path!r} has no weights for this model (its '
                         f'keys look like: {sample}); pass the checkpoint trained with CONFIG')
    load_state_dict(model, state_dict, strict=False, logger='current')
    meta = ckpt.get('meta', {})
    return meta if isinstance(meta, dict) else {}


def _clean_test_pipeline(cfg) -> list:
    """The config's test pipeline without ground-truth loading, reading from an array."""
    pipeline = None
    ds = _test_dataset_cfg(cfg)
    if ds is not None and ds.get('pipeline'):
        pipeline = ds['pipeline']
    elif cfg.get('test_pipeline'):
        pipeline = cfg['test_pipeline']
    if not pipeline:
        raise ValueError('the config has no test pipeline (test_dataloader.dataset.pipeline '
                         'or test_pipeline)')
    pipeline = [deepcopy(t) for t in pipeline
                if 'LoadAnnotations' not in str(t.get('type', ''))]
    first = str(pipeline[0].get('type', ''))
    if 'LoadImage' not in first:
        raise ValueError(f'the test pipeline must start with an image loader, got {first!r}')
    return pipeline


def init_model(config: str, checkpoint: str, device: str = 'cpu', cfg_options=None):
    """Build a detector or segmentor with the upstream API and load its weights.

    Args:
        config: Path of an mmdet or mmseg config.
        checkpoint: Its checkpoint.
        device: Torch device, e.g. ``'cpu'`` or ``'cuda:0'``.
        cfg_options: Optional dict merged into the config.

    Returns:
        tuple: ``(model, task)``; ``model.cfg`` is the config, ``model.dataset_meta`` holds
        ``classes`` and ``palette``, ``task`` is ``'det'`` or ``'seg'``.
    """
    from mmengine.config import Config
    from mmengine.model import revert_sync_batchnorm
    from mmengine.registry import init_default_scope

    import xcit_mm  # noqa: F401  (registers XCiTBackbone)

    if not osp.isfile(config):
        raise FileNotFoundError(f'config not found: {config!r}')
    cfg = Config.fromfile(config)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    task = config_task(cfg)
    # Weights come from CHECKPOINT: do not load (maybe absent) pretrained backbone weights.
    if 'init_cfg' in cfg.model.get('backbone', {}):
        cfg.model.backbone.init_cfg = None
    init_default_scope(cfg.default_scope)
    with warnings.catch_warnings(record=True):
        # The upstream initialisers warn about COCO/Cityscapes defaults when they are given
        # no checkpoint (and reset the filters themselves, hence record=True to swallow
        # them); class names are resolved below instead.
        if task == 'det':
            from mmdet.apis import init_detector
            model = init_detector(cfg, checkpoint=None, device='cpu', cfg_options=None)
        else:
            from mmseg.apis import init_model as init_segmentor
            model = init_segmentor(cfg, checkpoint=None, device='cpu', cfg_options=None)
    model = revert_sync_batchnorm(model)
    meta = load_weights(model, checkpoint)
    model.dataset_meta = resolve_dataset_meta(meta, cfg, _model_num_classes(model))
    model.cfg = cfg
    model.to(device)
    model.eval()
    return model, task


def build_visualizer(model, task: str, opacity: Optional[float] = None):
    """Build the upstream visualizer of the task with the model's class names and palette.

    The config's ``visualizer`` type is kept when it is the task's local visualizer (or a
    subclass); its storage backends are dropped: images are written to explicit files.

    Args:
        model: Model returned by :func:`init_model`.
        task: ``'det'`` or ``'seg'``.
        opacity: Opacity of masks (detection) or of the label-map overlay (segmentation);
            None keeps the config's / upstream default (0.8 for masks, 0.5 for label maps).

    Returns:
        A ``DetLocalVisualizer`` or ``SegLocalVisualizer`` instance.
    """
    from mmengine.registry import VISUALIZERS
    if task == 'det':
        from mmdet.visualization import DetLocalVisualizer as base
    else:
        from mmseg.visualization import SegLocalVisualizer as base
    vis_cfg = deepcopy(model.cfg.get('visualizer', None) or {})
    vis_type = vis_cfg.get('type', base.__name__)
    try:
        cls = VISUALIZERS.get(vis_type) if isinstance(vis_type, str) else vis_type
    except Exception:
        cls = None
    if cls is None or not issubclass(cls, base):
        cls = base
    kwargs = {k: v for k, v in vis_cfg.items()
              if k not in ('type', 'name', 'vis_backends', 'save_dir') and not k.startswith('_')}
    if opacity is not None:
        kwargs['alpha'] = opacity
    # Visualizers are named singletons; a fresh name gives a fresh instance each call.
    name = f'xcit_demo_{task}_{next(_VIS_COUNTER)}'
    vis = cls.get_instance(name, **kwargs)
    vis.dataset_meta = dict(classes=model.dataset_meta['classes'],
                            palette=model.dataset_meta['palette'])
    return vis


def predict_and_draw(model, task: str, visualizer, image_bgr: np.ndarray, out_file: str,
                     score_thr: float = 0.3, pipeline=None):
    """Run one image through the model and write the drawn prediction as ``out_file``.

    Args:
        model: Model returned by :func:`init_model`.
        task: ``'det'`` or ``'seg'``.
        visualizer: Visualizer returned by :func:`build_visualizer`.
        image_bgr: (H, W, 3) uint8 BGR image.
        out_file: Output PNG path (same H x W as the image).
        score_thr: Detections scoring below this are not drawn (detection only).
        pipeline: For detection, the composed test pipeline (built once by the caller).

    Returns:
        The data sample predicted by the model.
    """
    image_rgb = np.ascontiguousarray(image_bgr[..., ::-1])
    if task == 'det':
        from mmdet.apis import inference_detector
        result = inference_detector(model, image_bgr, test_pipeline=pipeline)
        visualizer.add_datasample(osp.basename(out_file), image_rgb, data_sample=result,
                                  draw_gt=False, show=False, out_file=out_file,
                                  pred_score_thr=score_thr)
    else:
        from mmseg.apis import inference_model
        result = inference_model(model, image_bgr)
        visualizer.add_datasample(osp.basename(out_file), image_rgb, data_sample=result,
                                  draw_gt=False, draw_pred=True, show=False,
                                  out_file=out_file)
    return result


def run_demo(images: Sequence[str], config: str, checkpoint: str, out_dir: str,
             device: str = 'cpu', score_thr: float = 0.3, opacity: Optional[float] = None,
             recursive: bool = False, cfg_options=None, progress: bool = True
             ) -> Tuple[List[str], Dict[str, str]]:
    """Draw the model's predictions for every image into ``out_dir``.

    Args:
        images: Image files and/or folders.
        config: mmdet or mmseg config.
        checkpoint: Checkpoint trained with ``config``.
        out_dir: Output folder (created).
        device: Torch device.
        score_thr: Detection score threshold for drawing.
        opacity: Mask / overlay opacity in (0, 1]; None keeps the upstream default.
        recursive: Walk sub-folders of folder inputs.
        cfg_options: Optional dict merged into the config.
        progress: Show a tqdm progress bar.

    Returns:
        The written PNG paths and a ``{input path: error message}`` dict of failed inputs.

    Raises:
        FileNotFoundError / ValueError: Bad inputs, config or checkpoint (before any drawing).
    """
    from mmcv.transforms import Compose
    from tqdm import tqdm

    if opacity is not None and not 0 < opacity <= 1:
        raise ValueError(f'--opacity must be in (0, 1], got {opacity}')
    paths, skipped = collect_images(images, recursive)
    if skipped:
        print(f'note: skipped {skipped} non-image file(s) inside the given folder(s)',
              file=sys.stderr)
    model, task = init_model(config, checkpoint, device, cfg_options)
    pipeline = _clean_test_pipeline(model.cfg)
    if task == 'det':
        pipeline[0]['type'] = 'mmdet.LoadImageFromNDArray'
        det_pipeline = Compose(pipeline)
    else:
        det_pipeline = None
        model.cfg.test_pipeline = pipeline  # what mmseg.apis.inference_model reads
    visualizer = build_visualizer(model, task, opacity)
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
            result = predict_and_draw(model, task, visualizer, img, out_file, score_thr,
                                      det_pipeline)
        except Exception as exc:
            raise RuntimeError(f'inference failed on {path!r} (image {img.shape[1]}x'
                               f'{img.shape[0]}): {exc}') from exc
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
                        help='image files and/or folders, then the config, then the '
                             'checkpoint')
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
    """Command-line entry point.

    Returns:
        0 when every image was drawn, 1 when some inputs could not be read (they are listed),
        2 for bad arguments, a missing path, config or checkpoint.
    """
    args = parse_args(argv)
    try:
        written, failed = run_demo(args.images, args.config, args.checkpoint, args.out_dir,
                                   device=args.device, score_thr=args.score_thr,
                                   opacity=args.opacity, recursive=args.recursive,
                                   cfg_options=args.cfg_options,
                                   progress=not args.no_progress)
    except (FileNotFoundError, ValueError) as exc:
        print(f'error: {exc}', file=sys.stderr)
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
