from .roi_align import GatherRoIAlign, gather_roi_align
from .lean_autograd import (batch_norm_stats_frozen, ffn_residual, recomputed_residual,
                            up2_to_nchw, xca_mixing, xca_residual)

__all__ = [
    'GatherRoIAlign', 'batch_norm_stats_frozen', 'ffn_residual', 'gather_roi_align',
    'recomputed_residual', 'up2_to_nchw', 'xca_mixing', 'xca_residual'
]
