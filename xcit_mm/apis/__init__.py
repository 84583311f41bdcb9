# Copyright (c) xcit_mm contributors. All rights reserved.
"""What the tools need beyond upstream: a bare XCiT backbone (XCA maps), the task of a config,
one-line errors; :mod:`.large_image` reads large images by windows and writes labels by tiles.

Detectors and segmentors are built and run with upstream's ``mmdet.apis`` and ``mmseg.apis``.
Not imported by ``import xcit_mm``.
"""
from .backbone import IMAGENET_MEAN, IMAGENET_STD, init_backbone, preprocess_cfg
from .utils import config_task, error_line, read_config

__all__ = [
    'IMAGENET_MEAN', 'IMAGENET_STD', 'config_task', 'error_line', 'init_backbone',
    'preprocess_cfg', 'read_config'
]
