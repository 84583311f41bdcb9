# XCiT-S12/8 + UperNet, 80k iterations, Cityscapes (19 classes), 512x1024 crops,
# whole-image test at 2048x1024. A recipe without released weights: not from the paper, not
# trained here, no result.
_base_ = ['./_base_/xcit_upernet_80k_cityscapes.py']

# ImageNet-1k initialisation as the ADE20k configs: the distilled 384-px XCiT-S12/8 weights.
pretrained = 'https://dl.fbaipublicfiles.com/xcit/xcit_small_12_p8_384_dist.pth'
model = dict(
    backbone=dict(patch_size=8, init_cfg=dict(type='Pretrained', checkpoint=pretrained)))
