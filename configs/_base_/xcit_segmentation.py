# The XCiT pieces shared by the segmentation recipes: ./xcit_ade20k_recipe.py (paper Table 6) and
# ./xcit_cityscapes_recipe.py (a recipe without released weights). mmengine refuses a key defined
# by two bases of the same list, so what mmseg's model and schedule bases also define (backbone,
# optimizer, warm-up) is kept here under xcit_* names; the task bases put it in place.

# XCiTBackbone, the layer-decay pieces and the lean models; everything else is stock.
custom_imports = dict(imports=['xcit_mm'], allow_failed_imports=False)

# XCiT in place of the ResNet of mmseg's model bases; the leaf configs add arch, patch size, drop
# path and the ImageNet weights (backbone.init_cfg).
xcit_backbone = dict(
    type='XCiTBackbone',
    norm_cfg=dict(type='SyncBN', requires_grad=True),
    frozen_stages=-1,
    norm_eval=False)

# AdamW lr 6e-5, wd 0.01, exactly as released (mmseg 0.11 configs: custom_keys
# 'absolute_pos_embed' / 'relative_position_bias_table' / 'norm' with decay_mult 0). The first two
# match no parameter here, so: no weight decay for parameter names containing `norm` (the XCiT
# LayerNorms norm1/2/3), wd 0.01 for everything else -- XCA temperature, layer-scale gammas,
# biases, the BatchNorms named `bn` of the backbone and of the mmseg heads' ConvModules. See
# configs/_base_/xcit_mask_rcnn_3x_coco.py and docs/configs.md ("Weight decay", with the opt-in
# rule that also exempts BatchNorms, temperatures and gammas).
xcit_optimizer = dict(type='AdamW', lr=6e-05, betas=(0.9, 0.999), weight_decay=0.01)
xcit_optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=xcit_optimizer,
    clip_grad=None,
    paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.0)}))

# The released schedule (mmcv 1.x: `policy='poly', power=1.0, min_lr=0.0, warmup='linear',
# warmup_iters=1500, warmup_ratio=1e-6`): lr(t) = lr * (1 - t / max_iters) at iteration t, and
# during the warm-up (t < 1500) that poly-decayed lr times 1e-6 + (1 - 1e-6) * t / 1500. mmengine
# chains overlapping schedulers by multiplying their factors, so a LinearLR and a PolyLR that both
# begin at 0 give the same product; `end` is one past mmcv's count because mmengine's schedulers
# reach their final value at step end - 1 (the warm-up factor is 1 at t = 1500, the poly factor
# 1 / max_iters at the last iteration, as in mmcv). The task bases add the PolyLR.
xcit_warmup = dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500 + 1)
