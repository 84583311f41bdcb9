"""xcit_mm: the XCiT backbone for mmdetection and mmsegmentation.

Importing the package registers ``XCiTBackbone`` in mmengine's root ``MODELS`` registry, which
mmdet's and mmseg's registries fall back to, so one class serves both (``custom_imports``).
It also lets ``torch.load(weights_only=True)`` read mmengine's own training checkpoints (an
allow-list of mmengine's HistoryBuffer and numpy arrays, see
:func:`xcit_mm.checkpoint.allow_runner_checkpoints`), so ``--resume`` works through upstream
tools too; pickled code is still refused.
"""
from .checkpoint import allow_runner_checkpoints
from .models import XCiTBackbone  # noqa: F401  (registers the backbone)
from .version import __version__  # noqa: F401

allow_runner_checkpoints()

__all__ = ['XCiTBackbone', '__version__']
