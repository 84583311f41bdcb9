from .backbones import XCiTBackbone, arch_zoo

__all__ = ['XCiTBackbone', 'arch_zoo']
