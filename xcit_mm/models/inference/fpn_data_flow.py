"""An FPN (mmdet's or mmseg's) or mmseg's UPerHead in data-flow order: stock's outputs bit for
bit, fewer maps alive. The levels are made top-down, each map freed once used, each conv on
stock's whole tensor (work by rows, which changes the bits, is the stream's: :func:`fpn_rows`).
Torch only: docs/lean_detection.md, docs/lean_segmentation.md."""
from itertools import accumulate
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .row_stream import (Combine, LevelByLevelBackbone, Local, Resize, RowMap, TensorRows,
                         band_rows_for, module_rows)


def why_not_data_flow_fpn(neck, fpn_type: type, extra_levels: bool = False) -> Optional[str]:
    """Why ``neck`` is not an FPN that :func:`fpn_in_data_flow_order` computes as stock does:
    ``fpn_type`` itself on every backbone level, any extra levels made by max pooling."""
    if type(neck) is not fpn_type:
        return f'the neck must be {fpn_type.__module__}.FPN, not {type(neck).__name__}'
    if neck.start_level != 0 or neck.backbone_end_level != neck.num_ins:
        return 'the neck must be an FPN on every backbone level (start_level=0, end_level=-1)'
    if neck.num_outs > neck.num_ins and not (extra_levels and not neck.add_extra_convs):
        return ('the neck must be an FPN that adds no levels' if not extra_levels else
                'the neck must be an FPN that adds levels by max pooling (add_extra_convs=False)')
    return None


