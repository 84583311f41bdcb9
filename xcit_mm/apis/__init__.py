# Copyright (c) xcit_mm contributors. All rights reserved.
"""What the tools need beyond upstream: a bare XCiT backbone (XCA maps), the task of a config,
one-line errors, large images read by windows and labels written by tiles (``large_image``).

Detectors and segmentors are built and run with upstream's ``mmdet.apis`` (``DetInferencer``,
``init_detector``) and ``mmseg.apis`` (``MMSegInferencer``, ``init_model``); ``import xcit_mm``
makes their checkpoint loading safe and exact. Not imported by ``import xcit_mm``.
"""
from .backbone import IMAGENET_MEAN, IMAGENET_STD, init_backbone, preprocess_cfg
from .large_image import LargeImageError, model_rows, open_image, write_labels
from .utils import config_task, error_line, read_config

__all__ = [
    'IMAGENET_MEAN', 'IMAGENET_STD', 'LargeImageError', 'config_task', 'error_line',
    'init_backbone', 'model_rows', 'open_image', 'preprocess_cfg', 'read_config', 'write_labels'
]
