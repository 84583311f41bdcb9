"""mmseg's ``UPerHead`` computed in data-flow order, for whole-image inference.

Stock ``EncoderDecoder`` keeps every backbone level until the head returns, and
``UPerHead._forward_feature`` (mmseg 1.2.2) keeps every lateral map until it returns, upsamples the
three coarser FPN outputs to stride 4 into a list and ``torch.cat``s them into a second copy: at
full resolution many ``channels`` x H/4 x W/4 maps are alive at once.

:func:`uper_head_in_data_flow_order` gives the same logits bit for bit: the same operations on the
same whole tensors (nothing is tiled: a convolution of another size can take another oneDNN
algorithm and differ in the last bit), each map freed as soon as the next step no longer needs it.
The backbone levels are made top-down, the stride-4 one last; a lateral is freed once it has given
its top-down term and its FPN conv has run (``fpn_data_flow.top_down_sums``); the top-down sums
are added in place where that gives the strides of stock's out-of-place sum
(``fpn_data_flow.add_as_stock``); and the FPN outputs are written one level at a time into a
buffer allocated with the shape and memory format ``torch.cat`` gives (:func:`empty_for_cat`; the
layout rules are ATen's, ported, as meta tensors would import ``torch._dynamo`` on first use).
"""
from itertools import accumulate
from typing import Sequence

import torch
from torch import Tensor

from mmseg.models.utils import resize

from .fpn_data_flow import (BackboneLevels, add_as_stock, resized_channels_last,
                            suggests_channels_last, top_down_sums)


def empty_for_cat(shapes: Sequence[Sequence[int]], channels_last: Sequence[bool], dim: int,
                  like: Tensor) -> Tensor:
    """An uninitialised tensor (``like``'s dtype and device) with the shape and memory format of
    ``torch.cat`` of tensors of these shapes along ``dim``, each suggesting channels last or not:
    channels last only if every one does (ATen's ``cat_compute_output_memory_format``)."""
    shape = list(shapes[0])
    shape[dim] = sum(s[dim] for s in shapes)
    fmt = torch.channels_last if all(channels_last) else torch.contiguous_format
    return torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=fmt)


def uper_head_in_data_flow_order(backbone, head, inputs: Tensor) -> Tensor:
    """``head.forward(backbone(inputs))`` for mmseg's ``UPerHead`` reading backbone levels
    ``0 .. n-1`` (``input_transform='multiple_select'``, ``in_index = range(n)``; the caller
    checks), bit for bit, each map freed when done.

    Order: PSP on level n-1; the top-down pass down to level 0 and its FPN conv; then the concat
    buffer, filled with FPN output 0 and the others upsampled one at a time (stock's order, n-1
    first); ``fpn_bottleneck`` and ``cls_seg``.
    """
    levels = BackboneLevels(backbone, inputs)
    n = len(head.in_index)
    for j in range(n, len(levels)):  # levels the head does not read
        levels.maps[j] = None

    def up(x: Tensor, size) -> Tensor:
        return resize(x, size=size, mode='bilinear', align_corners=head.align_corners)

    outs = [None] * n  # stock's fpn_outs
    outs[n - 1] = head.psp_forward([levels.pop(n - 1)])  # laterals[n - 1]
    bottom = top_down_sums(levels, head.lateral_convs, head.fpn_convs,
                           lambda lat, upper: add_as_stock(lat, up(upper, lat.shape[2:])),
                           outs[n - 1], outs, 0, n - 2)
    outs[0] = head.fpn_convs[0](bottom)
    del bottom
    size = outs[0].shape[2:]
    cat = empty_for_cat([o.shape[:2] + size for o in outs],
                        [suggests_channels_last(outs[0].shape, outs[0].stride())]
                        + [resized_channels_last(o, size) for o in outs[1:]], 1, outs[0])
    starts = [0, *accumulate(o.shape[1] for o in outs)]
    cat[:, starts[0]:starts[1]].copy_(outs[0])
    outs[0] = None
    for i in range(n - 1, 0, -1):
        part = up(outs[i], size)
        outs[i] = None
        cat[:, starts[i]:starts[i + 1]].copy_(part)
        del part
    feats = head.fpn_bottleneck(cat)
    del cat
    return head.cls_seg(feats)
