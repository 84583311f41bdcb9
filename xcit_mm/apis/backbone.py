# Copyright (c) xcit_mm contributors. All rights reserved.
"""A bare XCiT backbone for XCA visualisation, and a config's input normalisation.

Whole detectors and segmentors are built and run by upstream (``mmdet.apis.DetInferencer`` /
``init_detector``, ``mmseg.apis.MMSegInferencer`` / ``init_model``); ``import xcit_mm`` makes
their checkpoint loading safe and exact. What is left here has no upstream counterpart: an
``XCiTBackbone`` alone, from a config, a checkpoint or nothing.
"""
from typing import Optional, Union

from xcit_mm.models.utils.checkpoint_io import (CheckpointError, check_checkpoint,
                                                resolve_checkpoint_path)
from .utils import read_config

IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)


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
        cfg = read_config(model)
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


__all__ = ['IMAGENET_MEAN', 'IMAGENET_STD', 'init_backbone', 'preprocess_cfg']
