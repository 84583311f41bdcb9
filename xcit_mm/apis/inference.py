# Copyright (c) xcit_mm contributors. All rights reserved.
"""Building XCiT models for inference: whole detectors / segmentors, and bare backbones.

What :func:`mmdet.apis.init_detector` / :func:`mmseg.apis.init_model` do, for both tasks and with
this package's checkpoint handling:

* every checkpoint is read by THE reader, :mod:`xcit_mm.models.utils.checkpoint_io`
  (``weights_only``,
  URLs downloaded into torch's hub cache and read like local files: nothing downloaded is
  unpickled unsafely) and checked *before* the model is built, so a truncated file, a file with
  pickled code or an HTML page saved as ``.pth`` is one :class:`CheckpointError` naming the file;
* whole models are loaded strictly with :func:`~xcit_mm.models.utils.load_model_state_dict`
  (released XCiT layouts converted; a checkpoint of another model is an error naming the keys,
  never a silently random model);
* class names and palette (``model.dataset_meta``) come from the checkpoint's
  ``meta['dataset_meta']``, else from the config's test dataset, as upstream does.

Used by ``demo/image_demo.py`` and ``tools/analysis_tools/visualize_xca.py``.
"""
import os
import os.path as osp
import warnings
from copy import deepcopy
from typing import List, Optional, Tuple, Union

import numpy as np

from xcit_mm.models.utils.checkpoint_io import (CheckpointError, check_checkpoint,
                                         resolve_checkpoint_path)

TASK_BY_SCOPE = {'mmdet': 'det', 'mmseg': 'seg'}
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)


# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------
def load_config(config, cfg_options: Optional[dict] = None):
    """Read a config file (or copy a ``Config``) and merge ``cfg_options`` into it.

    Raises:
        FileNotFoundError: ``config not found: PATH`` for a missing file.
    """
    from mmengine.config import Config
    if isinstance(config, (str, os.PathLike)):
        config = str(config)
        if not osp.isfile(config):
            raise FileNotFoundError(f'config not found: {config!r}')
        cfg = Config.fromfile(config)
    elif isinstance(config, Config):
        cfg = deepcopy(config)
    else:
        raise TypeError(f'config must be a path or an mmengine Config, got {type(config)}')
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    return cfg


def config_task(cfg) -> str:
    """``'det'`` or ``'seg'`` from a config's ``default_scope``.

    Raises:
        ValueError: If the scope is neither ``mmdet`` nor ``mmseg``.
    """
    scope = cfg.get('default_scope', None)
    if scope not in TASK_BY_SCOPE:
        raise ValueError(f'config default_scope is {scope!r}; xcit_mm runs mmdet detectors '
                         "(default_scope='mmdet') and mmseg segmentors (default_scope='mmseg')")
    return TASK_BY_SCOPE[scope]


def _test_dataset_cfg(cfg):
    """The test dataset's config, unwrapped from dataset wrappers, or None."""
    loader = cfg.get('test_dataloader', None) or cfg.get('val_dataloader', None)
    if not loader or 'dataset' not in loader:
        return None
    ds = loader['dataset']
    # RepeatDataset / ClassBalancedDataset (``dataset``), ConcatDataset (``datasets``, first).
    while isinstance(ds, dict) and ('dataset' in ds or 'datasets' in ds):
        ds = ds['datasets'][0] if 'datasets' in ds else ds['dataset']
    return ds


def get_test_pipeline_cfg(cfg) -> list:
    """The config's test pipeline without its ground-truth loader.

    Raises:
        ValueError: If the config has no test pipeline or it does not start with a loader.
    """
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


