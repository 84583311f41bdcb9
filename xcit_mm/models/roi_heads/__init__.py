"""mmdet RoI-head parts; importing this package imports mmdet (``xcit_mm`` itself does not).

Configs that use them add it to ``custom_imports``:
``custom_imports = dict(imports=['xcit_mm', 'xcit_mm.models.roi_heads'])``.
"""
from .gather_roi_extractor import GatherRoIExtractor

__all__ = ['GatherRoIExtractor']
