# XCiT + Semantic FPN on the high-resolution shapes world (Cityscapes layout, 1024x2048): trains on
# 256x256 crops, tests on the whole image (LeanEncoderDecoder, mode='stream': the trunk layer by
# layer and every map in bands of rows of test_cfg.band_mb). The quick-start segmentor (./sem_fpn_xcit_shapes_ade.py:
# small XCiT from scratch, training extras) on another world; results of the whole image against
# sliding windows (two seeds): docs/shapes.md and docs/results/shapes_hires_sem_fpn.json, from
#
#   python tools/analysis_tools/shapes_hires_job.py --seeds 0 1
#
# (train, then tools/test.py whole-image and with --cfg-options model.test_cfg.mode=slide
# model.test_cfg.band_mb=None model.test_cfg.crop_size=(256,256) model.test_cfg.stride=(192,192),
# each in its own process). `python tools/train.py configs/shapes/sem_fpn_xcit_shapes_cityscapes.py`
# alone generates data/shapes_cityscapes/ if missing, trains and evaluates whole-image at the end.
#
# The world (shapes_world.draw_hires_image): the class is context. One shape per image, 500-850 px
# across, filled with a flat grey, on a striped scene whose hues tell the class (red circle, green
# square, blue triangle). A 256x256 window inside the shape sees grey only; the whole image sees
# the scene.
_base_ = ['./sem_fpn_xcit_shapes_ade.py']

data_root = 'data/shapes_cityscapes/'
image_size = (1024, 2048)
crop_size = (256, 256)
shapes_world = dict(
    root=data_root, task='cityscapes', num_train=60, num_val=20,
    image_size=image_size, seed=0, objects_per_image=(1, 1), size_range=(0.28, 0.41),
    progress=True)

data_preprocessor = dict(size=crop_size)
model = dict(
    data_preprocessor=data_preprocessor,
    # the whole image streamed in bands of about 4 MB (equal to the whole maps up to float
    # rounding); slide: --cfg-options model.test_cfg.mode=slide
    # model.test_cfg.band_mb=None model.test_cfg.crop_size=(256,256) model.test_cfg.stride=(192,192)
    test_cfg=dict(mode='stream', band_mb=4))

# ---- pipelines: random scale 0.25-1x of 1024x2048, 256x256 crops; test at 1x (scale_factor) ----
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=False),
    dict(type='RandomResize', scale=(image_size[1], image_size[0]), ratio_range=(0.25, 1.0),
         keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    # the resolution curve changes this factor (tools/analysis_tools/shapes_hires_job.py)
    dict(type='Resize', scale=None, scale_factor=1.0, keep_ratio=True),
    dict(type='LoadAnnotations', reduce_zero_label=False),
    dict(type='PackSegInputs'),
]
dataset = dict(
    _delete_=True,
    # mmseg's BaseSegDataset with Cityscapes' suffixes, generating the world if missing
    type='ShapesCityscapesDataset',
    shapes_world=shapes_world,
    data_root=data_root)
train_dataloader = dict(
    batch_size=4,
    dataset=dict(
        **dataset,
        data_prefix=dict(img_path='leftImg8bit/train', seg_map_path='gtFine/train'),
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=1,
    dataset=dict(
        **dataset,
        data_prefix=dict(img_path='leftImg8bit/val', seg_map_path='gtFine/val'),
        pipeline=test_pipeline))
test_dataloader = val_dataloader

# ---- schedule: the ADE job's warm-up and poly decay, over 800 iterations ------------------------
max_iters = 800
train_cfg = dict(max_iters=max_iters, val_interval=max_iters)
param_scheduler = [_base_.param_scheduler[0], dict(_base_.param_scheduler[1], end=max_iters)]
default_hooks = dict(logger=dict(interval=50), checkpoint=dict(interval=max_iters))
