# XCiT-T12/16 + Mask R-CNN (FPN), 3x schedule, COCO 2017 instance segmentation.
# Paper-reported (Table 5): 26.1M parameters, box AP 42.7, mask AP 38.5 (val2017).
# Released detector weights: https://dl.fbaipublicfiles.com/xcit/coco/maskrcnn_xcit_tiny_12_p16.pth
_base_ = ['./_base_/xcit_mask_rcnn_3x_coco.py']

# ImageNet-1k initialisation as released: the official README's training command
# (facebookresearch/xcit detection/README.md) starts from the distilled 384-px weights
# (S12/16: model.pretrained=.../xcit_small_12_p16_384_dist.pth); here those of XCiT-T12/16.
# For the 224-px ImageNet-1k weights (not distilled) instead, add `--cfg-options
# model.backbone.init_cfg.checkpoint=https://dl.fbaipublicfiles.com/xcit/xcit_tiny_12_p16_224.pth`
pretrained = 'https://dl.fbaipublicfiles.com/xcit/xcit_tiny_12_p16_384_dist.pth'

model = dict(
    backbone=dict(
        arch='t12',
        patch_size=16,
        drop_path_rate=0.0,
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[192] * 4))
