"""Whole-image Mask R-CNN with fewer live maps: :class:`LeanMaskRCNN`.

mmdet's ``TwoStageDetector.predict`` (3.3) keeps every backbone level until the neck returns,
every neck level (the stride-4 one is 256 x H/4 x W/4 floats: 1 GB at 4096 x 4096) until the RoI
head returns, and so through the RPN (whose 3x3 conv output and its ReLU are two more maps of
that size at stride 4) and through the mask pasting, which fills an N x H x W boolean tensor
(1.6 GB for 100 detections at 4096 x 4096) while all the feature maps are still alive.

:class:`LeanMaskRCNN` computes the same detections with fewer maps alive, by exact means only
(each operation is the stock one on the same full tensor; no convolution is tiled, because a
oneDNN convolution of another size picks another algorithm and differs in the last bit -- a
row-tiled 1x1 lateral conv was measured to differ here):

* **Backbone + FPN in data-flow order** (:meth:`LeanMaskRCNN._lean_extract_feat`, for a backbone
  with ``forward_trunk`` / ``forward_level`` such as XCiT and mmdet's ``FPN``): the levels are
  made top-down, the large stride-4 backbone map last, each freed by its lateral conv; each
  lateral is freed by its FPN conv; the top-down sum is added in place (``a.add_(b)`` gives the
  bits of ``a + b``) with the nearest upsampling done in row blocks (a copy: exact).
* **RPN with an in-place ReLU** (``relu_`` gives the bits of ``relu``), level by level, then
  mmdet's own ``predict_by_feat``.
* **Feature maps freed before the masks are pasted**: the RoI head's bbox and mask branches run
  as in ``StandardRoIHead.predict``; the mask logits (N x classes x 28 x 28) are computed, then
  every feature map is dropped, then mmdet's ``FCNMaskHead.predict_by_feat`` pastes the masks
  (on CPU mmdet already pastes each mask into its box region only).

Boxes, labels, scores and masks equal stock ``MaskRCNN.predict`` on the same weights
(``tests/test_lean_detection.py``). Configs: ``model = dict(type='LeanMaskRCNN', ...)`` is the
one key (``custom_imports`` of ``xcit_mm``, which the backbone needs anyway, registers the name;
the class is imported on first build, so ``import xcit_mm`` does not import mmdet).
``model.test_cfg.lean=False`` gives the stock ``predict``, and so does a ``predict`` under
autograd (the in-place sums would break it). Parts that are not the stock ones
(another neck, RPN head or RoI head class) run stock, only the ordering around them is lean.
Training, ``_forward`` and ``tensor`` mode are stock.
"""
from typing import List

import torch
import torch.nn.functional as F
from torch import Tensor

from mmdet.models.dense_heads import RPNHead
from mmdet.models.detectors import MaskRCNN
from mmdet.models.necks import FPN
from mmdet.models.roi_heads import StandardRoIHead
from mmdet.models.roi_heads.base_roi_head import BaseRoIHead
from mmdet.models.utils import empty_instances
from mmdet.registry import MODELS
from mmdet.structures import SampleList
from mmdet.structures.bbox import bbox2roi

# rows of a stride-4 map per block of the in-place top-down sum (a 1 MB-ish temporary)
TOP_DOWN_BLOCK_ROWS = 64


def _nearest_index(in_size: int, out_size: int, device) -> Tensor:
    """Source index of each output index of 1-D nearest resizing ``in_size`` -> ``out_size``,
    computed by ``F.interpolate`` itself (so it is the index torch uses; exact for sizes
    < 2**24)."""
    src = torch.arange(in_size, dtype=torch.float32, device=device).view(1, 1, in_size)
    return F.interpolate(src, size=out_size, mode='nearest').view(out_size).long()


def add_nearest_upsampled_(target: Tensor, source: Tensor, upsample_cfg: dict) -> Tensor:
    """``target += F.interpolate(source, size=target.shape[2:], **upsample_cfg)`` in row blocks.

    Nearest resizing is separable and only copies values, so gathering the source rows and
    columns torch's nearest resize reads gives its values; the block sum is the elementwise sum
    of the same operands. Other modes (or a ``scale_factor``) run the full-size call.
    """
    cfg = dict(upsample_cfg)
    if cfg.get('mode', 'nearest') != 'nearest' or 'scale_factor' in cfg or len(cfg) > 1:
        if 'scale_factor' in cfg:
            return target.add_(F.interpolate(source, **cfg))
        return target.add_(F.interpolate(source, size=target.shape[2:], **cfg))
    H, W = target.shape[2:]
    rows = _nearest_index(source.shape[2], H, source.device)
    cols = _nearest_index(source.shape[3], W, source.device)
    for r0 in range(0, H, TOP_DOWN_BLOCK_ROWS):
        r1 = min(r0 + TOP_DOWN_BLOCK_ROWS, H)
        block = source.index_select(2, rows[r0:r1]).index_select(3, cols)
        target[:, :, r0:r1].add_(block)
    return target


