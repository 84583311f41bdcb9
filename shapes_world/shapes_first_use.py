"""Generate the built-in shapes world on first use, whichever tool builds the dataset."""
import os
import os.path as osp
from typing import Optional

from .shapes import ensure_shapes_world


def ensure_at_data_root(data_root: str, shapes_world: Optional[dict]) -> None:
    """Generate ``shapes_world`` (the keyword arguments of ``generate_shapes``) at ``data_root``
    when that directory is missing or empty; an existing world is used as it is (tools/train.py
    and tools/test.py regenerate one made with other arguments, with a warning, before this)."""
    if not shapes_world or (osp.isdir(data_root) and os.listdir(data_root)):
        return
    ensure_shapes_world(dict(shapes_world=dict(shapes_world, root=data_root)))


class GeneratedOnFirstUse:
    """Dataset mixin: ``shapes_world`` (keyword arguments of ``generate_shapes``) is generated
    at the dataset's ``data_root`` if that directory is missing or empty, then the dataset
    (the next base class) is built as usual."""

    def __init__(self, *args, shapes_world: Optional[dict] = None, **kwargs):
        ensure_at_data_root(kwargs.get('data_root', ''), shapes_world)
        super().__init__(*args, **kwargs)
