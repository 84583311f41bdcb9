"""Whole-image segmentation without full-size logits: :class:`LeanEncoderDecoder`.

mmseg's ``EncoderDecoder.predict`` (1.2.2) resizes the C-class logits of the decode head to the
network input, crops the padding, resizes them again to the original image and only then takes the
argmax, keeping the full-size logits in every result. With ADE20k's 150 classes a 4096 x 4096
image costs 150 x 4096 x 4096 x 4 bytes = 10 GB for each of those full-size tensors, whatever the
size the network ran at. At full resolution the Semantic FPN neck and head also keep all four
levels of three stages alive at once, the stride-4 ones being the largest.

:class:`LeanEncoderDecoder` computes the same labels with less memory, by exact means only:

* **Post-processing in class chunks.** Bilinear resizing works on each channel independently, so
  resizing a chunk of classes gives the values the full call gives for those classes; a running
  maximum with a strict ``>`` (the earlier class wins a tie, as ``argmax`` returns the first
  maximum; a NaN wins as in ``argmax``) gives ``argmax`` of the full tensor. Only one chunk of
  full-size logits exists at a time. On this CPU torch's bilinear kernels give bit-identical
  channel results only for some chunk widths (a 1-channel call vectorises differently; in
  channels-last a chunk narrower than 24 channels, or not a multiple of 8, takes another path):
  chunks are multiples of 8 channels (at least 24 in channels-last), which
  ``tests/test_lean_segmentation.py`` checks against stock labels and logits.
* **Semantic FPN in the order the data flows** (:meth:`LeanEncoderDecoder._semantic_fpn_forward`):
  the XCiT levels are made one at a time (stride 32 first, the stride-4 map last), each FPN level
  as soon as its inputs exist, and every map is freed when the next step no longer needs it; the
  head sums its four branches into one accumulator. Each operation is the stock one on the same
  full tensor (no tiling): convolutions on differently sized inputs can take another oneDNN
  algorithm and differ in the last bit, which can flip an argmax at a near-tie, so spatial tiles
  were measured and rejected (they were not bit-identical here).

Labels are those of stock ``EncoderDecoder.predict`` on the same weights; logits, when kept,
equal stock's. Configs: ``model = dict(type='LeanEncoderDecoder', ...)`` is the one key
(``custom_imports`` of ``xcit_mm``, which the backbone needs anyway, registers the name; the
class is imported on first build, so ``import xcit_mm`` does not import mmseg). Our ADE20k
segmentation configs use it by default. ``test_cfg`` keys, all optional:

* ``lean`` (bool, default True): False gives the stock ``EncoderDecoder.predict``.
* ``keep_seg_logits`` (bool, default False): also store the full-size ``seg_logits`` that stock
  stores (assembled chunk by chunk, one C x H x W tensor per image). Without it the results carry
  ``pred_sem_seg`` only: IoUMetric, the visualizer, ``MMSegInferencer`` and ``inference_model``'s
  callers read nothing else, and a reader of ``seg_logits`` gets a clear AttributeError rather
  than logits of another size.
* ``lean_chunk_mb`` (int, default 256): memory of one chunk of full-size logits; the chunk is
  rounded to the widths above.
"""
from typing import List, Optional

import torch
from mmengine.structures import PixelData
from torch import Tensor

from mmseg.models.decode_heads import FPNHead
from mmseg.models.decode_heads.decode_head import BaseDecodeHead
from mmseg.models.necks import FPN
from mmseg.models.segmentors import EncoderDecoder
from mmseg.models.utils import resize
from mmseg.registry import MODELS
from mmseg.structures import SegDataSample
from mmseg.utils import OptSampleList, SampleList

from ..layers.fpn_data_flow import fpn_in_data_flow_order
from ..utils.ckpt_load import refuse_headless_load

# Chunk widths whose bilinear results equal the full call's, channel by channel (module docstring).
CHUNK_MULTIPLE = 8
MIN_CHUNK_CHANNELS_LAST = 24


