# Baseline of the shapes Semantic FPN for benchmarks only: the same model with the backbone's
# default contiguous NCHW outputs instead of channels-last ones; same values, so any difference is
# the memory layout's speed (docs/benchmark.md, "The shapes quick-start").
_base_ = ['../shapes/sem_fpn_xcit_shapes_ade.py']
model = dict(backbone=dict(out_channels_last=False))
