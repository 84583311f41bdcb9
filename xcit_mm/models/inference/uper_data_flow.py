"""mmseg's ``UPerHead`` in data-flow order: stock's operations on the same whole tensors (the
logits bit for bit), each map freed once no later step needs it, the FPN outputs written one at a
time into a buffer laid out as ``torch.cat``'s (``docs/lean_segmentation.md``)."""
from itertools import accumulate
from typing import Sequence

import torch
from torch import Tensor

from mmseg.models.utils import resize

from .fpn_data_flow import (BackboneLevels, add_as_stock, resized_channels_last,
                            suggests_channels_last, top_down_sums)


def empty_for_cat(shapes: Sequence[Sequence[int]], channels_last: Sequence[bool], dim: int,
                  like: Tensor) -> Tensor:
    """An empty tensor laid out as ``torch.cat`` of these shapes along ``dim`` would be: channels
    last only if every one suggests it (ATen's rule; meta tensors would import torch._dynamo)."""
    shape = list(shapes[0])
    shape[dim] = sum(s[dim] for s in shapes)
    fmt = torch.channels_last if all(channels_last) else torch.contiguous_format
    return torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=fmt)


def uper_head_in_data_flow_order(backbone, head, inputs: Tensor) -> Tensor:
    """``head.forward(backbone(inputs))`` for ``UPerHead`` on levels 0..n-1 (the caller checks),
    bit for bit."""
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