def suggests_channels_last(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """c10's ``is_channels_last_strides_2d_s4``: the layout ``F.interpolate`` and ``torch.cat``
    give their outputs (ambiguous strides count as NCHW)."""
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
    """Whether ``F.interpolate(x, size)`` suggests channels last (it keeps ``x``'s format)."""
    shape = tuple(x.shape[:2]) + tuple(size)
    return suggests_channels_last(
        shape, standard_strides(shape, suggests_channels_last(x.shape, x.stride())))


def adds_in_place(a: Tensor, b_shape, b_strides, *operands: Tensor) -> bool:
    """Whether ``a.add_(b)`` (``b`` of these sizes and strides) gives the bits and strides of
    ``a + b``: both of one standard layout (TensorIterator's fast setup then lays the sum out as
    ``a``) and autograd needing none of ``operands`` (the caller holds ``a`` alone)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in operands):
        return False
    return (a.dim() == 4 and a.shape == b_shape
            and a.stride() == tuple(b_strides) == standard_strides(a.shape, not a.is_contiguous()))


def add_as_stock(a: Tensor, b: Tensor) -> Tensor:
    """``a + b``, into ``a`` where :func:`adds_in_place`."""
    return a.add_(b) if adds_in_place(a, b.shape, b.stride(), a, b) else a + b


def add_top_down_(lat: Tensor, top: Tensor, upsample_cfg: dict, band_mb: float = 64) -> Tensor:
    """``lat + resize(top)`` as the FPN computes it, into ``lat`` where :func:`adds_in_place`; a
    nearest resize (a copy of pixels) is then added in bands of rows, never whole."""
    size = lat.shape[2:]
    up_strides = standard_strides(lat.shape, resized_channels_last(top, size))
    if (upsample_cfg.get('mode', 'nearest') != 'nearest'
            or not adds_in_place(lat, lat.shape, up_strides, lat, top)):
        kwargs = upsample_cfg if 'scale_factor' in upsample_cfg else dict(upsample_cfg, size=size)
        return add_as_stock(lat, F.interpolate(top, **kwargs))
    resized = Resize(TensorRows(top), size, 'nearest', interpolate_kwargs=upsample_cfg)
    resized.keeps = False  # each row is read once
    band = band_rows_for(band_mb, lat[:, :, :1].numel() * lat.element_size())
    for r0 in range(0, size[0], band):
        lat[:, :, r0:r0 + band].add_(resized.rows(r0, r0 + band))
    return lat


class BackboneLevels:
    """Backbone level ``i`` on demand, where the backbone makes its levels one at a time."""
    def __init__(self, backbone, inputs: Tensor):
        self.backbone = backbone
        self.image_hw = tuple(inputs.shape[-2:])
        self.per_level = isinstance(backbone, LevelByLevelBackbone)
        self.maps = list(backbone.forward_trunk(inputs) if self.per_level else backbone(inputs))

    def pop(self, i: int) -> Tensor:
        """Level ``i``, made now; its trunk map (or output) is dropped."""
        out, self.maps[i] = self.maps[i], None
        return self.backbone.forward_level(out, i, self.image_hw) if self.per_level else out


def top_down_sums(levels: BackboneLevels, lateral_convs, fpn_convs, add: Callable,
                  upper: Tensor, outs: list, last_conv: int) -> Tensor:
    """The top-down pass of an FPN (mmdet's, mmseg's, UPerHead's) below level ``len(outs) - 1``'s
    lateral sum ``upper``: each level's lateral ``add``-ed to the sum above, whose FPN conv
    (up to level ``last_conv``) then runs and frees it. Returns level 0's sum."""
    for i in range(len(outs) - 2, -1, -1):
        lat = add(lateral_convs[i](levels.pop(i)), upper)
        if i + 1 <= last_conv:  # the level above has given its top-down term
            outs[i + 1] = fpn_convs[i + 1](upper)
        upper = lat
    return upper


def fpn_in_data_flow_order(backbone, neck, inputs: Tensor) -> List[Tensor]:
    """``neck(backbone(inputs))`` for the neck's own levels, each map freed when done (the
    caller checks ``why_not_data_flow_fpn``)."""
    levels = BackboneLevels(backbone, inputs)
    n = len(levels.maps)
    outs = [None] * n
    top = top_down_sums(levels, neck.lateral_convs, neck.fpn_convs,
                        lambda lat, up: add_top_down_(lat, up, neck.upsample_cfg),
                        neck.lateral_convs[n - 1](levels.pop(n - 1)), outs, n - 1)
    # level 0's lateral sum; level 1's went before this largest conv
    outs[0] = neck.fpn_convs[0](top)
    return outs


def fpn_rows(levels: Sequence[RowMap], neck, extra_levels: int = 0) -> List[RowMap]:
    """``neck.forward(levels)`` of an FPN (mmdet's or mmseg's, 1x1 laterals, no extra convs) by
    rows: the laterals, the top-down sums and the FPN convs, then ``extra_levels`` levels made as
    mmdet's FPN makes them without extra convs (a max pool of kernel 1, stride 2, of the last)."""
    lateral = [module_rows(conv, level) for conv, level in zip(neck.lateral_convs, levels)]
    for i in range(len(lateral) - 1, 0, -1):
        lateral[i - 1] = top_down_rows(lateral[i - 1], lateral[i], neck.upsample_cfg)
    outs = [module_rows(conv, lat) for conv, lat in zip(neck.fpn_convs, lateral)]
    for _ in range(extra_levels):
        outs.append(Local(lambda x: F.max_pool2d(x, 1, stride=2), outs[-1], num=2))
    return outs


def top_down_rows(lateral: RowMap, top: RowMap, upsample_cfg: dict) -> RowMap:
    """``lateral + resize(top)`` by rows, resized as mmdet's and mmseg's FPN resize it."""
    top_down = Resize(top, (lateral.height, lateral.width), upsample_cfg.get('mode', 'nearest'),
                      upsample_cfg.get('align_corners'), interpolate_kwargs=upsample_cfg)
    return Combine(torch.add, lateral, top_down)


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
    del levels.maps[n:]  # levels the head does not read

    def up(x: Tensor, size) -> Tensor:  # mmseg's resize, without its warning
        return F.interpolate(x, size=size, mode='bilinear', align_corners=head.align_corners)

    outs = [None] * n  # stock's fpn_outs
    outs[n - 1] = head.psp_forward([levels.pop(n - 1)])  # laterals[n - 1]
    bottom = top_down_sums(levels, head.lateral_convs, head.fpn_convs,
                           lambda lat, upper: add_as_stock(lat, up(upper, lat.shape[2:])),
                           outs[n - 1], outs, n - 2)
    outs[0] = head.fpn_convs[0](bottom)
    del bottom
    size = outs[0].shape[2:]
    cat = empty_for_cat([o.shape[:2] + size for o in outs],
                        [suggests_channels_last(outs[0].shape, outs[0].stride())]
                        + [resized_channels_last(o, size) for o in outs[1:]], 1, outs[0])
    starts = [0, *accumulate(o.shape[1] for o in outs)]
    for i in (0, *range(n - 1, 0, -1)):  # level 0, the largest, is freed before any resize
        part = up(outs[i], size) if i else outs[0]
        outs[i] = None
        cat[:, starts[i]:starts[i + 1]].copy_(part)
        del part
    feats = head.fpn_bottleneck(cat)
    del cat
    return head.cls_seg(feats)