# --------------------------------------------------------------------------------------------
# class names and palette
# --------------------------------------------------------------------------------------------
def _config_metainfo(cfg) -> dict:
    """Metainfo (classes, palette) of the config's test dataset, without reading its data.

    The dataset is built with ``lazy_init=True`` as upstream ``init_detector`` does; if that
    fails (e.g. the dataset type is not importable) the class's ``METAINFO`` updated by the
    config's ``metainfo`` is used.
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


def resolve_dataset_meta(ckpt_meta: dict, cfg, num_classes: Optional[int] = None) -> dict:
    """The class names and palette to draw with.

    Classes: the checkpoint's ``meta['dataset_meta']`` (or old-style ``CLASSES``), then the
    config's test dataset metainfo, then ``class_0``, ``class_1``, ... Palette: the config's test
    dataset palette, then the checkpoint's, then a fixed random palette.

    Returns:
        dict with ``classes`` (tuple of str) and ``palette`` (list of RGB tuples).
    """
    meta = {}
    if ckpt_meta.get('dataset_meta'):
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
        warnings.warn('no class names in the checkpoint meta or the config; using class_0, '
                      'class_1, ...')
        meta['classes'] = tuple(f'class_{i}' for i in range(num_classes or 1))
    meta['classes'] = tuple(meta['classes'])
    n = max(len(meta['classes']), num_classes or 0)
    palette = meta.get('palette')
    if not isinstance(palette, (list, tuple)) or len(palette) < n:
        meta['palette'] = _default_palette(n)
    else:
        meta['palette'] = [tuple(int(c) for c in p) for p in palette]
    return meta


def model_num_classes(model) -> Optional[int]:
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


# --------------------------------------------------------------------------------------------
# whole models
# --------------------------------------------------------------------------------------------
def load_model_weights(model, checkpoint: str, what: str = 'checkpoint') -> dict:
    """Strictly load a detector / segmentor checkpoint into ``model``; return its ``meta``.

    Reads with :func:`~xcit_mm.models.utils.checkpoint_io.load_checkpoint_file` (``weights_only``;
    mmengine Runner checkpoints, bare state dicts, ``{'model': ...}`` and the released XCiT
    COCO / ADE20k files) and loads strictly with
    :func:`~xcit_mm.models.utils.load_model_checkpoint`.

    Raises:
        CheckpointError: An unreadable or unsafe file, or one that does not fit the model.
    """
    from xcit_mm.models.utils import load_model_checkpoint
    ckpt, _ = load_model_checkpoint(model, checkpoint, what=what)
    meta = ckpt.get('meta', {}) if isinstance(ckpt, dict) else {}
    return meta if isinstance(meta, dict) else {}


def init_model(config, checkpoint: Optional[str] = None, device: str = 'cpu',
               cfg_options: Optional[dict] = None):
    """Build a detector or segmentor from a config and load its checkpoint.

    Like :func:`mmdet.apis.init_detector` / :func:`mmseg.apis.init_model`, for both tasks (chosen
    by the config's ``default_scope``). The checkpoint is checked (downloaded first if it is a
    URL) *before* the model is built; the backbone's ``init_cfg`` is dropped, the weights come from
    ``checkpoint``. SyncBN is reverted to BN.

    Args:
        config (str | mmengine.Config): mmdet or mmseg config.
        checkpoint (str, optional): Local path or http(s) URL. None keeps the random init.
        device (str): Torch device, e.g. ``'cpu'`` or ``'cuda:0'``.
        cfg_options (dict, optional): Merged into the config.

    Returns:
        The model in eval mode on ``device``; ``model.cfg`` is the config, ``model.dataset_meta``
        holds ``classes`` and ``palette``. ``config_task(model.cfg)`` gives the task.

    Raises:
        FileNotFoundError: The config does not exist.
        ValueError: The config is not an mmdet / mmseg one.
        CheckpointError: The checkpoint is missing, unreadable, unsafe or of another model.
    """
    from mmengine.model import revert_sync_batchnorm
    from mmengine.registry import init_default_scope

    import xcit_mm  # noqa: F401  (registers XCiTBackbone)

    cfg = load_config(config, cfg_options)
    task = config_task(cfg)
    local = check_checkpoint(checkpoint, 'checkpoint') if checkpoint is not None else None
    if 'init_cfg' in cfg.model.get('backbone', {}):
        cfg.model.backbone.init_cfg = None  # weights come from `checkpoint`
    init_default_scope(cfg.default_scope)
    with warnings.catch_warnings(record=True):
        # The upstream initialisers warn about COCO / Cityscapes class names when given no
        # checkpoint (and reset the filters themselves, hence record=True); the names are
        # resolved below instead.
        if task == 'det':
            from mmdet.apis import init_detector
            model = init_detector(cfg, checkpoint=None, device='cpu')
        else:
            from mmseg.apis import init_model as init_segmentor
            model = init_segmentor(cfg, checkpoint=None, device='cpu')
    model = revert_sync_batchnorm(model)
    meta = load_model_weights(model, local) if local is not None else {}
    model.dataset_meta = resolve_dataset_meta(meta, cfg, model_num_classes(model))
    model.cfg = cfg
    model.to(device)
    model.eval()
    return model


def build_test_pipeline(model):
    """Prepare ``model`` for :func:`inference_model` on (H, W, 3) BGR arrays.

    Returns:
        For a detector, the composed test pipeline (build it once, pass it to every call); for a
        segmentor None (``model.cfg.test_pipeline``, which mmseg reads, is set instead).
    """
    pipeline = get_test_pipeline_cfg(model.cfg)
    if config_task(model.cfg) == 'seg':
        model.cfg.test_pipeline = pipeline
        return None
    from mmcv.transforms import Compose
    pipeline[0]['type'] = 'mmdet.LoadImageFromNDArray'
    return Compose(pipeline)


def inference_model(model, image_bgr: np.ndarray, pipeline=None):
    """Predict one (H, W, 3) uint8 BGR image with a model from :func:`init_model`.

    Args:
        pipeline: The return value of :func:`build_test_pipeline` (built here when None).

    Returns:
        The predicted ``DetDataSample`` / ``SegDataSample``.
    """
    if pipeline is None:
        pipeline = build_test_pipeline(model)
    if config_task(model.cfg) == 'det':
        from mmdet.apis import inference_detector
        return inference_detector(model, image_bgr, test_pipeline=pipeline)
    from mmseg.apis import inference_model as inference_segmentor
    return inference_segmentor(model, image_bgr)


# --------------------------------------------------------------------------------------------
# bare backbones
# --------------------------------------------------------------------------------------------
def preprocess_cfg(cfg) -> dict:
    """``mean`` / ``std`` / ``rgb`` of a config's ``data_preprocessor`` (ImageNet, RGB default)."""
    dp = cfg.get('model', {}).get('data_preprocessor', None) or \
        cfg.get('data_preprocessor', None) or {}
    mean = dp.get('mean', None) or IMAGENET_MEAN
    std = dp.get('std', None) or IMAGENET_STD
    # mmdet / mmseg loaders give BGR; `bgr_to_rgb=True` turns it into RGB before normalising.
    rgb = bool(dp.get('bgr_to_rgb', False) or dp.get('rgb_to_bgr', False)) if dp else True
    return dict(mean=tuple(mean), std=tuple(std), rgb=rgb)


