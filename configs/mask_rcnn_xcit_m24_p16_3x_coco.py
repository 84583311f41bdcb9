# XCiT-M24/16 + Mask R-CNN (FPN), 3x schedule, COCO 2017 instance segmentation.
# Paper-reported (Table 5): 101.1M parameters, box AP 46.7, mask AP 42.0 (val2017).
# Released detector weights:
#   https://dl.fbaipublicfiles.com/xcit/coco/maskrcnn_xcit_medium_24_p16.pth
_base_ = ['./_base_/xcit_mask_rcnn_3x_coco.py']

# ImageNet-1k weights of XCiT-M24/16 (224 px) from the official model zoo.
pretrained = 'https://dl.fbaipublicfiles.com/xcit/xcit_medium_24_p16_224.pth'

model = dict(
    backbone=dict(
        arch='m24',
        patch_size=16,
        drop_path_rate=0.15,
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[512] * 4))
