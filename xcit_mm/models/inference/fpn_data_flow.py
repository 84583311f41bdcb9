"""An FPN (mmdet's or mmseg's) computed in data-flow order, for whole-image inference.

Stock inference makes all four backbone levels, then all lateral maps, then all FPN outputs, so
at high resolution several maps of the stride-4 level's size are alive at once.
:func:`fpn_in_data_flow_order` gives the same outputs bit for bit with each map freed as soon as
the next step no longer needs it: the backbone levels are made top-down, the large stride-4 one
last (XCiT's ``forward_trunk`` / ``forward_level``); each lateral map is freed by its FPN conv;
the top-down sum is added in place and in bands of rows (:func:`add_top_down_`). Every
convolution runs on the same whole tensor as in stock: a oneDNN convolution of another size can
take another algorithm and differ in the last bit, so nothing is tiled.

With ``band_mb``, the stride-4 level goes further: it is made in bands of rows from a backbone
whose adapter is row-local (XCiT's ``forward_level_rows``), each band through the lateral conv,
the top-down sum and the FPN conv with the rows of context the convs need, and written into the
output map; so of that level's maps only the FPN output ever exists whole. The values equal the
whole-tensor path up to float rounding (:func:`conv_halo` gives the context).

Used by ``LeanEncoderDecoder`` (mmseg) and ``LeanMaskRCNN`` (mmdet); torch only, no task package.
"""
import math
from typing import Iterator, List, Optional, Protocol, Tuple, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor


@runtime_checkable
class LevelByLevelBackbone(Protocol):
    """A backbone that makes its levels one at a time: the trunk maps once, then each level's
    adapter on demand (``XCiTBackbone``). Any other backbone is run whole, as stock runs it."""

    def forward_trunk(self, x: Tensor, stem_band_mb: Optional[float] = None) -> List[Tensor]:
        ...

    def forward_level(self, feat: Tensor, level: int, image_hw: Tuple[int, int]) -> Tensor:
        ...


@runtime_checkable
class RowLocalBackbone(LevelByLevelBackbone, Protocol):
    """A level-by-level backbone whose stride-4 adapter is row-local: any band of that level's
    rows comes from the trunk rows that make it (``XCiTBackbone``), so it can run in bands."""

    def forward_level_rows(self, feat: Tensor, level: int, image_hw: Tuple[int, int],
                           start: int, stop: int) -> Tensor:
        ...


def _upsample(x: Tensor, size, upsample_cfg: dict) -> Tensor:
    """The FPN's top-down resize of ``x`` to ``size``, with its arguments (mmdet's and mmseg's
    FPN both call ``F.interpolate`` so)."""
    if 'scale_factor' in upsample_cfg:
        return F.interpolate(x, **upsample_cfg)
    return F.interpolate(x, size=size, **upsample_cfg)


def nearest_source(top_hw, lat_hw, upsample_cfg: dict) -> Tuple[Tensor, Tensor]:
    """For a nearest resize from ``top_hw`` to ``lat_hw``: the source row of every output row and
    the source column of every output column, read off the very same resize call applied to a
    map of coordinates (so they are the FPN's own, whatever its ``upsample_cfg``)."""
    h, w = top_hw
    rows = torch.arange(h, dtype=torch.float64).view(1, 1, h, 1).expand(1, 1, h, w)
    cols = torch.arange(w, dtype=torch.float64).view(1, 1, 1, w).expand(1, 1, h, w)
    source = _upsample(torch.cat([rows, cols], dim=1), tuple(lat_hw), upsample_cfg)
    assert tuple(source.shape[2:]) == tuple(lat_hw), (source.shape, lat_hw)
    return source[0, 0, :, 0].long(), source[0, 1, 0, :].long()


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


