# XCiT-S24/8 + UperNet, 160k iterations, ADE20k (150 classes), 512x512 crops.
# Paper-reported (Table 6): mIoU 48.1 (single scale, val).
# Released weights: https://dl.fbaipublicfiles.com/xcit/ade/upernet_xcit_small_24_p8.pth
_base_ = ['./_base_/xcit_upernet_160k_ade20k.py']

# ImageNet-1k weights of XCiT-S24/8 (224 px) from the official model zoo.
pretrained = 'https://dl.fbaipublicfiles.com/xcit/xcit_small_24_p8_224.pth'

model = dict(
    backbone=dict(
        arch='s24',
        patch_size=8,
        drop_path_rate=0.1,
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    decode_head=dict(in_channels=[384] * 4),
    auxiliary_head=dict(in_channels=384))
