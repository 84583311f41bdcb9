# Large scenes in the shapes world: Mask R-CNN trained on the 160 px images (crops of a scene, in
# effect) and tested on held-out 640 x 640 scenes drawn at the training scale, each with many
# objects, the largest of them wider than the tiles of LeanMaskRCNN's mode='tiles' overlap.
# The evidence of docs/lean_detection.md (whole image, stream, tiles):
#
#   python tools/train.py configs/shapes/mask_rcnn_xcit_shapes_large_coco.py \
#       --work-dir work_dirs/shapes_large
#   python benchmarks/tiled_detection_accuracy.py configs/shapes/mask_rcnn_xcit_shapes_large_coco.py \
#       work_dirs/shapes_large/iter_1200.pth --tiles 128:32 --stream 128:64 \
#       --figure docs/results/shapes_large_modes.png --out docs/results/shapes_large_modes
#
# Changed from mask_rcnn_xcit_shapes_coco.py: the FPN has no GroupNorm (the paper config's FPN,
# whose maps the stream makes band by band; the RoI heads keep theirs), and the test scenes.
_base_ = ['./mask_rcnn_xcit_shapes_coco.py']

model = dict(neck=dict(norm_cfg=None))

# ---- test: 640 x 640 scenes, objects of the training images' size in pixels ------------------------
# the training images' radii are 0.08-0.25 of 160 px: 0.02-0.0625 of 640 px
large_root = 'data/shapes_coco_large/'
scene_size = 640
large_world = dict(
    root=large_root, task='coco', num_train=1, num_val=40, image_size=scene_size, seed=1,
    objects_per_image=(16, 48), size_range=(0.02, 0.0625), progress=True)
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(scene_size, scene_size), keep_ratio=True),  # as drawn
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
test_dataloader = dict(
    batch_size=1,
    dataset=dict(
        shapes_world=large_world,
        data_root=large_root,
        ann_file='annotations/instances_val.json',
        data_prefix=dict(img='val/'),
        pipeline=test_pipeline))
test_evaluator = dict(ann_file=large_root + 'annotations/instances_val.json')
# many objects a scene: up to 48 drawn, mmdet's per-image limits above them
model.update(test_cfg=dict(rcnn=dict(max_per_img=100)))