def conv_halo(module) -> Optional[int]:
    """The rows of context on each side that ``module`` (an ``nn.Conv2d``, or an mmcv
    ``ConvModule`` around one with no norm or a BatchNorm, per pixel in eval mode) needs, in eval
    mode, for a band of its output rows: its padding, for a stride-1 conv padded to keep the
    size; None for any other module (it cannot run in bands: e.g. GroupNorm normalises over the
    whole map)."""
    conv = getattr(module, 'conv', module)
    if getattr(module, 'with_norm', False) and not isinstance(
            getattr(module, module.norm_name), torch.nn.modules.batchnorm._BatchNorm):
        return None
    if (type(conv) is not torch.nn.Conv2d or conv.padding_mode != 'zeros'
            or isinstance(conv.padding, str)):
        return None
    (kh, _), (sh, _), (ph, _), (dh, _) = (conv.kernel_size, conv.stride, conv.padding,
                                          conv.dilation)
    if sh != 1 or 2 * ph != dh * (kh - 1):
        return None
    return ph


def row_bands(height: int, band_rows: int, halo: int) -> Iterator[Tuple[int, int, int, int]]:
    """``(start, stop, lo, hi)`` of consecutive bands of ``band_rows`` rows covering ``height``
    rows: the band's rows, and those it is computed from with ``halo`` rows of context on each
    side where the map has them."""
    for start in range(0, height, band_rows):
        stop = min(height, start + band_rows)
        yield start, stop, max(0, start - halo), min(height, stop + halo)


