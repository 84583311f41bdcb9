# Shared recipe of the XCiT + Mask R-CNN (FPN) 3x COCO configs (paper Table 5).
#
# Everything that is not XCiT-specific comes from mmdet's own base configs (model, COCO 2017
# instance data with CocoMetric bbox + segm on val2017, runtime); this file only states where the
# paper's recipe differs from them. The leaf configs (configs/mask_rcnn_xcit_*_3x_coco.py) add the
# per-architecture settings: arch, patch size, drop-path rate, ImageNet weights, FPN input width.
#
# Recipe (paper Sec. 4 / App. B.2 and the released mmdet 2.11 configs):
#   - backbone: columnar XCiT, features after layers (4, 6, 8, 12) / (8, 12, 16, 24) rescaled to
#     strides 4/8/16/32 by the adapter; SyncBN in patch embedding, LPI and adapter (as released).
#   - FPN(in=[D]*4, out 256, 5 outputs), RoI extractors on strides [4, 8, 16, 32] (mmdet default).
#   - AdamW lr 1e-4, wd 0.05, no decay for parameter names containing `norm` (the released
#     custom_keys); 36 epochs, lr x0.1 after epochs 27 and 33, 500 linear warm-up iterations;
#     16 images per batch (8 GPUs x 2).
#   - ImageNet initialisation (leaf configs): the 384-px distilled weights of each model, as the
#     official README's training command.
#   - DETR-style multi-scale training augmentation; single-scale 1333x800 test.
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    'mmdet::_base_/datasets/coco_instance.py',
    'mmdet::_base_/schedules/schedule_1x.py',
    'mmdet::_base_/default_runtime.py',
]
# XCiTBackbone, the layer-decay pieces and the lean models; everything else is stock.
custom_imports = dict(imports=['xcit_mm'], allow_failed_imports=False)


model = dict(
    # mmdet's MaskRCNN whose predict frees feature maps as soon as they are used, same boxes,
    # labels, scores and masks (xcit_mm.models.detectors; docs/lean_segmentation.md);
    # test_cfg.lean=False gives the stock predict. Training is MaskRCNN's.
    type='LeanMaskRCNN',
    backbone=dict(
        # Replace the ResNet-50 settings of the base model entirely.
        _delete_=True,
        type='XCiTBackbone',
        # arch / patch_size / drop_path_rate / init_cfg are set by each leaf config.
        norm_cfg=dict(type='SyncBN', requires_grad=True),
        frozen_stages=-1,
        norm_eval=False),
    # Leaf configs set neck.in_channels = [D] * 4. The base model's RoI extractors already use
    # featmap_strides [4, 8, 16, 32], which matches the adapter's output strides.
)

# DETR / Sparse R-CNN multi-scale augmentation (same policy as the released XCiT and Swin 3x
# configs): flip, then either a multi-scale resize (short side 480..800 step 32, long side <= 1333)
# or resize to 400/500/600 + random crop 384..600 + multi-scale resize.
_multi_scales = [(480, 1333), (512, 1333), (544, 1333), (576, 1333),
                 (608, 1333), (640, 1333), (672, 1333), (704, 1333),
                 (736, 1333), (768, 1333), (800, 1333)]
train_pipeline = [
    dict(type='LoadImageFromFile', backend_args={{_base_.backend_args}}),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='RandomFlip', prob=0.5),
    dict(
        type='RandomChoice',
        transforms=[
            [dict(type='RandomChoiceResize', scales=_multi_scales, keep_ratio=True)],
            [
                dict(type='RandomChoiceResize',
                     scales=[(400, 1333), (500, 1333), (600, 1333)],
                     keep_ratio=True),
                dict(type='RandomCrop',
                     crop_type='absolute_range',
                     crop_size=(384, 600),
                     allow_negative_crop=True),
                dict(type='RandomChoiceResize', scales=_multi_scales, keep_ratio=True),
            ],
        ]),
    dict(type='PackDetInputs'),
]
# 2 images per GPU x 8 GPUs = the paper's batch of 16.
train_dataloader = dict(batch_size=2, dataset=dict(pipeline=train_pipeline))

# 3x schedule: 36 epochs, steps at 27 and 33, 500 linear warm-up iterations (ratio 0.001), as
# released (mmcv 1.x: lr x (0.001 + 0.999 * t / 500) at iteration t < 500, x 1 from t = 500 on).
# mmengine's LinearLR reaches its final factor at step end - 1, hence end=501 for the same values.
max_epochs = 36
train_cfg = dict(max_epochs=max_epochs)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=500 + 1),
    dict(
        type='MultiStepLR',
        begin=0,
        end=max_epochs,
        by_epoch=True,
        milestones=[27, 33],
        gamma=0.1),
]

# AdamW exactly as released (mmdet 2.11 configs: `paramwise_cfg=dict(custom_keys={
# 'absolute_pos_embed': ..., 'relative_position_bias_table': ..., 'norm': dict(decay_mult=0.)})`,
# taken over from Swin). The first two keys match no parameter of this model (XCiT has neither),
# so the rule is: no weight decay for parameter names containing `norm` -- the LayerNorms
# norm1/norm2/norm3 of the XCiT layers -- and wd 0.05 for everything else, including the XCA
# temperature, the layer-scale gammas, all biases and the BatchNorms named `bn` (patch embedding,
# LPI; the adapter's `fpn1.1` has no `norm` in its name either). mmcv 1.x and mmengine match
# custom_keys the same way (substring of the full parameter name). docs/configs.md ("Weight
# decay") shows an opt-in paramwise_cfg that also exempts BatchNorms, temperatures and gammas.
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(
        _delete_=True,
        type='AdamW',
        lr=0.0001,
        betas=(0.9, 0.999),
        weight_decay=0.05),
    paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.0)}))

# Learning rate is for 16 images per batch; enable with --auto-scale-lr when training on fewer.
auto_scale_lr = dict(enable=False, base_batch_size=16)

# One checkpoint per epoch as upstream, but keep only the last 3 (each is ~0.3-1.2 GB).
default_hooks = dict(checkpoint=dict(interval=1, max_keep_ckpts=3))
