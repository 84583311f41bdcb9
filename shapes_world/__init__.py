# Copyright (c) xcit_mm contributors. All rights reserved.
"""Built-in data: the deterministic "shapes" world in COCO, ADE20k and Cityscapes layouts."""
from .shapes import (CLASSES, PALETTE, ensure_shapes_world, generate_shapes, load_samples,
                     make_mosaic)

__all__ = [
    'CLASSES', 'PALETTE', 'ensure_shapes_world', 'generate_shapes', 'load_samples', 'make_mosaic'
]
