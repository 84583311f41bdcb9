"""xcit_mm: the XCiT backbone for mmdetection and mmsegmentation.

Importing the package registers ``XCiTBackbone`` in mmengine's root ``MODELS`` registry, which
mmdet's and mmseg's registries fall back to, so one class serves both (``custom_imports``).
"""
from .models import XCiTBackbone  # noqa: F401  (registers the backbone)
from .version import __version__  # noqa: F401

__all__ = ['XCiTBackbone', '__version__']
