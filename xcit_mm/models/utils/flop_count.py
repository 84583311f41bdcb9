"""Teach mmengine's FLOP counter ``aten::baddbmm``, the op of XCA's fused output projection,
which its ``FlopAnalyzer`` (behind mmdet's / mmseg's ``get_flops.py``) would count as 0."""
from typing import Any, List

from mmengine.analysis import complexity_analysis
from mmengine.analysis.jit_handles import bmm_flop_jit, generic_activation_jit

# the output's elements, as mmengine counts ``aten::bmm``
baddbmm_activation_jit = generic_activation_jit()


def baddbmm_flop_jit(inputs: List[Any], outputs: List[Any]) -> int:
    """FLOPs of ``aten::baddbmm(input, batch1, batch2, ...)``: its bmm's, one per multiply-add;
    the added ``input`` is not counted (as mmengine's addmm handle ignores the bias)."""
    return bmm_flop_jit(inputs[1:3], outputs)


def install_flop_handles() -> None:
    """Add the handles to mmengine's default tables, keeping an entry already there."""
    complexity_analysis._DEFAULT_SUPPORTED_FLOP_OPS.setdefault('aten::baddbmm', baddbmm_flop_jit)
    complexity_analysis._DEFAULT_SUPPORTED_ACT_OPS.setdefault('aten::baddbmm',
                                                              baddbmm_activation_jit)
