# The XCiT ADE20k recipe (paper Table 6) shared by the Semantic FPN 80k and UperNet 160k bases.
#
# mmseg's own bases give the ADE20k data (512x512 crops of images resized by 0.5-2.0 x 2048x512,
# cat_max_ratio 0.75, flip, photometric distortion; whole-image test at 2048x512; IoUMetric mIoU)
# and the runtime. mmengine refuses a key defined by two bases of the same list, so the pieces that
# the model and schedule bases also define (backbone, optimizer, warm-up) are kept here under
# xcit_* names, and configs/_base_/xcit_{sem_fpn_80k,upernet_160k}_ade20k.py put them in place.
_base_ = [
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
]

custom_imports = dict(imports=['xcit_mm'], allow_failed_imports=False)
# Safe and strict checkpoint loading (load_from, --resume, evaluating a released XCiT file as
# downloaded), with our tools and upstream mmdet/mmseg tools alike: xcit_mm.engine.XCiTRunner.
runner_type = 'XCiTRunner'
# Reliability (docs/reliability.md): stop at the first NaN/inf loss, naming the iteration and the
# loss terms (mmdet's CheckInvalidLossHook only exists in the mmdet scope and asserts every 50
# iterations without a message); save the random states in checkpoints so that --resume continues
# exactly as an uninterrupted run would.
custom_hooks = [dict(type='CheckFiniteLossHook', interval=1), dict(type='RandomStateHook')]

# 2 images per GPU x 8 GPUs = the paper's batch of 16.
train_dataloader = dict(batch_size=2)
val_dataloader = dict(batch_size=1)
test_dataloader = val_dataloader
auto_scale_lr = dict(enable=False, base_batch_size=16)

# XCiT in place of the ResNet of mmseg's model bases; the leaf configs add arch, patch size, drop
# path and the ImageNet weights (backbone.init_cfg).
xcit_backbone = dict(
    type='XCiTBackbone',
    norm_cfg=dict(type='SyncBN', requires_grad=True),
    frozen_stages=-1,
    norm_eval=False)

# AdamW lr 6e-5, wd 0.01, no decay on norm layers, the XCA temperature and the layer-scale gammas
# (see configs/_base_/xcit_mask_rcnn_3x_coco.py for why).
xcit_optimizer = dict(type='AdamW', lr=6e-05, betas=(0.9, 0.999), weight_decay=0.01)
xcit_optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=xcit_optimizer,
    clip_grad=None,
    paramwise_cfg=dict(
        norm_decay_mult=0.0,
        custom_keys={
            '.temperature': dict(decay_mult=0.0),
            '.gamma': dict(decay_mult=0.0),
        }))

# 1500 linear warm-up iterations (ratio 1e-6); the task bases follow it with a poly decay (power
# 1.0, down to 0) to the end of their schedule.
xcit_warmup = dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500)
