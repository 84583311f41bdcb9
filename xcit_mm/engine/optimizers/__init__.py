from .cpu_amp_optim_wrapper import CPU_AMP_TYPE, CPUAmpOptimWrapper, amp_optim_wrapper_type
from .layer_decay_optim_wrapper_constructor import XCiTLayerDecayOptimizerConstructor

__all__ = ['CPU_AMP_TYPE', 'CPUAmpOptimWrapper', 'amp_optim_wrapper_type',
           'XCiTLayerDecayOptimizerConstructor']
