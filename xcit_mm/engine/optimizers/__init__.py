from .cpu_amp_optim_wrapper import CPU_AMP_TYPE, CPUAmpOptimWrapper, amp_optim_wrapper_type

__all__ = ['CPU_AMP_TYPE', 'CPUAmpOptimWrapper', 'amp_optim_wrapper_type']
