# Copyright (c) xcit_mm contributors. All rights reserved.
"""Visualisation: predictions drawn with the upstream visualizers, and XCiT's XCA maps.

Not imported by ``import xcit_mm``: ``from xcit_mm.visualization import visualize_xca``.
"""
from .predictions import build_visualizer, draw_prediction
from .xca import (SAMPLE_IMAGES, XCAFigure, draw_grid, figure_size, load_image,
                  resize_longer_side, resolve_layers, to_tensor, visualize_xca, xca_maps,
                  xca_title)

__all__ = [
    'SAMPLE_IMAGES', 'XCAFigure', 'build_visualizer', 'draw_grid', 'draw_prediction',
    'figure_size', 'load_image', 'resize_longer_side', 'resolve_layers', 'to_tensor',
    'visualize_xca', 'xca_maps', 'xca_title'
]