@MODELS.register_module()
class LeanMaskRCNN(MaskRCNN):
    """mmdet's ``MaskRCNN`` whose ``predict`` keeps fewer full-resolution maps alive.

    Same constructor, training and ``_forward`` as ``MaskRCNN``; only ``predict`` changes (see
    the module docstring for what is freed when and why each step is exact).
    """

    def _lean(self) -> bool:
        cfg = self.test_cfg
        return bool(cfg.get('lean', True)) if cfg is not None else True

    # ------------------------------------------------------------------ predict
    def predict(self, batch_inputs: Tensor, batch_data_samples: SampleList,
                rescale: bool = True) -> SampleList:
        """Detections equal to ``TwoStageDetector.predict``'s, with maps freed early."""
        if not self._lean() or torch.is_grad_enabled():
            return super().predict(batch_inputs, batch_data_samples, rescale=rescale)
        assert self.with_bbox, 'Bbox head must be implemented.'
        x = self._lean_extract_feat(batch_inputs)  # a list this method alone holds
        batch_img_metas = [data_sample.metainfo for data_sample in batch_data_samples]
        if batch_data_samples[0].get('proposals', None) is None:
            rpn_results_list = self._lean_rpn_predict(x, batch_data_samples, batch_img_metas)
        else:
            rpn_results_list = [data_sample.proposals for data_sample in batch_data_samples]
        results_list = self._lean_roi_predict(x, rpn_results_list, batch_data_samples, rescale)
        return self.add_pred_to_datasample(batch_data_samples, results_list)

    # ------------------------------------------------------------------ features
    def _lean_extract_feat(self, batch_inputs: Tensor) -> List[Tensor]:
        """``list(self.extract_feat(batch_inputs))``, computed in data-flow order when the
        backbone makes its levels one at a time and the neck is mmdet's ``FPN``."""
        backbone, neck = self.backbone, getattr(self, 'neck', None)
        if not (hasattr(backbone, 'forward_trunk') and hasattr(backbone, 'forward_level')
                and type(neck) is FPN and neck.start_level == 0
                and neck.backbone_end_level == neck.num_ins):
            return list(self.extract_feat(batch_inputs))
        feats = list(backbone.forward_trunk(batch_inputs))
        image_hw = tuple(batch_inputs.shape[-2:])
        num_levels = len(feats)
        assert num_levels == len(neck.in_channels)
        lateral = [None] * num_levels
        outs = [None] * num_levels
        for i in range(num_levels - 1, -1, -1):
            level = backbone.forward_level(feats[i], i, image_hw)
            feats[i] = None  # the trunk map of this level is no longer needed
            lat = neck.lateral_convs[i](level)
            del level
            if i + 1 < num_levels:
                add_nearest_upsampled_(lat, lateral[i + 1], neck.upsample_cfg)
                # the level above has given its top-down term: its FPN conv can run, then go
                outs[i + 1] = neck.fpn_convs[i + 1](lateral[i + 1])
                lateral[i + 1] = None
            lateral[i] = lat
            del lat
        outs[0] = neck.fpn_convs[0](lateral[0])
        lateral[0] = None
        if neck.num_outs > num_levels:
            if neck.add_extra_convs:  # RetinaNet-style extra convs: stock code for the extras
                return list(self.extract_feat(batch_inputs))
            for _ in range(neck.num_outs - num_levels):
                outs.append(F.max_pool2d(outs[-1], 1, stride=2))
        return outs

    # ------------------------------------------------------------------ RPN
    def _lean_rpn_predict(self, x: List[Tensor], batch_data_samples: SampleList,
                          batch_img_metas: List[dict]):
        """``rpn_head.predict(x, batch_data_samples, rescale=False)`` with an in-place ReLU."""
        head = self.rpn_head
        if type(head) is not RPNHead:
            return head.predict(x, batch_data_samples, rescale=False)
        cls_scores, bbox_preds = [], []
        for feat in x:
            hidden = F.relu_(head.rpn_conv(feat))
            cls_scores.append(head.rpn_cls(hidden))
            bbox_preds.append(head.rpn_reg(hidden))
            del hidden
        return head.predict_by_feat(cls_scores, bbox_preds, batch_img_metas=batch_img_metas,
                                    rescale=False)

    # ------------------------------------------------------------------ RoI head
    def _lean_roi_predict(self, x: List[Tensor], rpn_results_list,
                          batch_data_samples: SampleList, rescale: bool):
        """``StandardRoIHead.predict`` (bbox branch, then mask branch), emptying ``x`` once the
        mask logits exist, before the masks are pasted."""
        head = self.roi_head
        if not (isinstance(head, StandardRoIHead) and type(head).predict is BaseRoIHead.predict
                and type(head).predict_mask is StandardRoIHead.predict_mask and head.with_mask):
            return head.predict(tuple(x), rpn_results_list, batch_data_samples, rescale=rescale)
        batch_img_metas = [data_sample.metainfo for data_sample in batch_data_samples]
        feats = tuple(x)
        results_list = head.predict_bbox(feats, batch_img_metas, rpn_results_list,
                                         rcnn_test_cfg=head.test_cfg, rescale=False)
        mask_rois = bbox2roi([res.bboxes for res in results_list])
        if mask_rois.shape[0] == 0:
            return empty_instances(batch_img_metas, mask_rois.device, task_type='mask',
                                   instance_results=results_list,
                                   mask_thr_binary=head.test_cfg.mask_thr_binary)
        mask_preds = head._mask_forward(feats, mask_rois)['mask_preds']
        del feats
        x.clear()  # the caller's list: the last reference to the feature maps
        num_mask_rois_per_img = [len(res) for res in results_list]
        mask_preds = mask_preds.split(num_mask_rois_per_img, 0)
        return head.mask_head.predict_by_feat(mask_preds=mask_preds, results_list=results_list,
                                              batch_img_metas=batch_img_metas,
                                              rcnn_test_cfg=head.test_cfg, rescale=rescale)
