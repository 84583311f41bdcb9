"""mmseg's ``EncoderDecoder`` whose ``predict`` gives stock's labels (and logits, when kept)
without full-size logits of all classes; ``mode='stream'`` is equal up to float rounding. Why
each step is exact, and the ``test_cfg`` keys: ``docs/lean_segmentation.md``."""
import inspect
import logging
import math
import tempfile
from contextlib import contextmanager
from functools import partial
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

import torch
from mmengine.logging import print_log
from mmengine.structures import PixelData
from torch import Tensor

from mmseg.models.decode_heads import FPNHead, UPerHead
from mmseg.models.decode_heads.decode_head import BaseDecodeHead
from mmseg.models.necks import FPN
from mmseg.models.segmentors import EncoderDecoder
from mmseg.models.utils import resize
from mmseg.registry import MODELS
from mmseg.structures import SegDataSample
from mmseg.utils import OptSampleList, SampleList

from ..inference.fpn_data_flow import (fpn_in_data_flow_order, uper_head_in_data_flow_order,
                                       why_not_data_flow_fpn)
from ..inference.row_stream import (Crop, LevelByLevelBackbone, TensorRows, TokenMaps,
                                    check_token_folder, stream_rows, why_not_norms)
from ..inference.scene_input import preprocessed_rows, stage_reporter, valid_pixels
from ..inference.seg_stream import (PyramidPooling, labels_rows, logits_rows, run_poolings,
                                    valid_cells_of, why_not_by_rows)
from ..inference.sharding import Shard, SlabRows, trunk_rows_read
from ..inference.settings import LeanSettingsMixin, SegmentorSettings
from ..utils.ckpt_load import refuse_headless_load
from ..utils.memory_budget import (MB, MemoryModel, MemoryPlanMixin, Plan, calibrate,
                                   measure_line, process_budget, read_budget_mb,
                                   release_free_heap)

# Chunk widths whose bilinear results equal the full call's, channel by channel: torch's CPU
# kernels take another path for 1 channel, and channels-last below 24 or off multiples of 8.
CHUNK_MULTIPLE = 8
MIN_CHUNK_CHANNELS_LAST = 24
# The stream's bands when test_cfg.band_mb gives none, shrunk under a budget down to the minimum.
STREAM_BAND_MB = dict(cpu=128, cuda=4096)
MIN_STREAM_BAND_MB = 32
# Square sizes at which the network's peak is measured (mode='auto'): cheap, and spread enough
# that a size whose peak sits off the line moves the fitted slope little.
CALIBRATION_SIZES = ((256, 256), (512, 512), (896, 896))
CALIBRATION_PIXELS = max(h * w for h, w in CALIBRATION_SIZES)
# The longer side (and half of it) at which the post-processing is measured: far below any budget.
POST_CALIBRATION_SIDE = 384
MARGIN = 1.05  # both lines are extrapolated far beyond the sizes measured
STRIDE_PROBE = 128  # input side of the forward that finds the head's output stride
LABEL_BYTES = 8  # the labels (int64) each image keeps until predict returns
FLOAT_BYTES = 4
# What the stream's shape-counted terms leave out (kernels' scratch, the allocator's rounding), and
# its work beyond the token maps: a fixed part and bands of band_mb (docs/gigapixel.md).
SLACK_MB = 16
STREAM_WORK_MB = 64
STREAM_WORK_BANDS = 2.5
# The trunk stage's work beyond its token maps, in bands of its FFN hidden layer: the band's
# tokens, the attention's pieces, the activation's copy and the rows written out come on top of
# the hidden layer itself (benchmarks/trunk_stage_peak.py, docs/gigapixel.md).
TRUNK_WORK_BANDS = 6
# The labels' least work, whatever the band: even a band of one row makes a few rows of every
# level, with the rows of context each conv reads and the rows kept for the next band, all as wide
# as the image. Measured once per model with bands of one row on a scene of this many pixel rows,
# at these widths, as a line in the width.
LABEL_FLOOR_ROWS = 64
LABEL_FLOOR_WIDTHS = (2048, 4096)
# Bytes per input element that mmseg's doors hold while predict runs (float batch, uint8 image).
INPUT_BYTES = 4 + 1
# The post-processing counted from its shapes, above what is measured (_whole_bound_mb): copies of
# a class chunk at full size alive at once (the head's resize and its flip, then the flip and the
# resize to the original shape: two at a time); bytes per output pixel
# that each image's running argmax keeps (best value, label) and that one image's update holds
# for a moment (the chunk's maximum and its index, the comparison, the two blends).
POST_CHUNK_COPIES = 2
POST_ARGMAX_KEPT_BYTES = 4 + 8
POST_ARGMAX_STEP_BYTES = 4 + 8 + 1 + 4 + 8
# Full-resolution copies of a class chunk alive at once in the stream's last steps (a bilinear
# resize's source rows, two gathered rows and their blend; the softmax's exponentials), and the
# rows of a band a chunk is sized for: few classes at once where the image is wide.
STREAM_CHUNK_COPIES = 6
STREAM_CHUNK_ROWS = 8
# stream_labels leaves tokens without a valid pixel out of XCA's sums when given valid_rows: the
# labels of the valid part then do not depend on the collar around it (those away from it are the
# part's own, alone), which leaving them in does not give; the caller masks the collar's labels.
MASK_XCA = True


def slide_windows(img_hw: Sequence[int], crop_size: Sequence[int],
                  stride: Sequence[int]) -> List[Tuple[int, int, int, int]]:
    """Stock ``slide_inference``'s windows ``(y1, y2, x1, x2)``, in its order."""
    spans = []  # per axis, each window's (start, end): its end clipped, then the crop before it
    for size, crop, step in zip(img_hw, crop_size, stride):
        grids = max(size - crop + step - 1, 0) // step + 1
        ends = [min(i * step + crop, size) for i in range(grids)]
        spans.append([(max(end - crop, 0), end) for end in ends])
    return [(y1, y2, x1, x2) for y1, y2 in spans[0] for x1, x2 in spans[1]]


def _is_channels_last(x: Tensor) -> bool:
    """Whether torch's resize takes its channels-last kernel for ``x`` (a whole head output)."""
    return (x.dim() == 4 and not x.is_contiguous()
            and x.is_contiguous(memory_format=torch.channels_last))


