from .check_finite_loss_hook import CheckFiniteLossHook, NonFiniteLossError
from .compile_hook import CompileFeatureExtractorHook
from .portable_checkpoint_hook import PortableCheckpointHook
from .random_state_hook import RandomStateHook
from .safe_checkpoint_hook import AtomicCheckpointHook, CheckpointSaveError, SafeCheckpointHook
from .sample_seeding_hook import SampleSeedingHook, shutdown_dataloader_workers
from .skipped_samples_hook import SkippedSamplesHook

__all__ = [
    'AtomicCheckpointHook', 'CheckFiniteLossHook', 'CheckpointSaveError',
    'CompileFeatureExtractorHook', 'NonFiniteLossError', 'PortableCheckpointHook',
    'RandomStateHook', 'SafeCheckpointHook',
    'SampleSeedingHook', 'SkippedSamplesHook', 'shutdown_dataloader_workers'
]
