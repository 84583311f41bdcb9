# xcit_mm's reliable-training runtime on mmengine's own Runner (docs/reliability.md).
#
# Add this file to the `_base_` list of any mmdet / mmseg config (ours include it); it only sets
# `custom_imports` and `custom_hooks`, which the upstream bases leave unset. Each hook is a
# registered piece of `xcit_mm.runtime`; without this file everything is stock mmengine:
#   - CheckFiniteLossHook: stop at the first NaN/inf loss on every rank, naming the iteration and
#     the loss terms;
#   - SampleSeedingHook: every training sample gets random numbers of its own, seeded by
#     (seed, rank, epoch, position), so --resume continues exactly with any num_workers /
#     persistent_workers; an unreadable sample is named (or skipped: on_bad_sample='skip');
#   - RandomStateHook: the Python / NumPy / torch random states of every rank travel in the
#     checkpoint and are restored on --resume;
#   - PortableCheckpointHook: checkpoints hold plain data only, so they open with torch's
#     weights_only loading in every upstream door (init_detector, DetInferencer, init_model,
#     MMSegInferencer, mmdet's / mmseg's tools) and keep their dataset_meta;
#   - CompileFeatureExtractorHook(follow_config=True): idle unless the config sets compile=True
#     (or compile=dict(torch.compile arguments)); then it compiles the feature extractor
#     (backbone + neck) instead of mmengine compiling the whole train step, which fails in the
#     optimizer step on torch 2.13 (docs/deployment.md).
# Atomic checkpoint files (new one written before the old one is deleted) come from
# `default_hooks = dict(checkpoint=dict(type='SafeCheckpointHook'))`, which the XCiT task bases
# set: mmengine refuses a key, such as default_hooks, defined by two bases of one list.
custom_imports = dict(imports=['xcit_mm', 'xcit_mm.runtime'], allow_failed_imports=False)
custom_hooks = [
    dict(type='CheckFiniteLossHook', interval=1),
    dict(type='SampleSeedingHook'),
    dict(type='RandomStateHook'),
    dict(type='PortableCheckpointHook'),
    dict(type='CompileFeatureExtractorHook', follow_config=True),
]
