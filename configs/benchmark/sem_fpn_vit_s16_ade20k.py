# ViT-S/16 (DeiT-S) + Semantic FPN: the ViT baseline of benchmarks/peak_memory.py, NOT a
# paper config (nothing here was trained or evaluated; the benchmark builds it with random
# weights). Everything is inherited from configs/sem_fpn_xcit_s12_p16_80k_ade20k.py (data
# preprocessor, FPN with 384 output channels and 4 outputs, FPNHead with 128 channels and 150
# classes, test pipeline) except the backbone and the neck chain.
#
# Backbone: mmseg's VisionTransformer with the DeiT-S settings of the backbone benchmark's
# `vit_s16` (benchmarks/xcit_benchmark/models.py): embed 384, depth 12, 6 heads, features after
# layers 3, 6, 9 and 12, all at stride 16. mmseg's MultiLevelNeck (scales 4, 2, 1, 0.5, as in
# mmseg's ViT UperNet configs) turns them into strides 4, 8, 16 and 32 for the same FPN.
_base_ = ['../sem_fpn_xcit_s12_p16_80k_ade20k.py']

vit_s16_backbone = dict(
    type='VisionTransformer',
    img_size=224,
    patch_size=16,
    embed_dims=384,
    num_layers=12,
    num_heads=6,
    mlp_ratio=4,
    out_indices=(2, 5, 8, 11),
    qkv_bias=True,
    with_cls_token=True,
    final_norm=False,
    interpolate_mode='bicubic',
    drop_path_rate=0.0,
    init_cfg=None)

model = dict(
    backbone=dict(_delete_=True, **vit_s16_backbone),
    # a list of necks is built as nn.Sequential: MultiLevelNeck, then the base's FPN
    neck=[
        dict(type='MultiLevelNeck', in_channels=[384] * 4, out_channels=384,
             scales=[4, 2, 1, 0.5]),
        dict(type='FPN', in_channels=[384] * 4, out_channels=384, num_outs=4),
    ])
