# NOT FROM THE PAPER -- no result is claimed for this config. XCiT-S12/16 + UperNet 160k ADE20k
# (configs/upernet_xcit_s12_p16_160k_ade20k.py, the paper's recipe) with layer-wise learning-rate
# decay added, as in BEiT / MAE segmentation fine-tuning recipes; the XCiT paper and its released
# code train with one learning rate for all layers. Untuned: the paper's lr, schedule and weight
# decay are kept unchanged, and decay_rate=0.75 is a typical value of those recipes, not a
# searched one.
#
# Learning rate of a parameter: optimizer.lr (6e-5, under the schedule) x 0.75 ** (13 - depth);
# depth 0 = patch_embed / pos_embed, i + 1 = backbone.layers.{i}, 13 = the adapter (fpn1..fpn4),
# the decode head and the auxiliary head. The number of layers is read from the model, so for a
# 24-layer backbone (S24 / M24) inherit their paper config instead: only the base line changes.
# Weight decay is the paper's rule unchanged (the base custom_keys: no decay for names containing
# 'norm'). See docs/layer_decay.md: the group table logged at start, `lr` (= the heads' lr) and
# the per-depth `depth_{d}_lr` scalars.
_base_ = ['./upernet_xcit_s12_p16_160k_ade20k.py']

optim_wrapper = dict(
    constructor='XCiTLayerDecayOptimizerConstructor',
    # Merged with the base paramwise_cfg (custom_keys={'norm': dict(decay_mult=0.0)}).
    paramwise_cfg=dict(decay_rate=0.75))

# The per-depth learning rates in the log (train/depth_{d}_lr).
custom_hooks = [dict(type='LayerDecayLrHook')]
