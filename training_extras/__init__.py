"""Training extras for mmengine's own ``Runner``: nothing here is about XCiT.

Any mmdet / mmseg config switches them on with one base, ``configs/_base_/training_extras.py``
(the quick-start jobs do; the paper configs run on stock hooks). Registers the pieces that make
long runs reliable and CPU-only runs possible (docs/training_extras.md): the hooks
``CheckFiniteLossHook``, ``RandomStateHook``, ``SampleSeedingHook``, ``PortableCheckpointHook``,
``SafeCheckpointHook`` (``AtomicCheckpointHook`` selects it from ``custom_hooks``),
``SkippedSamplesHook`` and ``CompileFeatureExtractorHook``; the dataset wrapper
``SeededSampleDataset`` and batch sampler ``SampleKeyBatchSampler``; ``CPUAmpOptimWrapper``
(bfloat16 autocast without a GPU) and ``CPUDistributedDataParallel`` (gloo without a GPU).
Without this import everything is stock mmengine behaviour.
"""
from .cpu_amp_optim_wrapper import CPU_AMP_TYPE, CPUAmpOptimWrapper, amp_optim_wrapper_type
from .data_check import (AnnotationFormatError, DatasetNotFoundError, check_annotation_formats,
                         check_data, coco_annotation_problem, find_missing_data)
from .dist_utils import (CPUDistributedDataParallel, distributed_session, init_cpu_dist,
                         init_distributed, prepare_cpu_distributed_cfg)
from .hooks import (AtomicCheckpointHook, CheckFiniteLossHook, CheckpointSaveError,
                    CompileFeatureExtractorHook, NonFiniteLossError, PortableCheckpointHook,
                    RandomStateHook, SafeCheckpointHook, SampleSeedingHook, SkippedSamplesHook)
from .sample_seeding import SampleKeyBatchSampler, SampleLoadError, SeededSampleDataset

__all__ = [
    'AnnotationFormatError', 'AtomicCheckpointHook', 'CPU_AMP_TYPE', 'CPUAmpOptimWrapper',
    'CPUDistributedDataParallel',
    'CheckFiniteLossHook', 'CheckpointSaveError', 'CompileFeatureExtractorHook',
    'DatasetNotFoundError', 'NonFiniteLossError', 'PortableCheckpointHook', 'RandomStateHook',
    'SafeCheckpointHook', 'SampleKeyBatchSampler', 'SampleLoadError', 'SampleSeedingHook',
    'SeededSampleDataset', 'SkippedSamplesHook', 'amp_optim_wrapper_type',
    'check_annotation_formats', 'check_data', 'coco_annotation_problem', 'distributed_session',
    'find_missing_data', 'init_cpu_dist', 'init_distributed', 'prepare_cpu_distributed_cfg'
]
