"""mmseg's ``UPerHead`` computed in data-flow order, for whole-image inference.

Stock ``EncoderDecoder`` keeps every backbone level until the head returns, and
``UPerHead._forward_feature`` (mmseg 1.2.2) keeps every lateral map until it returns, upsamples the
three coarser FPN outputs to stride 4 into a list and ``torch.cat``s them into a second copy: at
full resolution the stride-4 backbone map, the stride-4 lateral, four stride-4 FPN outputs and
their concatenation (``channels`` = 512 each, ``channels`` x H/4 x W/4 floats apiece) are alive
at once.

:func:`uper_head_in_data_flow_order` gives the same logits bit for bit: the same operations on the
same whole tensors (nothing is tiled: a convolution of another size can take another oneDNN
algorithm and differ in the last bit), each map freed as soon as the next step no longer needs it.
The backbone levels are made top-down, the stride-4 one last (``BackboneLevels``); a lateral is
freed once it has given its top-down term and its FPN conv has run; the top-down sums are added
in place where that gives the strides of stock's out-of-place sum (:func:`add_as_stock`); and the
FPN outputs are written one level at a time into a buffer allocated with the shape and memory
format ``torch.cat`` gives (:func:`empty_for_cat`; the layout rules are ATen's, ported, as meta
tensors would import ``torch._dynamo`` on first use). What remains is ``fpn_bottleneck``'s conv:
the concatenation, the conv's own copy of it (oneDNN) and its output.

Used by ``LeanEncoderDecoder``; torch and mmseg's ``resize`` only.
"""
from typing import List, Sequence, Tuple

import torch
from torch import Tensor

from mmseg.models.utils import resize

from .fpn_data_flow import BackboneLevels


def suggests_channels_last(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a 4-d tensor of these sizes and strides has ``suggest_memory_format()`` channels
    last: c10's ``is_channels_last_strides_2d_s4``, which decides the layout of the tensors that
    ``F.interpolate`` and ``torch.cat`` allocate (ambiguous strides count as NCHW)."""
    if len(shape) != 4 or strides[1] == 0:
        return False
    low = 0
    for d in (1, 3, 2, 0):
        if shape[d] == 0 or strides[d] < low or (d == 0 and low == strides[1]):
            return False
        low = strides[d] * shape[d] if shape[d] > 1 else strides[d]
    return True


def standard_strides(shape: Sequence[int], channels_last: bool) -> Tuple[int, ...]:
    """The strides of ``torch.empty(shape)`` in NCHW or channels-last memory format."""
    n, c, h, w = shape
    return (c * h * w, 1, w * c, c) if channels_last else (c * h * w, h * w, w, 1)


def resized_channels_last(x: Tensor, size) -> bool:
    """Whether ``F.interpolate(x, size)`` (bilinear) suggests channels last: its output is
    allocated in ``x``'s suggested memory format."""
    shape = tuple(x.shape[:2]) + tuple(size)
    return suggests_channels_last(
        shape, standard_strides(shape, suggests_channels_last(x.shape, x.stride())))


def empty_for_cat(shapes: Sequence[Sequence[int]], channels_last: Sequence[bool], dim: int,
                  like: Tensor) -> Tensor:
    """An uninitialised tensor (``like``'s dtype and device) with the shape and memory format of
    ``torch.cat`` of tensors of these shapes along ``dim``, each suggesting channels last or not:
    channels last only if every one does (ATen's ``cat_compute_output_memory_format``)."""
    shape = list(shapes[0])
    shape[dim] = sum(s[dim] for s in shapes)
    fmt = torch.channels_last if all(channels_last) else torch.contiguous_format
    return torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=fmt)


def add_as_stock(a: Tensor, b: Tensor) -> Tensor:
    """``a + b``: its bits and strides. Added into ``a`` in place where the out-of-place sum
    would have ``a``'s strides (TensorIterator's fast setup for two operands of the same shape
    and strides: standard NCHW, else standard channels-last) and autograd does not need ``a``
    (the caller holds ``a`` alone)."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return a + b
    same = a.dim() == 4 and a.shape == b.shape and a.stride() == b.stride()
    if same and a.is_contiguous():
        same = a.stride() == standard_strides(a.shape, False)
    elif same:
        same = (a.is_contiguous(memory_format=torch.channels_last)
                and a.stride() == standard_strides(a.shape, True))
    return a.add_(b) if same else a + b


def _up(x: Tensor, size, align_corners) -> Tensor:
    """UPerHead's resize: bilinear to ``size`` with the head's ``align_corners``."""
    return resize(x, size=size, mode='bilinear', align_corners=align_corners)


def uper_head_in_data_flow_order(backbone, head, inputs: Tensor) -> Tensor:
    """``head.forward(backbone(inputs))`` for mmseg's ``UPerHead`` reading backbone levels
    ``0 .. n-1`` (``input_transform='multiple_select'``, ``in_index = range(n)``; the caller
    checks), bit for bit, each map freed when done.

    Order: PSP on level n-1; for i = n-2 .. 0: lateral conv of level i (made now), the top-down
    term of the level above added, then the level above's FPN conv (its lateral freed); level 0's
    FPN conv; then the concat buffer, filled with FPN output 0 and the others upsampled one at a
    time (stock's order, n-1 first); ``fpn_bottleneck`` and ``cls_seg``.
    """
    levels = BackboneLevels(backbone, inputs)
    n = len(head.in_index)
    for j in range(n, len(levels)):  # levels the head does not read
        levels.maps[j] = None
    ac = head.align_corners
    outs: List[Tensor] = [None] * n  # stock's fpn_outs
    upper = outs[n - 1] = head.psp_forward([levels.pop(n - 1)])  # laterals[n - 1]
    for i in range(n - 2, -1, -1):
        lat = head.lateral_convs[i](levels.pop(i))
        lat = add_as_stock(lat, _up(upper, lat.shape[2:], ac))
        if i + 1 < n - 1:  # the level above has given its top-down term: its FPN conv runs
            outs[i + 1] = head.fpn_convs[i + 1](upper)
        upper = lat
        del lat
    outs[0] = head.fpn_convs[0](upper)
    del upper
    size = outs[0].shape[2:]
    cat = empty_for_cat([o.shape[:2] + size for o in outs],
                        [suggests_channels_last(outs[0].shape, outs[0].stride())]
                        + [resized_channels_last(o, size) for o in outs[1:]], 1, outs[0])
    starts = [0]
    for o in outs:
        starts.append(starts[-1] + o.shape[1])
    cat[:, starts[0]:starts[1]].copy_(outs[0])
    outs[0] = None
    for i in range(n - 1, 0, -1):
        part = _up(outs[i], size, ac)
        outs[i] = None
        cat[:, starts[i]:starts[i + 1]].copy_(part)
        del part
    feats = head.fpn_bottleneck(cat)
    del cat
    return head.cls_seg(feats)