def _class_slice(x: Tensor, c0: int, c1: int, batch: slice = slice(None)) -> Tensor:
    """``x[batch, c0:c1]`` in the layout (and so through the resize kernel) of the whole ``x``."""
    part = x[batch, c0:c1]
    if _is_channels_last(x):
        part = part.contiguous(memory_format=torch.channels_last)
    return part


class _RunningArgmax:
    """One image's ``argmax`` (and logits, when kept) over class chunks given in class order."""

    def __init__(self, num_classes: int, keep_logits: bool, step_done: Callable[[], None]):
        self.num_classes = num_classes
        self.keep_logits = keep_logits
        self.step_done = step_done  # called between the steps below (LeanEncoderDecoder)
        self.best = self.labels = self.logits = None

    def add(self, c0: int, make_chunk: Callable[[], Tensor]) -> None:
        """Classes [c0, c0 + c) as (c, H, W), made here to be freed before the maximum updates."""
        chunk = make_chunk()
        self.step_done()
        if self.keep_logits:
            if self.logits is None:
                self.logits = chunk.new_empty((self.num_classes, ) + tuple(chunk.shape[1:]))
            self.logits[c0:c0 + chunk.shape[0]] = chunk
        values, index = chunk.max(dim=0, keepdim=True)  # first maximum of the chunk
        del chunk
        self.step_done()
        if self.best is None:
            self.best, self.labels = values, index
            return
        # strictly greater: on a tie the earlier class keeps the pixel, and a NaN beats a
        # number, as in argmax
        better = (values > self.best) | (values.isnan() & ~self.best.isnan())
        self.best = torch.where(better, values, self.best)
        self.labels = torch.where(better, index + c0, self.labels)
        del values, index, better
        self.step_done()


def _whole_kb(mb: float) -> float:
    """``mb`` rounded down to whole KB: bands fitted to a budget that a plan's own estimate gave
    come out as that plan's, not a float rounding above them."""
    return mb if math.isinf(mb) else math.floor(mb * 1024) / 1024


