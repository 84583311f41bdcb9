# The training extras (training_extras/, docs/training_extras.md) for any mmdet / mmseg config: add
# this file to the config's `_base_` list, as the quick-start jobs in configs/shapes/ do:
#
#   _base_ = ['../mask_rcnn_xcit_s12_p8_3x_coco.py', '../_base_/training_extras.py']
#
# It sets `custom_hooks` only (the paper configs and mmdet's / mmseg's runtime bases leave it
# unset; a config that sets its own writes `custom_hooks = _base_.custom_hooks + [...]`). The
# types are full import paths, so no `custom_imports` entry is needed:
#   - CheckFiniteLossHook: stop at the first NaN/inf loss on every rank, naming the iteration and
#     the loss terms;
#   - SampleSeedingHook: every training sample gets random numbers of its own, seeded by
#     (seed, rank, epoch, position), so --resume continues exactly with any num_workers /
#     persistent_workers; an unreadable sample is named (or skipped: on_bad_sample='skip');
#   - RandomStateHook: the Python / NumPy / torch random states of every rank travel in the
#     checkpoint and are restored on --resume;
#   - PortableCheckpointHook: checkpoints hold plain data only, so they open with torch's
#     weights_only loading even where xcit_mm's allow-list is not installed;
#   - AtomicCheckpointHook: the default CheckpointHook becomes a SafeCheckpointHook with the same
#     settings (the new checkpoint is written before the old one is deleted, by rename);
#   - CompileFeatureExtractorHook(follow_config=True): idle unless the config sets compile=True
#     (or compile=dict(torch.compile arguments)); then it compiles the feature extractor
#     (backbone + neck) instead of mmengine compiling the whole train step, which fails in the
#     optimizer step on torch 2.13 (docs/deployment.md).
custom_hooks = [
    dict(type='training_extras.CheckFiniteLossHook', interval=1),
    dict(type='training_extras.SampleSeedingHook'),
    dict(type='training_extras.RandomStateHook'),
    dict(type='training_extras.PortableCheckpointHook'),
    dict(type='training_extras.AtomicCheckpointHook'),
    dict(type='training_extras.CompileFeatureExtractorHook', follow_config=True),
]
