# XCiT-S24/8 + Semantic FPN, 80k iterations, ADE20k (150 classes), 512x512 crops.
# Paper-reported (Table 6): mIoU 47.1 (single scale, val).
# Released weights: https://dl.fbaipublicfiles.com/xcit/ade/sem_fpn_xcit_small_24_p8.pth
_base_ = ['./_base_/xcit_sem_fpn_80k_ade20k.py']

# ImageNet-1k weights of XCiT-S24/8 (224 px) from the official model zoo.
pretrained = 'https://dl.fbaipublicfiles.com/xcit/xcit_small_24_p8_224.pth'

model = dict(
    backbone=dict(
        arch='s24',
        patch_size=8,
        drop_path_rate=0.1,
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    # FPN width 384 as released (S12/S24: 384).
    neck=dict(in_channels=[384] * 4, out_channels=384),
    decode_head=dict(in_channels=[384] * 4))
