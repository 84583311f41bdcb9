"""xcit_mm: the XCiT backbone for mmdetection and mmsegmentation.

Importing the package registers its modules in mmengine's root registries, which mmdet's and
mmseg's registries fall back to, so one ``custom_imports = dict(imports=['xcit_mm'])`` serves
both tasks: ``XCiTBackbone`` (MODELS), ``XCiTRunner`` (RUNNERS), ``CheckFiniteLossHook``,
``RandomStateHook``, ``SafeCheckpointHook``, ``SkippedSamplesHook`` and ``LayerDecayLrHook``
(HOOKS), ``CPUAmpOptimWrapper`` (OPTIM_WRAPPERS), ``XCiTLayerDecayOptimizerConstructor``
(OPTIM_WRAPPER_CONSTRUCTORS), ``SeededSampleDataset`` (DATASETS), ``SampleKeyBatchSampler``
(DATA_SAMPLERS) and ``CPUDistributedDataParallel`` (MODEL_WRAPPERS). It changes nothing else in
the process. ``xcit_mm.models.roi_heads`` (imported on request: it imports mmdet) adds
``GatherRoIExtractor`` (MODELS).
"""
from . import engine  # noqa: F401  (registers the runner, hooks and optim wrapper)
from .models import XCiTBackbone  # noqa: F401  (registers the backbone)
from .utils import dist_utils  # noqa: F401  (registers the CPU DDP wrapper)
from .version import __version__  # noqa: F401

__all__ = ['XCiTBackbone', '__version__']
