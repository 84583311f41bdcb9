"""Layer-wise learning-rate decay, registered by ``import xcit_mm``."""
from .hooks import LayerDecayLrHook
from .optimizers import XCiTLayerDecayOptimizerConstructor

__all__ = ['LayerDecayLrHook', 'XCiTLayerDecayOptimizerConstructor']