@MODELS.register_module()
class LeanEncoderDecoder(LeanSettingsMixin, MemoryPlanMixin, EncoderDecoder):
    """mmseg's ``EncoderDecoder`` with a lean ``predict``; training is stock's."""
    SETTINGS = SegmentorSettings
    # 'network': backbone, neck and head in data-flow order (Semantic FPN or UperNet); 'resize':
    # the head's resize joins the chunked post-processing; 'stream': mode='stream'
    LEAN_PATHS = ('network', 'resize', 'stream')

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # a file without weights for a head is an error, never a silently random head
        self.register_load_state_dict_post_hook(refuse_headless_load)
        self._release_heap = False  # set by each predict: mode='auto' (_step_done)
        self._head_geometry: Optional[Tuple[float, float, bool]] = None
        self._post_lines = {}  # the post-processing's measured line per batch geometry
        self.test_settings  # a malformed or misspelt key in the config fails at build

    def _settings_context(self) -> dict:
        return dict(default_crop=getattr(self.data_preprocessor, 'size', None))

    def why_not(self, path: str) -> Optional[str]:
        """Why the parts (and ``test_cfg``, for 'stream') rule out a lean path of ``LEAN_PATHS``,
        None if they allow it; asked on every predict, as a part may be replaced after the build."""
        self._check_lean_path(path)
        neck, head = getattr(self, 'neck', None), self.decode_head
        head_name = type(head).__name__
        if path == 'resize':
            if (type(head).predict is BaseDecodeHead.predict
                    and type(head).predict_by_feat is BaseDecodeHead.predict_by_feat):
                return None
            return f"{head_name} overrides the decode head's predict (forward + resize)"
        if path == 'stream':
            settings = self.test_settings
            why_resize, why_network = self.why_not('resize'), self.why_not('network')
            reasons = [
                (not settings.lean, 'it needs the lean predict (test_cfg.lean=False is set)'),
                (settings.keep_seg_logits,
                 'it keeps no full-size logits (remove test_cfg.keep_seg_logits)'),
                (why_resize is not None, why_resize),
                (not isinstance(self.backbone, LevelByLevelBackbone),
                 f'{type(self.backbone).__name__} cannot stream its trunk (XCiTBackbone can)'),
                (why_network is not None, why_network),
                (head.out_channels == 1,
                 'a one-channel (sigmoid) head is thresholded, not an argmax: use mode whole')]
            why = next((why for fails, why in reasons if fails), None)
            return why or why_not_norms(self.backbone) or why_not_by_rows(self.backbone, neck,
                                                                          head)
        in_order = (head.input_transform == 'multiple_select'
                    and list(head.in_index) == list(range(len(head.in_index))))
        if type(neck) is FPN and type(head) is FPNHead:
            why = why_not_data_flow_fpn(neck, FPN)
            in_order = in_order and len(head.in_index) <= neck.num_outs
        elif neck is None and type(head) is UPerHead:
            why = None
            in_order = in_order and (len(head.lateral_convs) == len(head.fpn_convs)
                                     == len(head.in_index) - 1)
        else:
            return ('it runs Semantic FPN (mmseg FPN + FPNHead) or UperNet (UPerHead, no neck), '
                    f'not {type(neck).__name__} + {head_name}')
        if why is None and not in_order:
            return f'{head_name} must read the levels 0..n-1 in order (in_index)'
        return why

    # ------------------------------------------------------------------ predict
    def predict(self, inputs: Tensor, data_samples: OptSampleList = None) -> SampleList:
        """Stock ``predict``'s labels (and logits with ``test_cfg.keep_seg_logits``)."""
        settings, name = self.test_settings, type(self).__name__
        mode, why_resize = settings.mode, self.why_not('resize')
        stream_keys = settings.band_mb, settings.token_maps, settings.token_dir
        if mode == 'stream' or any(k is not None for k in stream_keys):
            why = self.why_not('stream')
            if why is not None:
                raise ValueError(f"{name}: test_cfg mode='stream' cannot run: {why}; choose mode "
                                 "'whole', 'slide' or 'auto'")
        if mode == 'auto' and why_resize is not None and settings.max_memory is not None:
            raise ValueError(f"{name}: test_cfg.mode='auto' estimates memory only for mmseg's "
                             f"decode head predict; {why_resize}: choose mode 'whole' or 'slide'")
        self._release_heap = mode == 'auto'
        if not settings.lean:
            return super().predict(inputs, data_samples)
        if why_resize is not None:
            if mode == 'auto':  # no budget was set: run as before there was a choice
                self._log_decision(('whole', why_resize), f'{name}: whole image, unplanned: '
                                   f'{why_resize}, and only decode heads that do not can be '
                                   'planned', level=logging.WARNING)
            # full-size logits come from the inference itself: only the post-processing is lean
            return self._whole_post(self.inference(inputs, self._batch_img_metas(
                inputs, data_samples)), None, data_samples)
        plan = None  # mode='stream' within max_memory: where its token maps live
        if mode == 'auto':
            plan = self._auto_plan(inputs, data_samples)
        elif mode == 'stream' and settings.max_memory is not None:
            B, _, H, W = inputs.shape
            plan = self._choose_memory_plan(
                self.memory_plans(inputs, data_samples, stream_only=True),
                settings.max_memory, f'{name} on {B} x {H}x{W} px')
        run = mode if plan is None else plan.name
        if run == 'slide':
            return self._slide_predict(inputs, data_samples)
        if run.startswith('stream'):
            return self._stream_predict(inputs, data_samples, plan)
        low_res = self._network_forward(inputs)  # whole: the head's resize joins the chunked ones
        self._step_done()
        return self._whole_post(low_res, self._head_resize_size(inputs, data_samples),
                                data_samples)

    def inference(self, inputs: Tensor, batch_img_metas: List[dict]) -> Tensor:
        """Stock ``inference`` (what ``lean=False`` and heads that override ``predict`` run) by
        the settings' mode, as stock reads ``test_cfg.mode``, which may be absent here (the
        configs' default): 'slide' slides, any other mode runs whole, as stock's default."""
        ori_shape = batch_img_metas[0]['ori_shape']
        if not all(meta['ori_shape'] == ori_shape for meta in batch_img_metas):
            print_log('Image shapes are different in the batch.', logger='current',
                      level=logging.WARN)
        if self.test_settings.mode == 'slide':
            return self.slide_inference(inputs, batch_img_metas)
        return self.whole_inference(inputs, batch_img_metas)

    def _step_done(self) -> None:
        """mode='auto': the freed heap back to the OS, as its estimate measures each step alone."""
        if self._release_heap:
            release_free_heap()

    @staticmethod
    def _batch_img_metas(inputs: Tensor, data_samples: OptSampleList) -> List[dict]:
        """The metas stock ``predict`` passes on (defaults when there are no data samples)."""
        if data_samples is not None:
            return [data_sample.metainfo for data_sample in data_samples]
        return [dict(ori_shape=inputs.shape[2:], img_shape=inputs.shape[2:],
                     pad_shape=inputs.shape[2:], padding_size=[0, 0, 0, 0])] * inputs.shape[0]

    def _head_resize_size(self, inputs: Tensor, data_samples: OptSampleList) -> Tuple[int, int]:
        """The size ``BaseDecodeHead.predict_by_feat`` resizes the whole batch to."""
        meta = self._batch_img_metas(inputs, data_samples)[0]
        if 'pad_shape' in meta and not isinstance(meta['img_shape'], torch.Size):
            return tuple(meta['pad_shape'][:2])
        return tuple(meta['img_shape'])

    # ------------------------------------------------------------------ network
    def _network_forward(self, inputs: Tensor) -> Tensor:
        """``decode_head.forward(extract_feat(inputs))``: the logits at the head's resolution.
        Semantic FPN frees each map when done and sums the branches in stock's order, in place
        where nothing else holds the sum."""
        head = self.decode_head
        if self.why_not('network') is not None:
            return head.forward(self.extract_feat(inputs))
        if type(head) is UPerHead:
            return uper_head_in_data_flow_order(self.backbone, head, inputs)
        fpn_out = fpn_in_data_flow_order(self.backbone, self.neck, inputs)
        output = head.scale_heads[0](fpn_out[0])
        fpn_out[0] = None
        for i in range(1, len(head.feature_strides)):
            branch = resize(head.scale_heads[i](fpn_out[i]), size=output.shape[2:],
                            mode='bilinear', align_corners=head.align_corners)
            fpn_out[i] = None
            output = output + branch if output.requires_grad else output.add_(branch)
            del branch
        return head.cls_seg(output)

    # ------------------------------------------------------------------ streamed
    def stream_labels(self, read_rows: Callable[[int, int], 'np.ndarray'],
                      image_hw: Tuple[int, int], max_memory: Optional[float] = None,
                      token_dir: Optional[str] = None, progress: Optional[Callable] = None,
                      confidence: bool = False,
                      valid_rows: Optional[Callable[[int, int], 'np.ndarray']] = None,
                      mask_xca: bool = MASK_XCA, shard: Optional[Shard] = None
                      ) -> Iterator[tuple]:
        """An image larger than memory's labels, top to bottom: ``(start, stop, labels)``, int64
        (stop - start, W) on the CPU; with ``confidence``, ``(start, stop, labels, confidence)``,
        the confidence uint8 (stop - start, W): round(255 x the top-1 softmax probability of the
        logits at the image's resolution).

        ``read_rows(a, b)``: rows a..b-1 as mmcv reads them ((b - a, W, C) uint8, BGR),
        normalised here. ``valid_rows(a, b)``: which of those pixels hold data, a bool (b - a, W)
        array (False: nodata, alpha or mask); with ``mask_xca`` the tokens whose patch holds no
        valid pixel are left out of XCA's sums over the image (and UperNet's pools average the
        cells with data only), so that the labels of the data do not depend on the size of a
        nodata collar. The labels of invalid pixels are the model's
        all the same: the caller masks them. Under ``max_memory`` (MB) the token maps may go to
        ``token_dir``. ``progress``: see :func:`stage_reporter`.

        With a ``shard`` (``xcit_mm.models.inference.sharding.Shard``), this process is one rank
        of the image's sharded stream (docs/sharded_stream.md): every rank calls this with the
        same arguments and gets the labels of its slab's pixel rows only (whole-image row
        numbers; none where its slab is empty, which still takes part in the exchanges); the
        budget and the token maps are the rank's. ``progress`` then counts the rank's rows.

        The model's parts, the budget and the token folder are checked here, before the image
        is read; the work runs as the labels are iterated."""
        why, name = self.why_not('stream'), type(self).__name__
        if why is not None:
            raise ValueError(f'{name}.stream_labels: cannot stream: {why}')
        if shard is not None and 'shard' not in inspect.signature(
                self.backbone.stream_trunk).parameters:
            raise ValueError(f'{name}.stream_labels: {type(self.backbone).__name__} cannot stream '
                             'a slab of the image (XCiTBackbone can): pass shard=None')
        H, W = image_hw
        device = next(self.parameters()).device
        trunk_kwargs = {}
        if valid_rows is not None and mask_xca:
            if 'valid_pixels' not in inspect.signature(self.backbone.stream_trunk).parameters:
                raise ValueError(f'{name}.stream_labels: {type(self.backbone).__name__} cannot '
                                 'leave masked tokens out of its attention: pass '
                                 'mask_xca=False')
            trunk_kwargs['valid_pixels'] = partial(valid_pixels, valid_rows, W, device)
        budget = None if max_memory is None else read_budget_mb(dict(max_memory=max_memory), name)
        token_rows = kept_rows = None
        if shard is not None:  # the rows the rank's labels read, those it keeps and makes
            slab = shard.slab(H, self.backbone.patch_size)
            read = self._slab_trunk_rows(slab, image_hw, confidence)
            token_rows, kept_rows = self.backbone.rank_token_rows(
                slab.grid_rows, (slab.first, slab.stop), read)
            trunk_kwargs.update(shard=shard, read_rows=read)
        plans = self._stream_plans(image_hw, held_mb=0, budget_mb=budget, token_rows=token_rows,
                                   kept_rows=kept_rows)
        plan = plans[0] if budget is None else self._choose_memory_plan(
            plans, budget, f'{name} on {H}x{W} px')
        folder = self._token_folder(image_hw, plan, token_dir, budgeted=budget is not None,
                                    token_rows=token_rows, kept_rows=kept_rows)
        read_pixels = partial(preprocessed_rows, self.data_preprocessor, read_rows, device)

        def bands() -> Iterator[tuple]:
            with self._eval_no_grad():
                for start, stop, band in self._stream_bands(
                        read_pixels, image_hw, image_hw, (0, 0, 0, 0), image_hw, plan, folder,
                        progress, confidence, trunk_kwargs, token_rows):
                    if confidence:
                        yield start, stop, band[0].cpu(), band[1].to(torch.uint8).cpu()
                    else:
                        yield start, stop, band[0].cpu()

        return bands()

    def _stream_predict(self, inputs: Tensor, data_samples: OptSampleList,
                        plan: Optional[Plan]) -> SampleList:
        """mode='stream' (or the stream 'auto' chose): each image's labels, band by band."""
        head_hw = self._head_resize_size(inputs, data_samples)
        settings = self.test_settings
        budgeted = plan is not None
        plan = plan or self._stream_plans(inputs.shape[2:], held_mb=0)[0]  # no budget
        folder = self._token_folder(inputs.shape[2:], plan, settings.token_dir, budgeted)
        metas = self._metas(data_samples, inputs.shape[0])
        if any(meta is not None and meta.get('flip', None) for meta in metas):
            raise ValueError(f"{type(self).__name__}: test_cfg mode='stream' does not flip "
                             "(test-time augmentation): use mode 'whole' for flipped images")
        results = []
        for i, meta in enumerate(metas):
            out_hw = self._output_hw(meta, head_hw)
            labels = torch.empty((1, ) + tuple(out_hw), dtype=torch.long, device=inputs.device)
            image = inputs[i:i + 1]
            for start, stop, band in self._stream_bands(
                    lambda a, b: image[:, :, a:b], tuple(inputs.shape[2:]), head_hw,
                    self._padding(meta), out_hw, plan, folder):
                labels[0, start:stop] = band[0]
            results.append((labels, None))
        return self._set_results(data_samples, results)

    def _token_folder(self, image_hw: Sequence[int], plan: Plan, token_dir: Optional[str],
                      budgeted: bool, token_rows: Optional[int] = None,
                      kept_rows: Optional[int] = None) -> Optional[str]:
        """Where the token maps go (None: in memory), checked before any work: a folder with room
        for them (a rank's ``token_rows`` and ``kept_rows``, :meth:`XCiTBackbone.token_maps_mb`;
        default all), not in memory (tmpfs) unless a budget counted them (the in-memory plan)."""
        if not (self.test_settings.token_maps == 'disk' or plan.name == 'stream-disk'):
            return None
        folder = token_dir or tempfile.gettempdir()
        check_token_folder(folder,
                           self.backbone.token_maps_mb(image_hw, token_rows, kept_rows)[1] * MB,
                           memory_counted=budgeted and plan.name == 'stream')
        return folder

    def _labels_rows(self, trunk, image_hw, head_hw, crop, out_hw, band_mb: float,
                     confidence: bool = False, slab=None, valid_pixels=None):
        """The labels (and confidence) of the trunk maps, as rows (one graph for the stream and
        for working out which trunk rows a slab's labels read); with ``valid_pixels`` (the
        trunk's, pixel rows in), UperNet's pooling averages the coarsest level's cells that
        hold data only."""
        levels = [self.backbone.level_rows(trunk_map, i, image_hw)
                  for i, trunk_map in enumerate(trunk)]
        valid_cells = None if valid_pixels is None else valid_cells_of(
            valid_pixels, image_hw, self.backbone.strides[len(levels) - 1])
        logits = logits_rows(levels, getattr(self, 'neck', None), self.decode_head, band_mb, slab,
                             valid_cells)
        return labels_rows(logits, head_hw, crop, out_hw, self.decode_head.align_corners,
                           self.align_corners, self._stream_class_chunk(out_hw[1], band_mb),
                           confidence)

    def _slab_trunk_rows(self, slab, image_hw: Sequence[int],
                         confidence: bool) -> Tuple[int, int]:
        """The token rows (first, stop) the labels of ``slab``'s pixel rows read from the trunk
        maps (UperNet's pooling pass over the slab's share included), from the graph on
        placeholders of the maps' size: the rows its rank makes exactly."""
        p = self.backbone.patch_size
        grid = [-(-side // p) for side in image_hw]
        trunk = [SlabRows(*grid) for _ in self.backbone.out_indices]
        labels = self._labels_rows(trunk, image_hw, image_hw, (0, 0, 0, 0), image_hw,
                                   STREAM_BAND_MB['cpu'], confidence, slab)
        return trunk_rows_read(labels, *slab.pixel_rows, trunk)

    def _stream_bands(self, read_pixels, image_hw, head_hw, crop, out_hw, plan: Plan,
                      folder: Optional[str], progress: Optional[Callable] = None,
                      confidence: bool = False, trunk_kwargs: Optional[dict] = None,
                      token_rows: Optional[int] = None) -> Iterator[Tuple[int, int, Tensor]]:
        """One image: the trunk into token maps (in ``folder``, else in memory), then the labels
        (and confidence: channel 1) in bands of the plan's size, ``progress`` told by stage.
        With a ``shard`` in ``trunk_kwargs``, its rank's slab: the trunk's ``token_rows`` rows,
        then the labels of the slab's pixel rows (whole-image row numbers)."""
        band_mb, report = plan.band_mb, stage_reporter(progress)
        trunk_kwargs = trunk_kwargs or {}
        shard = trunk_kwargs.get('shard')
        slab = None if shard is None else shard.slab(image_hw[0], self.backbone.patch_size)
        first, stop = (0, out_hw[0]) if slab is None else slab.pixel_rows
        layers = max(self.backbone.out_indices) + 1
        if token_rows is None:
            token_rows = -(-image_hw[0] // self.backbone.patch_size)
        trunk_total, done = layers * token_rows, [0]

        def layer_done() -> None:
            done[0] += token_rows
            report(min(done[0], trunk_total), trunk_total, 'trunk')

        with TokenMaps(next(self.parameters()).device, folder) as maps, torch.no_grad():
            report(0, trunk_total, 'trunk')
            trunk = self.backbone.stream_trunk(read_pixels, image_hw, maps, band_mb, layer_done,
                                               **trunk_kwargs)
            labels = self._labels_rows(trunk, image_hw, head_hw, crop, out_hw, band_mb,
                                       confidence, slab, trunk_kwargs.get('valid_pixels'))
            if slab is not None:  # the slab's rows; every rank joins the poolings' exchanges
                labels = Crop(labels, first, 0, stop - first, out_hw[1])
            bands = stream_rows(labels, band_mb)
            if slab is not None:
                run_poolings(labels)
            report(0, stop - first, 'labels')
            for start, end, band in bands:
                yield start + first, end + first, band[0]
                report(end, stop - first, 'labels')

    def _stream_class_chunk(self, width: int, band_mb: float) -> int:
        """Classes the stream's full-resolution steps take at once: as many as keep a band of them
        (``STREAM_CHUNK_ROWS`` rows of ``width`` px, ``STREAM_CHUNK_COPIES`` copies) within
        ``band_mb``, a multiple of 8 (at least 8), at most all."""
        planes = int(band_mb * MB) // (FLOAT_BYTES * width * STREAM_CHUNK_ROWS
                                       * STREAM_CHUNK_COPIES)
        return min(self.out_channels,
                   max(CHUNK_MULTIPLE, planes // CHUNK_MULTIPLE * CHUNK_MULTIPLE))

    def _stream_plans(self, image_hw: Sequence[int], held_mb: float,
                      budget_mb: Optional[float] = None,
                      token_rows: Optional[int] = None,
                      kept_rows: Optional[int] = None) -> List[Plan]:
        """The stream's plans, token maps in memory then on disk: the maps (of ``token_rows``
        rows, a rank's, else the image's), what the caller holds, UperNet's pooled maps,
        ``SLACK_MB``, ``STREAM_WORK_MB`` and the larger work of the two stages: the trunk's
        (``TRUNK_WORK_BANDS`` of its bands, :meth:`XCiTBackbone.trunk_band_mb`) or the labels'
        (their least work at the image's width, :meth:`_label_floor`, measured only under a
        ``budget_mb``: without one nothing is compared with the estimates; and
        ``STREAM_WORK_BANDS`` bands). The bands: ``test_cfg.band_mb``, else the device's
        default (for a rank, its share of the image's token rows of it, so that its work shrinks
        with its share as its maps do), shrunk to fit ``budget_mb`` (down to the minimum)."""
        kept, maps_mb = self.backbone.token_maps_mb(image_hw, token_rows, kept_rows)
        floor_mb, floor = 0.0, ''
        if budget_mb is not None:
            floor_mb = self._label_floor().estimate_mb(LABEL_FLOOR_ROWS * image_hw[1])
            floor = f", the labels' floor at {image_hw[1]} px wide: {floor_mb:.0f} MB"
        fixed_mb = SLACK_MB + held_mb + STREAM_WORK_MB
        head = self.decode_head
        if type(head) is UPerHead:  # the pooled maps of its pyramid pooling
            scales = [scale if isinstance(scale, int) else max(scale)
                      for scale in head.psp_modules.pool_scales]
            fixed_mb += PyramidPooling.held_bytes(scales, head.in_channels[-1], head.channels,
                                                  -(-image_hw[1] // 32)) / MB
        default = STREAM_BAND_MB.get(next(self.parameters()).device.type, STREAM_BAND_MB['cpu'])
        if token_rows is not None:  # a rank: its share of the image's token rows of them
            share = token_rows / -(-image_hw[0] // self.backbone.patch_size)
            default = max(MIN_STREAM_BAND_MB, min(default, default * share))

        def work_mb(band_mb: float) -> float:  # the trunk's stage, then the labels'
            trunk = self.backbone.trunk_band_mb(image_hw, band_mb, token_rows)
            return max(TRUNK_WORK_BANDS * trunk, floor_mb + STREAM_WORK_BANDS * band_mb)

        plans = []
        for name, where, maps in (('stream', 'in memory', maps_mb), ('stream-disk', 'on disk', 0)):
            band_mb = self.test_settings.band_mb
            if band_mb is None:  # the largest bands whose work fits (down to the minimum)
                room = math.inf if budget_mb is None else budget_mb - (fixed_mb + maps)
                band_mb = min(default, _whole_kb((room - floor_mb) / STREAM_WORK_BANDS))
                if work_mb(band_mb) > room:  # the trunk's bands, unless the image is smaller
                    band_mb = min(band_mb, _whole_kb(room / TRUNK_WORK_BANDS))
                band_mb = max(MIN_STREAM_BAND_MB, band_mb)
            plans.append(Plan(name, fixed_mb + maps + work_mb(band_mb),
                              f'({kept} token maps of {maps_mb / kept:.0f} MB {where}, bands of '
                              f'{band_mb:.0f} MB{floor})', band_mb))
        return plans

    # the label stage's measured lines, per model structure (_label_floor)
    _label_floor_lines: dict = {}

    def _label_floor(self) -> MemoryModel:
        """The labels' peak (MB) with bands of one row, as a line in the pixels of a scene of
        ``LABEL_FLOOR_ROWS`` rows: what the label stage needs however small its bands, which grows
        with the image's width. Measured on zero token maps in memory (views of maps the plan
        counts apart), every band and class chunk as small as it goes; once per model structure
        (memory follows the modules and their shapes, not the weights' values)."""
        first = next(self.parameters())
        key = (tuple((name, type(module).__name__) for name, module in self.named_modules()),
               tuple(tuple(param.shape) for param in self.parameters()), first.dtype,
               first.device)
        if key not in self._label_floor_lines:
            backbone, p, tiny_mb = self.backbone, self.backbone.patch_size, 1e-6

            def labels_of_zeros(h: int, w: int) -> None:
                grid = (-(-h // p), -(-w // p))
                trunk = [TensorRows(first.new_zeros((1, backbone.embed_dims) + grid).contiguous(
                    memory_format=torch.channels_last)) for _ in backbone.out_indices]
                labels = self._labels_rows(trunk, (h, w), (h, w), (0, 0, 0, 0), (h, w), tiny_mb)
                for band in stream_rows(labels, tiny_mb):
                    del band

            with self._eval_no_grad():
                self._label_floor_lines[key] = measure_line(
                    labels_of_zeros, [(LABEL_FLOOR_ROWS, w) for w in LABEL_FLOOR_WIDTHS],
                    first.device)[0]
        return self._label_floor_lines[key]

    # ------------------------------------------------------------------ sliding windows
    def _slide_predict(self, inputs: Tensor, data_samples: OptSampleList) -> SampleList:
        """Stock ``slide_inference``, the window logits at the head's resolution, by chunks."""
        settings = self.test_settings
        windows = slide_windows(inputs.shape[2:], settings.crop_size, settings.stride)
        window_logits = []  # at the head's resolution, in stock's order
        for y1, y2, x1, x2 in windows:
            window_logits.append(self._network_forward(inputs[:, :, y1:y2, x1:x2]))
            self._step_done()
        return self._slide_post(window_logits, windows, inputs, data_samples)

    # ------------------------------------------------------------------ post-processing
    def _whole_post(self, low_res: Tensor, head_hw, data_samples: OptSampleList,
                    width: Optional[int] = None) -> SampleList:
        """The head's resize to ``head_hw`` (if given) and stock's post-processing, by chunks."""
        metas = self._metas(data_samples, low_res.shape[0])
        width = width or self._chunk_width(head_hw or low_res.shape[2:], metas,
                                           _is_channels_last(low_res))
        return self._postprocess(partial(_class_slice, low_res), head_hw, data_samples, metas,
                                 width)

    def _slide_post(self, window_logits: List[Tensor], windows: list, like: Tensor,
                    data_samples: OptSampleList, width: Optional[int] = None) -> SampleList:
        """Stock ``slide_inference``'s map (each window's logits resized into place, over the
        count of windows on each pixel, in ``like``'s dtype), post-processed by class chunks."""
        B, H, W = like.shape[0], windows[-1][1], windows[-1][3]  # the last window ends bottom right
        count = like.new_zeros((B, 1, H, W))
        for y1, y2, x1, x2 in windows:
            count[:, :, y1:y2, x1:x2] += 1
        assert (count == 0).sum() == 0

        def chunk_of(c0: int, c1: int) -> Tensor:
            acc = like.new_zeros((B, c1 - c0, H, W))
            for (y1, y2, x1, x2), logits in zip(windows, window_logits):
                part = resize(_class_slice(logits, c0, c1), size=(y2 - y1, x2 - x1),
                              mode='bilinear', align_corners=self.decode_head.align_corners)
                acc[:, :, y1:y2, x1:x2].add_(part)
                del part
                self._step_done()
            return acc.div_(count)

        metas = self._metas(data_samples, B)
        width = width or self._chunk_width((H, W), metas,
                                           any(map(_is_channels_last, window_logits)), B * H * W)
        return self._postprocess(chunk_of, None, data_samples, metas, width)

    def _postprocess(self, chunk_of: Callable[[int, int], Tensor], head_size,
                     data_samples: OptSampleList, metas: List[Optional[dict]],
                     width: int) -> SampleList:
        """Stock ``postprocess_result`` on the logits ``chunk_of(c0, c1)`` gives, resized to
        ``head_size`` first if given, into each image's running argmax."""
        C = self.out_channels
        if C == 1:  # binary head: one channel, nothing to chunk; stock code on the full map
            seg_logits = chunk_of(0, 1)
            if head_size is not None:
                seg_logits = resize(seg_logits, size=head_size, mode='bilinear',
                                    align_corners=self.decode_head.align_corners)
            return self.postprocess_result(seg_logits, data_samples)
        states = [_RunningArgmax(C, self.test_settings.keep_seg_logits, self._step_done)
                  for _ in metas]
        for c0 in range(0, C, width):
            chunk = chunk_of(c0, min(c0 + width, C))
            for i, (state, meta) in enumerate(zip(states, metas)):
                state.add(c0, partial(self._image_chunk, chunk, i, head_size, meta))
            del chunk
            self._step_done()
        return self._set_results(data_samples, [(s.labels, s.logits) for s in states])

    def _chunk_width(self, head_hw: Sequence[int], metas: List[Optional[dict]],
                     channels_last: bool, batch_map: int = 0) -> int:
        """As many classes as ``lean_chunk_mb`` holds planes of the largest image's labels (plus
        ``batch_map`` pixels), a multiple of 8, at least 8 (24 channels-last), at most all."""
        plane = batch_map + max(math.prod(self._output_hw(meta, head_hw)) for meta in metas)
        width = int(self.test_settings.lean_chunk_mb * 2**20 // (FLOAT_BYTES * max(plane, 1)))
        width = max(width // CHUNK_MULTIPLE * CHUNK_MULTIPLE,
                    MIN_CHUNK_CHANNELS_LAST if channels_last else CHUNK_MULTIPLE)
        return min(width, self.out_channels)

    @staticmethod
    def _metas(data_samples: OptSampleList, batch_size: int) -> List[Optional[dict]]:
        if data_samples is None:
            return [None] * batch_size
        return [sample.metainfo for sample in data_samples]

    @staticmethod
    def _set_results(data_samples: OptSampleList,
                     results: List[Tuple[Tensor, Optional[Tensor]]]) -> SampleList:
        """Stock's ``pred_sem_seg`` (and ``seg_logits`` if not None) of each image."""
        if data_samples is None:
            data_samples = [SegDataSample() for _ in results]
        for sample, (labels, logits) in zip(data_samples, results):
            data = {'pred_sem_seg': PixelData(data=labels)}
            if logits is not None:
                data['seg_logits'] = PixelData(data=logits)
            sample.set_data(data)
        return data_samples

    @staticmethod
    def _padding(meta: Optional[dict]) -> Tuple[int, int, int, int]:
        """The padding (left, right, top, bottom) that stock's post-processing crops off."""
        if meta is None:
            return (0, 0, 0, 0)
        return tuple(meta.get('img_padding_size', meta.get('padding_size', [0] * 4)))

    @staticmethod
    def _output_hw(meta: Optional[dict], head_hw: Sequence[int]) -> Tuple[int, int]:
        """The size of an image's labels: its original shape, or the head's size without metas."""
        return tuple(meta['ori_shape']) if meta is not None else tuple(head_hw)

    def _image_chunk(self, chunk: Tensor, i: int, head_size, meta: Optional[dict]) -> Tensor:
        """Image i of a class chunk (c, H, W) after stock's steps: the head's resize, the
        padding crop, the flip, the resize to the original shape."""
        x = _class_slice(chunk, 0, chunk.shape[1], slice(i, i + 1))
        if head_size is not None:
            x = resize(x, size=head_size, mode='bilinear',
                       align_corners=self.decode_head.align_corners)
        if meta is None:
            return x[0]
        H, W = x.shape[2:]
        left, right, top, bottom = self._padding(meta)
        x = x[:, :, top:H - bottom, left:W - right]
        if meta.get('flip', None):
            direction = meta.get('flip_direction', None)
            assert direction in ['horizontal', 'vertical']
            x = x.flip(dims=(3, ) if direction == 'horizontal' else (2, ))
        return resize(x, size=meta['ori_shape'], mode='bilinear',
                      align_corners=self.align_corners, warning=False)[0]

    # ------------------------------------------------------------------ memory budget
    def memory_plans(self, inputs: Tensor, data_samples: OptSampleList = None,
                     stream_only: bool = False, budget_mb: Optional[float] = None) -> List[Plan]:
        """``mode='auto'``'s plans in the order tried (``stream_only``: a budgeted mode='stream'),
        each with the peak (MB) ``predict`` adds: the input batch and the larger of the network's
        and the post-processing's, raised by ``MARGIN`` (``docs/lean_segmentation.md``); the
        stream's bands shrunk to fit ``budget_mb`` (default ``max_memory``)."""
        B, _, H, W = inputs.shape
        metas = self._metas(data_samples, B)
        head_hw = self._head_resize_size(inputs, data_samples)
        input_mb = INPUT_BYTES * inputs.numel() / MB
        stream = []
        if stream_only or self.why_not('stream') is None:
            labels = sum(math.prod(self._output_hw(meta, head_hw)) for meta in metas)
            stream = self._stream_plans((H, W), input_mb + LABEL_BYTES * labels / MB,
                                        budget_mb or self.test_settings.max_memory)
        if stream_only:
            return stream
        crop, stride = self.test_settings.crop_size, self.test_settings.stride
        line = self.network_memory_model(inputs)
        self._release_heap = True  # the post-processing is measured as mode='auto' runs it
        windows = slide_windows((H, W), crop, stride)
        win_hw = (min(crop[0], H), min(crop[1], W))
        s_h, s_w, _ = self._head_output_geometry(inputs)
        held_mb = ((len(windows) - 1) * FLOAT_BYTES * B * self.out_channels
                   * math.ceil(win_hw[0] / s_h) * math.ceil(win_hw[1] / s_w) / MB)
        whole_mb = input_mb + MARGIN * max(line.estimate_mb(B * H * W),
                                           self._post_mb(inputs, metas, head_hw))
        slide_mb = input_mb + MARGIN * max(line.estimate_mb(B * win_hw[0] * win_hw[1]) + held_mb,
                                           self._post_mb(inputs, metas, head_hw, windows))
        return [Plan('whole', whole_mb, f'({H}x{W} px)')] + stream + [
                Plan('slide', slide_mb, f'({len(windows)} windows {win_hw[0]}x{win_hw[1]}, '
                     f'stride {stride[0]}x{stride[1]})')]

    def _auto_plan(self, inputs: Tensor, data_samples: OptSampleList) -> Plan:
        """``mode='auto'``'s plan within ``max_memory``, else within the memory the process may
        use (read at each call: it moves). Whole where ``_whole_bound_mb`` fits, which measures
        nothing per image size (a test set of many sizes pays only the first call's calibration);
        else the first of ``memory_plans`` that fits. Without ``max_memory``, a batch no larger
        than the calibration's own forwards runs whole before any calibration
        (``_whole_without_calibrating``), so an ordinary image pays nothing for the planning.
        Nothing to plan within (neither a setting nor a readable limit): whole, as before the
        choice, with a warning."""
        settings = self.test_settings
        B, _, H, W = inputs.shape
        what = f'{type(self).__name__} on {B} x {H}x{W} px'
        budget, source = settings.max_memory, None
        if budget is None:
            found = process_budget(inputs.device)
            if found is None:
                self._log_decision(
                    ('whole', None), f'{what}: whole, unplanned: test_cfg.max_memory is not set '
                    'and the memory this process may use cannot be read here (no cgroup memory '
                    'files, no /proc/meminfo, not CUDA); set test_cfg.max_memory (MB) to plan',
                    level=logging.WARNING)
                return Plan('whole', math.inf, '(no budget)')
            budget, source = found
        within = (f'max_memory={budget:.0f} MB' if source is None else
                  f'{budget:.0f} MB, the memory this process may use ({source}; '
                  'test_cfg.max_memory sets a budget)')
        if source is not None and self._whole_without_calibrating(inputs, data_samples, budget):
            self._log_decision(
                ('whole unmeasured', source),
                f'{what}: whole, not calibrated: no larger than the largest forward a calibration '
                f'runs ({CALIBRATION_PIXELS} px), with the post-processing counted from its '
                f'shapes, within {within}')
            self.last_memory_plan = Plan('whole', math.nan, f'({H}x{W} px, not calibrated)')
            self.last_memory_plans, self._last_budget = (self.last_memory_plan, ), None
            return self.last_memory_plan
        bound = self._whole_bound_mb(inputs, data_samples)
        if bound > budget:
            return self._choose_memory_plan(
                self.memory_plans(inputs, data_samples, budget_mb=budget), budget, what, source)
        self._log_decision(None if source is None else ('whole', source),
                           f'{what}: whole, its peak at most {bound:.0f} MB (the network\'s line '
                           f'and the post-processing counted from its shapes), within {within}')
        self.last_memory_plan = Plan('whole', bound, f'({H}x{W} px, bound)')
        # the listing is the bound's one plan; no budget kept, so no later listing reuses it
        self.last_memory_plans, self._last_budget = (self.last_memory_plan, ), None
        return self.last_memory_plan

    def _whole_without_calibrating(self, inputs: Tensor, data_samples: OptSampleList,
                                   budget_mb: float) -> bool:
        """Whether the default (no ``max_memory``) may run this batch whole with the network's
        line not yet known: a batch of no more pixels than the largest forward a calibration runs
        peaks no higher in the network than that forward would, so calibrating first would only
        cost time (several forwards, each larger than the image); the post-processing, which
        grows with the original shapes rather than the network's input, still has to fit."""
        B, _, H, W = inputs.shape
        if (B * H * W > CALIBRATION_PIXELS or self.test_settings.memory_model is not None
                or self.calibrated_memory_model is not None):
            return False
        return self._whole_bound_mb(inputs, data_samples, with_network=False) <= budget_mb

    def _whole_bound_mb(self, inputs: Tensor, data_samples: OptSampleList,
                        with_network: bool = True) -> float:
        """At least whole's estimate in ``memory_plans`` without measuring at this geometry: the
        network's line, and for the post-processing its tensors counted from their shapes (the
        head's logits, ``POST_CHUNK_COPIES`` full-size class chunks of the largest image, every
        image's running argmax and kept logits, one image's argmax update, ``SLACK_MB``; each
        summed, though not all live at once), so that whole admitted here is whole that
        ``memory_plans`` would choose (``tests/test_segmentation_memory_budget.py`` checks the
        count against the measured post-processing). ``with_network=False``: the post-processing
        alone, for a batch whose network part needs no line (``_whole_without_calibrating``)."""
        B, _, H, W = inputs.shape
        metas = self._metas(data_samples, B)
        head_hw = self._head_resize_size(inputs, data_samples)
        s_h, s_w, channels_last = self._head_output_geometry(inputs)
        C = self.out_channels
        width = self._chunk_width(head_hw, metas, channels_last)
        planes = [math.prod(self._output_hw(meta, head_hw)) for meta in metas]
        kept = FLOAT_BYTES * C if self.test_settings.keep_seg_logits else 0
        largest = max(planes + [math.prod(head_hw)])  # one image's chunks at a time
        post = (FLOAT_BYTES * (B * C * math.ceil(H / s_h) * math.ceil(W / s_w)
                               + POST_CHUNK_COPIES * width * largest)
                + sum(planes) * (POST_ARGMAX_KEPT_BYTES + kept)
                + largest * POST_ARGMAX_STEP_BYTES)
        network = (self.network_memory_model(inputs).estimate_mb(B * H * W) if with_network
                   else 0.0)
        return INPUT_BYTES * inputs.numel() / MB + MARGIN * max(network, post / MB + SLACK_MB)

    def _post_mb(self, inputs: Tensor, metas: List[Optional[dict]], head_hw: Sequence[int],
                 windows: Optional[list] = None) -> float:
        """Peak (MB) of this batch's post-processing and its inputs: the same code measured on
        zeros at the batch's geometry scaled down, at the full size's chunk widths, extrapolated
        (each tensor has a fixed number of elements per pixel); kept per geometry."""
        B, _, H, W = inputs.shape
        C = self.out_channels
        s_h, s_w, channels_last = self._head_output_geometry(inputs)
        width = self._chunk_width(head_hw, metas, channels_last, B * H * W if windows else 0)
        images = [(tuple(m['ori_shape']), self._padding(m), m.get('flip'),
                   m.get('flip_direction')) for m in metas if m is not None]
        key = (tuple(inputs.shape), tuple(head_hw), tuple(windows or ()), width,
               self.test_settings.keep_seg_logits, tuple(images))
        if key in self._post_lines:
            return self._post_lines[key].estimate_mb(H * W)

        def scaled(f: float, *sizes) -> tuple:
            return tuple(max(1, round(v * f)) for v in sizes)

        def logits(f: float, h: int, w: int) -> Tensor:
            out = inputs.new_zeros((B, C) + scaled(f, math.ceil(h / s_h), math.ceil(w / s_w)))
            return out.contiguous(memory_format=torch.channels_last) if channels_last else out

        def sample(f: float, ori_hw, padding, flip, direction) -> SegDataSample:
            return SegDataSample(metainfo=dict(
                ori_shape=scaled(f, *ori_hw), padding_size=[round(p * f) for p in padding],
                flip=flip, flip_direction=direction))

        def run(h: int, w: int):
            f = h / H
            samples = [sample(f, *image) for image in images] if images else None
            if windows is None:
                return self._whole_post(logits(f, H, W), scaled(f, *head_hw), samples, width)
            boxes = [tuple(round(v * f) for v in box) for box in windows]
            return self._slide_post([logits(f, y2 - y1, x2 - x1) for y1, y2, x1, x2 in windows],
                                    boxes, inputs, samples, width)

        top = min(max(H, W), POST_CALIBRATION_SIDE)
        sides = [scaled(side / max(H, W), H, W) for side in (top / 2, top)]
        self._post_lines[key] = measure_line(run, sides, inputs.device)[0]
        return self._post_lines[key].estimate_mb(H * W)

    def _calibrate_memory(self, inputs: Tensor) -> MemoryModel:
        """The network's peak line: its forward on zeros at ``CALIBRATION_SIZES``, in eval mode."""
        with self._eval_no_grad():
            return calibrate(
                lambda h, w: self._network_forward(inputs.new_zeros((1, inputs.shape[1], h, w))),
                CALIBRATION_SIZES, f'{type(self).__name__} network', device=inputs.device)

    def _head_output_geometry(self, inputs: Tensor) -> Tuple[float, float, bool]:
        """Input pixels per head output pixel (h, w), and if channels-last: one forward, kept."""
        if self._head_geometry is None:
            with self._eval_no_grad():
                out = self._network_forward(
                    inputs.new_zeros((1, inputs.shape[1], STRIDE_PROBE, STRIDE_PROBE)))
            self._head_geometry = (STRIDE_PROBE / out.shape[2], STRIDE_PROBE / out.shape[3],
                                   _is_channels_last(out))
        return self._head_geometry

    @contextmanager
    def _eval_no_grad(self) -> Iterator[None]:
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.train(was_training)
