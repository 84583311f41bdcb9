"""Training-loop pieces, registered in mmengine's root registries (visible from mmdet / mmseg)."""
from .hooks import CheckFiniteLossHook, NonFiniteLossError, RandomStateHook
from .optimizers import CPU_AMP_TYPE, CPUAmpOptimWrapper, amp_optim_wrapper_type
from .runner import RELIABILITY_HOOKS, XCiTRunner, build_runner, ensure_reliability_hooks

__all__ = [
    'CPU_AMP_TYPE', 'CPUAmpOptimWrapper', 'CheckFiniteLossHook', 'NonFiniteLossError',
    'RELIABILITY_HOOKS', 'RandomStateHook', 'XCiTRunner', 'amp_optim_wrapper_type', 'build_runner',
    'ensure_reliability_hooks'
]
