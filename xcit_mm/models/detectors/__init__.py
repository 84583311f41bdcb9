"""mmdet detectors; importing this package imports mmdet (``xcit_mm`` itself does not: the root
registry builds :class:`LeanMaskRCNN` through a lazy entry, see ``xcit_mm/models/__init__.py``)."""
from .lean_mask_rcnn import LeanMaskRCNN

__all__ = ['LeanMaskRCNN']
