"""xcit_mm: the XCiT backbone for mmdetection and mmsegmentation.

``import xcit_mm`` (or ``custom_imports = dict(imports=['xcit_mm'])`` in a config) registers, in
mmengine's root registries that mmdet's and mmseg's fall back to, exactly:

- ``XCiTBackbone`` (MODELS), which loads every published XCiT weight layout by itself;
- ``XCiTLayerDecayOptimizerConstructor`` (OPTIM_WRAPPER_CONSTRUCTORS) and ``LayerDecayLrHook``
  (HOOKS), the optional layer-wise learning-rate decay.

Everything else is an opt-in import: ``xcit_mm.runtime`` (reliable-training hooks, sample
seeding, CPU AMP, CPU distributed helpers), ``xcit_mm.models.roi_heads`` (a faster CPU RoIAlign),
``xcit_mm.datasets`` (the built-in shapes data), ``xcit_mm.apis``, ``xcit_mm.deployment`` and
``xcit_mm.visualization``.
"""
from .engine import LayerDecayLrHook, XCiTLayerDecayOptimizerConstructor
from .models import XCiTBackbone
from .version import __version__

__all__ = ['LayerDecayLrHook', 'XCiTBackbone', 'XCiTLayerDecayOptimizerConstructor', '__version__']
