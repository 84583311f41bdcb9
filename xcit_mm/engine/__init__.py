"""Training-loop pieces, registered in mmengine's root registries (visible from mmdet / mmseg)."""
from .hooks import (CheckFiniteLossHook, LayerDecayLrHook, NonFiniteLossError, RandomStateHook,
                    SafeCheckpointHook, SkippedSamplesHook)
from .optimizers import (CPU_AMP_TYPE, CPUAmpOptimWrapper, XCiTLayerDecayOptimizerConstructor,
                         amp_optim_wrapper_type)
from .runner import (RELIABILITY_HOOKS, CheckpointSaveError, XCiTRunner, build_runner,
                     ensure_reliability_hooks)

__all__ = [
    'CPU_AMP_TYPE', 'CPUAmpOptimWrapper', 'CheckFiniteLossHook', 'CheckpointSaveError',
    'LayerDecayLrHook', 'NonFiniteLossError', 'RELIABILITY_HOOKS', 'RandomStateHook',
    'SafeCheckpointHook', 'SkippedSamplesHook', 'XCiTLayerDecayOptimizerConstructor',
    'XCiTRunner', 'amp_optim_wrapper_type', 'build_runner', 'ensure_reliability_hooks'
]
