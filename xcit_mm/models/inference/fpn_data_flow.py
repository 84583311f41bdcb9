"""An FPN (mmdet's or mmseg's) computed in data-flow order, for whole-image inference.

Stock inference makes all four backbone levels, then all lateral maps, then all FPN outputs, so
at high resolution several maps of the stride-4 level's size are alive at once.
:func:`fpn_in_data_flow_order` gives the same outputs bit for bit with each map freed as soon as
the next step no longer needs it: the backbone levels are made top-down, the large stride-4 one
last (XCiT's ``forward_trunk`` / ``forward_level``); each lateral map is freed by its FPN conv;
the top-down sum is added in place and in bands of rows (:func:`add_top_down_`). Every
convolution runs on the same whole tensor as in stock: a oneDNN convolution of another size can
take another algorithm and differ in the last bit, so nothing is tiled.

With ``band_mb``, the stride-4 level goes further: its FPN output is a row map
(:mod:`.row_stream`) made from the backbone's rows where its adapter is row-local (XCiT's
``level_rows``), through the lateral conv, the top-down sum and the FPN conv with the rows of
context the convs need, band by band into the output map; so of that level's maps only the FPN
output ever exists whole. The values equal the whole-tensor path up to float rounding.

Used by ``LeanEncoderDecoder`` (mmseg) and ``LeanMaskRCNN`` (mmdet); torch only, no task package.
"""
from typing import List, Optional, Protocol, Tuple, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

from .row_stream import (Combine, NotRowLocal, Resize, RowLocalBackbone, RowMap, TensorRows,
                         band_rows_for, materialize, module_rows, nearest_index)


@runtime_checkable
class LevelByLevelBackbone(Protocol):
    """A backbone that makes its levels one at a time: the trunk maps once, then each level's
    adapter on demand (``XCiTBackbone``). Any other backbone is run whole, as stock runs it."""

    def forward_trunk(self, x: Tensor) -> List[Tensor]:
        ...

    def forward_level(self, feat: Tensor, level: int, image_hw: Tuple[int, int]) -> Tensor:
        ...


def _upsample(x: Tensor, size, upsample_cfg: dict) -> Tensor:
    """The FPN's top-down resize of ``x`` to ``size``, with its arguments (mmdet's and mmseg's
    FPN both call ``F.interpolate`` so)."""
    if 'scale_factor' in upsample_cfg:
        return F.interpolate(x, **upsample_cfg)
    return F.interpolate(x, size=size, **upsample_cfg)


def nearest_source(top_hw, lat_hw, upsample_cfg: dict) -> Tuple[Tensor, Tensor]:
    """For a nearest resize from ``top_hw`` to ``lat_hw``: the source row of every output row and
    the source column of every output column, read off the very same resize call (so they are
    the FPN's own, whatever its ``upsample_cfg``)."""
    kwargs = dict(upsample_cfg, mode='nearest')
    return (nearest_index(top_hw[0], lat_hw[0], 0, kwargs),
            nearest_index(top_hw[1], lat_hw[1], 1, kwargs))


