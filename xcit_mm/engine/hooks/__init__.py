from .check_finite_loss_hook import CheckFiniteLossHook, NonFiniteLossError
from .random_state_hook import RandomStateHook

__all__ = ['CheckFiniteLossHook', 'NonFiniteLossError', 'RandomStateHook']
