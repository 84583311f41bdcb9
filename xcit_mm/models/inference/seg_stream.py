"""Semantic FPN and UperNet on a streamed XCiT trunk, and stock ``predict``'s labels, as
:class:`~.row_stream.RowMap` s made a band of rows at a time, each sum and resize where stock
does it (``docs/gigapixel.md``)."""
from functools import partial
from typing import Optional, Sequence

import torch
from mmseg.models.decode_heads import UPerHead
from mmseg.models.utils import Upsample

from .fpn_data_flow import top_down_rows
from .row_stream import (Combine, Crop, LevelByLevelBackbone, Local, NotRowLocal, Resize, RowMap,
                         TensorRows, module_rows)


def _resized(source: RowMap, target: RowMap, align_corners) -> RowMap:
    """``source`` resized bilinearly to ``target``'s size (itself where the sizes agree)."""
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


def logits_rows(levels: Sequence[RowMap], neck, head) -> RowMap:
    """The head's logits of the backbone's level maps, by rows: Semantic FPN
    (``FPNHead.forward(FPN.forward(levels))``) or UperNet."""
    if type(head) is UPerHead:
        return _upernet_rows(levels, head)
    lateral = [module_rows(conv, level) for conv, level in zip(neck.lateral_convs, levels)]
    for i in range(len(lateral) - 1, 0, -1):
        lateral[i - 1] = top_down_rows(lateral[i - 1], lateral[i], neck.upsample_cfg)
    outs = [module_rows(conv, lat) for conv, lat in zip(neck.fpn_convs, lateral)]
    output = _branch_rows(head.scale_heads[0], outs[0])
    for i in range(1, len(head.feature_strides)):
        branch = _branch_rows(head.scale_heads[i], outs[i])
        output = Combine(torch.add, output, _resized(branch, output, head.align_corners))
    return Local(head.cls_seg, output)


def _upernet_rows(levels: Sequence[RowMap], head: UPerHead) -> RowMap:
    """``UPerHead.forward(levels)`` by rows; its pyramid pooling (stock's ``psp_forward``) reads
    the whole (small) coarsest level."""
    lateral = [module_rows(conv, level) for conv, level in zip(head.lateral_convs, levels)]
    lateral.append(TensorRows(head.psp_forward([levels[-1].rows(0, levels[-1].height)])))
    for i in range(len(lateral) - 1, 0, -1):
        lateral[i - 1] = top_down_rows(lateral[i - 1], lateral[i],
                                       dict(mode='bilinear', align_corners=head.align_corners))
    outs = [module_rows(conv, lat) for conv, lat in zip(head.fpn_convs, lateral)] + lateral[-1:]
    outs = [outs[0]] + [_resized(out, outs[0], head.align_corners) for out in outs[1:]]
    cat = Combine(lambda *maps: torch.cat(maps, dim=1), *outs)
    return Local(head.cls_seg, module_rows(head.fpn_bottleneck, cat))


def labels_rows(logits: RowMap, head_hw: Sequence[int], crop: Sequence[int],
                out_hw: Sequence[int], head_align_corners: bool,
                align_corners: bool) -> RowMap:
    """Stock ``predict``'s labels (1, 1, H, W) by rows: the head's resize to ``head_hw``, the
    padding ``crop`` (left, right, top, bottom), the resize to ``out_hw``, the argmax."""
    x = Resize(logits, head_hw, 'bilinear', head_align_corners)
    left, right, top, bottom = crop
    x = Crop(x, top, left, head_hw[0] - top - bottom, head_hw[1] - left - right)
    if (x.height, x.width) != tuple(out_hw):
        x = Resize(x, out_hw, 'bilinear', align_corners)
    return Local(partial(torch.argmax, dim=1, keepdim=True), x)


def why_not_by_rows(backbone: LevelByLevelBackbone, neck, head) -> Optional[str]:
    """Why the neck or head cannot run by rows (None if they can): the graph a streamed predict
    builds, on a small image's placeholder maps."""
    side, device = 64, next(head.parameters()).device
    levels = [TensorRows(torch.zeros(1, channels, -(-side // stride), -(-side // stride),
                                     device=device))
              for channels, stride in zip(backbone.out_channels, backbone.strides)]
    try:
        with torch.no_grad():
            logits_rows(levels, neck, head)
    except NotRowLocal as error:
        return f'a part of the neck or head: {error}'
    return None
