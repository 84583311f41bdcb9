# XCiT + Mask R-CNN on the built-in shapes world (COCO layout): the paper's Mask R-CNN config,
# shrunk to train from scratch on a 2-core CPU. Results of the command below, on the 100 held-out
# images: docs/results/shapes_mask_rcnn.json (quoted in README).
#
#   python tools/train.py configs/shapes/mask_rcnn_xcit_shapes_coco.py
#
# generates data/shapes_coco/ if it does not exist (shapes_world.generate_shapes), trains, and
# evaluates box and mask AP (mmdet CocoMetric) on the held-out validation images at the end.
# Changed here: data, classes, image size (160 px), a small from-scratch XCiT (D=128, 6 layers, p8),
# narrower FPN and heads with GroupNorm (bbox head Shared4Conv1FC), fewer RoIs, lr 6e-4, a cosine
# schedule of 1200 iterations, and RoI features from training_extras' GatherRoIExtractor (mmcv's
# RoIAlign values, several times faster on CPU; docs/benchmark_shapes.md). Everything else (Mask
# R-CNN + FPN structure, AdamW, the released weight-decay rule: no decay for names containing
# 'norm', CocoDataset, CocoMetric) is the paper config's. See docs/shapes.md.
# The training extras are on (../_base_/training_extras.py, docs/training_extras.md).
_base_ = ['../mask_rcnn_xcit_t12_p16_3x_coco.py', '../_base_/training_extras.py']
custom_imports = dict(
    imports=[
        'xcit_mm',
        'training_extras',
        'training_extras.roi_heads',
        'shapes_world.shapes_coco',
    ],
    allow_failed_imports=False)

# ---- data: the shapes world, COCO layout --------------------------------------------------------
data_root = 'data/shapes_coco/'
image_size = 160
shapes_world = dict(
    root=data_root, task='coco', num_train=1000, num_val=100, image_size=image_size,
    seed=0, progress=True)
metainfo = dict(
    classes=('circle', 'square', 'triangle'),
    palette=[(220, 20, 60), (0, 130, 255), (20, 200, 60)])

# ---- model: a small XCiT (from scratch), BN on one CPU process, 3 classes ------------------------
embed_dims = 128
norm_cfg = dict(type='BN', requires_grad=True)
head_norm = dict(type='GN', num_groups=16, requires_grad=True)
model = dict(
    backbone=dict(
        arch=dict(_delete_=True, embed_dims=embed_dims, depth=6, num_heads=4),
        patch_size=8,
        out_indices=(1, 2, 3, 5),
        norm_cfg=norm_cfg,
        init_cfg=None),
    # Narrower FPN / heads and fewer RoIs: the CPU budget, not the task, sets these widths.
    # Training from scratch: GroupNorm in FPN and RoI heads (bbox head with 4 convs), as mmdet's
    # from-scratch Mask R-CNN recipe (configs/scratch/) does; without it the RoI heads diverge.
    neck=dict(in_channels=[embed_dims] * 4, out_channels=64, norm_cfg=head_norm),
    rpn_head=dict(in_channels=64, feat_channels=64),
    # RoIAlign as a weighted gather (GatherRoIExtractor): on this CPU mmcv's RoIAlign kernels were
    # the largest part of a training step after the backbone.
    roi_head=dict(
        bbox_roi_extractor=dict(
            type='GatherRoIExtractor', roi_layer=dict(sampling_ratio=2), out_channels=64),
        bbox_head=dict(
            type='Shared4Conv1FCBBoxHead',
            in_channels=64,
            conv_out_channels=64,
            fc_out_channels=256,
            norm_cfg=head_norm,
            num_classes=3),
        mask_roi_extractor=dict(
            type='GatherRoIExtractor', roi_layer=dict(sampling_ratio=2), out_channels=64),
        mask_head=dict(
            in_channels=64, conv_out_channels=64, norm_cfg=head_norm, num_classes=3)),
    train_cfg=dict(
        rpn_proposal=dict(nms_pre=600, max_per_img=200),
        rcnn=dict(sampler=dict(num=32))),
    test_cfg=dict(
        rpn=dict(nms_pre=600, max_per_img=200),
        rcnn=dict(max_per_img=30)))

# ---- pipelines: the images already have their final size (no multi-scale / crop) ----------------
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=(image_size, image_size), keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(image_size, image_size), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
train_dataloader = dict(
    batch_size=4,
    num_workers=0,
    persistent_workers=False,
    dataset=dict(
        # mmdet's CocoDataset that generates the shapes world at data_root if it is missing
        type='ShapesCocoDataset',
        shapes_world=shapes_world,
        data_root=data_root,
        metainfo=metainfo,
        ann_file='annotations/instances_train.json',
        data_prefix=dict(img='train/'),
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=4,
    num_workers=0,
    persistent_workers=False,
    dataset=dict(
        # mmdet's CocoDataset that generates the shapes world at data_root if it is missing
        type='ShapesCocoDataset',
        shapes_world=shapes_world,
        data_root=data_root,
        metainfo=metainfo,
        ann_file='annotations/instances_val.json',
        data_prefix=dict(img='val/'),
        pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/instances_val.json')
test_evaluator = val_evaluator

# ---- schedule: 1200 iterations, evaluated at the end -------------------------------------------
max_iters = 1200
train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters=max_iters,
                 val_interval=max_iters)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=50),
    dict(type='CosineAnnealingLR', T_max=max_iters - 50, eta_min_ratio=0.01,
         by_epoch=False, begin=50, end=max_iters),
]
# fused=True: torch's one-kernel AdamW update (same arithmetic); the per-parameter loop of the
# default kernel was over a tenth of this small model's training step on CPU (docs/benchmark.md)
optim_wrapper = dict(optimizer=dict(lr=6e-4, fused=True))
default_hooks = dict(
    logger=dict(interval=25),
    checkpoint=dict(by_epoch=False, interval=max_iters, max_keep_ckpts=2))
log_processor = dict(by_epoch=False, window_size=25)
randomness = dict(seed=0)
