# Shared recipe of the XCiT + Semantic FPN 80k ADE20k configs (paper Table 6).
#
# mmseg's own bases give the Semantic FPN model (FPN + FPNHead, 128 channels), the ADE20k data
# (512x512 crops of images resized by 0.5-2.0 x 2048x512, cat_max_ratio 0.75, flip, photometric
# distortion; whole-image test at 2048x512; IoUMetric mIoU), the runtime and the 80k schedule. This
# file changes what the paper's recipe changes; the leaf configs
# (configs/sem_fpn_xcit_*_80k_ade20k.py) add arch, patch size, drop path, ImageNet weights and the
# FPN width (384, T12: 192, M24: 512 as released).
_base_ = [
    'mmseg::_base_/models/fpn_r50.py',
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_80k.py',
]

custom_imports = dict(imports=['xcit_mm', 'xcit_mm.utils'], allow_failed_imports=False)
# Reliability (docs/reliability.md): stop at the first NaN/inf loss, naming the iteration and the
# loss terms (mmdet's CheckInvalidLossHook only exists in the mmdet scope and asserts every 50
# iterations without a message); save the random states in checkpoints so that --resume continues
# exactly as an uninterrupted run would.
custom_hooks = [dict(type='CheckFiniteLossHook', interval=1), dict(type='RandomStateHook')]

crop_size = (512, 512)
# Pads training batches to the crop size (mmseg's usual companion of the 512x512 ADE pipeline).
data_preprocessor = dict(size=crop_size)
model = dict(
    data_preprocessor=data_preprocessor,
    # The ResNet base sets `pretrained`, which EncoderDecoder would forward to the backbone; XCiT
    # loads its ImageNet weights through backbone.init_cfg instead.
    pretrained=None,
    backbone=dict(
        _delete_=True,
        type='XCiTBackbone',
        norm_cfg=dict(type='SyncBN', requires_grad=True),
        frozen_stages=-1,
        norm_eval=False),
    # neck.in_channels / neck.out_channels / decode_head.in_channels: set by the leaf configs.
    neck=dict(num_outs=4),
    decode_head=dict(channels=128, num_classes=150))

# AdamW lr 6e-5, wd 0.01, no decay on norm layers, the XCA temperature and the layer-scale gammas
# (see configs/_base_/xcit_mask_rcnn_3x_coco.py for why).
optimizer = dict(
    _delete_=True, type='AdamW', lr=6e-05, betas=(0.9, 0.999), weight_decay=0.01)
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=optimizer,
    clip_grad=None,
    paramwise_cfg=dict(
        norm_decay_mult=0.0,
        custom_keys={
            '.temperature': dict(decay_mult=0.0),
            '.gamma': dict(decay_mult=0.0),
        }))

# 1500 linear warm-up iterations (ratio 1e-6), then poly decay with power 1.0 down to 0.
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(
        type='PolyLR',
        eta_min=0.0,
        power=1.0,
        begin=1500,
        end=80000,
        by_epoch=False),
]

# 2 images per GPU x 8 GPUs = the paper's batch of 16.
train_dataloader = dict(batch_size=2)
val_dataloader = dict(batch_size=1)
test_dataloader = val_dataloader
auto_scale_lr = dict(enable=False, base_batch_size=16)
