"""Mask R-CNN with fewer live maps, whole or in tiles within a memory budget: :class:`LeanMaskRCNN`.

Whole, it gives stock's detections bit for bit (each operation stock's, on the same whole tensor);
the stream, tiles, ``mode='auto'`` and the keys: ``docs/lean_detection.md``. Training is stock's.
"""
import math
import tempfile
from functools import partial
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
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

from ..inference import det_stream
from ..inference.det_stream import FeatureWindow
from ..inference.fpn_data_flow import fpn_in_data_flow_order, fpn_rows, why_not_data_flow_fpn
from ..inference.row_stream import (Crop, LevelByLevelBackbone, NotRowLocal, RowMap, TensorRows,
                                    TokenMaps, band_rows_for, check_token_folder, conv_halo,
                                    why_not_norms)
from ..inference.scene_input import preprocessed_rows, stage_reporter, valid_pixels
from ..inference.settings import DetectorSettings, LeanSettingsMixin
from ..inference.sharding import EMPTY, Shard, SlabRows, trunk_rows_read
from ..utils.ckpt_load import refuse_headless_load
from ..utils.memory_budget import (MB, MemoryModel, MemoryPlanMixin, Plan, calibrate,
                                   measure_peak_growth_mb, read_budget_mb, release_free_heap)
from . import tiled_inference as tiling
from .box_masks import box_mask_rle

# The stream's bands of rows (MB) when test_cfg.band_mb gives none (band_mb is read by the stream
# alone, as the segmentor's): the segmentor's CPU default; the bands' work is counted as this many
# bands at once, and a little slack besides.
STREAM_BAND_MB = 128
STREAM_WORK_BANDS = 2.5
STREAM_SLACK_MB = 64
# A core's RPN runs over pieces of its rows, and its RoI heads over pieces of its boxes, each
# piece's largest map at most this part of a band: a step holds a few maps of that size at once
# (its input, its output, the copies the next layer makes), so that the heads of a core stay
# well below the window of features they read.
STREAM_PIECE_OF_BAND = 1 / 8


