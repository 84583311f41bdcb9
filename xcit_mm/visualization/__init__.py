# Copyright (c) xcit_mm contributors. All rights reserved.
"""Visualisation of XCiT's cross-covariance attention (XCA) maps.

Predictions are drawn by upstream: ``mmdet.apis.DetInferencer`` / ``mmseg.apis.MMSegInferencer``
with their visualizers (``demo/image_demo.py``).

Not imported by ``import xcit_mm``: ``from xcit_mm.visualization import visualize_xca``.
"""
from .xca import (SAMPLE_IMAGES, XCAFigure, draw_grid, figure_size, load_image,
                  resize_longer_side, resolve_layers, to_tensor, visualize_xca, xca_maps,
                  xca_title)

__all__ = [
    'SAMPLE_IMAGES', 'XCAFigure', 'draw_grid', 'figure_size', 'load_image', 'resize_longer_side',
    'resolve_layers', 'to_tensor', 'visualize_xca', 'xca_maps', 'xca_title'
]
