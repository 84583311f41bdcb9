# Copyright (c) xcit_mm contributors. All rights reserved.
"""What the tools need beyond upstream's ``mmdet.apis`` / ``mmseg.apis``: a bare XCiT backbone,
a config's task, one-line errors; :mod:`.large_image` for large images. Not imported by
``import xcit_mm``."""
from .utils import config_task, error_line, init_backbone, preprocess_cfg, read_config

__all__ = ['config_task', 'error_line', 'init_backbone', 'preprocess_cfg', 'read_config']
