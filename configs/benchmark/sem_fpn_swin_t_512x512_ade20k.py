# Swin-T + Semantic FPN: the benchmark's Swin-T BASELINE for
# configs/sem_fpn_xcit_s12_p16_80k_ade20k.py, NOT a paper config (the XCiT paper reports no
# Swin-T Semantic FPN; nothing here was trained or evaluated). It exists only so that
#   benchmarks/benchmark.py --whole-model configs/sem_fpn_xcit_s12_p16_80k_ade20k.py \
#       configs/benchmark/sem_fpn_swin_t_512x512_ade20k.py --shape 512 512 --batch-size 2 ...
# compares the two backbones inside the SAME segmentor: everything is inherited from the XCiT-S12/16
# config (data preprocessor, FPN with 384 output channels and 4 outputs, FPNHead with 128
# channels and 150 classes, data, schedule) except the backbone and the FPN's input channels.
#
# Backbone: mmseg's SwinTransformer with the Swin-T settings of mmseg's own Swin configs
# (mmseg::_base_/models/upernet_swin.py + swin/swin-tiny-patch4-window7-in1k-pre_upernet_*.py:
# embed 96, depths 2,2,6,2, heads 3,6,12,24, window 7, drop path 0.3, no absolute position
# embedding). The benchmark drops the Pretrained init_cfg (random initialisation, nothing is
# downloaded) and uses its own AdamW step, so the inherited XCiT optimizer / schedule settings
# below are never used by it; they are not a Swin training recipe.
_base_ = ['../sem_fpn_xcit_s12_p16_80k_ade20k.py']

swin_t_checkpoint = 'https://download.openmmlab.com/mmsegmentation/v0.5/pretrain/swin/swin_tiny_patch4_window7_224_20220317-1cdeb081.pth'  # noqa

model = dict(
    backbone=dict(
        _delete_=True,
        type='SwinTransformer',
        pretrain_img_size=224,
        embed_dims=96,
        patch_size=4,
        window_size=7,
        mlp_ratio=4,
        depths=[2, 2, 6, 2],
        num_heads=[3, 6, 12, 24],
        strides=(4, 2, 2, 2),
        out_indices=(0, 1, 2, 3),
        qkv_bias=True,
        qk_scale=None,
        patch_norm=True,
        drop_rate=0.,
        attn_drop_rate=0.,
        drop_path_rate=0.3,
        use_abs_pos_embed=False,
        act_cfg=dict(type='GELU'),
        norm_cfg=dict(type='LN', requires_grad=True),
        init_cfg=dict(type='Pretrained', checkpoint=swin_t_checkpoint)),
    # Swin-T's four stages; the FPN's output width (384) and the decode head stay as in the base.
    neck=dict(in_channels=[96, 192, 384, 768]))
