"""Mask R-CNN with fewer live maps, whole or in tiles within a memory budget: :class:`LeanMaskRCNN`.

Whole, it gives stock's detections bit for bit (each operation stock's, on the same whole tensor);
bands, tiles, ``mode='auto'`` and the keys: ``docs/lean_detection.md``. Training is stock's.
"""
import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from mmengine.structures import InstanceData
from torch import Tensor

from mmdet.models.dense_heads import RPNHead
from mmdet.models.detectors import MaskRCNN
from mmdet.models.necks import FPN
from mmdet.models.roi_heads import StandardRoIHead
from mmdet.models.roi_heads.base_roi_head import BaseRoIHead
from mmdet.models.roi_heads.mask_heads import FCNMaskHead
from mmdet.registry import MODELS
from mmdet.structures import DetDataSample, SampleList
from mmdet.structures.bbox import bbox2roi

from ..inference.fpn_data_flow import (fpn_bottom_rows, fpn_in_data_flow_order,
                                       why_not_data_flow_fpn)
from ..inference.row_stream import (LevelByLevelBackbone, Local, NotRowLocal, TensorRows, conv_halo,
                                    materialize)
from ..inference.settings import DetectorSettings, LeanSettingsMixin
from ..utils.ckpt_load import refuse_headless_load
from ..utils.memory_budget import (MB, MemoryModel, MemoryPlanMixin, Plan, calibrate,
                                   measure_peak_growth_mb, release_free_heap)
from . import tiled_inference as tiling


