# XCiT + Semantic 64 on the built-in shapes world (ADE20k layout): the paper's Semantic 64
# config, shrunk to train from scratch on a 2-core CPU in a few minutes and still learn.
#
#   python tools/train.py configs/shapes/sem_fpn_xcit_shapes_ade.py
#
# generates data/shapes_ade/ if it does not exist (xcit_mm.datasets.generate_shapes), trains, and
# evaluates mIoU (mmseg IoUMetric) on the held-out validation images at the end. Label maps follow
# ADE20k's convention (0 = background/"other", ignored via reduce_zero_label; 1..3 = the classes),
# read by mmseg's BaseSegDataset with ADE20k's suffixes and a 3-class metainfo (ADE20KDataset itself
# only accepts subsets of its 150 class names). Everything else not changed here (Semantic 64
# structure, AdamW, no decay on norms/temperature/gammas, poly schedule, IoUMetric) is the paper
# config's. See docs/shapes.md.
_base_ = ['../sem_fpn_xcit_t12_p16_80k_ade20k.py']

# ---- data: the shapes world, ADE20k layout ------------------------------------------------------
data_root = 'data/shapes_ade/'
image_size = 160
crop_size = (image_size, image_size)
shapes_world = dict(
    root=data_root, task='ade', num_train=1000, num_val=100, image_size=image_size,
    seed=0, progress=True)
metainfo = dict(
    classes=('circle', 'square', 'triangle'),
    palette=[(220, 20, 60), (0, 130, 255), (20, 200, 60)])

# ---- model: a small XCiT (from scratch), BN on one CPU process, 3 classes ------------------------
embed_dims = 128
norm_cfg = dict(type='BN', requires_grad=True)
data_preprocessor = dict(size=crop_size)
model = dict(
    data_preprocessor=data_preprocessor,
    backbone=dict(
        arch=dict(_delete_=True, embed_dims=embed_dims, depth=6, num_heads=4),
        patch_size=16,
        out_indices=(1,2,3,5),
        norm_cfg=norm_cfg,
        init_cfg=None),
    neck=dict(in_channels=[embed_dims] * 4, out_channels=64),
    decode_head=dict(
        in_channels=[64] * 4, channels=64, num_classes=3, norm_cfg=norm_cfg))

# ---- pipelines: the images already have their final size (no multi-scale / crop) ----------------
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=crop_size, keep_ratio=True),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs'),
]
dataset = dict(
    type='BaseSegDataset',
    data_root=data_root,
    metainfo=metainfo,
    img_suffix='.jpg',
    seg_map_suffix='.png',
    reduce_zero_label=True)
train_dataloader = dict(
    batch_size=4,
    num_workers=0,
    persistent_workers=0 > 0,
    dataset=dict(
        **dataset,
        data_prefix=dict(img_path='images/training', seg_map_path='annotations/training'),
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=4,
    num_workers=0,
    persistent_workers=0 > 0,
    dataset=dict(
        **dataset,
        data_prefix=dict(img_path='images/validation', seg_map_path='annotations/validation'),
        pipeline=test_pipeline))
test_dataloader = val_dataloader

# ---- schedule: 600 iterations, evaluated at the end --------------------------------------------
max_iters = 600
train_cfg = dict(max_iters=max_iters, val_interval=max_iters)
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=False, begin=0, end=50),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=50, end=max_iters, by_epoch=False),
]
optim_wrapper = dict(optimizer=dict(lr=2e-4))
default_hooks = dict(
    logger=dict(interval=25),
    checkpoint=dict(by_epoch=False, interval=max_iters, max_keep_ckpts=1))
randomness = dict(seed=0)