def add_top_down_(lat: Tensor, top: Tensor, upsample_cfg: dict, band_mb: float = 64,
                  source: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
    """``lat + resize(top)`` as the FPN computes it, in place and without a map of ``lat``'s size.

    Nearest resizing copies pixels (:func:`nearest_source`), and ``lat`` receives its sum in bands
    of about ``band_mb`` (the bits of ``a + b``). ``source``: the rows and columns of ``top`` that
    ``lat``'s rows and columns read, when ``lat`` is a band of the full lateral map. Other modes
    resize whole; under autograd the sum is not in place.
    """
    if lat.requires_grad or upsample_cfg.get('mode', 'nearest') != 'nearest':
        top_down = _upsample(top, lat.shape[2:], upsample_cfg)
        return lat + top_down if lat.requires_grad else lat.add_(top_down)
    row_of, col_of = source if source is not None else nearest_source(
        top.shape[2:], lat.shape[2:], upsample_cfg)
    row_of, col_of = row_of.to(top.device), col_of.to(top.device)  # built on the CPU
    row_bytes = lat.shape[0] * lat.shape[1] * lat.shape[3] * lat.element_size()
    band = band_rows_for(band_mb, row_bytes)
    for r0 in range(0, lat.shape[2], band):
        rows_of_band = top.index_select(2, row_of[r0:r0 + band])
        lat[:, :, r0:r0 + band].add_(rows_of_band.index_select(3, col_of))
    return lat


class BackboneLevels:
    """Backbone level ``i`` on demand, where the backbone can make its levels one at a time
    (XCiT's trunk once, its adapter per level)."""

    def __init__(self, backbone, inputs: Tensor):
        self.backbone = backbone
        self.image_hw = tuple(inputs.shape[-2:])
        self.per_level = isinstance(backbone, LevelByLevelBackbone)
        self.maps = list(backbone.forward_trunk(inputs) if self.per_level else backbone(inputs))

    def __len__(self) -> int:
        return len(self.maps)

    def pop(self, i: int) -> Tensor:
        """Level ``i``, made now; its trunk map (or output) is dropped."""
        out, self.maps[i] = self.maps[i], None
        return self.backbone.forward_level(out, i, self.image_hw) if self.per_level else out


def fpn_in_data_flow_order(backbone, neck, inputs: Tensor,
                           band_mb: Optional[float] = None) -> List[Tensor]:
    """``neck(backbone(inputs))`` for the neck's own levels (no extra outputs), each map freed
    when done. ``neck``: mmdet's or mmseg's ``FPN`` with ``start_level=0`` and every backbone
    level in (the caller checks). ``band_mb``: level 0 in bands of about that many MB (the parts
    must pass :func:`why_not_bottom_in_bands`; None: whole, bit for bit as stock)."""
    levels = BackboneLevels(backbone, inputs)
    outs, top = fpn_upper_levels(levels, neck)
    if band_mb is not None:
        trunk = TensorRows(levels.maps[0])
        levels.maps[0] = None
        outs[0] = materialize(fpn_bottom_rows(backbone, neck, trunk, TensorRows(top),
                                              levels.image_hw), band_mb)
        outs[1] = neck.fpn_convs[1](top)
        return outs
    lat = add_top_down_(neck.lateral_convs[0](levels.pop(0)), top, neck.upsample_cfg)
    outs[1] = neck.fpn_convs[1](top)
    del top  # level 1's lateral sum goes before the largest conv
    outs[0] = neck.fpn_convs[0](lat)
    return outs


def fpn_upper_levels(levels: BackboneLevels, neck) -> Tuple[List[Optional[Tensor]], Tensor]:
    """The FPN outputs of levels 2..n-1 (indices 0 and 1 left None) in data-flow order, and
    level 1's finished lateral sum: the top-down term of level 0, then the input of level 1's
    FPN conv, both the caller's. Each other lateral map is freed by its FPN conv once the level
    below has its term."""
    num_levels = len(levels)
    lateral = [None] * num_levels
    outs = [None] * num_levels
    for i in range(num_levels - 1, 0, -1):
        lat = neck.lateral_convs[i](levels.pop(i))
        if i + 1 < num_levels:
            lat = add_top_down_(lat, lateral[i + 1], neck.upsample_cfg)
            # the level above has given its top-down term: its FPN conv can run, then it goes
            outs[i + 1] = neck.fpn_convs[i + 1](lateral[i + 1])
            lateral[i + 1] = None
        lateral[i] = lat
        del lat
    return outs, lateral[1]


def fpn_bottom_rows(backbone, neck, trunk: RowMap, top: RowMap, image_hw) -> RowMap:
    """The FPN output of level 0 as rows: the backbone's level 0 from its trunk map's rows, the
    lateral conv, the sum with ``top`` (level 1's finished lateral sum) resized as the FPN
    resizes it, the FPN conv."""
    lateral = module_rows(neck.lateral_convs[0], backbone.level_rows(trunk, 0, image_hw))
    return module_rows(neck.fpn_convs[0], top_down_rows(lateral, top, neck.upsample_cfg))


def top_down_rows(lateral: RowMap, top: RowMap, upsample_cfg: dict) -> RowMap:
    """``lateral + resize(top)`` by rows, resized as mmdet's and mmseg's FPN resize it."""
    top_down = Resize(top, (lateral.height, lateral.width), upsample_cfg.get('mode', 'nearest'),
                      upsample_cfg.get('align_corners'), interpolate_kwargs=upsample_cfg)
    return Combine(torch.add, lateral, top_down)


def why_not_bottom_in_bands(backbone, neck) -> Optional[str]:
    """Why the FPN's level 0 cannot be made in bands of rows (None if it can): the very
    construction :func:`fpn_in_data_flow_order` makes, on a small image's placeholder maps."""
    if not isinstance(backbone, RowLocalBackbone):
        return (f'the backbone {type(backbone).__name__} cannot make its stride-4 level in '
                'bands of rows (XCiTBackbone can)')
    side, patch = 64, backbone.patch_size
    device = next(backbone.parameters()).device
    trunk = TensorRows(torch.zeros(1, backbone.out_channels[0], side // patch, side // patch,
                                   device=device))
    top = TensorRows(torch.zeros(1, neck.out_channels, side // 8, side // 8, device=device))
    try:
        fpn_bottom_rows(backbone, neck, trunk, top, (side, side))
    except NotRowLocal as error:
        return f'the FPN: {error}'
    return None
