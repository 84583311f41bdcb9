# A recipe without released weights, not from the paper: XCiT-S12 + UperNet, 80k iterations on
# Cityscapes (19 classes), the base of configs/upernet_xcit_s12_p{16,8}_80k_cityscapes.py.
#
# mmseg's model base gives UperNet (UPerHead 512 channels, pool scales (1, 2, 3, 6); auxiliary
# FCNHead on input index 2, 256 channels, loss weight 0.4); ./xcit_cityscapes_recipe.py the data,
# runtime, schedule, optimizer and the XCiT-S12 segmentor. Trained on 512x1024 crops, tested on
# the whole 2048x1024 image. The leaf configs add the patch size and the ImageNet weights.
_base_ = ['mmseg::_base_/models/upernet_r50.py', './xcit_cityscapes_recipe.py']

model = dict(
    decode_head=dict(in_channels=[384] * 4, channels=512, num_classes=19),
    auxiliary_head=dict(in_channels=384, in_index=2, num_classes=19),
    **_base_.xcit_cityscapes_segmentor)
