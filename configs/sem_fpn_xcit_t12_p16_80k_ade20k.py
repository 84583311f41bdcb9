# XCiT-T12/16 + Semantic FPN, 80k iterations, ADE20k (150 classes), 512x512 crops.
# Paper-reported (Table 6): mIoU 38.1 (single scale, val).
# Released weights: https://dl.fbaipublicfiles.com/xcit/ade/sem_fpn_xcit_tiny_12_p16.pth
_base_ = ['./_base_/xcit_sem_fpn_80k_ade20k.py']

# ImageNet-1k initialisation as released: the official README's training command
# (facebookresearch/xcit semantic_segmentation/README.md) starts from the distilled 384-px weights
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
    # FPN width 192 as released (T12: 192).
    neck=dict(in_channels=[192] * 4, out_channels=192),
    decode_head=dict(in_channels=[192] * 4))
