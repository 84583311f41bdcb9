"""RoIAlign as a weighted gather, for CPU training; importing this package imports mmdet
(``training_extras`` itself does not).

Configs that use them add it to ``custom_imports``:
``custom_imports = dict(imports=['training_extras.roi_heads'])``.
"""
from .gather_roi_extractor import GatherRoIExtractor
from .roi_align import GatherRoIAlign, gather_roi_align

__all__ = ['GatherRoIAlign', 'GatherRoIExtractor', 'gather_roi_align']
