"""Teach mmengine's FLOP counter ``aten::baddbmm``, the op of XCA's fused output projection.

XCA folds ``attn @ v`` into its projection and computes the result as one
``torch.baddbmm(bias, v, mixing)`` (:class:`~xcit_mm.models.backbones.xcit.XCA`).  mmengine 0.10's
``FlopAnalyzer`` -- what mmdet's and mmseg's ``tools/analysis_tools/get_flops.py`` run, through
``mmengine.analysis.get_model_complexity_info`` -- has no handle for that op: it warns
"Unsupported operator aten::baddbmm" once per layer and counts 0, so every XCiT model's total
misses the multiply-adds of all its XCA output projections.

:func:`install_flop_handles` adds the op to mmengine's module-level default tables, which every
``FlopAnalyzer`` / ``ActivationAnalyzer`` passes to ``set_op_handle`` when it is constructed, so
any analyzer created afterwards counts it (``import xcit_mm``, hence a config's
``custom_imports``, installs it).  The handles are mmengine's own for ``aten::bmm`` applied to the
two batched operands: ``b * n * m * p`` multiply-adds, one FLOP each, and the added tensor is not
counted (as mmengine's ``aten::addmm`` handle ignores its bias).
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
    """Add the ``aten::baddbmm`` handles to mmengine's default FLOP and activation tables.

    Idempotent; an entry already there (a future mmengine's own) is kept.  Without mmengine
    (``mmengine.analysis`` fails to import) nothing is done.
    """
    try:
        from mmengine.analysis import complexity_analysis
    except ImportError:  # pragma: no cover - mmengine is a dependency
        return
    complexity_analysis._DEFAULT_SUPPORTED_FLOP_OPS.setdefault('aten::baddbmm', baddbmm_flop_jit)
    complexity_analysis._DEFAULT_SUPPORTED_ACT_OPS.setdefault('aten::baddbmm',
                                                              baddbmm_activation_jit)
