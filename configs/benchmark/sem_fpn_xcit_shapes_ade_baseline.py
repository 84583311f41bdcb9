# Baseline of the shapes Semantic FPN for benchmarks only: the config as it was before its CPU
# speed settings, i.e. the backbone's contiguous NCHW outputs and torch's default AdamW kernel; same
# model and values (docs/benchmark.md, "The shapes quick-start").
_base_ = ['./sem_fpn_xcit_shapes_ade_nchw.py']
optim_wrapper = dict(optimizer=dict(fused=None))
