"""Layer-wise learning-rate decay, registered by ``import xcit_mm``."""
from .layer_decay import LayerDecayLrHook, XCiTLayerDecayOptimizerConstructor

__all__ = ['LayerDecayLrHook', 'XCiTLayerDecayOptimizerConstructor']
