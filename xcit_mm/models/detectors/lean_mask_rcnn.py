"""Mask R-CNN with fewer live maps, whole or in tiles within a memory budget: :class:`LeanMaskRCNN`.

mmdet's ``TwoStageDetector.predict`` keeps every backbone and neck level alive until the RoI head
returns, and pastes the N x H x W masks while they are all still there.

* **Whole image** (``mode='whole'``, the default): stock's detections bit for bit, by exact means
  only (each operation the stock one on the same full tensor; no convolution tiled, as a oneDNN
  convolution of another size may pick another algorithm): backbone + FPN in data-flow order
  (``fpn_data_flow``), each map freed once used; the RPN with an in-place ReLU; the bbox branch
  and each detection's mask logits (:meth:`~LeanMaskRCNN._lean_roi_predict`), then every map
  dropped, then the masks pasted.
* **Bands** (``band_mb``, any mode): the stride-4 maps besides the FPN output (the adapter map,
  the lateral map, the RPN conv's map) made in bands of rows with the context rows their convs
  need: equal to stock up to float rounding, not bit for bit.
* **Tiles** (``mode='tiles'``): each overlapping tile runs the path above up to its detections'
  mask logits, its maps dropped before the next; detections shifted and merged
  (``tiled_inference``), then the kept masks pasted at the original size: one tile over the image
  is the whole-image result bit for bit.
* **Auto** (``mode='auto'``, ``max_memory`` in MB): the whole image if a calibrated estimate of
  its peak fits the budget, else tiles (``utils.memory_budget``).

``test_cfg`` keys next to ``rpn`` and ``rcnn``: :class:`DetectorSettings`,
``docs/lean_detection.md``; ``lean=False``, or a whole-image ``predict`` under autograd (where
in-place sums would break it), gives stock ``predict``. Other parts than the stock ones run stock
in whole mode; tiles need mmdet's ``StandardRoIHead`` and ``FCNMaskHead``. Training, ``_forward``
and ``tensor`` mode are stock.
"""
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

from ..inference.fpn_data_flow import (LevelByLevelBackbone, fpn_in_data_flow_order,
                                       why_not_bottom_in_bands, why_not_data_flow_fpn)
from ..inference.row_stream import Local, TensorRows, conv_halo, materialize
from ..inference.settings import DetectorSettings, LeanSettingsMixin
from ..utils.ckpt_load import refuse_headless_load
from ..utils.memory_budget import (MB, MemoryModel, MemoryPlanMixin, Plan, calibrate,
                                   measure_peak_growth_mb, release_free_heap)
from . import tiled_inference as tiling


