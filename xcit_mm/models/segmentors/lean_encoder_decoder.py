"""Segmentation without full-size logits of all classes: :class:`LeanEncoderDecoder`.

mmseg's ``EncoderDecoder.predict`` (1.2.2) resizes the C-class logits to the input, crops the
padding, resizes them to the original image and only then takes the argmax, keeping C x H x W
floats per image; ``slide_inference`` adds every window into one such map (a zero-padded full-size
copy each), and Semantic FPN keeps every level of three stages alive at once. This class gives the
same labels with less memory, by exact means only:

* **Class chunks.** Bilinear resizing is per channel, so a chunk of classes resizes to the full
  call's values, and a running maximum with a strict ``>`` (the earlier class wins a tie, a NaN
  wins, as in ``argmax``) is the argmax. torch's CPU kernels give the full call's bits only for
  some widths (a 1-channel call vectorises differently; channels-last below 24 channels or off
  multiples of 8 takes another path): chunks are multiples of 8, at least 24 channels-last.
* **Data-flow order** (Semantic FPN, UperNet): the levels made one at a time, each map freed once
  no later step needs it; each operation the stock one on the same full tensor (a convolution of
  another size may pick another oneDNN algorithm and flip an argmax at a near-tie).
* **Windows without the full map** (``mode='slide'``): window logits kept at the head's
  resolution, each class chunk of stock's map rebuilt as stock builds it, each window added into
  its region in place (``x + 0.0 == x`` for every value the map holds: it starts at +0.0).
* **A memory budget** (``mode='auto'``): the first plan whose estimate fits ``max_memory`` runs;
  both parts of an estimate are measured: the network's line once per model, the
  post-processing on zeros at the batch's geometry scaled down once per geometry.
* **Stream** (``mode='stream'``, Semantic FPN or UperNet on XCiT): the trunk layer by layer over
  bands of token rows, every later map a band of rows at a time (``row_stream``, ``seg_stream``);
  equal to the whole-map logits up to float rounding, not bit for bit.

Labels equal stock ``predict``'s with the mode run; kept logits equal stock's. Without
``keep_seg_logits`` the results carry ``pred_sem_seg`` only, all that IoUMetric, the visualizer
and ``MMSegInferencer`` read. The ``test_cfg`` keys: :class:`SegmentorSettings`,
``docs/lean_segmentation.md``. ``custom_imports`` of ``xcit_mm`` registers the name; mmseg is
imported on the first build.
"""
import math
import tempfile
from contextlib import contextmanager
from functools import partial
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

import torch
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

from ..inference.fpn_data_flow import fpn_in_data_flow_order, why_not_data_flow_fpn
from ..inference.row_stream import TokenMaps, TokenRows, stream_rows
from ..inference.seg_stream import labels_rows, logits_rows, why_not_streamed
from ..inference.settings import LeanSettingsMixin, SegmentorSettings
from ..inference.uper_data_flow import uper_head_in_data_flow_order
from ..utils.ckpt_load import refuse_headless_load
from ..utils.memory_budget import (MB, MemoryModel, MemoryPlanMixin, Plan, calibrate,
                                   measure_line, read_budget_mb, release_free_heap)

# Chunk widths whose bilinear results equal the full call's, channel by channel (module docstring).
CHUNK_MULTIPLE = 8
MIN_CHUNK_CHANNELS_LAST = 24
# The stream's bands when test_cfg.band_mb gives none: many rows keep the share of context rows and
# per-call costs small; on the CPU small beside a large image's token maps (a GPU's kernels want
# larger ones). Under a budget they shrink to fit, down to the minimum.
STREAM_BAND_MB = dict(cpu=128, cuda=4096)
MIN_STREAM_BAND_MB = 32
# Square sizes at which the network's peak is measured (mode='auto'): cheap, and spread enough
# that a size whose peak sits off the line moves the fitted slope little.
CALIBRATION_SIZES = ((256, 256), (512, 512), (896, 896))
# The longer side to which a batch's post-processing is scaled down to be measured (and half of
# it): small enough that measuring stays well below any budget the network needs.
POST_CALIBRATION_SIDE = 384
# Both lines are extrapolated far beyond the sizes measured, where a slope a few percent off
# becomes that many percent of the estimate: the estimates are raised by this factor.
MARGIN = 1.05
STRIDE_PROBE = 128  # input side of the forward that finds the head's output stride
LABEL_BYTES = 8  # the labels (int64) each image keeps until predict returns
FLOAT_BYTES = 4
# What the stream's shape-counted terms leave out: kernels' scratch, the allocator's rounding.
SLACK_MB = 16
# The stream's work beyond its token maps: a fixed part (the coarse maps made whole, kernels'
# scratch) and bands of band_mb (the trunk's band with its FFN hidden layer; or the row maps'
# kept rows and the band being made). Upper bounds of the peaks measured with glibc's malloc
# (docs/gigapixel.md; at 8192² two bands fell short).
STREAM_WORK_MB = 64
STREAM_WORK_BANDS = 2.5
# Bytes per input element that mmseg's doors (inference_model, the test loop) hold while predict
# runs (the float batch, the packed uint8 image): the growth a caller sees includes them.
INPUT_BYTES = 4 + 1


