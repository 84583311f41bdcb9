from .lean_autograd import (ffn_residual, recomputed_residual, up2_to_nchw, xca_mixing,
                            xca_residual)

__all__ = ['ffn_residual', 'recomputed_residual', 'up2_to_nchw', 'xca_mixing', 'xca_residual']
