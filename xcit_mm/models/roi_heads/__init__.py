"""mmdet RoI-head parts; importing this package imports mmdet (``xcit_mm`` itself does not).

Configs that use them add it to ``custom_imports``:
``custom_imports = dict(imports=['xcit_mm', 'xcit_mm.models.roi_heads'])``.
"""
from .gather_roi_extractor import GatherRoIExtractor
from .roi_align import GatherRoIAlign, gather_roi_align

__all__ = ['GatherRoIAlign', 'GatherRoIExtractor', 'gather_roi_align']
