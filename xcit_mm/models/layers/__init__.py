from .lean_autograd import (batch_norm_stats_frozen, ffn_residual, recomputed_residual,
                            split_qk, split_qkv, up2_blockwise, xca_mixing, xca_mixing_of_sums,
                            xca_residual, xca_sums)

__all__ = [
    'batch_norm_stats_frozen', 'ffn_residual', 'recomputed_residual', 'split_qk', 'split_qkv',
    'up2_blockwise', 'xca_mixing', 'xca_mixing_of_sums', 'xca_residual', 'xca_sums'
]
