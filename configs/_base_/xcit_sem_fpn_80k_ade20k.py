# XCiT + Semantic FPN, 80k iterations on ADE20k (paper Table 6): the base of
# configs/sem_fpn_xcit_*_80k_ade20k.py.
#
# mmseg's bases give the Semantic FPN model (FPN + FPNHead, 128 channels) and the 80k schedule;
# ./xcit_ade20k_recipe.py the data, runtime and the paper's optimizer. The leaf configs add arch,
# patch size, drop path, ImageNet weights and the FPN width (384, T12: 192, M24: 512 as released).
_base_ = [
    'mmseg::_base_/models/fpn_r50.py',
    'mmseg::_base_/schedules/schedule_80k.py',
    './xcit_ade20k_recipe.py',
]

# Pads training batches to the crop size (mmseg's usual companion of the 512x512 ADE pipeline).
data_preprocessor = dict(size=_base_.crop_size)
model = dict(
    # mmseg's EncoderDecoder with whole-image prediction that never holds full-size logits of
    # all classes, same labels (xcit_mm.models.segmentors; docs/lean_segmentation.md);
    # test_cfg.lean=False gives the stock predict.
    type='LeanEncoderDecoder',
    data_preprocessor=data_preprocessor,
    # The ResNet base sets `pretrained`, which EncoderDecoder would forward to the backbone; XCiT
    # loads its ImageNet weights through backbone.init_cfg instead.
    pretrained=None,
    backbone=dict(_delete_=True, **_base_.xcit_backbone),
    # neck.in_channels / neck.out_channels / decode_head.in_channels: set by the leaf configs.
    neck=dict(num_outs=4),
    decode_head=dict(channels=128, num_classes=150),
    # No mode (mmseg's base sets 'whole'): LeanEncoderDecoder runs each image whole (stock's
    # labels) wherever it fits the memory the process may use, else streams it, and logs which;
    # test_cfg.mode='whole' is stock's whole path, test_cfg.max_memory (MB) sets the budget.
    test_cfg=dict(_delete_=True))

optimizer = dict(_delete_=True, **_base_.xcit_optimizer)
optim_wrapper = dict(_delete_=True, **_base_.xcit_optim_wrapper)
param_scheduler = [
    _base_.xcit_warmup,
    # Over the whole run, overlapping the warm-up, as released (see ./xcit_ade20k_recipe.py).
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=0, end=80000 + 1, by_epoch=False),
]
