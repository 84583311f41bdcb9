"""Training-loop pieces, registered in mmengine's root registries (visible from mmdet / mmseg)."""
from .hooks import CheckFiniteLossHook, LayerDecayLrHook, NonFiniteLossError, RandomStateHook
from .optimizers import (CPU_AMP_TYPE, CPUAmpOptimWrapper, XCiTLayerDecayOptimizerConstructor,
                         amp_optim_wrapper_type)
from .runner import RELIABILITY_HOOKS, XCiTRunner, build_runner, ensure_reliability_hooks

__all__ = [
    'CPU_AMP_TYPE', 'CPUAmpOptimWrapper', 'CheckFiniteLossHook', 'LayerDecayLrHook',
    'NonFiniteLossError', 'RELIABILITY_HOOKS', 'RandomStateHook',
    'XCiTLayerDecayOptimizerConstructor', 'XCiTRunner', 'amp_optim_wrapper_type', 'build_runner',
    'ensure_reliability_hooks'
]
