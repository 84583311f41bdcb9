# Copyright (c) xcit_mm contributors. All rights reserved.
"""Helpers shared by the command-line tools, and a bare XCiT backbone (for XCA visualisation);
whole models are built by upstream's ``init_detector`` / ``init_model`` and inferencers."""
import copy
import importlib
import os
import os.path as osp
import re
from typing import Optional, Union

from xcit_mm.models.utils.checkpoint_io import (CheckpointError, check_checkpoint,
                                                resolve_checkpoint_path)

_ANSI = re.compile(r'\x1b\[[0-9;?]*[ -/]*[@-~]')
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)

# task: (upstream package, its base model class, the xcit_mm models registered into its registry)
_TASKS = {'det': ('mmdet', 'BaseDetector', 'xcit_mm.models.detectors'),
          'seg': ('mmseg', 'BaseSegmentor', 'xcit_mm.models.segmentors')}


def error_line(error) -> str:
    """``error: MESSAGE`` on one line, without the terminal escape codes (torch's load errors
    carry ANSI bold codes and several lines), for a CLI's stderr."""
    text = _ANSI.sub('', str(error))
    return 'error: ' + ' '.join(text.split())


def read_config(config, cfg_options: Optional[dict] = None):
    """An mmengine ``Config`` from a path (or a copy of one), ``cfg_options`` merged."""
    from mmengine.config import Config
    if isinstance(config, Config):
        cfg = copy.deepcopy(config)
    elif isinstance(config, (str, os.PathLike)):
        config = str(config)
        if not osp.isfile(config):
            raise FileNotFoundError(f'config not found: {config!r}')
        cfg = Config.fromfile(config)
    else:
        raise TypeError(f'config must be a path or an mmengine Config, got {type(config)}')
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    return cfg


def config_task(cfg) -> str:
    """``'det'`` or ``'seg'``: whether ``cfg.model.type`` is an mmdet detector or an mmseg
    segmentor, as their ``MODELS`` registries resolve it (a ValueError if neither)."""
    model_type = (cfg.get('model', None) or {}).get('type', None)
    missing = []
    for task, (package, base_name, ours) in _TASKS.items():
        try:
            registry = importlib.import_module(f'{package}.registry').MODELS
            base = getattr(importlib.import_module(f'{package}.models'), base_name)
            importlib.import_module(ours)  # the lean model's class into the upstream registry
        except ImportError:
            missing.append(package)
            continue
        cls = registry.get(model_type) if isinstance(model_type, str) else model_type
        if isinstance(cls, type) and issubclass(cls, base):
            return task
    raise ValueError(f"config model type {model_type!r} (default_scope is "
                     f"{cfg.get('default_scope', None)!r}) is neither an mmdet detector nor an "
                     'mmseg segmentor: xcit_mm runs mmdet detectors and mmseg segmentors'
                     + (f' ({" and ".join(missing)} not installed)' if missing else ''))


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
    """An ``XCiTBackbone`` in eval mode and :func:`preprocess_cfg`'s dict. ``model``: a config
    (SyncBN made BN; ``checkpoint`` replaces its ``init_cfg``), a checkpoint file or URL (of
    ``arch`` / ``patch_size``), or ``'random'``. The checkpoint is checked before the build."""
    from xcit_mm.models import XCiTBackbone
    cfg, bb_cfg, what = {}, dict(arch=arch, patch_size=patch_size), '--checkpoint'
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
        if checkpoint is None:
            what = f'model.backbone.init_cfg.checkpoint of {model}'
        # forward_trunk stops at max(out_indices): None runs (and lets one capture) every layer
        bb_cfg['out_indices'] = None
    elif model != 'random':
        if checkpoint is not None:
            raise ValueError('MODEL is already a checkpoint; --checkpoint only goes with a '
                             "config or 'random'")
        checkpoint, what = model, 'checkpoint'
    if checkpoint is not None:
        bb_cfg['init_cfg'] = dict(type='Pretrained', checkpoint=checkpoint)
    init = bb_cfg.get('init_cfg', None)
    if isinstance(init, dict) and init.get('type') == 'Pretrained' and init.get('checkpoint'):
        # a URL is downloaded once; a config that opts out of weights_only is only resolved
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
    backbone.init_weights()  # the checkpoint if any, loaded strictly
    return backbone.to(device).eval(), preprocess_cfg(cfg)


__all__ = ['config_task', 'error_line', 'init_backbone', 'preprocess_cfg', 'read_config']