def init_backbone(model: str, arch: Union[str, dict] = 's12', patch_size: int = 16,
                  checkpoint: Optional[str] = None, device: str = 'cpu'):
    """Build an ``XCiTBackbone`` from a config, a checkpoint or nothing, in eval mode.

    Args:
        model (str): A config (``*.py``: its ``model.backbone``, SyncBN made BN, ``init_cfg``
            applied unless ``checkpoint`` replaces it), a checkpoint file or URL (any layout the
            backbone's ``Pretrained`` loader accepts), or ``'random'``.
        arch (str | dict): Arch when ``model`` is a checkpoint or ``'random'``.
        patch_size (int): 8 or 16, when ``model`` is a checkpoint or ``'random'``.
        checkpoint (str, optional): With a config or ``'random'``: the weights to load (e.g. a
            detector / segmentor trained with the config).
        device (str): Torch device.

    Returns:
        ``(backbone, preprocess)``: the backbone and a dict with ``mean``, ``std``, ``rgb`` (see
        :func:`preprocess_cfg`).

    Raises:
        FileNotFoundError: The config does not exist.
        ValueError: The config's backbone is not an XCiTBackbone, or bad arguments.
        CheckpointError: A missing, unreadable or unsafe checkpoint (checked before the backbone
            is built), or one of another arch / patch size.
    """
    from xcit_mm.models import XCiTBackbone
    preprocess = dict(mean=IMAGENET_MEAN, std=IMAGENET_STD, rgb=True)
    what = '--checkpoint' if checkpoint is not None else 'checkpoint'
    if model.endswith('.py'):
        cfg = load_config(model)
        bb_cfg = cfg.get('model', {}).get('backbone', None)
        if bb_cfg is None:
            raise ValueError(f'config {model!r} has no model.backbone')
        bb_cfg = bb_cfg.to_dict() if hasattr(bb_cfg, 'to_dict') else dict(bb_cfg)
        bb_type = str(bb_cfg.pop('type', '')).split('.')[-1]
        if bb_type != 'XCiTBackbone':
            raise ValueError(f'config {model!r} backbone is {bb_type!r}, not XCiTBackbone')
        norm = bb_cfg.get('norm_cfg', None)
        if isinstance(norm, dict) and 'SyncBN' in str(norm.get('type', '')):
            bb_cfg['norm_cfg'] = dict(norm, type='BN')  # same weights, runs on one device
        if checkpoint is not None:
            bb_cfg['init_cfg'] = dict(type='Pretrained', checkpoint=checkpoint)
        else:
            what = f'model.backbone.init_cfg.checkpoint of {model}'
        # forward_trunk stops at max(out_indices); the default ends at the last layer, so every
        # layer can be captured. out_indices change no weight.
        bb_cfg['out_indices'] = None
        preprocess = preprocess_cfg(cfg)
    elif model == 'random':
        bb_cfg = dict(arch=arch, patch_size=patch_size)
        if checkpoint is not None:
            bb_cfg['init_cfg'] = dict(type='Pretrained', checkpoint=checkpoint)
    else:
        if checkpoint is not None:
            raise ValueError('MODEL is already a checkpoint; --checkpoint only goes with a '
                             "config or 'random'")
        bb_cfg = dict(arch=arch, patch_size=patch_size,
                      init_cfg=dict(type='Pretrained', checkpoint=model))
    init = bb_cfg.get('init_cfg', None)
    if isinstance(init, dict) and init.get('type') == 'Pretrained' and init.get('checkpoint'):
        # Checked before anything is built; a URL is downloaded once and read from the cache.
        # A config that opts out of weights_only (a file its author trusts) is only resolved.
        check = resolve_checkpoint_path if init.get('weights_only', True) is False \
            else check_checkpoint
        try:
            init['checkpoint'] = check(init['checkpoint'], what)
        except CheckpointError as e:
            if what.startswith('model.backbone'):
                raise CheckpointError(
                    f'{e} Or pass --checkpoint PATH (e.g. the checkpoint trained with this '
                    f'config), or use MODEL=random.') from e
            raise
    backbone = XCiTBackbone(**bb_cfg)
    # Truncated-normal init, then the checkpoint if any, loaded strictly (a checkpoint of another
    # arch / patch size is a CheckpointError naming the tensors).
    backbone.init_weights()
    backbone.to(device)
    backbone.eval()
    return backbone, preprocess


__all__ = [
    'IMAGENET_MEAN', 'IMAGENET_STD', 'build_test_pipeline', 'config_task', 'inference_model',
    'init_backbone', 'init_model', 'load_config', 'load_model_weights', 'model_num_classes',
    'preprocess_cfg', 'resolve_dataset_meta', 'get_test_pipeline_cfg'
]