@MODELS.register_module()
class LeanMaskRCNN(LeanSettingsMixin, MemoryPlanMixin, MaskRCNN):
    """mmdet's ``MaskRCNN`` whose ``predict`` keeps fewer full-resolution maps alive."""
    SETTINGS = DetectorSettings
    LEAN_PATHS = ('fpn', 'rpn', 'roi', 'stream')

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # a file without weights for a head is an error, never a silently random head
        self.register_load_state_dict_post_hook(refuse_headless_load)
        self._check_parts()  # a malformed test_cfg, or parts it cannot run

    # ------------------------------------------------------------------ what the parts allow
    def why_not(self, path: str) -> Optional[str]:
        """None if the parts allow the lean ``path``, else why not: 'fpn' backbone + FPN in
        data-flow order, 'rpn' the RPN's in-place ReLU, 'roi' the RoI steps run here (tiles and
        auto need them), 'stream' the trunk streamed and the heads core by core."""
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
        if path == 'stream':
            return self._why_not_stream()
        if not isinstance(backbone, LevelByLevelBackbone):  # path == 'fpn'
            return f'the backbone {type(backbone).__name__} makes its levels all at once'
        return why_not_data_flow_fpn(neck, FPN, extra_levels=True)

    def _why_not_stream(self) -> Optional[str]:
        """Why the parts cannot run ``mode='stream'`` (None if they can): the XCiT trunk streamed,
        mmdet's FPN and RPN by rows, the stock RoI head, norms that are per pixel."""
        backbone, neck, rpn = self.backbone, getattr(self, 'neck', None), self.rpn_head
        if not hasattr(backbone, 'stream_trunk'):
            return f'{type(backbone).__name__} cannot stream its trunk (XCiTBackbone can)'
        why = (self.why_not('roi') or self.why_not('rpn') or why_not_norms(backbone)
               or why_not_data_flow_fpn(neck, FPN, extra_levels=True))
        if why:
            return why
        if conv_halo(rpn.rpn_conv) is None or conv_halo(rpn.rpn_cls) or conv_halo(rpn.rpn_reg):
            return "the RPN head must be mmdet's RPNHead with one stride-1 same-size conv"
        strides = [s[0] for s in rpn.prior_generator.strides]
        if strides != self._stream_strides():
            return (f'the RPN anchors have strides {strides}, the FPN levels '
                    f'{self._stream_strides()}')
        side = 64
        zeros = next(backbone.parameters()).new_zeros
        levels = [TensorRows(zeros(1, channels, -(-side // stride), -(-side // stride)))
                  for channels, stride in zip(backbone.out_channels, backbone.strides)]
        try:  # the very construction the stream makes, on a 64 px image's placeholder maps
            for level in range(len(levels)):
                backbone.level_rows(TensorRows(zeros(1, 1, 4, 4)), level, (side, side))
            fpn_rows(levels, neck, neck.num_outs - len(levels))
        except NotRowLocal as error:
            return f'the adapter or the FPN: {error}'
        return None

    def _stream_strides(self) -> List[int]:
        """The FPN outputs' strides: the backbone's, then x2 for each extra level."""
        strides = list(self.backbone.strides)
        for _ in range(self.neck.num_outs - len(strides)):
            strides.append(strides[-1] * 2)
        return strides

    def _check_parts(self) -> None:
        """The lean paths ``test_cfg`` asks for, refused where the parts rule them out."""
        name, settings = type(self).__name__, self.test_settings
        why = settings.mode == 'stream' and self.why_not('stream')
        if why:
            raise ValueError(f"{name}: test_cfg.mode='stream' needs {why}; use mode='tiles'")
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
            plan, cores = settings.mode, settings.cores_per_window()
            if plan == 'auto':
                B, _, H, W = batch_inputs.shape
                what = f'{name} ({B} image{"s" if B > 1 else ""} of {H}x{W} px)'
                plans = self.memory_plans(batch_inputs, batch_data_samples, rescale)
                chosen = self._choose_memory_plan(plans, settings.max_memory, what)
                plan, cores = chosen.name, chosen.window_cores
            if plan == 'whole':
                return self._predict_whole(batch_inputs, batch_data_samples, rescale)
            if plan in ('stream', 'stream-disk'):
                folder = self._token_folder(batch_inputs.shape[2:], plan)
                results_list = [self.stream_detections(batch_inputs[i:i + 1], meta, folder,
                                                       cores)
                                for i, meta in enumerate(batch_img_metas)]
            else:
                results_list = self._tile_detections(batch_inputs, batch_img_metas)
            results_list = self._paste_masks(results_list, batch_img_metas, rescale)
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
        outs = fpn_in_data_flow_order(self.backbone, neck, batch_inputs)
        for _ in range(neck.num_outs - len(outs)):  # extra levels as FPN makes them
            outs.append(F.max_pool2d(outs[-1], 1, stride=2))
        return outs

    def _lean_rpn_predict(self, x: List[Tensor], batch_data_samples: SampleList):
        """``rpn_head.predict(x, batch_data_samples, rescale=False)`` with an in-place ReLU: each
        level's conv map freed once its scores and box deltas exist."""
        head = self.rpn_head
        if self.why_not('rpn'):
            return head.predict(x, batch_data_samples, rescale=False)
        cls_scores, bbox_preds = [], []
        for feat in x:
            hidden = F.relu_(head.rpn_conv(feat))
            cls_scores.append(head.rpn_cls(hidden))
            bbox_preds.append(head.rpn_reg(hidden))
            del hidden
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
        output has them (other classes zero: it reads the detection's class only): stock's masks.
        With ``test_cfg.mask_format='rle'``, the same masks as COCO RLEs (:meth:`_rle_masks`)."""
        if self.test_settings.mask_format == 'rle':
            return [self._rle_masks(results, meta, rescale)
                    for results, meta in zip(results_list, batch_img_metas)]
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

    def _rle_masks(self, results: InstanceData, meta: dict, rescale: bool) -> InstanceData:
        """``FCNMaskHead.predict_by_feat``'s output for one image, its masks a list of COCO RLEs
        (``{'size': [H, W], 'counts': bytes}``, as ``CocoMetric`` takes them) instead of an
        (N, H, W) tensor: each mask pasted as mmdet pastes it, but over its box alone. The boxes
        are rescaled to the original image as mmdet's mask head rescales them."""
        logits = results.pop('mask_logits')
        results.pop('cut', None)
        h, w = meta['ori_shape'][:2]
        w_scale, h_scale = meta['scale_factor'][:2]
        if rescale:
            results.bboxes = results.bboxes / results.bboxes.new_tensor(
                [w_scale, h_scale, w_scale, h_scale])
        else:  # the network's scale, rounded as mmdet rounds it
            h, w = int(np.round(h * float(h_scale))), int(np.round(w * float(w_scale)))
        threshold = self.roi_head.test_cfg.mask_thr_binary
        results.masks = [box_mask_rle(one, box, (h, w), threshold)
                         for one, box in zip(logits, results.bboxes)]
        return results

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

    # ------------------------------------------------------------------ stream
    def stream_instances(self, read_rows: Callable[[int, int], 'np.ndarray'],
                         image_hw: Tuple[int, int], max_memory: Optional[float] = None,
                         token_dir: Optional[str] = None, progress: Optional[Callable] = None,
                         valid_rows: Optional[Callable[[int, int], 'np.ndarray']] = None,
                         shard: Optional[Shard] = None) -> Iterator[InstanceData]:
        """The instances of an image larger than memory, a row of cores at a time (each object
        once): ``InstanceData`` with ``bboxes`` (x1, y1, x2, y2 in the
        image's pixels), ``scores``, ``labels`` and ``mask_logits`` (N, side, side), the mask
        head's logits of each one's class over its box (``box_masks.paste_in_box`` makes the mask).

        ``read_rows(a, b)``: rows a..b-1 as mmcv reads them ((b - a, W, C), BGR), preprocessed
        here as the model's data preprocessor would. ``valid_rows(a, b)``: which of them hold data
        (bool (b - a, W)); tokens without any are left out of XCA's sums. Under ``max_memory``
        (MB) the token maps go to ``token_dir`` where memory would not hold them. ``progress``:
        as ``LeanEncoderDecoder.stream_labels``' (stages 'trunk', then 'cores').

        With a ``shard`` (``xcit_mm.models.inference.sharding.Shard``), this process is one rank
        of the scene's sharded stream (docs/sharded_stream.md): every rank calls this with the
        same scene, the trunk is shared out as the segmentor's, and each rank yields its rows of
        cores *not merged* (:meth:`stream_cores`); :meth:`merge_core_rows` over every rank's
        rows, in rank order, gives what one process yields.

        The parts, the budget and the token folder are checked here, before the image is read;
        the work runs as the instances are iterated."""
        name = type(self).__name__
        why = self.why_not('stream')
        if why is not None:
            raise ValueError(f'{name}.stream_instances: cannot stream: {why}')
        device = next(self.parameters()).device
        token_rows = kept_rows = None  # a rank's token maps hold its share of the rows
        if shard is not None:
            slab = shard.slab(image_hw[0], self.backbone.patch_size)
            token_rows, kept_rows = self.backbone.rank_token_rows(
                slab.grid_rows, (slab.first, slab.stop), self._rank_core_rows(shard, image_hw)[1])
        # no budget: the token maps in memory unless test_cfg says disk, windows as test_cfg
        plan = self._stream_plans(image_hw, token_rows, kept_rows=kept_rows)[0]
        if max_memory is not None:
            budget = read_budget_mb(dict(max_memory=max_memory), name)
            plan = self._choose_memory_plan(
                self._stream_plans(image_hw, token_rows, budget, kept_rows), budget,
                f'{name} on {image_hw[0]}x{image_hw[1]} px')
        folder = self._token_folder(image_hw, plan.name, token_dir, token_rows, kept_rows)
        read_pixels = partial(preprocessed_rows, self.data_preprocessor, read_rows, device)
        valid = (None if valid_rows is None else
                 partial(valid_pixels, valid_rows, image_hw[1], device))
        meta = dict(img_shape=tuple(image_hw), ori_shape=tuple(image_hw),
                    pad_shape=tuple(image_hw), batch_input_shape=tuple(image_hw),
                    scale_factor=(1., 1.))

        def instances() -> Iterator[InstanceData]:
            was_training = self.training
            self.eval()
            try:
                rows = self.stream_cores(read_pixels, image_hw, meta, folder, progress, valid,
                                         shard, plan.window_cores)
                for dets in rows if shard is not None else self.merge_core_rows(rows):
                    yield dets.cpu()
            finally:
                self.train(was_training)

        return instances()

    def _stream_plans(self, image_hw: Sequence[int], token_rows: Optional[int] = None,
                      budget_mb: Optional[float] = None,
                      kept_rows: Optional[int] = None) -> List[Plan]:
        """The stream's plans, token maps in memory then on disk (docs/lean_detection.md): the
        maps (a rank's ``token_rows`` and ``kept_rows``, :meth:`XCiTBackbone.token_maps_mb`;
        default all), the window of feature rows, the bands' work and the RoI heads' fixed part.
        The windows are as wide as ``test_cfg.window_width`` says, else the whole width; then,
        where a ``budget_mb`` is given and neither plan fits it, a third plan with the maps on
        disk and windows over the widest bands of core columns that fit (one core at least)."""
        settings, backbone, neck = self.test_settings, self.backbone, self.neck
        H, W = image_hw
        kept, maps_mb = backbone.token_maps_mb(image_hw, token_rows, kept_rows)
        rows = max(b - a for a, b in self._core_rows_and_windows(image_hw)[1])  # one buffer
        core_cols = det_stream.core_edges(W, settings.tile_size[1])
        margin = self._window_margin()
        band_mb = settings.band_mb or STREAM_BAND_MB
        num_proposals, num_dets = self._max_boxes()
        # the RoI heads at their most boxes as if whole: an upper bound of their pieces
        roi_mb = 3 * (num_proposals * self._roi_map_bytes('bbox')
                      + num_dets * self._roi_map_bytes('mask')) / MB
        maps = f'{kept} token maps of {maps_mb / kept:.0f} MB'

        def on_disk(cores: Optional[int]) -> Plan:
            """The plan with the maps on disk and windows of ``cores`` core columns."""
            groups = det_stream.column_windows(core_cols, cores, margin, W)
            width = max(group.right - group.left for group in groups)
            window_mb = det_stream.window_mb(width, rows, neck.out_channels,
                                             self._stream_strides())
            # a band is one row of the finest level at least, however wide the window
            work_mb = STREAM_WORK_BANDS * max(band_mb, self._window_row_bytes_per_px() * width
                                              / MB)
            columns = '' if len(groups) == 1 else f' x {width} columns ({len(groups)} bands)'
            return Plan('stream-disk', window_mb + work_mb + roi_mb + STREAM_SLACK_MB,
                        f'({maps} on disk, windows of {rows} rows{columns}: {window_mb:.0f} MB)',
                        window_cores=cores)

        cores = settings.cores_per_window()
        disk = on_disk(cores)
        plans = [Plan('stream', maps_mb + disk.estimate_mb,
                      disk.detail.replace('on disk', 'in memory'), window_cores=cores), disk]
        if (cores is None and budget_mb is not None and disk.estimate_mb > budget_mb
                and len(core_cols) > 1):
            narrower = [on_disk(n) for n in range(len(core_cols) - 1, 0, -1)]
            plans.append(next((plan for plan in narrower if plan.estimate_mb <= budget_mb),
                              narrower[-1]))
        return plans

    def _window_row_bytes_per_px(self) -> float:
        """The bytes of one row of the finest FPN level in every map a window makes it from
        (``FeatureWindow.row_bytes``), per pixel column of the window: measured once, on zero
        trunk maps of a small scene, a row made in eval mode."""
        if getattr(self, '_row_bytes_per_px', None) is None:
            side, backbone = 4 * det_stream.ALIGN, self.backbone
            cells = -(-side // backbone.patch_size)
            zeros = next(self.parameters()).new_zeros
            trunk = [TensorRows(zeros(1, backbone.embed_dims, cells, cells))
                     for _ in backbone.out_indices]
            window = self._window(trunk, (side, side), det_stream.ColumnWindow(range(1), 0, side))
            window.band_mb = 0  # one row a band
            was_training = self.training
            self.eval()
            try:
                with torch.no_grad():
                    window.move(0, self._stream_strides()[0])
            finally:
                self.train(was_training)
            self._row_bytes_per_px = window.row_bytes() / side
        return self._row_bytes_per_px

    def _token_folder(self, image_hw: Sequence[int], plan: str,
                      token_dir: Optional[str] = None,
                      token_rows: Optional[int] = None,
                      kept_rows: Optional[int] = None) -> Optional[str]:
        """Where the stream's token maps go: None (memory) unless ``test_cfg.token_maps`` is
        'disk' or the plan is the disk one; else ``token_dir``, ``test_cfg.token_dir`` or the
        temporary folder, checked for room and refused on tmpfs (memory the budget does not
        see), before any work."""
        settings = self.test_settings
        if not (plan == 'stream-disk' or settings.token_maps == 'disk'):
            return None
        folder = token_dir or settings.token_dir or tempfile.gettempdir()
        plans = self._stream_plans(image_hw, token_rows, kept_rows=kept_rows)
        check_token_folder(folder, (plans[0].estimate_mb - plans[1].estimate_mb) * MB)
        return folder

    def stream_detections(self, image: Tensor, meta: dict, folder: Optional[str] = None,
                          window_cores: Optional[int] = None) -> InstanceData:
        """One preprocessed image (1, C, H, W) by :meth:`stream_cores`, all its detections
        (network coordinates, each with its class's mask logits), best scored first; the token
        maps in ``folder`` if given, else in memory; windows of ``window_cores`` core columns
        (None: the whole width)."""
        dets = InstanceData.cat(list(self.merge_core_rows(self.stream_cores(
            lambda a, b: image[:, :, a:b], tuple(image.shape[2:]), meta, folder,
            window_cores=window_cores))))
        return dets[dets.scores.argsort(descending=True, stable=True)]

    @torch.no_grad()
    def stream_cores(self, read_pixels: Callable[[int, int], Tensor], image_hw: Tuple[int, int],
                     meta: dict, folder: Optional[str] = None,
                     progress: Optional[Callable] = None,
                     valid: Optional[Callable[[int, int], Tensor]] = None,
                     shard: Optional[Shard] = None,
                     window_cores: Optional[int] = None) -> Iterator[InstanceData]:
        """The detections of a scene read by ``read_pixels(a, b)`` (preprocessed rows a..b-1 of
        the network input, (1, C, b - a, W)), one row of cores after another, not yet merged
        (docs/lean_detection.md): the trunk streamed over the whole scene into token maps (in
        ``folder`` if given, else in memory), then for each core its proposals, detections and
        mask logits on the scene's own features. Each row of cores comes as one
        ``InstanceData`` whose ``next_top`` (metainfo) is the next row's top pixel row (None for
        the last); :meth:`merge_core_rows` keeps each object once. ``meta``: the image's
        (``img_shape`` clips the boxes).

        With a ``shard``, the rows of cores whose top lies in this rank's slab, on the trunk
        sharded as the segmentor's (the rows their windows read made exactly).

        With ``window_cores``, the windows of a row of cores cover bands of that many core
        columns (:func:`~..inference.det_stream.column_windows`), one band after the other, so
        that a window's memory does not grow with the scene's width; each band's rows are made
        anew from the token maps (the rows two rows of cores share are made twice)."""
        settings, backbone = self.test_settings, self.backbone
        band_mb = settings.band_mb or STREAM_BAND_MB
        H, W = image_hw
        report = stage_reporter(progress)
        layers = max(backbone.out_indices) + 1
        token_rows = -(-H // backbone.patch_size)
        done = [0]

        def layer_done() -> None:
            done[0] += token_rows
            report(done[0], layers * token_rows, 'trunk')

        all_rows, windows = self._core_rows_and_windows(image_hw)
        core_cols = det_stream.core_edges(W, settings.tile_size[1])
        bands = det_stream.column_windows(core_cols, window_cores, self._window_margin(), W)
        mine = range(len(all_rows))
        trunk_kwargs = {} if valid is None else dict(valid_pixels=valid)
        if shard is not None:
            mine, read = self._rank_core_rows(shard, image_hw)
            trunk_kwargs.update(shard=shard, read_rows=read)
        with TokenMaps(next(self.parameters()).device, folder) as maps:
            report(0, layers * token_rows, 'trunk')
            trunk = backbone.stream_trunk(read_pixels, image_hw, maps, band_mb, layer_done,
                                          **trunk_kwargs)
            whole_width = self._window(trunk, image_hw, bands[0]) if len(bands) == 1 else None
            total = len(mine) * len(core_cols)
            report(0, total, 'cores')
            for done_rows, i in enumerate(mine):
                row = []
                for band in bands:
                    window = whole_width or self._window(trunk, image_hw, band)
                    window.move(*windows[i])
                    for j in band.cores:
                        row.append(self._core_detections(window, (all_rows[i], core_cols[j]),
                                                         meta))
                        report(done_rows * len(core_cols) + j + 1, total, 'cores')
                    del window  # a band's window goes before the next one's is made
                dets = InstanceData.cat(row)
                dets.set_metainfo(dict(
                    next_top=all_rows[i + 1][0] if i + 1 < len(all_rows) else None))
                yield dets

    def _window(self, trunk: Sequence[RowMap], image_hw: Sequence[int],
                band: det_stream.ColumnWindow) -> FeatureWindow:
        """The window over a band of the scene's columns (``band.left:band.right``): the FPN
        levels as row maps made from those columns of the trunk maps alone."""
        p, H = self.backbone.patch_size, image_hw[0]
        if (band.left, band.right) != (0, image_hw[1]):
            first, stop = band.left // p, -(-band.right // p)
            trunk = [Crop(m, 0, first, m.height, stop - first) for m in trunk]
        levels = [self.backbone.level_rows(trunk_map, i, (H, band.right - band.left))
                  for i, trunk_map in enumerate(trunk)]
        return FeatureWindow(fpn_rows(levels, self.neck, self.neck.num_outs - len(levels)),
                             self._stream_strides(), self.test_settings.band_mb or STREAM_BAND_MB,
                             band.left)

    def merge_core_rows(self, rows: Iterable[InstanceData]) -> Iterator[InstanceData]:
        """The rows of cores of :meth:`stream_cores`, in the scene's order (from one process, or
        every rank's in rank order), through the whole image's class-wise NMS across the cores
        (:class:`~..inference.det_stream.CoreRowMerge`): after each row, the detections no later
        core can duplicate."""
        merge = det_stream.CoreRowMerge(self.roi_head.test_cfg.nms,
                                        self.test_settings.feature_margin)
        for row in rows:
            yield merge.add_row(row, row.metainfo['next_top'])

    def _core_rows_and_windows(self, image_hw: Sequence[int]):
        """The rows of cores (pixel rows (top, bottom)) and the window of each, all as tall as
        the tallest, with at least a cell of every level above and below each row of cores (the
        RPN conv's context)."""
        settings, H = self.test_settings, image_hw[0]
        core_rows = det_stream.core_edges(H, settings.tile_size[0])
        margin = self._window_margin()
        tallest = max(b - a for a, b in core_rows) + 2 * margin
        return core_rows, [det_stream.window_rows(rows, margin, H, tallest)
                           for rows in core_rows]

    def _window_margin(self) -> int:
        """How far (pixels) a window reaches past its cores: ``feature_margin``, and at least a
        cell of every level (the RPN conv's context)."""
        return max(self.test_settings.feature_margin, det_stream.ALIGN)

    def _rank_core_rows(self, shard: Shard, image_hw: Sequence[int]):
        """The rows of cores (indices) that this rank runs: those whose top pixel row lies in
        its slab, so that the token rows it makes are mostly its own; and the token rows their
        windows read."""
        first, stop = shard.slab(image_hw[0], self.backbone.patch_size).pixel_rows
        core_rows, windows = self._core_rows_and_windows(image_hw)
        mine = [i for i, (top, _) in enumerate(core_rows) if first <= top < stop]
        if not mine:
            return mine, EMPTY
        return mine, self._window_trunk_rows(image_hw, windows[mine[0]][0], windows[mine[-1]][1])

    def _window_trunk_rows(self, image_hw: Sequence[int], top: int, bottom: int):
        """The token rows of the trunk maps that every FPN level's rows under pixel rows
        ``[top, bottom)`` are made from (as the windows there read them), one span."""
        p = self.backbone.patch_size
        grid = [-(-side // p) for side in image_hw]
        placeholders = [SlabRows(*grid) for _ in self.backbone.out_indices]
        levels = [self.backbone.level_rows(m, i, image_hw) for i, m in enumerate(placeholders)]
        outs = fpn_rows(levels, self.neck, self.neck.num_outs - len(levels))
        spans = [trunk_rows_read(level, *det_stream.cells(top, bottom, stride, level.height),
                                 placeholders)
                 for level, stride in zip(outs, self._stream_strides())]
        spans = [span for span in spans if span != EMPTY]
        if not spans:
            return EMPTY
        return min(a for a, _ in spans), max(b for _, b in spans)

    def _core_detections(self, window: FeatureWindow, core, meta: dict) -> InstanceData:
        """One core's detections: its anchors' proposals, the RoI heads on the window's features
        around it (RoIs shifted to the window; boxes decoded and clipped on the scene), each with
        its class's mask logits."""
        return self._core_roi(window, core, self._core_proposals(window, core, meta), meta)

    def _core_proposals(self, window: FeatureWindow, core, meta: dict) -> InstanceData:
        """The RPN's proposals from the anchors of one core (scene coordinates): each level's
        cells of the core with a cell of context for the RPN conv, the scene's anchors there."""
        rpn = self.rpn_head
        (y0, y1), (x0, x1) = core
        halo = conv_halo(rpn.rpn_conv)
        cls_scores, bbox_preds, priors = [], [], []
        for level, stride in enumerate(self._stream_strides()):
            size = window.cells_hw(level)
            (r0, r1) = det_stream.cells(y0, y1, stride, size[0])
            (c0, c1) = det_stream.cells(x0, x1, stride, size[1])
            left = c0 - max(0, c0 - halo)
            piece = self._stream_piece(4 * rpn.rpn_conv.out_channels * (c1 - c0 + 2 * halo))
            scores, deltas = [], []
            for a in range(r0, r1, piece):  # pieces of rows, each with its halo
                b = min(r1, a + piece)
                feat = window.crop(level, (a - halo, b + halo), (c0 - halo, c1 + halo))
                top = a - max(0, a - halo)
                hidden = F.relu_(rpn.rpn_conv(feat))[:, :, top:top + b - a, left:left + c1 - c0]
                scores.append(rpn.rpn_cls(hidden)[0])
                deltas.append(rpn.rpn_reg(hidden)[0])
                del hidden
            cls_scores.append(torch.cat(scores, dim=1))
            bbox_preds.append(torch.cat(deltas, dim=1))
            anchors = rpn.prior_generator.single_level_grid_priors(
                (r1 - r0, c1 - c0), level, dtype=cls_scores[-1].dtype,
                device=cls_scores[-1].device)
            priors.append(anchors + anchors.new_tensor([c0 * stride, r0 * stride] * 2))
        return rpn._predict_by_feat_single(cls_scores, bbox_preds, [None] * len(priors), priors,
                                           meta, rpn.test_cfg, rescale=False)

    def _stream_piece(self, item_bytes: int) -> int:
        """How many rows or boxes of ``item_bytes`` bytes each (of a step's largest map) a core's
        heads take at once: :data:`STREAM_PIECE_OF_BAND` of a band."""
        band_mb = self.test_settings.band_mb or STREAM_BAND_MB
        return band_rows_for(band_mb * STREAM_PIECE_OF_BAND, item_bytes)

    def _roi_map_bytes(self, branch: str) -> int:
        """Bytes per box of the largest map of the RoI heads' ``branch``: 'bbox', its RoI
        features (channels x 7 x 7 for Mask R-CNN); 'mask', its upsampled map (channels x 28 x
        28)."""
        head = self.roi_head
        if branch == 'bbox':
            extractor = head.bbox_roi_extractor
            return 4 * extractor.out_channels * extractor.roi_layers[0].output_size[0] ** 2
        classes, side = self._mask_shape()
        return 4 * max(head.mask_head.conv_out_channels, classes) * side * side

    def _in_pieces(self, forward, feats, rois: Tensor, keys: Sequence[str],
                   roi_bytes: int) -> dict:
        """``forward(feats, rois)``'s ``keys``, run on pieces of ``rois`` (:meth:`_stream_piece`
        of ``roi_bytes`` each) and joined: the same values, a piece's maps at a time."""
        piece = self._stream_piece(roi_bytes)
        parts = [forward(feats, rois[i:i + piece]) for i in range(0, len(rois), piece)]
        return {key: torch.cat([part[key] for part in parts]) for key in keys}

    def _core_roi(self, window: FeatureWindow, core, proposals: InstanceData,
                  meta: dict) -> InstanceData:
        """The RoI heads on a core's proposals, reading the window's features: all the rows it
        holds (``feature_margin`` above and below the core) over its width (the scene's, or a
        band of columns reaching ``feature_margin`` and more past the core), so a box reaching
        past the core reads the scene's features, not a crop's edge.

        The window's tensors are used as they are: mmcv's CPU RoIAlign reads a map's raw memory
        as contiguous NCHW, which they are, and its cost is per RoI, not per pixel of the map,
        so reading the whole width needs no copy and no more time."""
        head = self.roi_head
        feats = tuple(window.held[level].contiguous()  # a no-op: each is one tensor already
                      for level in range(len(head.bbox_roi_extractor.featmap_strides)))
        rois = bbox2roi([proposals.bboxes])
        shift = rois.new_tensor([0, window.left, window.top, window.left, window.top])
        if rois.shape[0] == 0:
            dets = InstanceData(bboxes=rois.new_zeros((0, 4)), scores=rois.new_zeros((0, )),
                                labels=rois.new_zeros((0, ), dtype=torch.long))
        else:
            out = self._in_pieces(head._bbox_forward, feats, rois - shift,
                                  ('cls_score', 'bbox_pred'), self._roi_map_bytes('bbox'))
            dets = head.bbox_head.predict_by_feat(
                rois=(rois, ), cls_scores=(out['cls_score'], ), bbox_preds=(out['bbox_pred'], ),
                batch_img_metas=[meta], rcnn_test_cfg=head.test_cfg, rescale=False)[0]
            del out
        side = self._mask_shape()[1]
        if len(dets) == 0:
            dets.mask_logits = rois.new_zeros((0, side, side))
            return dets
        mask_preds = self._in_pieces(head._mask_forward, feats, bbox2roi([dets.bboxes]) - shift,
                                     ('mask_preds', ), self._roi_map_bytes('mask'))['mask_preds']
        dets.mask_logits = mask_preds[torch.arange(len(dets)),
                                      dets.labels if mask_preds.shape[1] > 1 else 0]
        dets.scores, dets.labels = dets.scores.clone(), dets.labels.clone()
        return dets

    # ------------------------------------------------------------------ memory plans
    def memory_plans(self, batch_inputs: Tensor, batch_data_samples: SampleList,
                     rescale: bool = True) -> List[Plan]:
        """The plans of ``mode='auto'``, whole then tiles (their estimates: docs/)."""
        settings, model = self.test_settings, self.network_memory_model(batch_inputs)
        batch_img_metas = [data_sample.metainfo for data_sample in batch_data_samples]
        max_per_img = self._max_boxes()[1]
        channels, side = self._mask_shape()
        fmt = settings.mask_format
        # the heap a network run leaves (the line's base) is still resident while masks are pasted
        paste_mb = model.base_mb + tiling.paste_estimate_mb(batch_img_metas, rescale, max_per_img,
                                                            channels, side, fmt)
        B, _, H, W = batch_inputs.shape
        grids = self._tile_grids(batch_inputs, batch_img_metas)
        divisor = getattr(self.data_preprocessor, 'pad_size_divisor', 1)
        tile_px = max(math.prod(tiling.padded_hw(t, batch_inputs.shape, divisor))
                      for tiles in grids for t in tiles)
        # a tile's detection until the merge: box, score, label (int64), cut flag, mask logits
        held_mb = sum(map(len, grids)) * max_per_img * (4 * 4 + 4 + 8 + 1 + 4 * side**2) / MB
        rows = len({t.y0 for t in grids[0]})
        th, tw = settings.tile_size

        def pasting(network_mb: float, pasting_mb: float, count: int) -> str:
            """Words for a plan whose peak is pasting whole-image masks, naming the fix."""
            if fmt == 'rle' or pasting_mb <= network_mb:
                return ''
            return (f', set by pasting up to {count} masks of the whole image: test_cfg.'
                    "mask_format='rle' pastes each in its box")

        whole_mb = B * model.estimate_mb(H * W)
        whole = Plan('whole', max(whole_mb, paste_mb),
                     f'{H}x{W}' + pasting(whole_mb, paste_mb, B * max_per_img))
        tiles = Plan('tiles', max(model.estimate_mb(tile_px), paste_mb) + held_mb,
                     f'{rows}x{len(grids[0]) // rows} tiles of {th}x{tw} px, overlap '
                     f'{settings.tile_overlap} px'
                     + pasting(model.estimate_mb(tile_px), paste_mb, B * max_per_img))
        if self.why_not('stream'):
            return [whole, tiles]
        # the stream holds every core's detections until the masks are pasted, and each core
        # keeps up to max_per_img of them: predict pastes them all at the image's size
        cores = (len(det_stream.core_edges(H, th)) * len(det_stream.core_edges(W, tw)))
        stream_held_mb = cores * max_per_img * (4 * 4 + 4 + 8 + 4 * side**2) / MB
        margin = self._window_margin()
        stream_paste_mb = model.base_mb + tiling.paste_estimate_mb(
            batch_img_metas, rescale, cores * max_per_img, channels, side, fmt,
            box_width=min(W, tw + 2 * margin))
        streams = [Plan(p.name, max(p.estimate_mb + stream_held_mb, stream_paste_mb),
                        p.detail + pasting(p.estimate_mb + stream_held_mb, stream_paste_mb,
                                           cores * max_per_img))
                   for p in self._stream_plans((H, W), budget_mb=settings.max_memory)]
        return [whole] + streams + [tiles]

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
