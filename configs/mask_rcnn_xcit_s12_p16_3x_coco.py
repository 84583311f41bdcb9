# XCiT-S12/16 + Mask R-CNN (FPN), 3x schedule, COCO 2017 instance segmentation.
# Paper-reported (Table 5): 44.3M parameters, box AP 45.3, mask AP 40.8 (val2017).
# Released detector weights: https://dl.fbaipublicfiles.com/xcit/coco/maskrcnn_xcit_small_12_p16.pth
_base_ = ['./_base_/xcit_mask_rcnn_3x_coco.py']

# ImageNet-1k weights of XCiT-S12/16 (224 px) from the official model zoo.
pretrained = 'https://dl.fbaipublicfiles.com/xcit/xcit_small_12_p16_224.pth'

model = dict(
    backbone=dict(
        arch='s12',
        patch_size=16,
        drop_path_rate=0.05,
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[384] * 4))
