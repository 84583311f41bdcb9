from mmengine.registry import MODELS as _ROOT_MODELS

from .backbones import XCiTBackbone, arch_zoo


def _build_lean_encoder_decoder(*args, **kwargs):
    """Build :class:`xcit_mm.models.segmentors.LeanEncoderDecoder`, importing it (and so mmseg)
    only now: ``model = dict(type='LeanEncoderDecoder', ...)`` works with ``custom_imports`` of
    ``xcit_mm`` alone, and ``import xcit_mm`` stays free of mmseg. Once imported, the class
    itself is in mmseg's registry, which mmseg-scoped builds search before this one."""
    from .segmentors import LeanEncoderDecoder
    return LeanEncoderDecoder(*args, **kwargs)


if 'LeanEncoderDecoder' not in _ROOT_MODELS.module_dict:
    _ROOT_MODELS.register_module('LeanEncoderDecoder', module=_build_lean_encoder_decoder)


def _build_lean_mask_rcnn(*args, **kwargs):
    """Build :class:`xcit_mm.models.detectors.LeanMaskRCNN`, importing it (and so mmdet) only
    now, as :func:`_build_lean_encoder_decoder` does for mmseg."""
    from .detectors import LeanMaskRCNN
    return LeanMaskRCNN(*args, **kwargs)


if 'LeanMaskRCNN' not in _ROOT_MODELS.module_dict:
    _ROOT_MODELS.register_module('LeanMaskRCNN', module=_build_lean_mask_rcnn)

__all__ = ['XCiTBackbone', 'arch_zoo']
