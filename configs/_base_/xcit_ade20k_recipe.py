# The XCiT ADE20k recipe (paper Table 6) shared by the Semantic FPN 80k and UperNet 160k bases.
#
# mmseg's own bases give the ADE20k data (512x512 crops of images resized by 0.5-2.0 x 2048x512,
# cat_max_ratio 0.75, flip, photometric distortion; whole-image test at 2048x512; IoUMetric mIoU)
# and the runtime; ./xcit_segmentation.py the pieces it shares with the Cityscapes recipe (the
# xcit_mm import, backbone, optimizer and warm-up, explained there) under xcit_* names, which
# configs/_base_/xcit_{sem_fpn_80k,upernet_160k}_ade20k.py put in place.
_base_ = [
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    './xcit_segmentation.py',
]

# 2 images per GPU x 8 GPUs = the paper's batch of 16.
train_dataloader = dict(batch_size=2)
val_dataloader = dict(batch_size=1)
test_dataloader = val_dataloader
auto_scale_lr = dict(enable=False, base_batch_size=16)
