from .check_finite_loss_hook import CheckFiniteLossHook, NonFiniteLossError
from .layer_decay_lr_hook import LayerDecayLrHook
from .random_state_hook import RandomStateHook
from .safe_checkpoint_hook import SafeCheckpointHook
from .skipped_samples_hook import SkippedSamplesHook

__all__ = [
    'CheckFiniteLossHook', 'LayerDecayLrHook', 'NonFiniteLossError', 'RandomStateHook',
    'SafeCheckpointHook', 'SkippedSamplesHook'
]
