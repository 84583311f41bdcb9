"""``ShapesSegDataset``: mmseg's ``BaseSegDataset`` that generates the shapes world on first use.

Opt-in (it imports mmseg):
``custom_imports = dict(imports=[..., 'shapes_world.shapes_seg'])``.
"""
from mmseg.datasets import BaseSegDataset
from mmseg.registry import DATASETS

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
