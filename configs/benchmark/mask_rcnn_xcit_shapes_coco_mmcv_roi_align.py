# Baseline of the shapes Mask R-CNN for benchmarks only: the same model with mmdet's
# SingleRoIExtractor (mmcv's RoIAlign kernels) instead of training_extras' GatherRoIExtractor; same
# values, so any difference is the RoI op's speed (docs/benchmark.md, "The shapes quick-start").
_base_ = ['../shapes/mask_rcnn_xcit_shapes_coco.py']
model = dict(
    roi_head=dict(
        bbox_roi_extractor=dict(type='SingleRoIExtractor'),
        mask_roi_extractor=dict(type='SingleRoIExtractor')))
