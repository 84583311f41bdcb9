# XCiT-M24/8 + UperNet, 160k iterations, ADE20k (150 classes), 512x512 crops.
# Paper-reported (Table 6): mIoU 48.4 (single scale, val).
# Released weights: https://dl.fbaipublicfiles.com/xcit/ade/upernet_xcit_medium_24_p8.pth
_base_ = ['./_base_/xcit_upernet_160k_ade20k.py']

# ImageNet-1k initialisation as released: the official README's training command
# (facebookresearch/xcit semantic_segmentation/README.md) starts from the distilled 384-px weights
# (S12/16: model.pretrained=.../xcit_small_12_p16_384_dist.pth); here those of XCiT-M24/8.
# For the 224-px ImageNet-1k weights (not distilled) instead, add `--cfg-options
# model.backbone.init_cfg.checkpoint=https://dl.fbaipublicfiles.com/xcit/xcit_medium_24_p8_224.pth`
pretrained = 'https://dl.fbaipublicfiles.com/xcit/xcit_medium_24_p8_384_dist.pth'

model = dict(
    backbone=dict(
        arch='m24',
        patch_size=8,
        drop_path_rate=0.15,
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    decode_head=dict(in_channels=[512] * 4),
    auxiliary_head=dict(in_channels=512))
