"""mmseg segmentors; importing this package imports mmseg (``xcit_mm`` itself does not: the root
registry builds :class:`LeanEncoderDecoder` lazily, see ``xcit_mm/models/__init__.py``)."""
from .lean_encoder_decoder import LeanEncoderDecoder

__all__ = ['LeanEncoderDecoder']
