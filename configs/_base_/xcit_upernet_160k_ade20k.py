# XCiT + UperNet, 160k iterations on ADE20k (paper Table 6): the base of
# configs/upernet_xcit_*_160k_ade20k.py.
#
# mmseg's bases give UperNet (UPerHead 512 channels, pool scales (1, 2, 3, 6); auxiliary FCNHead on
# input index 2 with 256 channels and loss weight 0.4) and the 160k schedule;
# ./xcit_ade20k_recipe.py the data, runtime and the paper's optimizer. The leaf configs add arch,
# patch size, drop path, ImageNet weights and the head input widths [D] * 4 / D.
_base_ = [
    'mmseg::_base_/models/upernet_r50.py',
    'mmseg::_base_/schedules/schedule_160k.py',
    './xcit_ade20k_recipe.py',
]

data_preprocessor = dict(size=_base_.crop_size)
model = dict(
    # mmseg's EncoderDecoder with whole-image prediction that never holds full-size logits of
    # all classes, same labels (xcit_mm.models.segmentors; docs/lean_segmentation.md);
    # test_cfg.lean=False gives the stock predict.
    type='LeanEncoderDecoder',
    data_preprocessor=data_preprocessor,
    # The ResNet base sets `pretrained`; XCiT uses backbone.init_cfg instead.
    pretrained=None,
    backbone=dict(_delete_=True, **_base_.xcit_backbone),
    # decode_head.in_channels / auxiliary_head.in_channels: set by the leaf configs.
    decode_head=dict(channels=512, pool_scales=(1, 2, 3, 6), num_classes=150),
    auxiliary_head=dict(
        in_index=2, channels=256, num_classes=150, loss_decode=dict(loss_weight=0.4)),
    # No mode (mmseg's base sets 'whole'): LeanEncoderDecoder runs each image whole (stock's
    # labels) wherever it fits the memory the process may use, else streams it, and logs which;
    # test_cfg.mode='whole' is stock's whole path, test_cfg.max_memory (MB) sets the budget.
    test_cfg=dict(_delete_=True))

optimizer = dict(_delete_=True, **_base_.xcit_optimizer)
optim_wrapper = dict(_delete_=True, **_base_.xcit_optim_wrapper)
param_scheduler = [
    _base_.xcit_warmup,
    # Over the whole run, overlapping the warm-up, as released (see ./xcit_ade20k_recipe.py).
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=0, end=160000 + 1, by_epoch=False),
]
