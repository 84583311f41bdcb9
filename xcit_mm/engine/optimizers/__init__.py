from .layer_decay_optim_wrapper_constructor import XCiTLayerDecayOptimizerConstructor

__all__ = ['XCiTLayerDecayOptimizerConstructor']
