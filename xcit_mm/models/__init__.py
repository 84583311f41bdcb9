import importlib

from mmengine.registry import MODELS as _ROOT_MODELS

from .backbones import XCiTBackbone, arch_zoo


def _register_lazily(name: str, package: str) -> None:
    """A root-registry builder that imports ``package`` (mmseg / mmdet) only when a config builds
    ``name``, so that ``import xcit_mm`` stays free of both."""

    def build(*args, **kwargs):
        return getattr(importlib.import_module(package, __name__), name)(*args, **kwargs)

    build.__name__ = build.__qualname__ = f'build_{name}'
    if name not in _ROOT_MODELS.module_dict:
        _ROOT_MODELS.register_module(name, module=build)


_register_lazily('LeanEncoderDecoder', '.segmentors')
_register_lazily('LeanMaskRCNN', '.detectors')

__all__ = ['XCiTBackbone', 'arch_zoo']
