# Copyright (c) xcit_mm contributors. All rights reserved.
"""Inference APIs: build a detector / segmentor / bare XCiT backbone and load its checkpoint.

Not imported by ``import xcit_mm``: ``from xcit_mm.apis import init_model``.
"""
from .inference import (IMAGENET_MEAN, IMAGENET_STD, build_test_pipeline, config_task,
                        get_test_pipeline_cfg, inference_model, init_backbone, init_model,
                        load_config, load_model_weights, model_num_classes, preprocess_cfg,
                        resolve_dataset_meta)
from .utils import error_line

__all__ = [
    'IMAGENET_MEAN', 'IMAGENET_STD', 'build_test_pipeline', 'config_task', 'error_line',
    'get_test_pipeline_cfg', 'inference_model', 'init_backbone', 'init_model', 'load_config',
    'load_model_weights', 'model_num_classes', 'preprocess_cfg', 'resolve_dataset_meta'
]
