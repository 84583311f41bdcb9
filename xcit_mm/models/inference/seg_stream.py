"""Semantic FPN and UperNet on a streamed XCiT trunk: logits and labels as row maps.

The backbone's trunk maps (``XCiTBackbone.stream_trunk``) become the adapter levels, the neck,
the head, the logits and the labels as :class:`~.row_stream.RowMap` s, made a band of rows at a
time by :func:`~.row_stream.stream_rows`: mmseg's FPN + FPNHead and UPerHead, link by link, in
their own order of operations (each sum and resize where stock does it). UperNet's pyramid
pooling reads the whole stride-32 map (small); its pooled maps are resized by rows like the rest.
The labels are stock ``predict``'s: the head's resize to the input, the padding crop, the resize
to the original shape, the argmax, each a band of rows at a time.
"""
from typing import Optional, Sequence, Tuple

import torch
from mmseg.models.decode_heads import FPNHead, UPerHead
from mmseg.models.necks import FPN
from mmseg.models.utils import Upsample
from torch import Tensor

from .fpn_data_flow import top_down_rows, why_not_data_flow_fpn
from .row_stream import (Combine, Crop, Local, NotRowLocal, Resize, RowMap, StreamedBackbone,
                         TensorRows, module_rows)


def _cat(*maps: Tensor) -> Tensor:
    return torch.cat(maps, dim=1)


def _argmax(logits: Tensor) -> Tensor:
    return logits.argmax(dim=1, keepdim=True)


def _resized(source: RowMap, target: RowMap, align_corners) -> RowMap:
    """``source`` resized bilinearly to ``target``'s size, or itself where the sizes agree (a
    resize to its own size copies)."""
    if (source.height, source.width) == (target.height, target.width):
        return source
    return Resize(source, (target.height, target.width), 'bilinear', align_corners)


def _branch_rows(branch, source: RowMap) -> RowMap:
    """One of FPNHead's scale heads (convs and mmseg ``Upsample`` s) as rows."""
    for module in branch:
        if isinstance(module, Upsample):
            size = module.size or [int(side * module.scale_factor)
                                   for side in (source.height, source.width)]
            source = Resize(source, size, module.mode, module.align_corners)
        else:
            source = module_rows(module, source)
    return source


def semantic_fpn_rows(levels: Sequence[RowMap], neck: FPN, head: FPNHead) -> RowMap:
    """``FPNHead.forward(FPN.forward(levels))``: the logits at the head's stride, by rows."""
    lateral = [module_rows(conv, level) for conv, level in zip(neck.lateral_convs, levels)]
    for i in range(len(lateral) - 1, 0, -1):
        lateral[i - 1] = top_down_rows(lateral[i - 1], lateral[i], neck.upsample_cfg)
    outs = [module_rows(conv, lat) for conv, lat in zip(neck.fpn_convs, lateral)]
    output = _branch_rows(head.scale_heads[0], outs[0])
    for i in range(1, len(head.feature_strides)):
        branch = _branch_rows(head.scale_heads[i], outs[i])
        output = Combine(torch.add, output, _resized(branch, output, head.align_corners))
    return Local(head.cls_seg, output)


def upernet_rows(levels: Sequence[RowMap], head: UPerHead) -> RowMap:
    """``UPerHead.forward(levels)`` by rows; its pyramid pooling module reads the whole (small)
    coarsest level, and the pooled maps are resized by rows."""
    top = levels[-1].rows(0, levels[-1].height)
    pooled = [TensorRows(top)] + [_resized(TensorRows(ppm(top)), levels[-1],
                                           head.psp_modules.align_corners)
                                  for ppm in head.psp_modules]
    lateral = [module_rows(conv, level) for conv, level in zip(head.lateral_convs, levels)]
    lateral.append(module_rows(head.bottleneck, Combine(_cat, *pooled)))
    for i in range(len(lateral) - 1, 0, -1):
        lateral[i - 1] = top_down_rows(lateral[i - 1], lateral[i],
                                       dict(mode='bilinear', align_corners=head.align_corners))
    outs = [module_rows(conv, lat) for conv, lat in zip(head.fpn_convs, lateral)] + lateral[-1:]
    outs = [outs[0]] + [_resized(out, outs[0], head.align_corners) for out in outs[1:]]
    return Local(head.cls_seg, module_rows(head.fpn_bottleneck, Combine(_cat, *outs)))


def logits_rows(backbone, neck, head, trunk_maps: Sequence[RowMap],
                image_hw: Tuple[int, int]) -> RowMap:
    """The head's logits of a streamed trunk, by rows (Semantic FPN or UperNet)."""
    levels = [backbone.level_rows(trunk_map, i, image_hw) for i, trunk_map in
              enumerate(trunk_maps)]
    if type(head) is UPerHead:
        return upernet_rows(levels, head)
    return semantic_fpn_rows(levels, neck, head)


def labels_rows(logits: RowMap, head_hw: Sequence[int], crop: Sequence[int],
                out_hw: Sequence[int], head_align_corners: bool,
                align_corners: bool) -> RowMap:
    """Stock ``predict``'s labels (1, 1, H, W) by rows: the head's resize to ``head_hw``, the
    padding ``crop`` (top, bottom, left, right), the resize to ``out_hw``, the argmax."""
    x = Resize(logits, head_hw, 'bilinear', head_align_corners)
    top, bottom, left, right = crop
    x = Crop(x, top, left, head_hw[0] - top - bottom, head_hw[1] - left - right)
    if (x.height, x.width) != tuple(out_hw):
        x = Resize(x, out_hw, 'bilinear', align_corners)
    return Local(_argmax, x)


def why_not_streamed(backbone, neck, head) -> Optional[str]:
    """Why this backbone, neck and head cannot run streamed (None if they can), as a reason a
    user can act on: the graph is built on a small image's placeholder maps, so the check is
    the very construction a streamed predict makes."""
    if not isinstance(backbone, StreamedBackbone):
        return f'{type(backbone).__name__} cannot stream its trunk (XCiTBackbone can)'
    semantic_fpn = type(neck) is FPN and type(head) is FPNHead
    if not (semantic_fpn or (neck is None and type(head) is UPerHead)):
        return (f'it runs Semantic FPN (mmseg FPN + FPNHead) or UperNet (UPerHead, no neck), not '
                f'{type(neck).__name__} + {type(head).__name__}')
    if semantic_fpn and (why := why_not_data_flow_fpn(neck, FPN)):
        return why
    if head.out_channels == 1:
        return 'a one-channel (sigmoid) head is thresholded, not an argmax: use mode whole'
    side, device = 64, next(head.parameters()).device
    placeholders = [TensorRows(torch.zeros(1, channels, -(-side // stride), -(-side // stride),
                                           device=device))
                    for channels, stride in zip(backbone.out_channels, backbone.strides)]
    try:
        with torch.no_grad():
            logits_rows(_Placeholder(placeholders), neck, head, placeholders, (side, side))
    except NotRowLocal as error:
        return f'a part of the neck or head: {error}'
    return None


class _Placeholder:
    """A backbone whose levels are given maps (for :func:`why_not_streamed`)."""

    def __init__(self, levels: Sequence[RowMap]):
        self.levels = levels

    def level_rows(self, trunk_map: RowMap, level: int, image_hw) -> RowMap:
        return self.levels[level]
