"""Released COCO / ADE20k XCiT files, built in the exact layouts of the official detection/ and
semantic_segmentation/ code (mmdet 2.11 / mmseg 0.11) from an independent reference
(tests/xcit_reference.py): shared by tests/test_released_models.py and test_upstream_doors.py.
"""
import os.path as osp
from collections import OrderedDict

import torch
from mmengine.config import Config
from mmengine.registry import init_default_scope
from xcit_reference import OfficialDenseXCiT, mmpretrain_trunk

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
D, DEPTH, HEADS = 64, 4, 4
SMALL_BACKBONE = dict(arch=dict(embed_dims=D, depth=DEPTH, num_heads=HEADS),
                      out_indices=(0, 1, 2, 3), norm_cfg=dict(type='BN', requires_grad=True),
                      init_cfg=None)

# Names the released files use for the neck and heads (mmdet 2.11 / mmseg 0.11), by hand.
RELEASED_HEAD_KEYS = {
    'mask_rcnn': [
        'neck.lateral_convs.0.conv.weight', 'neck.fpn_convs.3.conv.bias',
        'rpn_head.rpn_conv.weight', 'rpn_head.rpn_cls.weight', 'rpn_head.rpn_reg.bias',
        'roi_head.bbox_head.shared_fcs.0.weight', 'roi_head.bbox_head.shared_fcs.1.bias',
        'roi_head.bbox_head.fc_cls.weight', 'roi_head.bbox_head.fc_reg.weight',
        'roi_head.mask_head.convs.3.conv.weight', 'roi_head.mask_head.upsample.weight',
        'roi_head.mask_head.conv_logits.weight'],
    'sem_fpn': [
        'neck.lateral_convs.0.conv.weight', 'neck.fpn_convs.3.conv.weight',
        'decode_head.scale_heads.0.0.conv.weight', 'decode_head.scale_heads.3.2.bn.running_var',
        'decode_head.conv_seg.weight'],
    'upernet': [
        'decode_head.psp_modules.3.1.conv.weight', 'decode_head.bottleneck.bn.running_mean',
        'decode_head.lateral_convs.0.conv.weight', 'decode_head.fpn_convs.2.conv.weight',
        'decode_head.fpn_bottleneck.conv.weight', 'decode_head.conv_seg.weight',
        'auxiliary_head.convs.0.conv.weight', 'auxiliary_head.conv_seg.bias'],
}
PAPER_CONFIG = {
    'mask_rcnn': 'configs/mask_rcnn_xcit_t12_p{p}_3x_coco.py',
    'sem_fpn': 'configs/sem_fpn_xcit_t12_p{p}_80k_ade20k.py',
    'upernet': 'configs/upernet_xcit_t12_p{p}_160k_ade20k.py',
}


def small_model_cfg(family: str, patch_size: int) -> Config:
    """The paper config of ``family`` with a small trunk (D=64, 4 layers), neck and heads as wide
    as the trunk (the released layouts' names do not depend on the widths; the files' size and
    the tests' time do), and BN for SyncBN."""
    cfg = Config.fromfile(osp.join(REPO, PAPER_CONFIG[family].format(p=patch_size)))
    cfg.model.backbone.update(SMALL_BACKBONE, patch_size=patch_size)
    cfg.model.backbone.arch = dict(SMALL_BACKBONE['arch'])
    if family == 'upernet':  # the configs' structure, narrower (512 / 256 channels there)
        cfg.model.decode_head.update(in_channels=[D] * 4, channels=D)
        cfg.model.auxiliary_head.update(in_channels=D, channels=D // 2)
    else:  # an FPN neck of 256 channels there
        cfg.model.neck.update(in_channels=[D] * 4, out_channels=D)
    if family == 'mask_rcnn':  # 1024-wide fcs there
        roi = cfg.model.roi_head
        cfg.model.rpn_head.update(in_channels=D, feat_channels=D)
        roi.bbox_roi_extractor.out_channels = roi.mask_roi_extractor.out_channels = D
        roi.bbox_head.update(in_channels=D, fc_out_channels=2 * D)
        roi.mask_head.update(in_channels=D, conv_out_channels=D)
    if family == 'sem_fpn':
        cfg.model.decode_head.in_channels = [D] * 4
    for module in (cfg.model.get('decode_head'), cfg.model.get('auxiliary_head')):
        if module is not None:
            module.norm_cfg = dict(type='BN', requires_grad=True)
    return cfg


def build(cfg_model, scope):
    init_default_scope(scope)
    from mmengine.registry import MODELS
    return MODELS.build(cfg_model)


def _scope(family):
    return 'mmdet' if family == 'mask_rcnn' else 'mmseg'


def released_file(mmpretrain_xcit, family, patch_size, tmp_path, cfg=None):
    """Write a released file of ``family`` (for the model of ``cfg``, by default
    :func:`small_model_cfg`); return its path, the official backbone, the neck/head tensors it
    holds and the config."""
    cfg = cfg or small_model_cfg(family, patch_size)
    trunk = mmpretrain_trunk(mmpretrain_xcit, patch_size, D, DEPTH, HEADS)
    official = OfficialDenseXCiT(trunk, D, patch_size)
    # Neck and heads: the upstream modules' own names (unchanged since mmdet 2.11 / mmseg 0.11),
    # with random values so that a tensor that is not loaded cannot go unnoticed.
    upstream = build(cfg.model, _scope(family))
    torch.manual_seed(7)
    heads = OrderedDict((k, 0.1 * torch.randn_like(v) if v.is_floating_point()
                         else v.clone()) for k, v in upstream.state_dict().items()
                        if not k.startswith('backbone.'))
    for key in heads:
        if key.endswith('running_var'):
            heads[key] = heads[key].abs() + 0.5
    state = OrderedDict(('backbone.' + k, v) for k, v in official.released_state_dict().items())
    state.update(heads)
    path = str(tmp_path / f'{family}_xcit_p{patch_size}.pth')
    # mmcv 1.x checkpoints: meta with versions and classes, the weights, the optimizer state.
    torch.save({'meta': {'mmdet_version' if family == 'mask_rcnn' else 'mmseg_version': '2.11.0',
                         'CLASSES': ('a', 'b'), 'epoch': 36, 'iter': 1000},
                'state_dict': state, 'optimizer': {'state': {}, 'param_groups': []}}, path)
    return path, official, heads, cfg
