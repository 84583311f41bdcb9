# XCiT + Semantic FPN on the built-in shapes world (ADE20k layout): the paper's Semantic FPN
# config, shrunk to train from scratch on a 2-core CPU. Results of the command below, on the 100
# held-out images: docs/results/shapes_sem_fpn.json (quoted in README).
#
#   python tools/train.py configs/shapes/sem_fpn_xcit_shapes_ade.py
#
# generates data/shapes_ade/ if it does not exist (shapes_world.generate_shapes), trains, and
# evaluates mIoU (mmseg IoUMetric) on the held-out validation images at the end.
#
# Background is a class here (label 0, as in Pascal VOC), not ignored as ADE20k's "other" is
# (reduce_zero_label): with background ignored the only signal is which shape a pixel belongs to,
# and from scratch neither this XCiT nor a ResNet-18 left chance level (mIoU ~0.2) within the
# budget; learning the object/background boundary first gives the features that tell the shapes
# apart (docs/shapes.md). IoUMetric prints the IoU of every class, background included.
#
# Read with mmseg's BaseSegDataset and ADE20k's suffixes (ADE20KDataset only accepts subsets of
# its 150 class names). Everything else not changed here (Semantic FPN structure, AdamW, the
# released weight-decay rule: no decay for names containing 'norm', IoUMetric) is the paper
# config's.
# The training extras are on (../_base_/training_extras.py, docs/training_extras.md).
_base_ = ['../sem_fpn_xcit_t12_p16_80k_ade20k.py', '../_base_/training_extras.py']
custom_imports = dict(
    imports=[
        'xcit_mm',
        'training_extras',
        'shapes_world.shapes_seg',
    ],
    allow_failed_imports=False)

# ---- data: the shapes world, ADE20k layout ------------------------------------------------------
data_root = 'data/shapes_ade/'
image_size = 160
crop_size = (image_size, image_size)
shapes_world = dict(
    root=data_root, task='ade', num_train=1000, num_val=100, image_size=image_size,
    seed=0, progress=True)
metainfo = dict(
    classes=('background', 'circle', 'square', 'triangle'),
    palette=[(0, 0, 0), (220, 20, 60), (0, 130, 255), (20, 200, 60)])

# ---- model: a small XCiT (from scratch), BN on one CPU process, 4 classes ------------------------
embed_dims = 128
norm_cfg = dict(type='BN', requires_grad=True)
data_preprocessor = dict(size=crop_size)
model = dict(
    data_preprocessor=data_preprocessor,
    backbone=dict(
        arch=dict(_delete_=True, embed_dims=embed_dims, depth=6, num_heads=4),
        patch_size=16,
        out_indices=(1, 2, 3, 5),
        norm_cfg=norm_cfg,
        # the trunk's own layout: the FPN and its head then convolve and upsample channels-last,
        # which is faster on CPU (docs/benchmark.md, "The shapes quick-start")
        out_channels_last=True,
        init_cfg=None),
    neck=dict(in_channels=[embed_dims] * 4, out_channels=64),
    decode_head=dict(
        in_channels=[64] * 4, channels=64, num_classes=4, norm_cfg=norm_cfg))

# ---- pipelines: the images already have their final size (no multi-scale / crop) ----------------
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=False),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=crop_size, keep_ratio=True),
    dict(type='LoadAnnotations', reduce_zero_label=False),
    dict(type='PackSegInputs'),
]
dataset = dict(
    # mmseg's BaseSegDataset that generates the shapes world at data_root if it is missing
    type='ShapesSegDataset',
    shapes_world=shapes_world,
    data_root=data_root,
    metainfo=metainfo,
    img_suffix='.jpg',
    seg_map_suffix='.png',
    reduce_zero_label=False)
train_dataloader = dict(
    batch_size=4,
    num_workers=0,
    persistent_workers=False,
    dataset=dict(
        **dataset,
        data_prefix=dict(img_path='images/training', seg_map_path='annotations/training'),
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=4,
    num_workers=0,
    persistent_workers=False,
    dataset=dict(
        **dataset,
        data_prefix=dict(img_path='images/validation', seg_map_path='annotations/validation'),
        pipeline=test_pipeline))
test_dataloader = val_dataloader

# ---- schedule: 2500 iterations (10 epochs), evaluated at the end ----------------------------
max_iters = 2500
train_cfg = dict(max_iters=max_iters, val_interval=max_iters)
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=False, begin=0, end=50),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=50, end=max_iters, by_epoch=False),
]
# fused=True: torch's one-kernel AdamW update (same arithmetic); the per-parameter loop of the
# default kernel was over a tenth of this small model's training step on CPU (docs/benchmark.md)
optim_wrapper = dict(optimizer=dict(lr=1e-3, fused=True))
default_hooks = dict(
    logger=dict(interval=100),
    checkpoint=dict(by_epoch=False, interval=max_iters, max_keep_ckpts=2),
    # mmseg's `tools/test.py --show-dir` draws every `interval`-th test batch (50 by default, more
    # than this test set has): draw each one (nothing is drawn without --show-dir or --show)
    visualization=dict(interval=1))
randomness = dict(seed=0)
