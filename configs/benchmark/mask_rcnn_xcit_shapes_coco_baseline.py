# Baseline of the shapes Mask R-CNN for benchmarks only: the config as it was before its CPU speed
# settings, i.e. mmdet's SingleRoIExtractor (mmcv's RoIAlign kernels) and torch's default AdamW
# kernel; same model and values (docs/benchmark.md, "The shapes quick-start").
_base_ = ['./mask_rcnn_xcit_shapes_coco_mmcv_roi_align.py']
optim_wrapper = dict(optimizer=dict(fused=None))
