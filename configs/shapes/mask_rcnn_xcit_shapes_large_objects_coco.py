# Objects larger than a tile: the model of mask_rcnn_xcit_shapes_large_coco.py (same training,
# same weights) tested on held-out 640 x 640 scenes whose objects are the largest the training
# images hold (radius 32-40 px, 64-96 px across), so that LeanMaskRCNN's tiles of 64 px cut
# every one of them, and the stream's cores of 64 px are smaller than every one of them.
# The evidence of docs/lean_detection.md (whole image, stream, tiles; AP over all objects and over
# those whose box is wider or taller than a tile):
#
#   python tools/train.py configs/shapes/mask_rcnn_xcit_shapes_large_coco.py \
#       --work-dir work_dirs/shapes_large
#   python benchmarks/tiled_detection_accuracy.py \
#       configs/shapes/mask_rcnn_xcit_shapes_large_objects_coco.py \
#       work_dirs/shapes_large/iter_1200.pth --tiles 64:16 128:32 --stream 64:64 --larger-than 64 \
#       --figure docs/results/shapes_large_objects_modes.png \
#       --out docs/results/shapes_large_objects_modes
_base_ = ['./mask_rcnn_xcit_shapes_large_coco.py']

# the training images' largest radius is 0.25 of 160 px = 40 px: 0.0625 of 640 px
large_root = 'data/shapes_coco_large_objects/'
large_world = dict(
    root=large_root, task='coco', num_train=1, num_val=40, image_size=640, seed=2,
    objects_per_image=(8, 20), size_range=(0.05, 0.0625), progress=True)
test_dataloader = dict(
    dataset=dict(
        shapes_world=large_world,
        data_root=large_root))
test_evaluator = dict(ann_file=large_root + 'annotations/instances_val.json')