def read_band_mb(value, owner: str) -> Optional[float]:
    """``test_cfg.band_mb`` of either lean model: None (every map whole, stock's bits) or the MB
    of a band of rows, a positive finite number; anything else is an error naming the fix."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f'{owner}: test_cfg.band_mb must be a positive number of MB, e.g. '
                         f'band_mb=64 (or None: every map whole); got {value!r}')
    return float(value)


def band_rows_for(band_mb: float, row_bytes: int) -> int:
    """The rows of a band of about ``band_mb`` MB, ``row_bytes`` bytes a row (at least one)."""
    return max(1, int(band_mb * 2**20) // max(1, row_bytes))


def conv_in_bands(conv, x: Tensor, band_rows: int, halo: int) -> Iterator[Tensor]:
    """``conv(x)`` band by band of ``band_rows`` output rows: each band computed from its rows of
    ``x`` and ``halo`` rows of context on each side (where the image has them; zero padding
    beyond, as the whole conv)."""
    for start, stop, lo, hi in row_bands(x.shape[2], band_rows, halo):
        yield conv(x[:, :, lo:hi])[:, :, start - lo:stop - lo]


class BackboneLevels:
    """Backbone level ``i`` on demand, where the backbone can make its levels one at a time
    (XCiT's trunk once, its adapter per level); rows of the bottom level on their own where its
    adapter is row-local (XCiT's ``forward_level_rows``). ``stem_band_mb``: XCiT's conv stem in
    bands of rows (``forward_trunk``; equal up to float rounding)."""

    def __init__(self, backbone, inputs: Tensor, stem_band_mb: Optional[float] = None):
        self.backbone = backbone
        self.image_hw = tuple(inputs.shape[-2:])
        self.per_level = isinstance(backbone, LevelByLevelBackbone)
        if not self.per_level:
            self.maps = list(backbone(inputs))
        elif stem_band_mb is not None:  # XCiT: the conv stem in bands of rows
            self.maps = list(backbone.forward_trunk(inputs, stem_band_mb=stem_band_mb))
        else:
            self.maps = list(backbone.forward_trunk(inputs))

    def __len__(self) -> int:
        return len(self.maps)

    def pop(self, i: int) -> Tensor:
        """Level ``i``, made now; its trunk map (or output) is dropped."""
        out, self.maps[i] = self.maps[i], None
        return self.backbone.forward_level(out, i, self.image_hw) if self.per_level else out

    def bottom_hw(self) -> Optional[Tuple[int, int]]:
        """The size of level 0 if it can be made in bands of rows (:meth:`bottom_rows`)."""
        if not isinstance(self.backbone, RowLocalBackbone):
            return None
        stride = self.backbone.strides[0]
        return tuple((side + stride - 1) // stride for side in self.image_hw)

    def bottom_rows(self, start: int, stop: int) -> Tensor:
        """Rows ``start:stop`` of level 0 (its trunk map is kept until :meth:`pop`)."""
        return self.backbone.forward_level_rows(self.maps[0], 0, self.image_hw, start, stop)


def fpn_in_data_flow_order(backbone, neck, inputs: Tensor,
                           band_mb: Optional[float] = None) -> List[Tensor]:
    """``neck(backbone(inputs))`` for the neck's own levels (no extra outputs), each map freed
    when done. ``neck``: mmdet's or mmseg's ``FPN`` with ``start_level=0`` and every backbone
    level in (the caller checks). ``band_mb``: level 0 in bands of about that many MB where the
    backbone and :func:`neck_bands_bottom_level` allow (else whole, bit for bit as stock)."""
    levels = BackboneLevels(backbone, inputs)
    outs, top = fpn_upper_levels(levels, neck)
    if band_mb is not None and levels.bottom_hw() is not None and neck_bands_bottom_level(neck):
        outs[0] = bottom_level_in_bands(levels, neck, top, band_mb)
        levels.maps[0] = None
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


def neck_bands_bottom_level(neck) -> bool:
    """Whether the FPN's level 0 can run in bands (:func:`bottom_level_in_bands`): a 1x1 lateral
    conv, a stride-1 size-keeping FPN conv and a nearest top-down resize."""
    return (conv_halo(neck.lateral_convs[0]) == 0 and conv_halo(neck.fpn_convs[0]) is not None
            and neck.upsample_cfg.get('mode', 'nearest') == 'nearest')


def bottom_level_in_bands(levels: BackboneLevels, neck, top: Tensor, band_mb: float) -> Tensor:
    """The FPN output of level 0, made band by band (:class:`BottomLevelRows`) and written into
    the output map: only the output is ever whole; each band's maps are about ``band_mb``."""
    rows = BottomLevelRows(levels, neck, top)
    height, width = rows.hw
    row_bytes = max(levels.maps[0].shape[1], top.shape[1]) * width * top.element_size()
    out = None
    for start, stop, _, _ in row_bands(height, band_rows_for(band_mb, row_bytes), 0):
        band = rows(start, stop)
        if out is None:
            out = band.new_empty(band.shape[:2] + (height, width))
        out[:, :, start:stop] = band
        del band
    return out


class BottomLevelRows:
    """Rows of the FPN output of level 0 on demand, from the backbone rows that make them: the
    rows and the FPN conv's context rows through the lateral conv, the top-down rows of ``top``
    (level 1's finished lateral sum) added, the FPN conv, the context cut off. The parts must run
    in bands (:func:`neck_bands_bottom_level`, :meth:`BackboneLevels.bottom_hw`)."""

    def __init__(self, levels: BackboneLevels, neck, top: Tensor):
        self.levels, self.neck, self.top = levels, neck, top
        self.hw = levels.bottom_hw()
        self.halo = conv_halo(neck.fpn_convs[0])
        row_of, col_of = nearest_source(top.shape[2:], self.hw, neck.upsample_cfg)
        self.row_of, self.col_of = row_of.to(top.device), col_of.to(top.device)

    def __call__(self, start: int, stop: int) -> Tensor:
        """Output rows ``start:stop``."""
        lo, hi = max(0, start - self.halo), min(self.hw[0], stop + self.halo)
        lat = self.neck.lateral_convs[0](self.levels.bottom_rows(lo, hi))
        lat = add_top_down_(lat, self.top, self.neck.upsample_cfg,
                            source=(self.row_of[lo:hi], self.col_of))
        return self.neck.fpn_convs[0](lat)[:, :, start - lo:stop - lo]
