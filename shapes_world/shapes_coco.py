"""``ShapesCocoDataset``: mmdet's ``CocoDataset`` that generates the shapes world on first use.

Opt-in (it imports mmdet):
``custom_imports = dict(imports=[..., 'shapes_world.shapes_coco'])``.
"""
from mmdet.datasets import CocoDataset
from mmdet.registry import DATASETS

from .shapes_first_use import GeneratedOnFirstUse


@DATASETS.register_module()
class ShapesCocoDataset(GeneratedOnFirstUse, CocoDataset):
    """``CocoDataset`` over the built-in shapes world, generated at ``data_root`` if missing.

    So a fresh clone trains and tests with any tool (ours, mmdet's ``tools/train.py`` /
    ``mim train``) without a data preparation step.

    Args:
        shapes_world (dict, optional): Keyword arguments of
            :func:`shapes_world.generate_shapes` (``task='coco'``, sizes, seed...).
        **kwargs: Those of ``CocoDataset``.
    """
