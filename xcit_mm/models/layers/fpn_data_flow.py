"""An FPN (mmdet's or mmseg's) computed in data-flow order, for whole-image inference.

Stock inference makes all four backbone levels, then all lateral maps, then all FPN outputs, so
at high resolution several maps of the stride-4 level's size are alive at once.
:func:`fpn_in_data_flow_order` gives the same outputs bit for bit with each map freed as soon as
the next step no longer needs it: the backbone levels are made top-down, the large stride-4 one
last (XCiT's ``forward_trunk`` / ``forward_level``); each lateral map is freed by its FPN conv;
the top-down sum is added in place and in bands of rows (:func:`add_top_down_`). Every
convolution runs on the same whole tensor as in stock: a oneDNN convolution of another size can
take another algorithm and differ in the last bit, so nothing is tiled.

Used by ``LeanEncoderDecoder`` (mmseg) and ``LeanMaskRCNN`` (mmdet); torch only, no task package.
"""
from typing import Callable, List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


def _upsample(x: Tensor, size, upsample_cfg: dict) -> Tensor:
    """The FPN's top-down resize of ``x`` to ``size``, with its arguments (mmdet's and mmseg's
    FPN both call ``F.interpolate`` so)."""
    if 'scale_factor' in upsample_cfg:
        return F.interpolate(x, **upsample_cfg)
    return F.interpolate(x, size=size, **upsample_cfg)


def add_top_down_(lat: Tensor, top: Tensor, upsample_cfg: dict, band_mb: float = 64) -> Tensor:
    """``lat + resize(top)`` as the FPN computes it, in place and without a map of ``lat``'s size.

    Nearest resizing copies pixels: the source row and column of every output pixel are read off
    the very same resize call applied to a map of coordinates, and ``lat`` receives its sum in
    bands of about ``band_mb`` (the bits of ``a + b``). Other modes resize whole; under autograd
    the sum is not in place.
    """
    if lat.requires_grad or upsample_cfg.get('mode', 'nearest') != 'nearest':
        top_down = _upsample(top, lat.shape[2:], upsample_cfg)
        return lat + top_down if lat.requires_grad else lat.add_(top_down)
    h, w = top.shape[2:]
    rows = torch.arange(h, dtype=torch.float64).view(1, 1, h, 1).expand(1, 1, h, w)
    cols = torch.arange(w, dtype=torch.float64).view(1, 1, 1, w).expand(1, 1, h, w)
    source = _upsample(torch.cat([rows, cols], dim=1), lat.shape[2:], upsample_cfg)
    assert source.shape[2:] == lat.shape[2:], (source.shape, lat.shape)
    row_of, col_of = source[0, 0, :, 0].long(), source[0, 1, 0, :].long()
    row_bytes = lat.shape[0] * lat.shape[1] * lat.shape[3] * lat.element_size()
    band = max(1, int(band_mb * 2**20) // max(1, row_bytes))
    for r0 in range(0, lat.shape[2], band):
        rows_of_band = top.index_select(2, row_of[r0:r0 + band])
        lat[:, :, r0:r0 + band].add_(rows_of_band.index_select(3, col_of))
    return lat


def backbone_levels(backbone, inputs: Tensor) -> Tuple[Callable[[int], Tensor], int]:
    """A function giving backbone level ``i`` (made on demand where the backbone can: XCiT's
    trunk once, its adapter per level), and the number of levels."""
    if hasattr(backbone, 'forward_trunk') and hasattr(backbone, 'forward_level'):
        feats = list(backbone.forward_trunk(inputs))
        image_hw = tuple(inputs.shape[-2:])

        def level(i):
            out = backbone.forward_level(feats[i], i, image_hw)
            feats[i] = None  # the trunk map of this level is no longer needed
            return out

        return level, len(feats)
    outs = list(backbone(inputs))

    def level(i):
        out, outs[i] = outs[i], None
        return out

    return level, len(outs)


def fpn_in_data_flow_order(backbone, neck, inputs: Tensor) -> List[Tensor]:
    """``neck(backbone(inputs))`` for the neck's own levels (no extra outputs), each map freed
    when done. ``neck``: mmdet's or mmseg's ``FPN`` with ``start_level=0`` and every backbone
    level in (the caller checks)."""
    level, num_levels = backbone_levels(backbone, inputs)
    lateral = [None] * num_levels
    outs = [None] * num_levels
    for i in range(num_levels - 1, -1, -1):
        lat = neck.lateral_convs[i](level(i))
        if i + 1 < num_levels:
            lat = add_top_down_(lat, lateral[i + 1], neck.upsample_cfg)
            # the level above has given its top-down term: its FPN conv can run, then it goes
            outs[i + 1] = neck.fpn_convs[i + 1](lateral[i + 1])
            lateral[i + 1] = None
        lateral[i] = lat
        del lat
    outs[0] = neck.fpn_convs[0](lateral[0])
    return outs