def chunk_width(num_channels: int, plane_numel: int, budget_mb: float,
                channels_last: bool) -> int:
    """Classes per chunk: as many as ``budget_mb`` holds at ``plane_numel`` float32 pixels each,
    rounded down to a multiple of 8, at least 8 (24 channels-last) and at most all of them."""
    width = int(budget_mb * 2**20 // (4 * max(plane_numel, 1)))
    width = width // CHUNK_MULTIPLE * CHUNK_MULTIPLE
    width = max(width, MIN_CHUNK_CHANNELS_LAST if channels_last else CHUNK_MULTIPLE)
    return min(width, num_channels)


def _is_channels_last(x: Tensor) -> bool:
    """Whether torch's resize takes its channels-last kernel for ``x`` (a whole head output)."""
    return (x.dim() == 4 and not x.is_contiguous()
            and x.is_contiguous(memory_format=torch.channels_last))


@MODELS.register_module()
class LeanEncoderDecoder(EncoderDecoder):
    """mmseg's ``EncoderDecoder`` whose ``predict`` never holds full-size logits of all classes.

    Same constructor, training, ``_forward`` and slide inference as ``EncoderDecoder``; only
    ``predict`` changes (see the module docstring for why each step is exact, and for the
    ``test_cfg`` keys ``lean``, ``keep_seg_logits`` and ``lean_chunk_mb``).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # a file without weights for a head is an error, never a silently random head
        self.register_load_state_dict_post_hook(refuse_headless_load)

    # ------------------------------------------------------------------ settings
    def _test_option(self, key, default):
        cfg = self.test_cfg
        return cfg.get(key, default) if cfg is not None else default

    # ------------------------------------------------------------------ predict
    def predict(self, inputs: Tensor, data_samples: OptSampleList = None) -> SampleList:
        """Labels (and, with ``test_cfg.keep_seg_logits``, logits) equal to stock ``predict``."""
        if not self._test_option('lean', True):
            return super().predict(inputs, data_samples)
        if data_samples is not None:
            batch_img_metas = [data_sample.metainfo for data_sample in data_samples]
        else:
            batch_img_metas = [
                dict(ori_shape=inputs.shape[2:], img_shape=inputs.shape[2:],
                     pad_shape=inputs.shape[2:], padding_size=[0, 0, 0, 0])
            ] * inputs.shape[0]
        if self.test_cfg.get('mode', 'whole') == 'slide' or not self._head_resize_is_stock():
            # full-size logits come from the inference itself: only the post-processing is lean
            return self._postprocess(self.inference(inputs, batch_img_metas), None, data_samples)
        # stock: inference() -> encode_decode() -> decode_head.predict() = forward() and a
        # resize to the input size (predict_by_feat); here that resize joins the chunked ones
        self.inference_checks(batch_img_metas)
        low_res = self._network_forward(inputs)
        head_size = self._head_resize_size(batch_img_metas)
        return self._postprocess(low_res, head_size, data_samples)

    def inference_checks(self, batch_img_metas: List[dict]) -> None:
        """What ``EncoderDecoder.inference`` checks before running (mode, one ori_shape)."""
        assert self.test_cfg.get('mode', 'whole') in ['slide', 'whole'], \
            f'Only "slide" or "whole" test mode are supported, but got {self.test_cfg["mode"]}.'

    def _head_resize_is_stock(self) -> bool:
        """Whether the decode head's ``predict`` is mmseg's forward + bilinear resize."""
        head = type(self.decode_head)
        return (head.predict is BaseDecodeHead.predict
                and head.predict_by_feat is BaseDecodeHead.predict_by_feat)

    @staticmethod
    def _head_resize_size(batch_img_metas: List[dict]):
        """The size ``BaseDecodeHead.predict_by_feat`` resizes the whole batch to."""
        meta = batch_img_metas[0]
        if isinstance(meta['img_shape'], torch.Size):
            return meta['img_shape']
        if 'pad_shape' in meta:
            return meta['pad_shape'][:2]
        return meta['img_shape']

    # ------------------------------------------------------------------ network
    def _network_forward(self, inputs: Tensor) -> Tensor:
        """``decode_head.forward(extract_feat(inputs))``: the logits at the head's resolution."""
        if self._is_semantic_fpn():
            return self._semantic_fpn_forward(inputs)
        return self.decode_head.forward(self.extract_feat(inputs))

    def _is_semantic_fpn(self) -> bool:
        """mmseg's FPN (4 levels in, 4 out, no extra levels, nearest top-down) + FPNHead."""
        neck = getattr(self, 'neck', None)
        head = self.decode_head
        return (type(neck) is FPN and type(head) is FPNHead and neck.start_level == 0
                and neck.backbone_end_level == neck.num_ins and neck.num_outs == neck.num_ins
                and head.input_transform == 'multiple_select'
                and list(head.in_index) == list(range(len(head.in_index)))
                and len(head.in_index) <= neck.num_outs)

    def _semantic_fpn_forward(self, inputs: Tensor) -> Tensor:
        """``FPNHead.forward(FPN.forward(backbone(inputs)))`` with each map freed when done.

        The same operations on the same tensors as stock, in data-flow order: the backbone and
        FPN by :func:`~xcit_mm.models.layers.fpn_data_flow.fpn_in_data_flow_order`, then the
        head's branch 0, then branches 1..3 added into it one at a time in stock's order (float
        addition is not associative). ``a.add_(b)`` on a tensor that only this function holds
        gives the bits of ``a + b``.
        """
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

    # ------------------------------------------------------------------ post-processing
    def _postprocess(self, seg_logits: Tensor, head_size, data_samples: OptSampleList) -> list:
        """Stock ``postprocess_result`` (and, when ``head_size`` is given, the head's resize to
        it before), class chunk by class chunk, with a running argmax."""
        batch_size, C = seg_logits.shape[:2]
        if C == 1:  # binary head: one channel, nothing to chunk; stock code on the full map
            if head_size is not None:
                seg_logits = resize(seg_logits, size=head_size, mode='bilinear',
                                    align_corners=self.decode_head.align_corners)
            return self.postprocess_result(seg_logits, data_samples)
        only_prediction = data_samples is None
        if only_prediction:
            data_samples = [SegDataSample() for _ in range(batch_size)]
        keep_logits = self._test_option('keep_seg_logits', False)
        budget_mb = self._test_option('lean_chunk_mb', 256)
        for i in range(batch_size):
            meta = None if only_prediction else data_samples[i].metainfo
            labels, logits = self._labels_of_image(seg_logits, i, head_size, meta, budget_mb,
                                                   keep_logits)
            data = {'pred_sem_seg': PixelData(data=labels)}
            if keep_logits:
                data['seg_logits'] = PixelData(data=logits)
            data_samples[i].set_data(data)
        return data_samples

    def _image_chunk(self, seg_logits: Tensor, i: int, c0: int, c1: int, head_size,
                     meta: Optional[dict]) -> Tensor:
        """Classes [c0, c1) of image i after the stock steps: head resize, padding crop, flip,
        resize to the original shape. Returns (c1 - c0, H, W)."""
        x = seg_logits[i:i + 1, c0:c1]
        if _is_channels_last(seg_logits):  # the layout (and so the kernel) stock runs on
            x = x.contiguous(memory_format=torch.channels_last)
        if head_size is not None:
            x = resize(x, size=head_size, mode='bilinear',
                       align_corners=self.decode_head.align_corners)
        if meta is None:
            return x[0]
        H, W = x.shape[2:]
        if 'img_padding_size' not in meta:
            padding_size = meta.get('padding_size', [0] * 4)
        else:
            padding_size = meta['img_padding_size']
        left, right, top, bottom = padding_size
        x = x[:, :, top:H - bottom, left:W - right]
        if meta.get('flip', None):
            direction = meta.get('flip_direction', None)
            assert direction in ['horizontal', 'vertical']
            x = x.flip(dims=(3, ) if direction == 'horizontal' else (2, ))
        return resize(x, size=meta['ori_shape'], mode='bilinear',
                      align_corners=self.align_corners, warning=False)[0]

    def _labels_of_image(self, seg_logits: Tensor, i: int, head_size, meta: Optional[dict],
                         budget_mb: float, keep_logits: bool):
        """(labels (1, H, W) int64, full logits or None) of image i by running argmax."""
        C = seg_logits.shape[1]
        if meta is not None:
            out_hw = tuple(meta['ori_shape'])
        elif head_size is not None:
            out_hw = tuple(head_size)
        else:
            out_hw = tuple(seg_logits.shape[2:])
        width = chunk_width(C, out_hw[0] * out_hw[1], budget_mb, _is_channels_last(seg_logits))
        best = labels = full = None
        for c0 in range(0, C, width):
            c1 = min(c0 + width, C)
            chunk = self._image_chunk(seg_logits, i, c0, c1, head_size, meta)
            if keep_logits:
                if full is None:
                    full = chunk.new_empty((C, ) + tuple(chunk.shape[1:]))
                full[c0:c1] = chunk
            values, index = chunk.max(dim=0, keepdim=True)  # first maximum of the chunk
            del chunk
            if best is None:
                best, labels = values, index
                continue
            # strictly greater: on a tie the earlier class keeps the pixel, as argmax does;
            # a NaN beats a number, as argmax's NaN does
            better = (values > best) | (values.isnan() & ~best.isnan())
            best = torch.where(better, values, best)
            labels = torch.where(better, index + c0, labels)
            del values, index, better
        return labels, full
