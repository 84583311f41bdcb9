# Copyright (c) xcit_mm contributors. All rights reserved.
"""XCiT's cross-covariance attention maps (predictions are drawn by upstream's inferencers).
Not imported by ``import xcit_mm``."""
from .xca import SAMPLE_IMAGES, XCAFigure, visualize_xca, xca_maps

__all__ = ['SAMPLE_IMAGES', 'XCAFigure', 'visualize_xca', 'xca_maps']
