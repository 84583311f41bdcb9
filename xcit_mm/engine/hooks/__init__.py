from .layer_decay_lr_hook import LayerDecayLrHook

__all__ = ['LayerDecayLrHook']