def chunk_width(num_channels: int, plane_numel: int, budget_mb: float,
                channels_last: bool) -> int:
    """Classes per chunk: as many as ``budget_mb`` holds at ``plane_numel`` float32 pixels each,
    rounded down to a multiple of 8, at least 8 (24 channels-last) and at most all of them."""
    width = int(budget_mb * 2**20 // (4 * max(plane_numel, 1)))
    width = width // CHUNK_MULTIPLE * CHUNK_MULTIPLE
    width = max(width, MIN_CHUNK_CHANNELS_LAST if channels_last else CHUNK_MULTIPLE)
    return min(width, num_channels)


def slide_windows(img_hw: Sequence[int], crop_size: Sequence[int],
                  stride: Sequence[int]) -> List[Tuple[int, int, int, int]]:
    """The windows ``(y1, y2, x1, x2)`` of stock ``slide_inference``, in its order (row-major);
    a window is clipped to the image where the image is smaller than the crop."""
    (h_img, w_img), (h_crop, w_crop), (h_stride, w_stride) = img_hw, crop_size, stride
    h_grids = max(h_img - h_crop + h_stride - 1, 0) // h_stride + 1
    w_grids = max(w_img - w_crop + w_stride - 1, 0) // w_stride + 1
    windows = []
    for h_idx in range(h_grids):
        for w_idx in range(w_grids):
            y2 = min(h_idx * h_stride + h_crop, h_img)
            x2 = min(w_idx * w_stride + w_crop, w_img)
            windows.append((max(y2 - h_crop, 0), y2, max(x2 - w_crop, 0), x2))
    return windows


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
    """``argmax`` over the classes of one image given chunk by chunk in class order, and the
    full logits when they are kept."""

    def __init__(self, num_classes: int, keep_logits: bool,
                 step_done: Callable[[], None] = lambda: None):
        self.num_classes = num_classes
        self.keep_logits = keep_logits
        self.step_done = step_done  # called between the steps below (LeanEncoderDecoder)
        self.best = self.labels = self.logits = None

    def add(self, c0: int, make_chunk: Callable[[], Tensor]) -> None:
        """Classes [c0, c0 + c): ``make_chunk()`` gives them as (c, H, W). The chunk is made
        here, so that it is freed before the running maximum is updated."""
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
        # strictly greater: on a tie the earlier class keeps the pixel, as argmax does;
        # a NaN beats a number, as argmax's NaN does
        better = (values > self.best) | (values.isnan() & ~self.best.isnan())
        self.best = torch.where(better, values, self.best)
        self.labels = torch.where(better, index + c0, self.labels)
        del values, index, better
        self.step_done()

    def finish(self) -> None:
        """Free the running maxima once every class is in (the labels and logits stay)."""
        self.best = None

    @classmethod
    def of_labels(cls, labels: Tensor) -> '_RunningArgmax':
        """The finished state of labels made otherwise (no logits kept)."""
        state = cls(0, keep_logits=False)
        state.labels = labels
        return state


@MODELS.register_module()
class LeanEncoderDecoder(LeanSettingsMixin, MemoryPlanMixin, EncoderDecoder):
    """mmseg's ``EncoderDecoder`` whose ``predict`` never holds full-size logits of all classes.

    Same constructor, training and ``_forward`` as ``EncoderDecoder``; only ``predict`` changes
    (see the module docstring for why each step is exact, and for the ``test_cfg`` keys).
    ``mode='auto'`` and a budgeted stream keep their plans as :class:`MemoryPlanMixin` says.
    """
    SETTINGS = SegmentorSettings

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # a file without weights for a head is an error, never a silently random head
        self.register_load_state_dict_post_hook(refuse_headless_load)
        self._release_heap = False  # set by each predict: mode='auto' (_step_done)
        self._head_geometry: Optional[Tuple[float, float, bool]] = None
        self._post_lines = {}  # the post-processing's measured line per batch geometry
        self.test_settings  # a malformed or misspelt key in the config fails at build

    # ------------------------------------------------------------------ settings
    def _settings_context(self) -> dict:
        return dict(default_crop=getattr(self.data_preprocessor, 'size', None))

    def _check_parts(self, settings: SegmentorSettings) -> None:
        """What the mode needs of the model's parts, checked on every predict (a part may be
        replaced after the build): a streaming model, a stock head resize for 'auto'."""
        name = type(self).__name__
        stream_keys = settings.band_mb, settings.token_maps, settings.token_dir
        streams = settings.mode == 'stream' or any(k is not None for k in stream_keys)
        why = self._why_not_streamed() if streams else None
        if why is not None:
            raise ValueError(f"{name}: test_cfg mode='stream' cannot run: {why}; choose mode "
                             "'whole', 'slide' or 'auto'")
        if settings.mode == 'auto' and not self._head_resize_is_stock():
            raise ValueError(
                f"{name}: test_cfg.mode='auto' estimates memory only for a decode head whose "
                f'predict is mmseg\'s (forward + resize); {type(self.decode_head).__name__} '
                "overrides it: choose mode 'whole' or 'slide'")

    def _why_not_streamed(self) -> Optional[str]:
        """Why this model cannot run mode='stream' (None if it can)."""
        if not self.test_settings.lean:
            return 'it needs the lean predict (test_cfg.lean=False is set)'
        if self.test_settings.keep_seg_logits:
            return 'it keeps no full-size logits (remove test_cfg.keep_seg_logits)'
        if not self._head_resize_is_stock():
            return (f'{type(self.decode_head).__name__} overrides the decode head\'s predict')
        return why_not_streamed(self.backbone, getattr(self, 'neck', None), self.decode_head)

    # ------------------------------------------------------------------ predict
    def predict(self, inputs: Tensor, data_samples: OptSampleList = None) -> SampleList:
        """Labels (and, with ``test_cfg.keep_seg_logits``, logits) equal to stock ``predict``
        with the mode run: 'whole', 'slide', or the one 'auto' chooses within ``max_memory``."""
        settings = self.test_settings
        self._check_parts(settings)
        mode = settings.mode
        self._release_heap = auto = mode == 'auto'
        if not settings.lean:
            return super().predict(inputs, data_samples)
        batch_img_metas = self._batch_img_metas(inputs, data_samples)
        if not self._head_resize_is_stock():
            # full-size logits come from the inference itself: only the post-processing is lean
            return self._postprocess(self.inference(inputs, batch_img_metas), None, data_samples)
        plan = None  # mode='stream' within max_memory: where its token maps live
        if auto or mode == 'stream' and settings.max_memory is not None:
            B, _, H, W = inputs.shape
            plan = self._choose_memory_plan(
                self.memory_plans(inputs, data_samples, stream_only=not auto),
                settings.max_memory, f'{type(self).__name__} on {B} x {H}x{W} px')
        run = mode if plan is None else plan.name
        if run == 'slide':
            return self._slide_predict(inputs, data_samples, settings.crop_size, settings.stride)
        if run.startswith('stream'):
            return self._stream_predict(inputs, data_samples, batch_img_metas, plan)
        return self._whole_predict(inputs, batch_img_metas, data_samples)

    def _step_done(self) -> None:
        """Between the steps of a mode='auto' run: the freed heap back to the OS, where glibc
        would keep it resident and add it to the next step's (the estimate measures each)."""
        if self._release_heap:
            release_free_heap()

    @staticmethod
    def _batch_img_metas(inputs: Tensor, data_samples: OptSampleList) -> List[dict]:
        """The metas stock ``predict`` passes on (defaults when there are no data samples)."""
        if data_samples is not None:
            return [data_sample.metainfo for data_sample in data_samples]
        return [dict(ori_shape=inputs.shape[2:], img_shape=inputs.shape[2:],
                     pad_shape=inputs.shape[2:], padding_size=[0, 0, 0, 0])] * inputs.shape[0]

    def _whole_predict(self, inputs: Tensor, batch_img_metas: List[dict],
                       data_samples: OptSampleList) -> SampleList:
        """Stock whole inference: ``inference()`` -> ``encode_decode()`` ->
        ``decode_head.predict()`` = forward() and a resize to the input size (predict_by_feat);
        here that resize joins the chunked ones of the post-processing."""
        low_res = self._network_forward(inputs)
        self._step_done()
        return self._postprocess(low_res, self._head_resize_size(batch_img_metas), data_samples)

    def _head_resize_is_stock(self) -> bool:
        """Whether the decode head's ``predict`` is mmseg's forward + bilinear resize."""
        head = type(self.decode_head)
        return (head.predict is BaseDecodeHead.predict
                and head.predict_by_feat is BaseDecodeHead.predict_by_feat)

    @staticmethod
    def _head_resize_size(batch_img_metas: List[dict]):
        """The size ``BaseDecodeHead.predict_by_feat`` resizes the whole batch to."""
        meta = batch_img_metas[0]
        if 'pad_shape' in meta and not isinstance(meta['img_shape'], torch.Size):
            return meta['pad_shape'][:2]
        return meta['img_shape']

    # ------------------------------------------------------------------ network
    def _network_forward(self, inputs: Tensor) -> Tensor:
        """``decode_head.forward(extract_feat(inputs))``: the logits at the head's resolution."""
        if self._is_semantic_fpn():
            return self._semantic_fpn_forward(inputs)
        if self._is_upernet():
            return uper_head_in_data_flow_order(self.backbone, self.decode_head, inputs)
        return self.decode_head.forward(self.extract_feat(inputs))

    def _is_semantic_fpn(self) -> bool:
        """mmseg's FPN on every level, adding none (``why_not_data_flow_fpn``) + FPNHead."""
        neck, head = getattr(self, 'neck', None), self.decode_head
        return (why_not_data_flow_fpn(neck, FPN) is None and type(head) is FPNHead
                and head.input_transform == 'multiple_select'
                and list(head.in_index) == list(range(len(head.in_index)))
                and len(head.in_index) <= neck.num_outs)

    def _semantic_fpn_forward(self, inputs: Tensor) -> Tensor:
        """``FPNHead.forward(FPN.forward(backbone(inputs)))`` with each map freed when done:
        stock's operations in data-flow order (``fpn_in_data_flow_order``), the head's branches
        added into branch 0 in stock's order (float addition is not associative); ``a.add_(b)``
        on a tensor only this function holds gives the bits of ``a + b``."""
        head = self.decode_head
        fpn_out = fpn_in_data_flow_order(self.backbone, self.neck, inputs)
        num_branches = len(head.feature_strides)
        output = head.scale_heads[0](fpn_out[0])
        fpn_out[0] = None
        for i in range(1, num_branches):
            branch = resize(head.scale_heads[i](fpn_out[i]), size=output.shape[2:],
                            mode='bilinear', align_corners=head.align_corners)
            fpn_out[i] = None
            output = output + branch if output.requires_grad else output.add_(branch)
            del branch
        return head.cls_seg(output)

    def _is_upernet(self) -> bool:
        """mmseg's UPerHead (not a subclass) on the backbone's levels 0..n-1 in order, no neck:
        what ``uper_head_in_data_flow_order`` computes as stock does."""
        head = self.decode_head
        return (not self.with_neck and type(head) is UPerHead
                and head.input_transform == 'multiple_select'
                and list(head.in_index) == list(range(len(head.in_index)))
                and len(head.lateral_convs) == len(head.fpn_convs) == len(head.in_index) - 1)

    # ------------------------------------------------------------------ streamed
    def stream_labels(self, read_rows: Callable[[int, int], 'np.ndarray'],
                      image_hw: Tuple[int, int], max_memory: Optional[float] = None,
                      token_dir: Optional[str] = None,
                      progress: Optional[Callable[[int, int], None]] = None
                      ) -> Iterator[Tuple[int, int, Tensor]]:
        """Labels of an image larger than memory, a band of rows at a time, top to bottom:
        ``(start, stop, labels)`` with ``labels`` int64 (stop - start, W) on the CPU.

        ``read_rows(a, b)`` gives pixel rows a..b-1 as mmcv reads images: (b - a, W, C) uint8,
        BGR for colour; they are normalised as this model's data preprocessor does, at full
        resolution (no test-pipeline resize). ``max_memory`` (MB): what the call may add; the
        token maps go to files under ``token_dir`` when they do not fit in it (an error names
        the minimum when not even that fits). ``progress(done, total)`` follows the work.
        """
        why = self._why_not_streamed()
        if why is not None:
            raise ValueError(f'{type(self).__name__}.stream_labels: cannot stream: {why}')
        pre = self.data_preprocessor
        device = next(self.parameters()).device

        def read_pixels(start: int, stop: int) -> Tensor:
            rows = torch.from_numpy(np.ascontiguousarray(read_rows(start, stop))).to(device)
            rows = rows.permute(2, 0, 1)[None]
            if getattr(pre, 'channel_conversion', False):  # mmseg's SegDataPreProcessor
                rows = rows[:, [2, 1, 0]]
            rows = rows.float()
            return (rows - pre.mean) / pre.std if getattr(pre, '_enable_normalize', False) else rows

        plan = None
        if max_memory is not None:
            budget = read_budget_mb(dict(max_memory=max_memory), type(self).__name__)
            plans = self._stream_plans(image_hw, held_mb=0, budget_mb=budget)
            plan = self._choose_memory_plan(plans, budget, f'{type(self).__name__} on '
                                            f'{image_hw[0]}x{image_hw[1]} px')
        with self._eval_no_grad():
            for start, stop, labels in self._stream_bands(
                    read_pixels, image_hw, image_hw, (0, 0, 0, 0), image_hw, plan,
                    token_dir, progress):
                yield start, stop, labels.cpu()

    def _stream_predict(self, inputs: Tensor, data_samples: OptSampleList,
                        batch_img_metas: List[dict], plan: Optional[Plan]) -> SampleList:
        """mode='stream' (or the stream 'auto' chose): each image's labels made band by band
        into one (1, H, W) map, as stock's ``predict`` makes them."""
        head_hw = tuple(self._head_resize_size(batch_img_metas))
        states = []
        for i in range(inputs.shape[0]):
            meta = None if data_samples is None else data_samples[i].metainfo
            if meta is not None and meta.get('flip', None):
                raise ValueError(f"{type(self).__name__}: test_cfg mode='stream' does not flip "
                                 "(test-time augmentation): use mode 'whole' for flipped images")
            out_hw = self._output_hw(meta, head_hw)
            labels = torch.empty((1, ) + tuple(out_hw), dtype=torch.long, device=inputs.device)
            image = inputs[i:i + 1]
            for start, stop, band in self._stream_bands(
                    lambda a, b: image[:, :, a:b], tuple(inputs.shape[2:]), head_hw,
                    self._padding(meta), out_hw, plan, self.test_settings.token_dir):
                labels[0, start:stop] = band
            states.append(_RunningArgmax.of_labels(labels))
        return self._set_results(data_samples, states)

    def _stream_bands(self, read_pixels, image_hw, head_hw, crop, out_hw, plan: Optional[Plan],
                      token_dir: Optional[str],
                      progress: Optional[Callable[[int, int], None]] = None
                      ) -> Iterator[Tuple[int, int, Tensor]]:
        """The stream of one image: the trunk into token maps (on disk for plan 'stream-disk'),
        then the labels (rows, W) band by band, in bands of the plan's size (no plan: the
        default, :meth:`_stream_band_mb`). ``progress(done, total)``: the trunk's layers count as
        half the work, the label rows as the other half."""
        band_mb = plan.band_mb if plan is not None else self._stream_band_mb(None, 0)
        on_disk = (self.test_settings.token_maps == 'disk'
                   or plan is not None and plan.name == 'stream-disk')
        layers = max(self.backbone.out_indices) + 1
        total, done = 2 * out_hw[0], [0]

        def advance(units: int) -> None:
            done[0] += units
            if progress is not None:
                progress(min(done[0], total), total)

        folder = (token_dir or tempfile.gettempdir()) if on_disk else None
        with TokenMaps(next(self.parameters()).device, folder) as maps, \
                torch.no_grad():
            trunk = self.backbone.stream_trunk(read_pixels, image_hw, maps, band_mb,
                                               lambda: advance(out_hw[0] // layers))
            advance(out_hw[0] - done[0])
            logits = logits_rows(self.backbone, getattr(self, 'neck', None), self.decode_head,
                                 [TokenRows(m) for m in trunk], image_hw)
            labels = labels_rows(logits, head_hw, crop, out_hw, self.decode_head.align_corners,
                                 self.align_corners)
            for start, stop, band in stream_rows(labels, band_mb):
                yield start, stop, band[0, 0]
                advance(stop - start)

    def _stream_plans(self, image_hw: Sequence[int], held_mb: float,
                      budget_mb: Optional[float] = None) -> List[Plan]:
        """The stream's plans for an image with their estimates: the token maps in memory, then
        on disk. Each adds the bands' work (``STREAM_WORK_MB`` and ``STREAM_WORK_BANDS`` bands),
        what the caller holds (``held_mb``: the input, the labels) and ``SLACK_MB``; the maps
        are the trunk's kept ones and the one updated. The bands are as large as ``budget_mb``
        leaves room for (:meth:`_stream_band_mb`), the size each plan then runs with."""
        p, D = self.backbone.patch_size, self.backbone.embed_dims
        grid = [(side + p - 1) // p for side in image_hw]
        kept = len(set(self.backbone.out_indices) - {max(self.backbone.out_indices)}) + 1
        maps_mb = kept * FLOAT_BYTES * D * grid[0] * grid[1] / MB
        fixed_mb = SLACK_MB + held_mb + STREAM_WORK_MB
        if type(self.decode_head) is UPerHead:  # the pyramid pooling reads the stride-32 map
            head = self.decode_head
            fixed_mb += (FLOAT_BYTES * math.prod(-(-side // 32) for side in image_hw)
                         * (D + (len(head.pool_scales) + 1) * head.channels) / MB)
        plans = []
        for name, where, maps in (('stream', 'in memory', maps_mb), ('stream-disk', 'on disk', 0)):
            band_mb = self._stream_band_mb(budget_mb, fixed_mb + maps)
            plans.append(Plan(name, fixed_mb + maps + STREAM_WORK_BANDS * band_mb,
                              f'({kept} token maps of {maps_mb / kept:.0f} MB {where}, bands of '
                              f'{band_mb:.0f} MB)', band_mb))
        return plans

    def _stream_band_mb(self, budget_mb: Optional[float], fixed_mb: float) -> float:
        """``test_cfg.band_mb`` if given; else ``STREAM_BAND_MB`` of the device, or under
        ``budget_mb`` the largest band up to that which fits beside ``fixed_mb`` (at least the
        minimum)."""
        given = self.test_settings.band_mb
        if given is not None:
            return given
        default = STREAM_BAND_MB.get(next(self.parameters()).device.type, STREAM_BAND_MB['cpu'])
        if budget_mb is None:
            return default
        room = (budget_mb - fixed_mb) / STREAM_WORK_BANDS
        return max(MIN_STREAM_BAND_MB, min(default, room))

    # ------------------------------------------------------------------ sliding windows
    def _slide_predict(self, inputs: Tensor, data_samples: OptSampleList,
                       crop_size: Tuple[int, int], stride: Tuple[int, int]) -> SampleList:
        """Stock ``slide_inference`` + ``postprocess_result``, one class chunk at a time: the
        window logits stay at the head's resolution (the one cost that grows with the window
        count), and :meth:`_slide_post` rebuilds each chunk of stock's map from them."""
        windows = slide_windows(inputs.shape[2:], crop_size, stride)
        window_logits = []  # at the head's resolution, in stock's order
        for y1, y2, x1, x2 in windows:
            window_logits.append(self._network_forward(inputs[:, :, y1:y2, x1:x2]))
            self._step_done()
        count = self._window_count(inputs, inputs.shape, windows)
        return self._slide_post(window_logits, windows, count, data_samples)

    def _slide_post(self, window_logits: List[Tensor], windows: list, count: Tensor,
                    data_samples: OptSampleList, widths: Optional[List[int]] = None) -> SampleList:
        """Each class chunk (``widths[0]`` classes, default :meth:`_chunk_widths`) of stock's map
        (:meth:`_slide_chunk`), post-processed per image into its running argmax."""
        C = window_logits[0].shape[1]
        if C == 1:  # binary head: one channel, nothing to chunk; stock code on the full map
            return self.postprocess_result(
                self._slide_chunk(window_logits, windows, count, 0, 1), data_samples)
        metas = self._metas(data_samples, count.shape[0])
        width = (widths or self._chunk_widths(
            C, count.shape, metas, any(map(_is_channels_last, window_logits)), slide=True))[0]
        states = [_RunningArgmax(C, self.test_settings.keep_seg_logits, self._step_done)
                  for _ in metas]
        for c0 in range(0, C, width):
            chunk = self._slide_chunk(window_logits, windows, count, c0, min(c0 + width, C))
            for i, (state, meta) in enumerate(zip(states, metas)):
                state.add(c0, partial(self._image_chunk, chunk, i, 0, chunk.shape[1], None, meta))
            del chunk
            self._step_done()
        for state in states:
            state.finish()
        return self._set_results(data_samples, states)

    @staticmethod
    def _window_count(like: Tensor, shape: Sequence[int], windows: list) -> Tensor:
        """Stock's count map: how many windows cover each pixel, (batch, 1, H, W)."""
        count = like.new_zeros((shape[0], 1) + tuple(shape[2:]))
        for y1, y2, x1, x2 in windows:
            count[:, :, y1:y2, x1:x2] += 1
        assert (count == 0).sum() == 0
        return count

    def _slide_chunk(self, window_logits: List[Tensor], windows: list, count: Tensor, c0: int,
                     c1: int) -> Tensor:
        """Classes [c0, c1) of stock ``slide_inference``'s result, (batch, c1 - c0, H, W): each
        window resized to its size as ``decode_head.predict_by_feat`` resizes it, added in
        stock's order into a zero map, which is divided by the count map."""
        acc = count.new_zeros((count.shape[0], c1 - c0) + tuple(count.shape[2:]))
        for (y1, y2, x1, x2), logits in zip(windows, window_logits):
            part = resize(_class_slice(logits, c0, c1), size=(y2 - y1, x2 - x1),
                          mode='bilinear', align_corners=self.decode_head.align_corners)
            acc[:, :, y1:y2, x1:x2].add_(part)
            del part
            self._step_done()
        return acc.div_(count)

    # ------------------------------------------------------------------ post-processing
    def _postprocess(self, seg_logits: Tensor, head_size, data_samples: OptSampleList,
                     widths: Optional[List[int]] = None) -> list:
        """Stock ``postprocess_result`` (and, when ``head_size`` is given, the head's resize to
        it before), class chunk by class chunk (``widths`` classes per image, default
        :meth:`_chunk_widths`), with a running argmax."""
        batch_size, C = seg_logits.shape[:2]
        if C == 1:  # binary head: one channel, nothing to chunk; stock code on the full map
            if head_size is not None:
                seg_logits = resize(seg_logits, size=head_size, mode='bilinear',
                                    align_corners=self.decode_head.align_corners)
            return self.postprocess_result(seg_logits, data_samples)
        metas = self._metas(data_samples, batch_size)
        widths = widths or self._chunk_widths(C, head_size or seg_logits.shape[2:], metas,
                                              _is_channels_last(seg_logits))
        states = []
        for i, (meta, width) in enumerate(zip(metas, widths)):
            state = _RunningArgmax(C, self.test_settings.keep_seg_logits, self._step_done)
            for c0 in range(0, C, width):
                state.add(c0, lambda: self._image_chunk(seg_logits, i, c0, min(c0 + width, C),
                                                        head_size, meta))
            state.finish()
            states.append(state)
        return self._set_results(data_samples, states)

    def _chunk_widths(self, num_classes: int, head_hw: Sequence[int],
                      metas: List[Optional[dict]], channels_last: bool,
                      slide: bool = False) -> List[int]:
        """Classes per chunk of each image's post-processing: its planes per class are the
        image's labels and, for the windows (``slide``), the batch's map of ``head_hw``
        (B, _, H, W): then the narrowest of the images' widths, for all."""
        batch_map = len(metas) * math.prod(head_hw[-2:]) if slide else 0
        widths = [chunk_width(num_classes, batch_map + math.prod(self._output_hw(m, head_hw[-2:])),
                              self.test_settings.lean_chunk_mb, channels_last) for m in metas]
        return [min(widths)] * len(widths) if slide else widths

    @staticmethod
    def _metas(data_samples: OptSampleList, batch_size: int) -> List[Optional[dict]]:
        """Each image's meta, None for every image without data samples."""
        if data_samples is None:
            return [None] * batch_size
        return [sample.metainfo for sample in data_samples]

    def _set_results(self, data_samples: OptSampleList,
                     states: List[_RunningArgmax]) -> SampleList:
        """Stock's results: ``pred_sem_seg`` (and ``seg_logits`` when kept) per image."""
        if data_samples is None:
            data_samples = [SegDataSample() for _ in states]
        for sample, state in zip(data_samples, states):
            data = {'pred_sem_seg': PixelData(data=state.labels)}
            if state.keep_logits:
                data['seg_logits'] = PixelData(data=state.logits)
            sample.set_data(data)
        return data_samples

    @staticmethod
    def _padding(meta: Optional[dict]) -> Tuple[int, int, int, int]:
        """The padding (top, bottom, left, right) that stock's post-processing crops off."""
        if meta is None:
            return (0, 0, 0, 0)
        padding = meta.get('img_padding_size', meta.get('padding_size', [0] * 4))
        left, right, top, bottom = padding
        return (top, bottom, left, right)

    @staticmethod
    def _output_hw(meta: Optional[dict], head_hw: Sequence[int]) -> Tuple[int, int]:
        """The size of an image's labels: its original shape, or the head's size without metas."""
        return tuple(meta['ori_shape']) if meta is not None else tuple(head_hw)

    def _image_chunk(self, seg_logits: Tensor, i: int, c0: int, c1: int, head_size,
                     meta: Optional[dict]) -> Tensor:
        """Classes [c0, c1) of image i after the stock steps: head resize, padding crop, flip,
        resize to the original shape. Returns (c1 - c0, H, W)."""
        x = _class_slice(seg_logits, c0, c1, slice(i, i + 1))
        if head_size is not None:
            x = resize(x, size=head_size, mode='bilinear',
                       align_corners=self.decode_head.align_corners)
        if meta is None:
            return x[0]
        H, W = x.shape[2:]
        top, bottom, left, right = self._padding(meta)
        x = x[:, :, top:H - bottom, left:W - right]
        if meta.get('flip', None):
            direction = meta.get('flip_direction', None)
            assert direction in ['horizontal', 'vertical']
            x = x.flip(dims=(3, ) if direction == 'horizontal' else (2, ))
        return resize(x, size=meta['ori_shape'], mode='bilinear',
                      align_corners=self.align_corners, warning=False)[0]

    # ------------------------------------------------------------------ memory budget
    def memory_plans(self, inputs: Tensor, data_samples: OptSampleList = None,
                     stream_only: bool = False) -> List[Plan]:
        """The plans of ``mode='auto'`` (the stream's alone with ``stream_only``, for a budgeted
        mode='stream') for this batch, in the order tried, with the estimated peak (MB) that
        ``predict`` adds running each.

        A run has two phases, and its estimate is the larger: the network (its line,
        :meth:`network_memory_model`) with what is kept from before, then the post-processing
        beside the network's output (:meth:`_post_mb`). Both lines are extrapolated, so their
        estimates are raised by ``MARGIN``; both add the input batch (``INPUT_BYTES``).
        """
        B, _, H, W = inputs.shape
        metas = self._metas(data_samples, B)
        head_hw = tuple(self._head_resize_size(self._batch_img_metas(inputs, data_samples)))
        stream = []
        if stream_only or self._why_not_streamed() is None:
            stream = self._stream_plans((H, W), self._held_mb(inputs, metas, head_hw),
                                        self.test_settings.max_memory)
        if stream_only:
            return stream
        crop, stride = self.test_settings.crop_size, self.test_settings.stride
        line = self.network_memory_model(inputs)
        self._release_heap = True  # the post-processing is measured as mode='auto' runs it
        input_mb = INPUT_BYTES * inputs.numel() / MB
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

    def _held_mb(self, inputs: Tensor, metas: List[Optional[dict]], head_hw) -> float:
        """What a stream's caller holds: the input batch and every image's labels."""
        labels = sum(math.prod(self._output_hw(meta, head_hw)) for meta in metas)
        return (INPUT_BYTES * inputs.numel() + LABEL_BYTES * labels) / MB

    def _post_mb(self, inputs: Tensor, metas: List[Optional[dict]], head_hw: Sequence[int],
                 windows: Optional[list] = None) -> float:
        """Peak (MB) of the post-processing of this batch with the tensors it starts from (the
        network's output; or the windows' logits and count map), measured on zeros at the batch's
        geometry scaled down (``POST_CALIBRATION_SIDE``) at the full-size run's chunk widths, and
        extrapolated: each of its tensors has a fixed number of elements per pixel. Kept per
        geometry."""
        B, _, H, W = inputs.shape
        C = self.out_channels
        s_h, s_w, channels_last = self._head_output_geometry(inputs)
        widths = self._chunk_widths(C, head_hw if windows is None else inputs.shape, metas,
                                    channels_last, slide=windows is not None)
        key = (tuple(inputs.shape), tuple(head_hw), tuple(windows or ()), str(widths),
               self.test_settings.keep_seg_logits,
               tuple((self._output_hw(m, head_hw), self._padding(m), m and m.get('flip'),
                      m and m.get('flip_direction')) for m in metas))
        if key in self._post_lines:
            return self._post_lines[key].estimate_mb(H * W)

        def scaled(f: float, *sizes) -> tuple:
            return tuple(max(1, round(v * f)) for v in sizes)

        def logits(f: float, h: int, w: int) -> Tensor:
            out = inputs.new_zeros((B, C) + scaled(f, math.ceil(h / s_h), math.ceil(w / s_w)))
            return out.contiguous(memory_format=torch.channels_last) if channels_last else out

        def sample(meta: dict, f: float) -> SegDataSample:
            top, bottom, left, right = (round(p * f) for p in self._padding(meta))
            return SegDataSample(metainfo=dict(
                ori_shape=scaled(f, *meta['ori_shape']), padding_size=[left, right, top, bottom],
                flip=meta.get('flip'), flip_direction=meta.get('flip_direction')))

        def run(h: int, w: int):
            f = h / H
            samples = None if metas[0] is None else [sample(meta, f) for meta in metas]
            if windows is None:
                return self._postprocess(logits(f, H, W), scaled(f, *head_hw), samples, widths)
            boxes = [tuple(round(v * f) for v in box) for box in windows]
            count = self._window_count(inputs, (B, 1) + scaled(f, H, W), boxes)
            return self._slide_post([logits(f, y2 - y1, x2 - x1) for y1, y2, x1, x2 in windows],
                                    boxes, count, samples, widths)

        top = min(max(H, W), POST_CALIBRATION_SIDE)
        sides = [scaled(side / max(H, W), H, W) for side in (top / 2, top)]
        self._post_lines[key] = measure_line(run, sides, inputs.device)[0]
        return self._post_lines[key].estimate_mb(H * W)

    def _calibrate_memory(self, inputs: Tensor) -> MemoryModel:
        """The network's peak line (:meth:`network_memory_model`): the network forward on zeros
        at ``CALIBRATION_SIZES``, in eval mode."""
        channels = inputs.shape[1]
        with self._eval_no_grad():
            return calibrate(
                lambda h, w: self._network_forward(inputs.new_zeros((1, channels, h, w))),
                CALIBRATION_SIZES, f'{type(self).__name__} network', device=inputs.device)

    def _head_output_geometry(self, inputs: Tensor) -> Tuple[float, float, bool]:
        """Input pixels per head output pixel (h, w) and whether the output is channels-last
        (which sets the chunk widths), from one small forward on zeros, kept."""
        if self._head_geometry is None:
            with self._eval_no_grad():
                out = self._network_forward(
                    inputs.new_zeros((1, inputs.shape[1], STRIDE_PROBE, STRIDE_PROBE)))
            self._head_geometry = (STRIDE_PROBE / out.shape[2], STRIDE_PROBE / out.shape[3],
                                   _is_channels_last(out))
        return self._head_geometry

    @contextmanager
    def _eval_no_grad(self) -> Iterator[None]:
        """Eval mode (batch norm statistics stay as they are) without autograd, then as before."""
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.train(was_training)
