# Shared recipe of the XCiT + UperNet 160k ADE20k configs (paper Table 6).
#
# mmseg's own bases give UperNet (UPerHead 512 channels, pool scales (1, 2, 3, 6); auxiliary
# FCNHead on input index 2 with 256 channels and loss weight 0.4), the ADE20k data (512x512 crops,
# whole-image 2048x512 test, IoUMetric mIoU), the runtime and the 160k schedule. This file changes
# what the paper's recipe changes; the leaf configs (configs/upernet_xcit_*_160k_ade20k.py) add
# arch, patch size, drop path, ImageNet weights and the head input widths [D] * 4 / D.
_base_ = [
    'mmseg::_base_/models/upernet_r50.py',
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_160k.py',
]

custom_imports = dict(imports=['xcit_mm', 'xcit_mm.utils'], allow_failed_imports=False)
# Reliability (docs/reliability.md): stop at the first NaN/inf loss, naming the iteration and the
# loss terms (mmdet's CheckInvalidLossHook only exists in the mmdet scope and asserts every 50
# iterations without a message); save the random states in checkpoints so that --resume continues
# exactly as an uninterrupted run would.
custom_hooks = [dict(type='CheckFiniteLossHook', interval=1), dict(type='RandomStateHook')]

crop_size = (512, 512)
data_preprocessor = dict(size=crop_size)
model = dict(
    data_preprocessor=data_preprocessor,
    # The ResNet base sets `pretrained`; XCiT uses backbone.init_cfg instead.
    pretrained=None,
    backbone=dict(
        _delete_=True,
        type='XCiTBackbone',
        norm_cfg=dict(type='SyncBN', requires_grad=True),
        frozen_stages=-1,
        norm_eval=False),
    # decode_head.in_channels / auxiliary_head.in_channels: set by the leaf configs.
    decode_head=dict(
        channels=512, pool_scales=(1, 2, 3, 6), num_classes=150),
    auxiliary_head=dict(
        in_index=2, channels=256, num_classes=150,
        loss_decode=dict(loss_weight=0.4)))

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
        end=160000,
        by_epoch=False),
]

# 2 images per GPU x 8 GPUs = the paper's batch of 16.
train_dataloader = dict(batch_size=2)
val_dataloader = dict(batch_size=1)
test_dataloader = val_dataloader
auto_scale_lr = dict(enable=False, base_batch_size=16)
