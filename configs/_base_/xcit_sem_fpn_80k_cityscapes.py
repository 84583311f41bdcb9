# A recipe without released weights, not from the paper: XCiT-S12 + Semantic FPN, 80k iterations
# on Cityscapes (19 classes), the base of configs/sem_fpn_xcit_s12_p{16,8}_80k_cityscapes.py.
#
# mmseg's model base gives the Semantic FPN (FPN with 4 outputs + FPNHead, 128 channels);
# ./xcit_cityscapes_recipe.py the data, runtime, schedule, optimizer and the XCiT-S12 segmentor.
# Trained on 512x1024 crops, tested on the whole 2048x1024 image. The leaf configs add the patch
# size and the ImageNet weights.
_base_ = ['mmseg::_base_/models/fpn_r50.py', './xcit_cityscapes_recipe.py']

# FPN width 384, as the ADE20k S12 configs.
model = dict(
    neck=dict(in_channels=[384] * 4, out_channels=384, num_outs=4),
    decode_head=dict(in_channels=[384] * 4, channels=128, num_classes=19),
    **_base_.xcit_cityscapes_segmentor)
