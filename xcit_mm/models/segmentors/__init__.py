"""mmseg segmentors; importing this package imports mmseg (``xcit_mm`` itself does not).

Configs need no import for it: ``import xcit_mm`` registers the name ``LeanEncoderDecoder`` with a
builder that imports this package on first use (see ``xcit_mm/models/__init__.py``).
"""
from .lean_encoder_decoder import LeanEncoderDecoder

__all__ = ['LeanEncoderDecoder']