@MODELS.register_module()
class LeanMaskRCNN(LeanSettingsMixin, MemoryPlanMixin, MaskRCNN):
    """mmdet's ``MaskRCNN`` whose ``predict`` keeps fewer full-resolution maps alive, on the whole
    image, in tiles, or whichever fits a memory budget (module docstring); ``mode='auto'`` keeps
    its plans as :class:`MemoryPlanMixin` says.
    """
    SETTINGS = DetectorSettings

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # a file without weights for a head is an error, never a silently random head
        self.register_load_state_dict_post_hook(refuse_headless_load)
        # a malformed test_cfg, or bands the parts cannot run, fail at build
        self._check_bands(self.test_settings.band_mb)

    def _band_mb(self) -> Optional[float]:
        """``test_cfg.band_mb`` in eval mode (a BatchNorm in training mode normalises over the
        whole map)."""
        return None if self.training else self.test_settings.band_mb

    def _check_bands(self, band_mb: Optional[float]) -> None:
        """``band_mb`` needs parts whose stride-4 work can run in bands of rows: an error naming
        the part otherwise (never a silent whole-image run)."""
        if band_mb is None:
            return
        rpn, neck = self.rpn_head, getattr(self, 'neck', None)
        why = None
        if isinstance(self.backbone, LevelByLevelBackbone):
            why = why_not_data_flow_fpn(neck, FPN, extra_levels=True)
        if why is None:
            why = why_not_bottom_in_bands(self.backbone, neck)
        if why is None and not (type(rpn) is RPNHead and conv_halo(rpn.rpn_conv) is not None
                                and conv_halo(rpn.rpn_cls) == conv_halo(rpn.rpn_reg) == 0):
            why = "the RPN head must be mmdet's RPNHead with one stride-1 same-size conv"
        if why:
            raise ValueError(f'{type(self).__name__}: test_cfg.band_mb: {why}; remove band_mb '
                             '(every map whole) or use mode=\'tiles\'')

    # ------------------------------------------------------------------ predict
    def predict(self, batch_inputs: Tensor, batch_data_samples: SampleList,
                rescale: bool = True) -> SampleList:
        """Detections of the whole image (stock's, with maps freed early), of tiles, or of
        whichever fits ``test_cfg.max_memory``."""
        settings = self.test_settings
        self._check_bands(settings.band_mb)
        if settings.mode == 'whole':
            if not settings.lean or torch.is_grad_enabled():
                return super().predict(batch_inputs, batch_data_samples, rescale=rescale)
            return self._predict_whole(batch_inputs, batch_data_samples, rescale)
        if not self._stock_roi_head():
            raise ValueError(
                f"{type(self).__name__}: test_cfg.mode='tiles' / 'auto' need mmdet's "
                f'StandardRoIHead with an FCNMaskHead (stock predict, predict_bbox, predict_mask '
                f'and predict_by_feat), got {type(self.roi_head).__name__} / '
                f'{type(getattr(self.roi_head, "mask_head", None)).__name__}; use mode=\'whole\'')
        if batch_data_samples[0].get('proposals', None) is not None:
            raise ValueError(
                f"{type(self).__name__}: test_cfg.mode='tiles' / 'auto' make proposals per tile; "
                "precomputed proposals (data_samples.proposals) need mode='whole'")
        with torch.no_grad():
            if settings.mode == 'auto':
                B, _, H, W = batch_inputs.shape
                plan = self._choose_memory_plan(
                    self.memory_plans(batch_inputs, batch_data_samples, rescale),
                    settings.max_memory,
                    f'{type(self).__name__} ({B} image{"s" if B > 1 else ""} of {H}x{W} px)')
                if plan.name == 'whole':
                    return self._predict_whole(batch_inputs, batch_data_samples, rescale)
            return self._predict_tiles(batch_inputs, batch_data_samples, rescale, settings)

    def _stock_roi_head(self) -> bool:
        """Whether the RoI head is mmdet's ``StandardRoIHead`` with an ``FCNMaskHead``, whose
        steps :meth:`_lean_roi_predict` and :meth:`_paste_masks` run in their stead."""
        head = self.roi_head
        return (isinstance(head, StandardRoIHead) and head.with_mask
                and type(head).predict is BaseRoIHead.predict
                and type(head).predict_bbox is StandardRoIHead.predict_bbox
                and type(head).predict_mask is StandardRoIHead.predict_mask
                and isinstance(head.mask_head, FCNMaskHead)
                and type(head.mask_head).predict_by_feat is FCNMaskHead.predict_by_feat)

    def _predict_whole(self, batch_inputs: Tensor, batch_data_samples: SampleList,
                       rescale: bool) -> SampleList:
        """The whole batch input at once, lean."""
        assert self.with_bbox, 'Bbox head must be implemented.'
        x = self._lean_extract_feat(batch_inputs)  # a list this method alone holds
        batch_img_metas = [data_sample.metainfo for data_sample in batch_data_samples]
        if batch_data_samples[0].get('proposals', None) is None:
            rpn_results_list = self._lean_rpn_predict(x, batch_data_samples, batch_img_metas)
        else:
            rpn_results_list = [data_sample.proposals for data_sample in batch_data_samples]
        if self._stock_roi_head():
            results_list = self._paste_masks(
                self._lean_roi_predict(x, rpn_results_list, batch_img_metas), batch_img_metas,
                rescale)
        else:
            results_list = self.roi_head.predict(tuple(x), rpn_results_list, batch_data_samples,
                                                 rescale=rescale)
        return self.add_pred_to_datasample(batch_data_samples, results_list)

    # ------------------------------------------------------------------ features
    def _lean_extract_feat(self, batch_inputs: Tensor) -> List[Tensor]:
        """``list(self.extract_feat(batch_inputs))``, in data-flow order where
        :meth:`_lean_fpn`."""
        if not self._lean_fpn():
            return list(self.extract_feat(batch_inputs))  # e.g. RetinaNet-style extra convs
        neck = self.neck
        outs = fpn_in_data_flow_order(self.backbone, neck, batch_inputs, self._band_mb())
        for _ in range(neck.num_outs - len(outs)):  # extra levels as FPN makes them
            outs.append(F.max_pool2d(outs[-1], 1, stride=2))
        return outs

    def _lean_fpn(self) -> bool:
        """Whether the backbone makes its levels one at a time and the neck is mmdet's ``FPN``
        that ``fpn_in_data_flow_order`` computes (``why_not_data_flow_fpn``)."""
        return (isinstance(self.backbone, LevelByLevelBackbone) and why_not_data_flow_fpn(
            getattr(self, 'neck', None), FPN, extra_levels=True) is None)

    # ------------------------------------------------------------------ RPN
    def _lean_rpn_predict(self, x: List[Tensor], batch_data_samples: SampleList,
                          batch_img_metas: List[dict]):
        """``rpn_head.predict(x, batch_data_samples, rescale=False)`` with an in-place ReLU, its
        stride-4 level in bands with ``band_mb`` (the parts checked by :meth:`_check_bands`)."""
        head = self.rpn_head
        if type(head) is not RPNHead:
            return head.predict(x, batch_data_samples, rescale=False)

        def hidden(feat: Tensor) -> Tensor:
            return F.relu_(head.rpn_conv(feat))

        def scores_and_deltas(hidden: Tensor) -> Tensor:
            return torch.cat([head.rpn_cls(hidden), head.rpn_reg(hidden)], dim=1)

        band_mb = self._band_mb()
        cls_scores, bbox_preds = [], []
        for level, feat in enumerate(x):
            if level == 0 and band_mb is not None:  # the conv's map one band at a time
                # two row maps, so that the bands are sized by the conv's wide map too
                hidden_rows = Local(hidden, TensorRows(feat), conv_halo(head.rpn_conv))
                both = materialize(Local(scores_and_deltas, hidden_rows), band_mb)
            else:
                both = scores_and_deltas(hidden(feat))
            cls_score, bbox_pred = both.split(
                [head.rpn_cls.out_channels, head.rpn_reg.out_channels], dim=1)
            cls_scores.append(cls_score)
            bbox_preds.append(bbox_pred)
        return head.predict_by_feat(cls_scores, bbox_preds, batch_img_metas=batch_img_metas,
                                    rescale=False)

    # ------------------------------------------------------------------ RoI head
    def _lean_roi_predict(self, x: List[Tensor], rpn_results_list,
                          batch_img_metas: List[dict]) -> List[InstanceData]:
        """``StandardRoIHead``'s bbox branch (``rescale=False``: input coordinates) and, per
        detection, the mask logits of its class (``mask_logits``, n x 28 x 28, from one mask
        forward over the batch as stock's); then ``x`` (the caller's list: the last reference to
        the feature maps) is emptied, before any mask is pasted (:meth:`_paste_masks`)."""
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
        """mmdet's ``FCNMaskHead.predict_by_feat`` on detections with ``mask_logits``
        (network-scale boxes; rescaled, and pasted at the original size, when ``rescale``).
        Each detection's logits go back into an n x classes x 28 x 28 tensor laid out as the
        head's own output (the other classes zero: the head reads the detection's class only),
        so the masks are pasted bit for bit as from that output."""
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
        return (1 if mask_head.class_agnostic else mask_head.num_classes,
                int(mask_head.roi_feat_size[0] * (upsample or 1)))

    # ------------------------------------------------------------------ tiles
    def _tile_grids(self, batch_inputs: Tensor, batch_img_metas: List[dict],
                    settings: DetectorSettings) -> List[List[tiling.Tile]]:
        """The tiles of each image of the batch (network scale)."""
        return [tiling.tile_grid(meta['img_shape'], batch_inputs.shape[-2:], settings.tile_size,
                                 settings.tile_overlap) for meta in batch_img_metas]

    def _predict_tiles(self, batch_inputs: Tensor, batch_data_samples: SampleList,
                       rescale: bool, settings: DetectorSettings) -> SampleList:
        """Each image tile by tile (one tile's maps alive at a time), the tiles' detections merged
        per image, then the kept masks pasted for the whole batch."""
        head = self.roi_head
        batch_img_metas = [data_sample.metainfo for data_sample in batch_data_samples]
        results_list = []
        for i, tiles in enumerate(self._tile_grids(batch_inputs, batch_img_metas, settings)):
            per_tile = []
            for tile in tiles:
                per_tile.append(self._tile_detections(batch_inputs[i:i + 1], tile))
                # freed heap pages back to the OS: each tile starts as a calibrated run did, and
                # the small allocations of many tiles do not pile up in the resident set
                release_free_heap()
            dets = InstanceData.cat(per_tile)
            del per_tile
            results_list.append(tiling.merge_tile_detections(
                dets, head.test_cfg.nms, head.test_cfg.max_per_img))
        results_list = self._paste_masks(results_list, batch_img_metas, rescale)
        return self.add_pred_to_datasample(batch_data_samples, results_list)

    def _tile_detections(self, inputs: Tensor, tile: tiling.Tile) -> InstanceData:
        """The detections of one tile of one image's batch input (1, C, H, W): boxes shifted to
        image coordinates, marked ``cut`` where they touch a tile edge inside the image."""
        preprocessor = self.data_preprocessor
        tile_input = tiling.cut_tile(inputs, tile, getattr(preprocessor, 'pad_size_divisor', 1),
                                     getattr(preprocessor, 'pad_value', 0))
        dets = self._detect_in_tile(tile_input, tiling.tile_meta(tile, tile_input.shape[-2:]))
        del tile_input
        dets.cut = tiling.touches_cut_edge(dets.bboxes, tile)
        dets.bboxes = dets.bboxes + dets.bboxes.new_tensor([tile.x0, tile.y0, tile.x0, tile.y0])
        # own copies: the head's scores and labels are views of its NMS output over all the
        # boxes it scored, which would otherwise stay alive for every tile until the merge
        dets.scores, dets.labels = dets.scores.clone(), dets.labels.clone()
        return dets

    def _detect_in_tile(self, tile_input: Tensor, meta: dict) -> InstanceData:
        """The lean network part on one input (1, C, h, w) seen as an image of its own, up to
        the mask logits (:meth:`_lean_roi_predict`); every feature map is freed on return."""
        x, rpn_results_list = self._features_and_proposals(tile_input, meta)
        return self._lean_roi_predict(x, rpn_results_list, [meta])[0]

    def _features_and_proposals(self, inputs: Tensor, meta: dict):
        """(feature maps as a list, RPN proposals) of one input (1, C, h, w): the first stage of
        :meth:`_detect_in_tile`, whose peak grows with the pixels."""
        x = self._lean_extract_feat(inputs)
        return x, self._lean_rpn_predict(x, [DetDataSample(metainfo=meta)], [meta])

    # ------------------------------------------------------------------ memory plans
    def memory_plans(self, batch_inputs: Tensor, batch_data_samples: SampleList,
                     rescale: bool = True) -> List[Plan]:
        """The plans of ``mode='auto'``, whole then tiles, with the estimated peak growth (MB) of
        each: the whole-image plan (the network part on the batch input, or after it the masks
        and their pasting) and the tiles plan (the network part on the largest tile, or the masks
        and pasting, plus what every tile's detections hold until the merge)."""
        settings = self.test_settings
        model = self.network_memory_model(batch_inputs)
        batch_img_metas = [data_sample.metainfo for data_sample in batch_data_samples]
        max_per_img = self._max_detections()
        channels, side = self._mask_shape()
        paste_mb = tiling.paste_estimate_mb(
            [tiling.mask_output_hw(meta, rescale) for meta in batch_img_metas], max_per_img,
            channels, side)
        B, _, H, W = batch_inputs.shape
        # the heap a network run leaves (the line's base) is still resident while masks are pasted
        paste_mb += model.base_mb
        whole_mb = max(B * model.estimate_mb(H * W), paste_mb)
        grids = self._tile_grids(batch_inputs, batch_img_metas, settings)
        divisor = getattr(self.data_preprocessor, 'pad_size_divisor', 1)
        tile_px = max(h * w for tiles in grids for t in tiles
                      for h, w in [tiling.padded_hw(t, batch_inputs.shape, divisor)])
        held_mb = (sum(map(len, grids)) * max_per_img
                   * tiling.held_bytes_per_detection(side) / MB)
        tiles_mb = max(model.estimate_mb(tile_px), paste_mb) + held_mb
        rows = len({t.y0 for t in grids[0]})
        cols = len(grids[0]) // rows
        th, tw = settings.tile_size
        return [Plan('whole', whole_mb, f'{H}x{W}'),
                Plan('tiles', tiles_mb, f'{rows}x{cols} tiles of {th}x{tw} px, overlap '
                     f'{settings.tile_overlap} px')]

    def _max_proposals(self) -> int:
        """The most proposals the RPN passes to the RoI head per image (``rpn.max_per_img``)."""
        return int(self.test_cfg.rpn.get('max_per_img', 1000))

    def _max_detections(self) -> int:
        """The most detections per image (``rcnn.max_per_img``; the proposals when unlimited)."""
        max_per_img = self.roi_head.test_cfg.max_per_img
        return max_per_img if max_per_img > 0 else self._max_proposals()

    @torch.no_grad()
    def _calibrate_memory(self, batch_inputs: Tensor) -> MemoryModel:
        """The line bounding the network part's peak growth (:meth:`_detect_in_tile`) over its
        input pixels, on fixed random inputs (the RPN finds as many proposals as on an image).

        The RoI branch adds about the same at any size, and at the small sizes a calibration can
        afford it is the peak, so a line through whole runs would undercut large images: the
        features + proposals line is fitted at ``tiling.CALIBRATION_SIDES``, and the RoI
        branch's growth at its most proposals (measured once, on the maps of a first, unmeasured
        run) is added to its base.
        """
        generator = torch.Generator().manual_seed(0)
        channels = batch_inputs.shape[1]

        def square(side: int):
            inputs = torch.randn(1, channels, side, side, generator=generator).to(batch_inputs)
            return inputs, dict(img_shape=(side, side), ori_shape=(side, side),
                                pad_shape=(side, side), batch_input_shape=(side, side),
                                scale_factor=(1.0, 1.0))

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
        """The RoI branch of :meth:`_lean_roi_predict` on maps ``x`` with as many proposals and
        detections as the test config allows: the bbox branch on ``rpn.max_per_img`` random
        boxes, the mask branch on ``rcnn.max_per_img`` of them (its cost depends on these counts,
        not on the image; a random image may yield fewer)."""
        head = self.roi_head
        num_proposals = self._max_proposals()
        num_dets = min(self._max_detections(), num_proposals)
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
