# Copyright (c) xcit_mm contributors. All rights reserved.
"""Helpers shared by the command-line tools."""
import copy
import importlib
import os
import os.path as osp
import re
from typing import Optional

_ANSI = re.compile(r'\x1b\[[0-9;?]*[ -/]*[@-~]')

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


__all__ = ['config_task', 'error_line', 'read_config']