@MODELS.register_module()
class LeanMaskRCNN(LeanSettingsMixin, MemoryPlanMixin, MaskRCNN):
    """mmdet's ``MaskRCNN`` whose ``predict`` keeps fewer full-resolution maps alive."""
    SETTINGS = DetectorSettings
    LEAN_PATHS = ('fpn', 'rpn', 'roi', 'bands')

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # a file without weights for a head is an error, never a silently random head
        self.register_load_state_dict_post_hook(refuse_headless_load)
        self._check_parts()  # a malformed test_cfg, or parts it cannot run

    def _band_mb(self) -> Optional[float]:
        """``band_mb`` in eval mode (a BatchNorm in training mode normalises over the whole map)."""
        return None if self.training else self.test_settings.band_mb

    # ------------------------------------------------------------------ what the parts allow
    def why_not(self, path: str) -> Optional[str]:
        """None if the parts allow the lean ``path``, else why not: 'fpn' backbone + FPN in
        data-flow order, 'rpn' the RPN's in-place ReLU, 'roi' the RoI steps run here (tiles and
        auto need them), 'bands' the stride-4 work in bands of rows."""
        self._check_lean_path(path)
        backbone, neck, rpn, roi = (self.backbone, getattr(self, 'neck', None), self.rpn_head,
                                    self.roi_head)
        if path == 'roi':
            mask_head = getattr(roi, 'mask_head', None)
            if (isinstance(roi, StandardRoIHead) and roi.with_mask
                    and type(roi).predict is BaseRoIHead.predict
                    and type(roi).predict_bbox is StandardRoIHead.predict_bbox
                    and type(roi).predict_mask is StandardRoIHead.predict_mask
                    and isinstance(mask_head, FCNMaskHead)
                    and type(mask_head).predict_by_feat is FCNMaskHead.predict_by_feat):
                return None
            return ("mmdet's StandardRoIHead with an FCNMaskHead (stock predict, predict_bbox, "
                    f'predict_mask and predict_by_feat), got {type(roi).__name__} / '
                    f'{type(mask_head).__name__}')
        if path == 'rpn':
            return None if type(rpn) is RPNHead else f"{type(rpn).__name__} is not mmdet's RPNHead"
        if not isinstance(backbone, LevelByLevelBackbone):
            if path == 'bands':
                return (f'the backbone {type(backbone).__name__} cannot make its stride-4 level '
                        'in bands of rows (XCiTBackbone can)')
            return f'the backbone {type(backbone).__name__} makes its levels all at once'
        why = why_not_data_flow_fpn(neck, FPN, extra_levels=True)
        if why or path == 'fpn':
            return why
        zeros, trunk_side = next(backbone.parameters()).new_zeros, 64 // backbone.patch_size
        try:  # the very construction the bands make, on a 64 px image's placeholder maps
            fpn_bottom_rows(backbone, neck,
                            TensorRows(zeros(1, backbone.out_channels[0], trunk_side, trunk_side)),
                            TensorRows(zeros(1, neck.out_channels, 8, 8)), (64, 64))
        except NotRowLocal as error:
            return f'the FPN: {error}'
        if not (type(rpn) is RPNHead and conv_halo(rpn.rpn_conv) is not None
                and conv_halo(rpn.rpn_cls) == conv_halo(rpn.rpn_reg) == 0):
            return "the RPN head must be mmdet's RPNHead with one stride-1 same-size conv"
        return None

    def _check_parts(self) -> None:
        """The lean paths ``test_cfg`` asks for, refused where the parts rule them out."""
        name, settings = type(self).__name__, self.test_settings
        why = settings.band_mb is not None and self.why_not('bands')
        if why:
            raise ValueError(f'{name}: test_cfg.band_mb: {why}; remove band_mb (every map whole) '
                             "or use mode='tiles'")
        why = settings.mode != 'whole' and self.why_not('roi')
        if why:
            raise ValueError(f"{name}: test_cfg.mode='tiles' / 'auto' need {why}; use "
                             "mode='whole'")

    # ------------------------------------------------------------------ predict
    def predict(self, batch_inputs: Tensor, batch_data_samples: SampleList,
                rescale: bool = True) -> SampleList:
        """Detections of the whole image, of tiles, or of whichever fits ``test_cfg.max_memory``."""
        settings, name = self.test_settings, type(self).__name__
        self._check_parts()
        proposals = batch_data_samples[0].get('proposals', None) is not None
        if settings.mode == 'whole' and (not settings.lean or torch.is_grad_enabled()):
            # stock's: in-place sums would break autograd
            return super().predict(batch_inputs, batch_data_samples, rescale=rescale)
        if settings.mode != 'whole' and proposals:
            raise ValueError(f"{name}: test_cfg.mode='tiles' / 'auto' make proposals per tile; "
                             "precomputed proposals (data_samples.proposals) need mode='whole'")
        batch_img_metas = [data_sample.metainfo for data_sample in batch_data_samples]
        with torch.no_grad():
            plan = settings.mode
            if plan == 'auto':
                B, _, H, W = batch_inputs.shape
                what = f'{name} ({B} image{"s" if B > 1 else ""} of {H}x{W} px)'
                plans = self.memory_plans(batch_inputs, batch_data_samples, rescale)
                plan = self._choose_memory_plan(plans, settings.max_memory, what).name
            if plan == 'whole':
                return self._predict_whole(batch_inputs, batch_data_samples, rescale)
            results_list = self._paste_masks(self._tile_detections(batch_inputs, batch_img_metas),
                                             batch_img_metas, rescale)
        return self.add_pred_to_datasample(batch_data_samples, results_list)

    def _predict_whole(self, batch_inputs: Tensor, batch_data_samples: SampleList,
                       rescale: bool) -> SampleList:
        """The lean network on the whole batch, under ``predict``'s ``no_grad``."""
        assert self.with_bbox, 'Bbox head must be implemented.'
        batch_img_metas = [data_sample.metainfo for data_sample in batch_data_samples]
        x = self._lean_extract_feat(batch_inputs)  # a list this method alone holds
        if batch_data_samples[0].get('proposals', None) is not None:
            rpn_results_list = [data_sample.proposals for data_sample in batch_data_samples]
        else:
            rpn_results_list = self._lean_rpn_predict(x, batch_data_samples)
        if self.why_not('roi'):
            results_list = self.roi_head.predict(tuple(x), rpn_results_list, batch_data_samples,
                                                 rescale=rescale)
        else:
            results_list = self._paste_masks(
                self._lean_roi_predict(x, rpn_results_list, batch_img_metas), batch_img_metas,
                rescale)
        return self.add_pred_to_datasample(batch_data_samples, results_list)

    # ------------------------------------------------------------------ network
    def _lean_extract_feat(self, batch_inputs: Tensor) -> List[Tensor]:
        """``list(self.extract_feat(batch_inputs))``, in data-flow order where the parts allow."""
        if self.why_not('fpn'):
            return list(self.extract_feat(batch_inputs))  # e.g. RetinaNet-style extra convs
        neck = self.neck
        outs = fpn_in_data_flow_order(self.backbone, neck, batch_inputs, self._band_mb())
        for _ in range(neck.num_outs - len(outs)):  # extra levels as FPN makes them
            outs.append(F.max_pool2d(outs[-1], 1, stride=2))
        return outs

    def _lean_rpn_predict(self, x: List[Tensor], batch_data_samples: SampleList):
        """``rpn_head.predict(x, batch_data_samples, rescale=False)`` with an in-place ReLU, its
        stride-4 level in bands with ``band_mb``."""
        head = self.rpn_head
        if self.why_not('rpn'):
            return head.predict(x, batch_data_samples, rescale=False)

        def hidden(feat: Tensor) -> Tensor:
            return F.relu_(head.rpn_conv(feat))

        def scores_and_deltas(hidden: Tensor) -> Tensor:
            return torch.cat([head.rpn_cls(hidden), head.rpn_reg(hidden)], dim=1)

        band_mb, sizes = self._band_mb(), [head.rpn_cls.out_channels, head.rpn_reg.out_channels]
        outs = []
        for level, feat in enumerate(x):
            if level == 0 and band_mb is not None:  # the conv's map one band at a time
                # two row maps, so that the bands are sized by the conv's wide map too
                hidden_rows = Local(hidden, TensorRows(feat), conv_halo(head.rpn_conv))
                both = materialize(Local(scores_and_deltas, hidden_rows), band_mb)
            else:
                both = scores_and_deltas(hidden(feat))
            outs.append(both.split(sizes, dim=1))
        cls_scores, bbox_preds = map(list, zip(*outs))
        return head.predict_by_feat(
            cls_scores, bbox_preds, rescale=False,
            batch_img_metas=[data_sample.metainfo for data_sample in batch_data_samples])

    def _lean_roi_predict(self, x: List[Tensor], rpn_results_list,
                          batch_img_metas: List[dict]) -> List[InstanceData]:
        """``StandardRoIHead``'s bbox branch (``rescale=False``) and each detection's mask logits
        of its class (``mask_logits``); ``x``, the caller's last reference to the maps, emptied."""
        head = self.roi_head
        feats = tuple(x)
        results_list = head.predict_bbox(feats, batch_img_metas, rpn_results_list,
                                         rcnn_test_cfg=head.test_cfg, rescale=False)
        rois = bbox2roi([res.bboxes for res in results_list])
        if rois.shape[0] == 0:
            logits = rois.new_zeros((0, ) + (self._mask_shape()[1], ) * 2)
        else:
            mask_preds = head._mask_forward(feats, rois)['mask_preds']
            labels = torch.cat([res.labels for res in results_list])
            # the logits of the detection's class: a copy, not a view of mask_preds
            logits = mask_preds[torch.arange(len(labels)),
                                labels if mask_preds.shape[1] > 1 else 0]
            del mask_preds
        del feats
        x.clear()
        for res, part in zip(results_list, logits.split([len(res) for res in results_list])):
            res.mask_logits = part
        return results_list

    def _paste_masks(self, results_list: List[InstanceData], batch_img_metas: List[dict],
                     rescale: bool) -> List[InstanceData]:
        """mmdet's ``FCNMaskHead.predict_by_feat`` on ``mask_logits`` put back where the head's
        output has them (other classes zero: it reads the detection's class only): stock's masks."""
        channels = self._mask_shape()[0]
        mask_preds = []
        for results in results_list:
            logits = results.pop('mask_logits')
            results.pop('cut', None)
            full = logits.new_zeros((len(results), channels) + tuple(logits.shape[1:]))
            full[torch.arange(len(results)), 0 if channels == 1 else results.labels] = logits
            mask_preds.append(full)
        return self.roi_head.mask_head.predict_by_feat(
            mask_preds=tuple(mask_preds), results_list=results_list,
            batch_img_metas=batch_img_metas, rcnn_test_cfg=self.roi_head.test_cfg,
            rescale=rescale)

    def _mask_shape(self) -> Tuple[int, int]:
        """(channels, side) of the mask head's logits (classes or 1, 28 for Mask R-CNN)."""
        mask_head = self.roi_head.mask_head
        upsample = mask_head.scale_factor if mask_head.upsample is not None else 1
        return mask_head.conv_logits.out_channels, int(mask_head.roi_feat_size[0] * upsample)

    # ------------------------------------------------------------------ tiles
    def _tile_grids(self, batch_inputs: Tensor,
                    batch_img_metas: List[dict]) -> List[List[tiling.Tile]]:
        settings = self.test_settings
        return [tiling.tile_grid(meta['img_shape'], batch_inputs.shape[-2:], settings.tile_size,
                                 settings.tile_overlap) for meta in batch_img_metas]

    def _tile_detections(self, batch_inputs: Tensor,
                         batch_img_metas: List[dict]) -> List[InstanceData]:
        """Each image tile by tile, the tiles' detections merged per image (masks not pasted)."""
        head, preprocessor = self.roi_head, self.data_preprocessor
        pad = (getattr(preprocessor, 'pad_size_divisor', 1), getattr(preprocessor, 'pad_value', 0))
        results_list = []
        for i, tiles in enumerate(self._tile_grids(batch_inputs, batch_img_metas)):
            per_tile = []
            for tile in tiles:
                tile_input = tiling.cut_tile(batch_inputs[i:i + 1], tile, *pad)
                dets = self._detect_in_tile(tile_input, tiling.image_meta(
                    (tile.valid_h, tile.valid_w), tile_input.shape[-2:]))
                del tile_input
                dets.cut = tiling.touches_cut_edge(dets.bboxes, tile)  # image coordinates next
                dets.bboxes = dets.bboxes + dets.bboxes.new_tensor([tile.x0, tile.y0] * 2)
                # copies: the head's are views keeping its NMS input (every scored box) alive
                dets.scores, dets.labels = dets.scores.clone(), dets.labels.clone()
                per_tile.append(dets)
                release_free_heap()  # each tile starts as a calibrated run did, no heap piled up
            dets = InstanceData.cat(per_tile)
            del per_tile
            results_list.append(tiling.merge_tile_detections(
                dets, head.test_cfg.nms, head.test_cfg.max_per_img))
        return results_list

    def _detect_in_tile(self, tile_input: Tensor, meta: dict) -> InstanceData:
        """The lean network up to the mask logits on one tile seen as an image, its maps freed."""
        x, rpn_results_list = self._features_and_proposals(tile_input, meta)
        return self._lean_roi_predict(x, rpn_results_list, [meta])[0]

    def _features_and_proposals(self, inputs: Tensor, meta: dict):
        """(feature maps as a list, RPN proposals): the stage whose peak grows with the pixels."""
        x = self._lean_extract_feat(inputs)
        return x, self._lean_rpn_predict(x, [DetDataSample(metainfo=meta)])

    # ------------------------------------------------------------------ memory plans
    def memory_plans(self, batch_inputs: Tensor, batch_data_samples: SampleList,
                     rescale: bool = True) -> List[Plan]:
        """The plans of ``mode='auto'``, whole then tiles (their estimates: docs/)."""
        settings, model = self.test_settings, self.network_memory_model(batch_inputs)
        batch_img_metas = [data_sample.metainfo for data_sample in batch_data_samples]
        max_per_img = self._max_boxes()[1]
        channels, side = self._mask_shape()
        # the heap a network run leaves (the line's base) is still resident while masks are pasted
        paste_mb = model.base_mb + tiling.paste_estimate_mb(batch_img_metas, rescale, max_per_img,
                                                            channels, side)
        B, _, H, W = batch_inputs.shape
        grids = self._tile_grids(batch_inputs, batch_img_metas)
        divisor = getattr(self.data_preprocessor, 'pad_size_divisor', 1)
        tile_px = max(math.prod(tiling.padded_hw(t, batch_inputs.shape, divisor))
                      for tiles in grids for t in tiles)
        # a tile's detection until the merge: box, score, label (int64), cut flag, mask logits
        held_mb = sum(map(len, grids)) * max_per_img * (4 * 4 + 4 + 8 + 1 + 4 * side**2) / MB
        rows = len({t.y0 for t in grids[0]})
        th, tw = settings.tile_size
        return [Plan('whole', max(B * model.estimate_mb(H * W), paste_mb), f'{H}x{W}'),
                Plan('tiles', max(model.estimate_mb(tile_px), paste_mb) + held_mb,
                     f'{rows}x{len(grids[0]) // rows} tiles of {th}x{tw} px, overlap '
                     f'{settings.tile_overlap} px')]

    def _max_boxes(self) -> Tuple[int, int]:
        """The most proposals and detections per image the test config allows."""
        proposals = int(self.test_cfg.rpn.get('max_per_img', 1000))
        detections = self.roi_head.test_cfg.max_per_img
        return proposals, detections if detections > 0 else proposals

    @torch.no_grad()
    def _calibrate_memory(self, batch_inputs: Tensor) -> MemoryModel:
        """The line bounding :meth:`_detect_in_tile`'s peak growth: features + proposals fitted on
        random inputs, plus the RoI branch at its most boxes (the same at any size)."""
        generator = torch.Generator().manual_seed(0)

        def square(side: int):
            inputs = torch.randn(1, batch_inputs.shape[1], side, side, generator=generator)
            return inputs.to(batch_inputs), tiling.image_meta((side, side), (side, side))

        sides = list(tiling.CALIBRATION_SIDES)
        inputs, meta = square(sides[0])
        maps = self._features_and_proposals(inputs, meta)[0]  # also the unmeasured first run
        del inputs
        device = batch_inputs.device  # measured where it runs: host or GPU memory
        roi_mb = measure_peak_growth_mb(lambda: self._worst_case_roi_stage(maps, meta), device)
        maps.clear()
        return calibrate(lambda h, w: self._features_and_proposals(*square(h))[1],
                         [(s, s) for s in sides], f'{type(self).__name__} (features + proposals)',
                         fixed_mb=roi_mb, fixed_what='RoI branch', device=device)

    def _worst_case_roi_stage(self, x: List[Tensor], meta: dict) -> Tensor:
        """The RoI branch on maps ``x`` with the most boxes the test config allows (its cost
        depends on the counts, not the image; a random image may yield fewer)."""
        head = self.roi_head
        num_proposals, num_dets = self._max_boxes()
        h, w = meta['img_shape']
        generator = torch.Generator().manual_seed(0)
        size = x[0].new_tensor([w, h])
        corner = torch.rand(num_proposals, 2, generator=generator).to(size) * size
        extent = (torch.rand(num_proposals, 2, generator=generator).to(size) + 0.1) * size / 2
        boxes = torch.cat([corner, torch.minimum(corner + extent, size)], dim=1)
        feats = tuple(x)
        head.predict_bbox(feats, [meta], [InstanceData(bboxes=boxes)],
                          rcnn_test_cfg=head.test_cfg, rescale=False)
        return head._mask_forward(feats, bbox2roi([boxes[:num_dets]]))['mask_preds'][:, :1]
