import importlib

from mmengine.registry import MODELS as _ROOT_MODELS

from .backbones import XCiTBackbone, arch_zoo


def _register_lazily(name: str, package: str) -> None:
    """Register ``name`` in mmengine's root MODELS as a builder that imports ``package`` (and so
    mmseg or mmdet) only when a config builds it: ``model = dict(type=name, ...)`` works with
    ``custom_imports`` of ``xcit_mm`` alone, and ``import xcit_mm`` stays free of both. Once
    imported, the class itself is in mmseg's / mmdet's registry, which their scoped builds search
    before this one."""

    def build(*args, **kwargs):
        return getattr(importlib.import_module(package, __name__), name)(*args, **kwargs)

    build.__name__ = build.__qualname__ = f'build_{name}'
    if name not in _ROOT_MODELS.module_dict:
        _ROOT_MODELS.register_module(name, module=build)


_register_lazily('LeanEncoderDecoder', '.segmentors')
_register_lazily('LeanMaskRCNN', '.detectors')

__all__ = ['XCiTBackbone', 'arch_zoo']
