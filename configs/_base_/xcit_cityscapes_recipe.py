# A recipe without released weights, not from the paper: XCiT on Cityscapes (19 classes), 80k
# iterations. Neither the XCiT paper nor facebookresearch/xcit trained or released Cityscapes
# models, and no result of these configs is claimed here.
#
# Shared by ./xcit_{sem_fpn,upernet}_80k_cityscapes.py. mmseg's own bases give the Cityscapes data
# (512x1024 crops of images resized by 0.5-2.0 x 2048x1024, cat_max_ratio 0.75, flip, photometric
# distortion; whole-image test at 2048x1024; IoUMetric mIoU; 2 images per GPU), the runtime and the
# 80k schedule; ./xcit_segmentation.py the XCiT pieces of the ADE20k recipe (backbone, AdamW 6e-5 /
# wd 0.01 with the released 'norm' decay rule, warm-up), put in place below. The learning rate is
# the ADE20k one, not tuned for Cityscapes.
_base_ = [
    'mmseg::_base_/datasets/cityscapes.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_80k.py',
    './xcit_segmentation.py',
]

# 2 images per GPU (mmseg's Cityscapes base) x 4 GPUs = 8, as mmseg's Cityscapes configs (4xb2).
auto_scale_lr = dict(enable=False, base_batch_size=8)

optimizer = dict(_delete_=True, **_base_.xcit_optimizer)
optim_wrapper = dict(_delete_=True, **_base_.xcit_optim_wrapper)
# The ADE20k recipe's warm-up and poly decay (power 1, overlapping the warm-up, see
# ./xcit_segmentation.py) over the 80k iterations of mmseg's schedule.
param_scheduler = [_base_.xcit_warmup] + [
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=0, end=80000 + 1, by_epoch=False)]

# What both task bases set on top of mmseg's model bases: XCiT-S12 (drop path 0.05, as the ADE20k
# S12 leaves) in place of the ResNet (whose `pretrained` is dropped: XCiT loads its ImageNet
# weights through backbone.init_cfg, set by the leaf configs); training batches padded to the crop
# size (as mmseg's Cityscapes configs); mmseg's EncoderDecoder with a whole-image prediction that
# never holds full-size logits of all classes, same labels (xcit_mm.models.segmentors;
# docs/lean_segmentation.md; test_cfg.lean=False gives the stock one); without a test_cfg.mode it
# runs each image whole wherever it fits the memory the process may use, else streams it, and logs
# which (test_cfg.mode='whole': stock's whole path).
xcit_cityscapes_segmentor = dict(
    type='LeanEncoderDecoder',
    data_preprocessor=dict(size=_base_.crop_size),
    pretrained=None,
    backbone=dict(_delete_=True, arch='s12', drop_path_rate=0.05, **_base_.xcit_backbone),
    test_cfg=dict(_delete_=True))
