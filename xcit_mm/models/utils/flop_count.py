"""Teach mmengine's FLOP counter ``aten::baddbmm``, the op of XCA's fused output projection.

mmengine's ``FlopAnalyzer`` (behind mmdet's / mmseg's ``get_flops.py``) has no handle for it and
would count XCA's output projections as 0. ``import xcit_mm`` adds one to its default tables.
"""
from typing import Any, List

__all__ = ['baddbmm_flop_jit', 'baddbmm_activation_jit', 'install_flop_handles']


def baddbmm_flop_jit(inputs: List[Any], outputs: List[Any]) -> int:
    """FLOPs of ``aten::baddbmm(input, batch1, batch2, beta, alpha)``: those of ``bmm(batch1,
    batch2)`` (mmengine's handle), one per multiply-add; ``input`` (the bias) is not counted."""
    from mmengine.analysis.jit_handles import bmm_flop_jit
    return bmm_flop_jit(inputs[1:3], outputs)


def baddbmm_activation_jit(inputs: List[Any], outputs: List[Any]) -> int:
    """Activations of ``aten::baddbmm``: the output's elements, as mmengine counts ``aten::bmm``."""
    from mmengine.analysis.jit_handles import generic_activation_jit
    return generic_activation_jit()(inputs, outputs)


def install_flop_handles() -> None:
    """Add the ``aten::baddbmm`` handles to mmengine's default FLOP and activation tables
    (idempotent; an entry already there, a future mmengine's own, is kept)."""
    from mmengine.analysis import complexity_analysis
    complexity_analysis._DEFAULT_SUPPORTED_FLOP_OPS.setdefault('aten::baddbmm', baddbmm_flop_jit)
    complexity_analysis._DEFAULT_SUPPORTED_ACT_OPS.setdefault('aten::baddbmm',
                                                              baddbmm_activation_jit)
