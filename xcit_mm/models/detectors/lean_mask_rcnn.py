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

from ..layers.fpn_data_flow import fpn_in_data_flow_order
from ..utils.ckpt_load import refuse_headless_load


@MODELS.register_module()
class LeanMaskRCNN(MaskRCNN):
    """mmdet's ``MaskRCNN`` whose ``predict`` keeps fewer full-resolution maps alive.

    Same constructor, training and ``_forward`` as ``MaskRCNN``; only ``predict`` changes (see
    the module docstring for what is freed when and why each step is exact).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # a file without weights for a head is an error, never a silently random head
        self.register_load_state_dict_post_hook(refuse_headless_load)

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
                and neck.backbone_end_level == neck.num_ins
                and not (neck.num_outs > neck.num_ins and neck.add_extra_convs)):
            return list(self.extract_feat(batch_inputs))  # e.g. RetinaNet-style extra convs
        outs = fpn_in_data_flow_order(backbone, neck, batch_inputs)
        for _ in range(neck.num_outs - len(outs)):  # extra levels as FPN makes them
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
