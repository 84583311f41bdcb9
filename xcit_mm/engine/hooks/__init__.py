from .check_finite_loss_hook import CheckFiniteLossHook, NonFiniteLossError
from .layer_decay_lr_hook import LayerDecayLrHook
from .random_state_hook import RandomStateHook

__all__ = ['CheckFiniteLossHook', 'LayerDecayLrHook', 'NonFiniteLossError', 'RandomStateHook']
