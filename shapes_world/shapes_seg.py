"""``ShapesSegDataset`` (ADE20k layout) and ``ShapesCityscapesDataset`` (the high-resolution world,
Cityscapes layout): mmseg's ``BaseSegDataset`` that generates the shapes world on first use.

Opt-in (it imports mmseg):
``custom_imports = dict(imports=[..., 'shapes_world.shapes_seg'])``.
"""
from mmseg.datasets import BaseSegDataset
from mmseg.registry import DATASETS

from .shapes import CITYSCAPES_IMG_SUFFIX, CITYSCAPES_SEG_SUFFIX, CLASSES, PALETTE
from .shapes_first_use import GeneratedOnFirstUse


@DATASETS.register_module()
class ShapesSegDataset(GeneratedOnFirstUse, BaseSegDataset):
    """``BaseSegDataset`` over the built-in shapes world (ADE20k layout), generated at
    ``data_root`` if missing, so that any tool (ours, mmseg's ``tools/train.py`` / ``mim
    train``) runs on a fresh clone.

    Args:
        shapes_world (dict, optional): Keyword arguments of
            :func:`shapes_world.generate_shapes` (``task='ade'``, sizes, seed...).
        **kwargs: Those of ``BaseSegDataset``.
    """


@DATASETS.register_module()
class ShapesCityscapesDataset(GeneratedOnFirstUse, BaseSegDataset):
    """``BaseSegDataset`` over the high-resolution shapes world (Cityscapes layout and suffixes,
    ``shapes_world.generate_shapes(task='cityscapes')``), generated at ``data_root`` if missing.

    Classes background, circle, square, triangle (label maps hold 0..3 as written).

    Args:
        shapes_world (dict, optional): Keyword arguments of
            :func:`shapes_world.generate_shapes` (``task='cityscapes'``, sizes, seed...).
        **kwargs: Those of ``BaseSegDataset``.
    """
    METAINFO = dict(
        classes=('background', ) + CLASSES,
        palette=[(0, 0, 0)] + [tuple(c) for c in PALETTE])

    def __init__(self, img_suffix=CITYSCAPES_IMG_SUFFIX, seg_map_suffix=CITYSCAPES_SEG_SUFFIX,
                 reduce_zero_label=False, **kwargs):
        super().__init__(img_suffix=img_suffix, seg_map_suffix=seg_map_suffix,
                         reduce_zero_label=reduce_zero_label, **kwargs)
